"""Preallocated KV storage: one fixed slot per running sequence, for every layer.

Allocating once means a decode step never allocates or copies the cache: a step writes its
new positions in place and attends over a view of its slot. Rolling back rejected draft
tokens is free: the positions past `lengths[slot]` are simply overwritten by the next step.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated per-slot KV storage for `num_layers` layers; rollback = set the length."""

    def __init__(self, num_layers: int, max_slots: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 zeroed: bool = True) -> None:
        for name, value in (("num_layers", num_layers), ("max_slots", max_slots), ("max_seq_len", max_seq_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.num_layers = num_layers
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        shape = (num_layers, max_slots, num_kv_heads, max_seq_len, head_dim)
        # Heads before positions so that a slot's head is one contiguous [len, head_dim] block:
        # attention reads a prefix of it as a strided view, with no copy. `zeroed=False` for a
        # reader that never lets an unwritten position into its arithmetic (the native
        # forward): untouched pages then cost no memory, so the footprint follows the context
        # requests actually reach. Masked torch attention still multiplies masked keys.
        new = torch.zeros if zeroed else torch.empty
        self.k = new(shape, dtype=dtype, device=device)  # [layers, slots, kvh, max_seq_len, hd]
        self.v = new(shape, dtype=dtype, device=device)
        self.lengths: list[int] = [0] * max_slots  # valid positions per slot
        self._free: list[int] = list(range(max_slots - 1, -1, -1))  # stack: lowest slot pops first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_slots and slot not in self._free

    def allocate(self) -> int:
        """A free slot with length 0; ValueError when every slot is taken."""
        if not self._free:
            raise ValueError(f"KV cache full: all {self.max_slots} slots are allocated")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_allocated(slot)
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (drop rejected draft tokens)."""
        self._check_allocated(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate: length must be in [0, {self.lengths[slot]}] for slot {slot}, got {length}")
        self.lengths[slot] = length

    def _check_allocated(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        if slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
