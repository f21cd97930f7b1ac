"""Our drafter: the native suffix automaton pool, one batched `extend` per step."""

from __future__ import annotations

import numpy as np


class SuffixAutomatonDrafter:
    """`SuffixAutomatonPool` as a benchmark drafter; `global_pool_tokens > 0` shares responses."""

    def __init__(self, max_slots: int, max_seq_len: int, draft_len: int,
                 global_pool_tokens: int = 0, global_bias: int | None = None) -> None:
        from replicas.speculation.suffix import SuffixAutomatonPool

        self.name = "ours SA + global" if global_pool_tokens else "ours SA"
        self.draft_len = draft_len
        self.keep_responses = global_pool_tokens > 0
        # global_bias: how much longer a pool match must be than the request's own to win;
        # None keeps the pool's default.
        bias = {} if global_bias is None else {"global_bias": global_bias}
        self.pool = SuffixAutomatonPool(max_slots, max_seq_len, global_pool_tokens, **bias)

    def start(self, request_id: int, prompt: np.ndarray) -> None:
        self.pool.add_request(request_id, prompt)

    def step(self, request_ids: np.ndarray, accepted: np.ndarray,
             accepted_lens: np.ndarray) -> np.ndarray:
        _, draft = self.pool.extend(request_ids, accepted, accepted_lens, self.draft_len)
        return draft

    def stop(self, request_id: int) -> None:
        self.pool.remove_request(request_id, keep_in_global_pool=self.keep_responses)
