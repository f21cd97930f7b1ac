"""The suffix automata as the engine core uses them: one batched extend per step.

Every token a step emits is fed to its request's automaton in a single `extend` over the
whole batch, which leaves each sequence's `sa_match_len` and `sa_draft` for the next step's
plan. Two homes for the automata, one interface:

- `HostSuffixDrafts`: the native CPU pool (with the cross-request pool of finished
  responses); results are in place when `feed` returns.
- `DeviceSuffixDrafts`: the automata live in GPU memory (`DeviceSuffixAutomatonPool`) and
  the extend kernel runs on the engine's stream: one native call copies the step's tokens
  up from pinned memory, runs the kernel and copies match lengths and drafts back, all
  async; `settle()` (called when the next step plans) waits for that copy alone. The SA adds
  no synchronisation of its own; the host keeps detokenising while the kernel runs. It has
  no cross-request pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from replicas.torch_engine.sequence import Sequence

logger = logging.getLogger(__name__)

Fed = list[tuple["Sequence", list[int]]]  # (sequence, tokens it emitted this step)

# Prompt tokens a prediction's copy starts with (`prediction_prefix`).
PREDICTION_ANCHOR = 8


def prediction_prefix(prompt_ids: list[int], prediction: list[int], room: int) -> list[int]:
    """What a request's automaton reads before its prompt when the client predicted its output
    (OpenAI's Predicted Outputs): the prompt's last PREDICTION_ANCHOR tokens, then the
    prediction. The prompt's end then repeats first at the very start, so from its first
    output token on, while the output follows the prediction, the SA drafts the prediction
    (the first occurrence of a match is what it drafts from); where the output departs and
    comes back, its suffix meets the prediction again there. At most `room` tokens (an
    automaton holds one context window): a longer prediction is cut, one with no room left
    is not used."""
    if not prediction or room <= PREDICTION_ANCHOR:
        return []
    return (prompt_ids[-PREDICTION_ANCHOR:] + prediction)[:room]


def _pack(fed: Fed, accepted: np.ndarray, lens: np.ndarray) -> None:
    """Row b of `accepted [B, W]` and `lens [B]`: the tokens sequence b emitted (rest left as is,
    extend never reads past `lens[b]`)."""
    for b, (_, tokens) in enumerate(fed):
        accepted[b, : len(tokens)] = tokens
        lens[b] = len(tokens)


def _assign(fed: Fed, match_len: np.ndarray, draft: np.ndarray) -> None:
    for b, (seq, _) in enumerate(fed):
        seq.sa_match_len = int(match_len[b])
        row = draft[b]
        seq.sa_draft = row[row >= 0].tolist()  # numpy's own loop: a step of 8 spent ~5% of its Python here


class HostSuffixDrafts:
    """Automata in host memory (`SuffixAutomatonPool`, with its cross-request pool)."""

    def __init__(self, max_slots: int, max_seq_len: int, global_pool_tokens: int) -> None:
        from replicas.speculation.suffix import SuffixAutomatonPool

        self.pool = SuffixAutomatonPool(max_slots, max_seq_len, global_pool_tokens)

    def add(self, sa_id: int, prompt_ids: list[int]) -> None:
        self.pool.add_request(sa_id, np.asarray(prompt_ids, dtype=np.int32))

    def has(self, sa_id: int) -> bool:
        return self.pool.has_request(sa_id)

    @property
    def pool_tokens(self) -> int:
        """Tokens the cross-request pool holds now."""
        return self.pool.global_pool_tokens_used

    def remove(self, sa_id: int) -> None:
        self.pool.remove_request(sa_id)

    def feed(self, fed: Fed, draft_len: int) -> None:
        """Extend every fed sequence's automaton; their drafts are in place on return."""
        if not fed:
            return
        ids = np.asarray([seq.sa_id for seq, _ in fed], dtype=np.int64)
        accepted = np.zeros((len(fed), max(len(tokens) for _, tokens in fed)), dtype=np.int32)
        lens = np.zeros(len(fed), dtype=np.int32)
        _pack(fed, accepted, lens)
        _assign(fed, *self.pool.extend(ids, accepted, lens, draft_len))

    def settle(self) -> None:
        """Nothing is ever pending on the host."""


class DeviceSuffixDrafts:
    """Automata in GPU memory; the extend kernel runs on the current stream of `device`."""

    pool_tokens = 0  # no cross-request pool here

    def __init__(self, max_slots: int, max_seq_len: int, device: torch.device) -> None:
        from replicas.speculation.suffix import _sa_native

        self.device = device
        self.pool = _sa_native.DeviceSuffixAutomatonPool(max_slots, max_seq_len, device.index or 0)
        self._staged = _PinnedInts()   # [slot ids | lengths | tokens [B, W]]
        self._results = _PinnedInts()  # [match lengths | drafts [B, draft_len]]
        self._pending: tuple[Fed, int] | None = None  # the fed sequences and the draft length
        self._done = torch.cuda.Event()

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def add(self, sa_id: int, prompt_ids: list[int]) -> None:
        self.pool.add_request(sa_id, np.asarray(prompt_ids, dtype=np.int32), self._stream())

    def has(self, sa_id: int) -> bool:
        try:
            self.pool.slot_of(sa_id)
        except KeyError:
            return False
        return True

    def remove(self, sa_id: int) -> None:
        # A kernel still queued on the slot runs before any later add_request (same stream).
        self.pool.remove_request(sa_id)

    def feed(self, fed: Fed, draft_len: int) -> None:
        """Queue the extend (copy up, kernel, copy down); the drafts reach the sequences at `settle()`."""
        self.settle()  # the pinned buffers are free again
        if not fed:
            return
        batch, width = len(fed), max(len(tokens) for _, tokens in fed)
        staged = self._staged.take(batch * (2 + width))
        staged[:batch] = [self.pool.slot_of(seq.sa_id) for seq, _ in fed]
        _pack(fed, staged[2 * batch:].reshape(batch, width), staged[batch: 2 * batch])
        results = self._results.take(batch * (1 + draft_len))
        self.pool.extend_staged(staged.ctypes.data, batch, width, draft_len, results.ctypes.data, self._stream())
        self._done.record(torch.cuda.current_stream(self.device))
        self._pending = (fed, draft_len)

    def settle(self) -> None:
        """Wait for the last extend's results (one small copy) and give them to their sequences."""
        if self._pending is None:
            return
        fed, draft_len = self._pending
        self._pending = None
        self._done.synchronize()
        out = self._results.array
        _assign(fed, out[: len(fed)], out[len(fed): len(fed) * (1 + draft_len)].reshape(len(fed), draft_len))


class _PinnedInts:
    """A page-locked int32 buffer, kept between steps and grown on demand (async copies need it)."""

    def __init__(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.int32)
        self.array = self._tensor.numpy()

    def take(self, length: int) -> np.ndarray:
        """The first `length` ints (contents undefined); only while no copy still uses the buffer."""
        if length > self.array.size:
            self._tensor = torch.empty(max(length, 2 * self.array.size), dtype=torch.int32, pin_memory=True)
            self.array = self._tensor.numpy()
        return self.array[:length]


def suffix_drafts(device: torch.device, max_slots: int, max_seq_len: int, global_pool_tokens: int):
    """The automata's home for an engine on `device`: the GPU where the module has the kernel."""
    from replicas.speculation.suffix import CUDA_COMPILED

    if device.type != "cuda":
        return HostSuffixDrafts(max_slots, max_seq_len, global_pool_tokens)
    if not CUDA_COMPILED:
        logger.warning("the suffix automaton module was built without nvcc: its automata stay on the host")
        return HostSuffixDrafts(max_slots, max_seq_len, global_pool_tokens)
    if global_pool_tokens:
        logger.warning("sa_global_pool_tokens=%d is not used on a GPU: the device automata have no "
                       "cross-request pool", global_pool_tokens)
    return DeviceSuffixDrafts(max_slots, max_seq_len, device)
