"""The paged KV cache's bookkeeping: pages taken on demand, shared by count, given back."""

from __future__ import annotations

import pytest
import torch

from replicas.torch_engine.kv_cache import PAGE_TOKENS, KVCache, PagedKVCache


def small(num_pages: int | None = None, slots: int = 3, max_seq_len: int = 4 * PAGE_TOKENS) -> PagedKVCache:
    return PagedKVCache(num_layers=2, max_slots=slots, max_seq_len=max_seq_len, num_kv_heads=1, head_dim=8,
                        num_pages=num_pages)


def table(cache: PagedKVCache, slot: int) -> list[int]:
    return cache.block_table[slot].tolist()


def test_pages_are_taken_as_a_slot_grows_lowest_first_and_given_back_when_it_ends():
    cache = small()
    assert cache.num_pages == 3 * 4 and cache.free_pages == 12
    assert cache.k.shape == (2, 1, 12, PAGE_TOKENS, 8) and cache.k.dtype == torch.float16
    a, b = cache.allocate(), cache.allocate()
    assert cache.reserve(a, 0, 1) and cache.reserve(b, 0, 40) and cache.reserve(a, 1, 33)
    assert cache.pages_of(a) == [0, 3] and cache.pages_of(b) == [1, 2]
    assert table(cache, a) == [0, 3, -1, -1] and table(cache, b) == [1, 2, -1, -1]
    assert cache.reserve(a, 33, 40) and cache.pages_of(a) == [0, 3]  # its block 1 already has a page
    cache.lengths[a] = 40
    cache.truncate(a, 20)  # a rollback keeps the pages: the next step writes there again
    assert cache.pages_of(a) == [0, 3] and cache.free_pages == 8
    cache.free(a)
    assert cache.free_pages == 10 and table(cache, a) == [-1] * 4
    c = cache.allocate()
    assert c == a and cache.reserve(c, 0, 64) and cache.pages_of(c) == [0, 3]


def test_a_short_pool_takes_nothing_and_asks_to_reclaim_what_it_lacks():
    cache = small(num_pages=3)
    a, b = cache.allocate(), cache.allocate()
    assert cache.reserve(a, 0, 64)
    asked = []
    assert not cache.reserve(b, 0, 64)  # no reclaim hook: just no
    cache.reclaim = lambda n: asked.append(n) or 0
    assert not cache.reserve(b, 0, 96)
    assert asked == [2] and cache.pages_of(b) == [] and cache.free_pages == 1

    def give_back(n: int) -> int:  # a holder lets go of pages, as the prefix cache evicting
        cache.free(a)
        return 2

    cache.reclaim = give_back
    assert cache.reserve(b, 0, 96) and cache.pages_of(b) == [0, 1, 2]


def test_shared_pages_are_counted_read_only_and_free_with_their_last_holder():
    cache = small()
    a, b = cache.allocate(), cache.allocate()
    assert cache.reserve(a, 0, 64)
    shared = cache.pages_of(a)
    cache.hold(shared[0])  # a prefix cache keeping block 0
    for i, page in enumerate(shared):  # b reuses both blocks, copying nothing
        cache.share(b, i, page)
    assert cache.pages_of(b) == shared and [cache.refs[p] for p in shared] == [3, 2]
    assert cache.usage() == 2 / 12  # a page two slots share is used once
    with pytest.raises(RuntimeError, match="page 1 is shared .* would be written"):
        cache.reserve(b, 40, 70)  # b writing inside a's block 1
    assert cache.reserve(b, 64, 70) and cache.pages_of(b) == shared + [2]
    cache.free(a)
    cache.free(b)
    assert cache.refs[shared[0]] == 1 and cache.free_pages == 11  # block 0 stays while held
    assert cache.usage() == 0  # ... by the prefix cache alone, which gives it back when short
    cache.unref(shared[0])
    assert cache.free_pages == 12


def test_sharing_a_block_a_slot_has_lets_its_own_page_go():
    cache = small()
    a, b = cache.allocate(), cache.allocate()
    assert cache.reserve(a, 0, 32) and cache.reserve(b, 0, 32)
    cache.share(b, 0, cache.pages_of(a)[0])  # the same KV, kept once
    assert cache.pages_of(b) == [0] and cache.refs[0] == 2 and cache.refs[1] == 0 and cache.free_pages == 11
    cache.k[:, :, 0], cache.v[:, :, 0] = torch.randn(2, *cache.k[:, :, 0].shape).half()
    cache.copy_page(0, 5)
    assert torch.equal(cache.k[:, :, 5], cache.k[:, :, 0]) and torch.equal(cache.v[:, :, 5], cache.v[:, :, 0])


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="max_seq_len: must be a multiple of 32"):
        small(max_seq_len=40)
    with pytest.raises(ValueError, match="num_pages: must be >= 1"):
        small(num_pages=0)
    cache = small()
    a = cache.allocate()
    with pytest.raises(ValueError, match=r"positions \[0, 129\) outside \[0, 128\]"):
        cache.reserve(a, 0, 129)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        cache.reserve(1, 0, 1)
    with pytest.raises(ValueError, match="share: block 1 of slot 0"):
        cache.share(a, 1, 0)  # not its next block
    full = small()
    b = full.allocate()
    full.reserve(b, 0, 128)
    pages = full.pages_of(b)
    with pytest.raises(ValueError, match="share: block 4 of slot 0"):
        full.share(b, 4, pages[0])  # past the slot's last block: nothing changes
    assert full.pages_of(b) == pages and full.refs[pages[0]] == 1
    with pytest.raises(ValueError, match="hold: page 4 is free"):
        cache.hold(4)


def test_a_fixed_slot_cache_is_used_by_the_positions_its_slots_hold():
    cache = KVCache(num_layers=1, max_slots=2, max_seq_len=64, num_kv_heads=1, head_dim=8)
    a = cache.allocate()
    cache.lengths[a] = 32
    assert cache.usage() == 32 / 128
    cache.free(a)
    assert cache.usage() == 0
