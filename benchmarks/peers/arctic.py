"""Peer: Arctic Inference's `SuffixDecodingCache`, driven the way vLLM's proposer drives it.

vLLM's `SuffixDecodingProposer` (v1/spec_decode/suffix_decoding.py) is the reference use:
per request and per step it appends the newly sampled tokens with `add_active_response`,
then calls `speculate` on the last `max_tree_depth` tokens of the request. Its defaults are
the settings here: tree depth 24, spec factor 1.0, min token prob 0.1, and a global cache
of up to 10000 responses (`max_cached_requests=0` turns the global cache off).
The API is per request, so a batched step is a Python loop over the batch, as in vLLM.
"""

from __future__ import annotations

import numpy as np

TREE_DEPTH = 24
SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
MAX_CACHED_REQUESTS = 10000


class ArcticSuffixDrafter:
    def __init__(self, max_slots: int, max_seq_len: int, draft_len: int,
                 global_cache: bool, tree_depth: int = TREE_DEPTH,
                 spec_factor: float = SPEC_FACTOR, min_token_prob: float = MIN_TOKEN_PROB) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.name = "Arctic suffix + global" if global_cache else "Arctic suffix"
        self.draft_len = draft_len
        self.tree_depth = tree_depth
        self.spec_factor = spec_factor
        self.min_token_prob = min_token_prob
        self.cache = SuffixDecodingCache(
            max_tree_depth=tree_depth,
            max_cached_requests=MAX_CACHED_REQUESTS if global_cache else 0)
        # Each request's tokens so far, as vLLM keeps them in its input batch.
        self.max_seq_len = max_seq_len
        self.history: dict[int, tuple[np.ndarray, list[int]]] = {}

    def start(self, request_id: int, prompt: np.ndarray) -> None:
        if request_id in self.cache.cached_requests:
            self.cache.evict_cached_response(request_id)  # what vLLM does on id reuse
        self.cache.start_request(request_id, prompt)
        tokens = np.zeros(self.max_seq_len, dtype=np.int32)
        tokens[: len(prompt)] = prompt
        self.history[request_id] = (tokens, [len(prompt)])

    def step(self, request_ids: np.ndarray, accepted: np.ndarray,
             accepted_lens: np.ndarray) -> np.ndarray:
        drafts = np.full((len(request_ids), self.draft_len), -1, dtype=np.int32)
        for b, request_id in enumerate(request_ids.tolist()):
            tokens, length = self.history[request_id]
            n = int(accepted_lens[b])
            if n:
                new = accepted[b, :n]
                self.cache.add_active_response(request_id, new)
                tokens[length[0]: length[0] + n] = new
                length[0] += n
            end = length[0]
            draft = self.cache.speculate(
                request_id, tokens[max(0, end - self.tree_depth): end],
                max_spec_tokens=self.draft_len, max_spec_factor=self.spec_factor,
                min_token_prob=self.min_token_prob)
            drafts[b, : len(draft.token_ids)] = draft.token_ids
        return drafts

    def stop(self, request_id: int) -> None:
        self.cache.stop_request(request_id)
        del self.history[request_id]
