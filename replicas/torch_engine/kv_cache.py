"""KV storage for running sequences: slots with lengths, over contiguous or paged memory.

`KVCache` (the torch forward, on CUDA): one fixed region per slot for every layer, so a
decode step never allocates or copies and attends over a view of its slot.

`PagedKVCache` (the native CPU forward): one pool of pages of 32 positions shared by every
slot, sized by a byte budget rather than slots x window; a slot's block table names the
page of each of its blocks. Pages are taken as a sequence grows and given back when it
ends (a rollback keeps them: the next step writes there again). A page may be shared
(reference-counted) by several slots and the prefix cache: a cached prompt prefix is reused
by pointing at its pages, not by copying.

In both, rolling back rejected draft tokens is setting the length: the positions past
`lengths[slot]` are simply overwritten by the next step.
"""

from __future__ import annotations

import heapq
from typing import Callable

import torch

from replicas.torch_engine.sizes import PAGE_TOKENS, page_bytes


class KVCacheFull(RuntimeError):
    """The paged cache has no free page left for a step, even after `reclaim`."""


class SlotTable:
    """`max_slots` sequences' slots and lengths; the storage behind them is the subclass's."""

    def __init__(self, num_layers: int, max_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int) -> None:
        for name, value in (("num_layers", num_layers), ("max_slots", max_slots), ("max_seq_len", max_seq_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
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
        self._release(slot)
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (drop rejected draft tokens)."""
        self._check_allocated(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate: length must be in [0, {self.lengths[slot]}] for slot {slot}, got {length}")
        self.lengths[slot] = length

    def reserve(self, slot: int, start: int, end: int) -> bool:
        """Room for `slot`'s positions [start, end) to be written: always, in fixed slots."""
        return True

    def usage(self) -> float:
        """The share of the cache the allocated slots' positions fill (0 to 1)."""
        return sum(self.lengths) / (self.max_slots * self.max_seq_len)

    def _release(self, slot: int) -> None:
        """`slot` is being freed: its storage is no longer needed."""

    def _check_allocated(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        if slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")


class KVCache(SlotTable):
    """Preallocated per-slot KV storage for `num_layers` layers; rollback = set the length."""

    def __init__(self, num_layers: int, max_slots: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__(num_layers, max_slots, max_seq_len, num_kv_heads, head_dim)
        shape = (num_layers, max_slots, num_kv_heads, max_seq_len, head_dim)
        # Heads before positions so that a slot's head is one contiguous [len, head_dim] block:
        # attention reads a prefix of it as a strided view, with no copy. Zeroed: masked torch
        # attention still multiplies masked keys.
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kvh, max_seq_len, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)


class PagedKVCache(SlotTable):
    """fp16 KV in a pool of `num_pages` pages of 32 positions, shared by the slots.

    k, v: [layers, kvh, pages, 32, hd]; the native forward keeps each (head, page)'s K
    transposed ([hd][32]) and its V as shaped. A head's pages side by side: a slot whose pages
    run in order reads as one stream per head. `block_table` [max_slots, max_seq_len / 32]
    int32 names the page of each block of each slot (-1: none). `num_pages` defaults to every
    slot's whole window. Untouched pages cost no memory (the pool is not initialised: the
    native forward never lets an unwritten position into its arithmetic), and free pages are
    handed out lowest first, so the footprint follows the pages in use.
    """

    def __init__(self, num_layers: int, max_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 num_pages: int | None = None) -> None:
        super().__init__(num_layers, max_slots, max_seq_len, num_kv_heads, head_dim)
        if max_seq_len % PAGE_TOKENS:
            raise ValueError(f"max_seq_len: must be a multiple of {PAGE_TOKENS}, got {max_seq_len}")
        self.blocks_per_slot = max_seq_len // PAGE_TOKENS
        self.num_pages = max_slots * self.blocks_per_slot if num_pages is None else num_pages
        if self.num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {self.num_pages}")
        shape = (num_layers, num_kv_heads, self.num_pages, PAGE_TOKENS, head_dim)
        self.k = torch.empty(shape, dtype=torch.float16)
        self.v = torch.empty(shape, dtype=torch.float16)
        self.block_table = torch.full((max_slots, self.blocks_per_slot), -1, dtype=torch.int32)
        self._table = self.block_table.numpy()  # the same memory, for cheap scalar access
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]  # each slot's pages, block order
        self.refs = [0] * self.num_pages  # holders of each page: slots' blocks and the prefix cache
        self._free_pages = list(range(self.num_pages))  # a heap: the lowest free page goes first
        # Called with a number of pages when too few are free; frees what it can (the prefix
        # cache evicting blocks nobody uses) and returns how many it freed.
        self.reclaim: Callable[[int], int] | None = None

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def usage(self) -> float:
        """The share of the pages that slots hold; those only the prefix cache holds it gives
        back when short (`reclaim`), so they count as free."""
        return len({page for pages in self._pages for page in pages}) / self.num_pages

    def pages_of(self, slot: int) -> list[int]:
        """`slot`'s pages in block order (a copy)."""
        return list(self._pages[slot])

    def reserve(self, slot: int, start: int, end: int) -> bool:
        """Pages for `slot`'s positions below `end`, taking free ones (reclaiming if short) for
        the blocks it has none for yet; False, taking none, when there are too few. The blocks
        from `start` on are about to be written: a page there held by anyone else would be a
        bug (shared pages are only ever read), so that is a RuntimeError."""
        self._check_allocated(slot)
        if not 0 <= start <= end <= self.max_seq_len:
            raise ValueError(f"reserve: positions [{start}, {end}) outside [0, {self.max_seq_len}]")
        pages = self._pages[slot]
        for page in pages[start // PAGE_TOKENS: -(-end // PAGE_TOKENS)]:
            if self.refs[page] != 1:
                raise RuntimeError(f"slot {slot}: page {page} is shared ({self.refs[page]} holders) and would be written")
        need = -(-end // PAGE_TOKENS) - len(pages)
        if need > len(self._free_pages) and self.reclaim is not None:
            self.reclaim(need - len(self._free_pages))
        if need > len(self._free_pages):
            return False
        for _ in range(need):
            page = heapq.heappop(self._free_pages)
            self.refs[page] = 1
            self._table[slot, len(pages)] = page
            pages.append(page)
        return True

    def share(self, slot: int, block: int, page: int) -> None:
        """Block `block` of `slot` becomes `page` (held once more), which holds the same KV: the
        slot's next block, or one it has whose page is then let go."""
        self._check_allocated(slot)
        pages = self._pages[slot]
        if not 0 <= block <= min(len(pages), self.blocks_per_slot - 1) or not 0 <= page < self.num_pages \
                or not self.refs[page]:
            raise ValueError(f"share: block {block} of slot {slot} ({len(pages)} blocks) to page {page}")
        self.refs[page] += 1
        if block == len(pages):
            pages.append(page)
        else:
            self.unref(pages[block])
            pages[block] = page
        self._table[slot, block] = page

    def hold(self, page: int) -> None:
        """One more holder of a page in use (the prefix cache keeping a block)."""
        if not self.refs[page]:
            raise ValueError(f"hold: page {page} is free")
        self.refs[page] += 1

    def unref(self, page: int) -> None:
        """One holder fewer; the page is free once nobody holds it."""
        self.refs[page] -= 1
        if not self.refs[page]:
            heapq.heappush(self._free_pages, page)

    def copy_page(self, src: int, dst: int) -> None:
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]

    def _release(self, slot: int) -> None:
        for page in self._pages[slot]:
            self.unref(page)
        self._table[slot] = -1
        self._pages[slot] = []
