"""Prefix cache: KV of earlier requests in fixed 32-token blocks, reused by prompts that start alike.

Blocks form a tree keyed by their tokens (a radix tree over token blocks): block i of a
sequence is the child, under block i-1, keyed by tokens [32i, 32i + 32). A path from the
root is a token prefix, matched exactly (keys are the tokens, not a hash of them), so a
new request reuses the longest prefix its context shares with any earlier one (whole
blocks, then the leading positions of one more) and prefills only the rest. Each cache salt
(`GenerationRequest.cache_salt`: an API key's, a client's) has a tree of its own: a request
reuses only what requests with its salt stored, so no one learns from a faster prefill what
another key's prompts held.

Exact by construction: the KV (and hidden state) of a position depends only on the tokens
up to it, and the native forward computes each row's bits the same whatever else its
step holds, so KV stored from one request's prefill or decode steps is bitwise what a cold
prefill of the same tokens writes. Only positions whose KV is committed (below the
request's `num_cached`) are stored, so a verify's rejected draft positions never get in.

Where the blocks live depends on the target's cache:
- the native forward's `PagedKVCache`: a block is a page of the pool the running requests
  use. Storing one is holding the request's own page (no copy); reusing it is pointing a new
  request's block table at it (no copy); only the last, partial block a new prompt shares is
  copied, into a page of its own that the request goes on writing. The cached blocks and the
  running requests draw on one budget: when a request needs a page and none is free, the
  least recently used blocks nobody holds are evicted (`PagedKVCache.reclaim`).
- the torch forward's `KVCache` (CUDA), whose slots are contiguous: the blocks live in a
  pool of their own and are copied into a request's slot on admission (about 0.75 MB per
  block for the default model: milliseconds for a 1k-token prefix, against seconds of
  prefill).
A block is held (reference-counted) by every running request whose context passes through
it, from admission until the request ends; the least recently used blocks that no request
holds and that have no children are evicted when the cache is at its budget. When nothing
can be evicted, a request simply stores no more blocks: a full cache means cold prefill,
never an error.

The MTP head's own KV depends on the token after each position, which a block's key does
not fix, so the head's cache is not stored: the target's hidden states are, and the head
reruns over them (its one layer costs a few percent of the target's prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch
from torch import Tensor

from replicas.torch_engine.kv_cache import KVCache, PagedKVCache
from replicas.torch_engine.sizes import PAGE_TOKENS, page_bytes, prefix_block_bytes, prefix_blocks

BLOCK_TOKENS = PAGE_TOKENS  # a cached block is one page (one block of the native K layout)


@dataclass(eq=False)
class Block:
    """One cached block: its hidden-state row, where its KV is, its place in the tree, who holds it."""

    row: int  # index into the hidden-state rows (and the copied pool's); -1 for the root
    kv: int  # its KV: a page of the paged cache, or a row of the copied pool
    parent: Block | None
    key: tuple[int, ...]  # its tokens (a root's: its salt alone)
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)
    refs: int = 0  # running requests holding it


@dataclass
class PrefixStats:
    """Monotonic counters: prompt tokens admitted, those served from the cache, blocks evicted."""

    hit_tokens: int = 0
    prompt_tokens: int = 0
    evicted_blocks: int = 0


class SharedPages:
    """Blocks as pages of the paged cache: kept by holding the request's page, lent by sharing it."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def keep(self, slot: int, index: int, row: int) -> int:
        """A new cached block from block `index` of `slot`: where its KV is kept."""
        page = self.cache.pages_of(slot)[index]
        self.cache.hold(page)
        return page

    def adopt(self, slot: int, index: int, kv: int) -> None:
        """Block `index` of `slot` holds what cached `kv` holds: the slot uses the cached page."""
        self.cache.share(slot, index, kv)

    def lend(self, slot: int, whole: list[int], partial: int | None) -> bool:
        """Blocks 0.. of a new request's `slot` from cached KV: `whole` shared, `partial` copied
        into a page of the slot's own (False, copying nothing, when there is none to take)."""
        for i, page in enumerate(whole):
            self.cache.share(slot, i, page)
        if partial is None:
            return True
        end = (len(whole) + 1) * BLOCK_TOKENS
        if not self.cache.reserve(slot, end - BLOCK_TOKENS, end):
            return False
        self.cache.copy_page(partial, self.cache.pages_of(slot)[-1])
        return True

    def drop(self, kv: int) -> None:
        """An evicted block's KV is no longer the cache's."""
        self.cache.unref(kv)


