"""The one interface every drafter in the benchmark is driven through.

It is the shape of our pool's batched call, because that is what an engine has in hand
after verification: the accepted tokens of each request in the batch as an int32 matrix.
Adapters for peers whose API is per request loop over the rows inside `step`, so the
time a step takes includes that loop, as it would in a serving engine.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Drafter(Protocol):
    name: str

    def start(self, request_id: int, prompt: np.ndarray) -> None:
        """Admit a request with its prompt tokens ([P] int32)."""

    def step(self, request_ids: np.ndarray, accepted: np.ndarray,
             accepted_lens: np.ndarray) -> np.ndarray:
        """Feed accepted[b, :accepted_lens[b]] to request_ids[b]; return drafts [B, K] int32.

        request_ids [B] int64, accepted [B, W] int32 C-contiguous, accepted_lens [B] int32;
        a zero length feeds nothing (the first draft after `start`). Drafts are padded
        with -1 past each request's draft length.
        """

    def stop(self, request_id: int) -> None:
        """Finish a request; drafters with a cross-request cache keep its response."""
