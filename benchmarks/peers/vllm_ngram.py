"""Peer: vLLM's n-gram (prompt lookup) kernel, the numba code vLLM runs, unmodified.

`batch_propose_numba` is vLLM's batched entry (it loops over the batch inside numba and
calls `_find_longest_matched_ngram_and_propose_tokens` per request, which rescans the whole
context every step). vLLM caps it at one numba thread, and so do we. The module imports
`VllmConfig` only for a type hint, so a stub of `vllm.config` is enough to load it without
vLLM's serving dependencies (it is installed with --no-deps).
"""

from __future__ import annotations

import sys
import types

import numpy as np


def load_kernel_module():
    """vllm.v1.spec_decode.ngram_proposer, imported with `vllm.config` stubbed out."""
    if "vllm.config" not in sys.modules:
        stub = types.ModuleType("vllm.config")
        stub.VllmConfig = object
        sys.modules["vllm.config"] = stub
    from vllm.v1.spec_decode import ngram_proposer

    return ngram_proposer


class VllmNgramDrafter:
    def __init__(self, max_slots: int, max_seq_len: int, draft_len: int,
                 min_n: int, max_n: int) -> None:
        kernel = load_kernel_module()
        import numba

        numba.set_num_threads(1)
        self.name = f"vLLM n-gram [{min_n},{max_n}]"
        self.propose = kernel.batch_propose_numba
        self.min_n, self.max_n, self.draft_len = min_n, max_n, draft_len
        # vLLM's input-batch buffers: [max_num_seqs, max_model_len] tokens, per-row lengths.
        self.max_model_len = max_seq_len
        self.token_ids = np.zeros((max_slots, max_seq_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_slots, dtype=np.int32)
        self.draft = np.zeros((max_slots, draft_len), dtype=np.int32)
        self.num_drafts = np.zeros(max_slots, dtype=np.int32)
        self.free = list(range(max_slots - 1, -1, -1))
        self.row_of: dict[int, int] = {}

    def start(self, request_id: int, prompt: np.ndarray) -> None:
        row = self.free.pop()
        self.row_of[request_id] = row
        self.token_ids[row, : len(prompt)] = prompt
        self.num_tokens[row] = len(prompt)

    def step(self, request_ids: np.ndarray, accepted: np.ndarray,
             accepted_lens: np.ndarray) -> np.ndarray:
        rows = [self.row_of[r] for r in request_ids.tolist()]
        for b, row in enumerate(rows):
            n = int(accepted_lens[b])
            end = self.num_tokens[row]
            self.token_ids[row, end: end + n] = accepted[b, :n]
            self.num_tokens[row] = end + n
        self.propose(rows, self.num_tokens, self.token_ids, self.min_n, self.max_n,
                     self.max_model_len, self.draft_len, self.draft, self.num_drafts)
        drafts = self.draft[rows].copy()
        drafts[np.arange(self.draft_len)[None, :] >= self.num_drafts[rows][:, None]] = -1
        return drafts

    def stop(self, request_id: int) -> None:
        row = self.row_of.pop(request_id)
        self.num_tokens[row] = 0
        self.free.append(row)