class CopiedBlocks:
    """Blocks in a pool of their own, copied out of and into the contiguous slots of a `KVCache`."""

    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        if cache.max_seq_len % BLOCK_TOKENS:
            raise ValueError(f"max_seq_len: the cache's {cache.max_seq_len} positions are not whole blocks of "
                             f"{BLOCK_TOKENS} (the engine rounds its window up)")
        self.cache = cache
        layers, _, heads, _, head_dim = cache.k.shape
        shape = (layers, num_blocks, heads, BLOCK_TOKENS, head_dim)
        # Untouched pool pages cost no memory: the footprint follows what is cached.
        self._k = torch.empty(shape, dtype=cache.k.dtype, device=cache.k.device)  # [L, blocks, kvh, 32, hd]
        self._v = torch.empty(shape, dtype=cache.v.dtype, device=cache.v.device)

    def keep(self, slot: int, index: int, row: int) -> int:
        for pool, src in ((self._k, self.cache.k), (self._v, self.cache.v)):
            pool[:, row] = _slot_blocks(src, slot, index, 1)[:, :, 0]
        return row

    def adopt(self, slot: int, index: int, kv: int) -> None:
        """The slot's own copy of a cached block stays where it is."""

    def lend(self, slot: int, whole: list[int], partial: int | None) -> bool:
        if not whole and partial is None:
            return True
        rows = torch.tensor(whole + ([partial] if partial is not None else []), device=self._k.device)
        for pool, dest in ((self._k, self.cache.k), (self._v, self.cache.v)):
            _slot_blocks(dest, slot, 0, len(rows)).copy_(pool[:, rows].transpose(1, 2))
        return True

    def drop(self, kv: int) -> None:
        """Nothing to give back: the row is reused."""


