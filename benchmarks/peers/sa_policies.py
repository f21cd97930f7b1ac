"""Ablation: which earlier occurrence a suffix-automaton draft should continue from.

Our automaton drafts what followed the FIRST occurrence of the longest repeated suffix.
This pure-numpy drafter takes the same match length (from the native
`longest_repeated_suffix`) and finds every earlier occurrence by brute force, then drafts
from the first, the most recent, or the most frequent continuation (a greedy walk down the
continuations' trie, as Arctic's suffix tree drafts; ties go to the most recent). It is
O(text) per step, for MAT ablations only, never for timing. Local text only (no pool).
"""

from __future__ import annotations

import numpy as np

POLICIES = ("first", "recent", "frequent")


def earlier_occurrences(text: np.ndarray, match_len: int) -> np.ndarray:
    """End indices (ascending) of the earlier occurrences of text's last match_len tokens."""
    suffix = text[len(text) - match_len:]
    ends = np.nonzero(text[:-1] == suffix[-1])[0]
    for back in range(1, match_len):
        ends = ends[ends >= back]
        ends = ends[text[ends - back] == suffix[-1 - back]]
        if not len(ends):
            break
    return ends


def continuation(text: np.ndarray, ends: np.ndarray, draft_len: int, policy: str) -> list[int]:
    if policy == "first":
        ends = ends[:1]
    elif policy == "recent":
        ends = ends[-1:]
    draft: list[int] = []
    for depth in range(draft_len):
        ends = ends[ends + 1 + depth < len(text)]
        if not len(ends):
            break
        following = text[ends + 1 + depth]
        values, counts = np.unique(following, return_counts=True)
        tied = set(values[counts == counts.max()].tolist())
        choice = next(v for v in following[::-1].tolist() if v in tied)
        draft.append(choice)
        ends = ends[following == choice]
    return draft


class SuffixPolicyDrafter:
    def __init__(self, max_slots: int, max_seq_len: int, draft_len: int, policy: str) -> None:
        from replicas.speculation.suffix import longest_repeated_suffix

        if max_slots != 1 or policy not in POLICIES:
            raise ValueError("one request at a time, policy in " + ", ".join(POLICIES))
        self.name = f"SA ablation: {policy} occurrence"
        self.match = longest_repeated_suffix
        self.policy, self.draft_len = policy, draft_len
        self.text, self.length = np.zeros(max_seq_len, dtype=np.int32), 0

    def start(self, request_id: int, prompt: np.ndarray) -> None:
        self.text[: len(prompt)] = prompt
        self.length = len(prompt)

    def step(self, request_ids: np.ndarray, accepted: np.ndarray,
             accepted_lens: np.ndarray) -> np.ndarray:
        n = int(accepted_lens[0])
        self.text[self.length: self.length + n] = accepted[0, :n]
        self.length += n
        text = self.text[: self.length]
        drafts = np.full((1, self.draft_len), -1, dtype=np.int32)
        match_len, _ = self.match(text)
        if match_len > 0:
            draft = continuation(text, earlier_occurrences(text, match_len), self.draft_len, self.policy)
            drafts[0, : len(draft)] = draft
        return drafts

    def stop(self, request_id: int) -> None:
        self.length = 0