class PrefixCache:
    """Blocks of committed KV (and hidden states, for the MTP head) shared across requests by prefix."""

    def __init__(self, cache: KVCache | PagedKVCache, hidden_size: int, budget_bytes: int) -> None:
        """`cache`: the target's KV cache (its slots are what blocks come from and go to);
        `hidden_size` 0 keeps no hidden states (no MTP head). `budget_bytes` must hold the
        blocks of one full context window (`cache.max_seq_len`)."""
        self.block_bytes = prefix_block_bytes(
            page_bytes(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.k.element_size()), hidden_size)
        self.num_blocks = prefix_blocks(cache.max_seq_len, budget_bytes, self.block_bytes)
        self.cache = cache
        if isinstance(cache, PagedKVCache):
            self.store: SharedPages | CopiedBlocks = SharedPages(cache)
            cache.reclaim = self.reclaim
        else:
            self.store = CopiedBlocks(cache, self.num_blocks)
        self._hidden = torch.empty((self.num_blocks, BLOCK_TOKENS, hidden_size), dtype=torch.float32,
                                   device=cache.k.device) if hidden_size else None
        self._roots: dict[str, Block] = {}  # by salt, those with blocks stored under them
        self._free_rows = list(range(self.num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, Block] = OrderedDict()  # row -> block, least recently used first
        self.stats = PrefixStats()

    # -- admission ------------------------------------------------------------------------
    def admit(self, context: Seq[int], slot: int, salt: str = "") -> tuple[list[Block], Tensor | None]:
        """Give `slot` the longest prefix of `context` cached under `salt` (its length set to
        it) and hold its whole blocks. At least one token is left to prefill (its logits are needed). Past
        the whole blocks, the cached block sharing the most leading tokens with the rest lends
        those positions too (the KV of a position depends on nothing after it); it is copied,
        not held, and skipped when the paged cache has no page to copy it into. Returns the
        held chain and the prefix's hidden states [n, d] (None without them, or when nothing
        is reused)."""
        limit = len(context) - 1
        chain, node = [], self._root(salt)
        for i in range(limit // BLOCK_TOKENS):
            child = node.children.get(_key(context, i))
            if child is None:
                break
            chain.append(child)
            node = child
        whole = len(chain) * BLOCK_TOKENS
        tail = tuple(context[whole: min(whole + BLOCK_TOKENS, limit)])
        partial, shared = None, 0
        for child in node.children.values():
            common = _common_prefix(child.key, tail)
            if common > shared:
                partial, shared = child, common
        for block in chain + ([partial] if partial else []):  # the partial one only while it is copied
            block.refs += 1
        if not self.store.lend(slot, [b.kv for b in chain], partial.kv if partial else None):
            partial.refs -= 1
            partial, shared = None, 0
        if partial:
            partial.refs -= 1
        copied = chain + ([partial] if partial else [])
        for block in copied:
            self._lru.move_to_end(block.row)
        n = whole + shared
        self.cache.lengths[slot] = n
        if not n or self._hidden is None:
            return chain, None
        rows = torch.tensor([b.row for b in copied], device=self._hidden.device)
        return chain, self._hidden[rows].flatten(0, 1)[:n]

    # -- storing --------------------------------------------------------------------------
    def extend(self, chain: list[Block], tokens: Seq[int], num_committed: int, slot: int,
               hidden: Tensor | None, tail: bool = False, salt: str = "") -> int:
        """Store the whole blocks of `tokens[:num_committed]` past `chain` (held, extended in
        place) under `salt`, from `slot`'s KV and `hidden` [rows, d] (the hidden states from
        position `len(chain) * 32` on). `tail`: the request is over, so its last, partial block is stored
        too, as a leaf keyed by its fewer tokens (not held; a later prompt can reuse its leading
        positions). Returns how many hidden rows it consumed; it stops early, without error,
        when no block can be evicted."""
        start = len(chain)
        parent = chain[-1] if chain else self._root(salt)
        for i in range(start, num_committed // BLOCK_TOKENS):
            block = self._block(parent, _key(tokens, i), slot, i, hidden, (i - start) * BLOCK_TOKENS)
            if block is None:
                break
            block.refs += 1
            chain.append(block)
            parent = block
        used = (len(chain) - start) * BLOCK_TOKENS
        end = len(chain) * BLOCK_TOKENS
        if tail and end < num_committed and len(chain) == num_committed // BLOCK_TOKENS:
            self._block(parent, tuple(tokens[end:num_committed]), slot, len(chain), hidden, used)
        return used

    def _block(self, parent: Block, key: tuple[int, ...], slot: int, index: int, hidden: Tensor | None,
               first_row: int) -> Block | None:
        """`parent`'s child under `key`, stored from block `index` of `slot` (and `hidden` rows
        from `first_row`) if new, else adopted by the slot in place of its own copy; touched as
        just used. None when the cache has no room."""
        block = parent.children.get(key)
        if block is None:
            row = self._take_row()
            if row is None:
                return None
            block = Block(row, self.store.keep(slot, index, row), parent, key)
            parent.children[key] = block
            if parent.parent is None:
                self._roots[parent.key[0]] = parent
            if self._hidden is not None:
                self._hidden[row, :len(key)] = hidden[first_row: first_row + len(key)]
        elif len(key) == BLOCK_TOKENS:
            self.store.adopt(slot, index, block.kv)
        self._lru[block.row] = block
        self._lru.move_to_end(block.row)
        return block

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        """An admitted request's prompt tokens, and how many of them came from the cache."""
        self.stats.prompt_tokens += prompt_tokens
        self.stats.hit_tokens += hit_tokens

    def release(self, chain: list[Block]) -> None:
        """The request holding `chain` has ended: its blocks may be evicted from now on."""
        for block in chain:
            block.refs -= 1
        chain.clear()

    def reclaim(self, pages: int) -> int:
        """Evict up to `pages` blocks nobody holds, least recently used first (the paged cache
        asking for pages); how many were evicted."""
        evicted = 0
        while evicted < pages and self._evict():
            evicted += 1
        return evicted

    @property
    def keeps_hidden(self) -> bool:
        """Blocks keep their positions' hidden states (with an MTP head): what the lm_head scores
        a cached prefix's prompt tokens from, without prefilling it."""
        return self._hidden is not None

    @property
    def cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def held_blocks(self) -> int:
        """Blocks some running request holds (0 when the engine is idle)."""
        return sum(1 for b in self._lru.values() if b.refs)

    # -- internals ------------------------------------------------------------------------
    def _root(self, salt: str) -> Block:
        """The root of `salt`'s blocks (a new one, kept once a block is stored under it)."""
        return self._roots.get(salt) or Block(-1, -1, None, (salt,))

    def _take_row(self) -> int | None:
        if not self._free_rows and not self._evict():
            return None
        return self._free_rows.pop()

    def _evict(self) -> bool:
        """Drop the least recently used block that no request holds and that has no children."""
        victim = next((b for b in self._lru.values() if not b.refs and not b.children), None)
        if victim is None:
            return False
        del victim.parent.children[victim.key]
        if victim.parent.parent is None and not victim.parent.children:
            del self._roots[victim.parent.key[0]]  # its salt has nothing stored now
        del self._lru[victim.row]
        self._free_rows.append(victim.row)
        self.store.drop(victim.kv)
        self.stats.evicted_blocks += 1
        return True


def _key(tokens: Seq[int], i: int) -> tuple[int, ...]:
    return tuple(tokens[i * BLOCK_TOKENS: (i + 1) * BLOCK_TOKENS])


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _slot_blocks(cache_kv: Tensor, slot: int, first: int, count: int) -> Tensor:
    """Blocks [first, first + count) of a slot as a view [L, kvh, count, 32, hd]. A block's
    positions are one contiguous run of the slot whatever the layout inside it (the native
    K is transposed within each 32-block), so copying whole blocks keeps it."""
    span = cache_kv[:, slot, :, first * BLOCK_TOKENS: (first + count) * BLOCK_TOKENS]
    return span.unflatten(2, (count, BLOCK_TOKENS))
