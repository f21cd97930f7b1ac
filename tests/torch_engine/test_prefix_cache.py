"""The prefix cache: a prompt served partly from cached blocks is bitwise a cold prefill.

Every warm run is compared with an engine that has no prefix cache (the oracle), token for
token and logprob for logprob; the blocks lent to a slot (shared pages on CPU, copies on
CUDA) with `torch.equal` on logits and KV. On CPU the blocks share one page pool with the
running requests: a tight pool sends requests back to the queue, and they resume exactly.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from replicas.engine import DEFAULT_MODEL, SpeculationConfig
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
from replicas.torch_engine.kv_cache import KVCache, PagedKVCache
from replicas.torch_engine.model import SeqSpan
from replicas.torch_engine.prefix_cache import BLOCK_TOKENS, PrefixCache
from replicas.torch_engine.loader import model_config
from tests.polling import async_wait_until, wait_until
from tests.torch_engine.engine_util import chat_prompt, code_edit_prompts, collect_logprobs, request

MAX_SEQ_LEN = 2048


def _engine(device: str, **overrides) -> TorchEngine:
    settings = dict(max_batch_size=8, max_seq_len=MAX_SEQ_LEN, speculation=SpeculationConfig(batch_gate=8))
    return TorchEngine(TorchEngineConfig(device=device, **{**settings, **overrides}))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engines(request, loop):
    """(warm: the default prefix cache, cold: none), on one device."""
    pair = (_engine(request.param), _engine(request.param, prefix_cache_bytes=0))
    for engine in pair:
        loop.run_until_complete(engine.start())
    yield pair
    for engine in pair:
        loop.run_until_complete(engine.shutdown())


def _ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(count)]


def _run(loop, engine, prompt, **kw):
    """(tokens, logprobs, cached_tokens) of one request run to the end."""
    tokens, _, logprobs, last = loop.run_until_complete(collect_logprobs(engine, request(prompt, **kw)))
    return tokens, logprobs, last.cached_tokens


def _same_as_cold(loop, engines, prompt, **kw) -> int:
    """Run `prompt` on both engines; assert equal tokens and logprobs; the warm run's cached tokens."""
    warm, cold = engines
    tokens, logprobs, cached = _run(loop, warm, prompt, logprobs=2, **kw)
    assert (tokens, logprobs) == _run(loop, cold, prompt, logprobs=2, **kw)[:2]
    return cached


def _idle(engine) -> bool:
    core = engine.core
    return not core.has_work and core.prefix.held_blocks == 0 and core.cache.num_free == core.cache.max_slots


def _kv(cache, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a slot's first n positions as [L, kvh, n, hd], whatever the cache's layout."""
    if not isinstance(cache, PagedKVCache):
        return cache.k[:, slot, :, :n], cache.v[:, slot, :, :n]
    pages = cache.pages_of(slot)
    layers, kvh, _, _, hd = cache.k.shape
    k = cache.k[:, :, pages].reshape(layers, kvh, len(pages), hd, BLOCK_TOKENS).transpose(3, 4)  # K^T per page
    return k.reshape(layers, kvh, -1, hd)[:, :, :n], cache.v[:, :, pages].reshape(layers, kvh, -1, hd)[:, :, :n]


def test_blocks_lent_to_a_slot_are_bitwise_a_cold_prefill(engines):
    core = engines[0].core
    model, cache, prefix = core.model, core.cache, core.prefix
    first = _ids(1, 150)
    second = first[:100] + _ids(2, 50)  # diverges inside block 3 (positions 96-127)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    try:
        hidden_a = model(torch.tensor(first), [SeqSpan(a, 0, len(first))], cache)
        chain = []
        assert prefix.extend(chain, first, len(first), a, hidden_a) == 4 * BLOCK_TOKENS
        prefix.release(chain)

        chain, reused_hidden = prefix.admit(second, b)  # 3 whole blocks, then 4 positions of block 3
        assert len(chain) == 3 and cache.lengths[b] == 100
        assert torch.equal(reused_hidden, hidden_a[:100])
        warm = model(torch.tensor(second[100:]), [SeqSpan(b, 100, len(second) - 100)], cache)
        cold = model(torch.tensor(second), [SeqSpan(c, 0, len(second))], cache)
        assert torch.equal(warm, cold[100:])
        assert torch.equal(model.logits(warm), model.logits(cold[100:]))
        n = len(second)
        for got, want in zip(_kv(cache, b, n), _kv(cache, c, n)):
            assert torch.equal(got, want)
        if isinstance(cache, PagedKVCache):  # the whole blocks are a's pages, not copies
            assert cache.pages_of(b)[:3] == cache.pages_of(a)[:3] != cache.pages_of(c)[:3]
        prefix.release(chain)
    finally:
        for slot in (a, b, c):
            cache.free(slot)


def test_repeated_prompt_and_the_next_turn_equal_cold(engines, loop):
    warm = engines[0]
    user = "Add type hints.\n\n```python\n" + "\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(12)) + "```"
    turn1 = chat_prompt(warm, user)
    assert _same_as_cold(loop, engines, turn1, max_tokens=48) == 0
    cached = _same_as_cold(loop, engines, turn1, max_tokens=48)
    assert cached == len(warm.tokenizer.encode(turn1, add_special_tokens=False)) - 1  # all but the last

    answer = warm.tokenizer.decode(_run(loop, warm, turn1, max_tokens=48)[0], skip_special_tokens=True)
    turn2 = warm.tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "Now add a docstring to f3."}], tokenize=False, add_generation_prompt=True)
    assert _same_as_cold(loop, engines, turn2, max_tokens=32) >= cached  # the first turn's blocks
    # seeded sampling draws the same tokens warm or cold
    assert _same_as_cold(loop, engines, turn2, max_tokens=32, temperature=0.8, seed=7) > cached


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_prompt_diverging_mid_block_reuses_what_it_shares(engines, loop, mode):
    base = _ids(10 + len(mode), 200)
    _same_as_cold(loop, engines, base, max_tokens=8, mode=mode)
    variant = base[:100] + _ids(20, 60)  # diverges at position 100, inside block 3
    assert _same_as_cold(loop, engines, variant, max_tokens=24, mode=mode) == 100


def test_concurrent_requests_sharing_a_prefix_equal_cold_alone(engines, loop):
    warm, cold = engines
    edits = code_edit_prompts(warm, 2)
    shared = _ids(30, 300)
    prompts = [shared + _ids(31 + i, 40) for i in range(6)] + edits
    modes = ["auto", "sa", "mtp", "off"] * 2

    async def together():
        return await asyncio.gather(*(collect_logprobs(warm, request(p, max_tokens=40, mode=m, logprobs=1))
                                      for p, m in zip(prompts, modes)))

    results = loop.run_until_complete(together())
    for prompt, mode, (tokens, _, logprobs, last) in zip(prompts, modes, results):
        assert (tokens, logprobs) == _run(loop, cold, prompt, max_tokens=40, mode=mode, logprobs=1)[:2]
    assert sum(last.cached_tokens >= 300 for *_, last in results[:6]) >= 5  # the first one stores the rest's
    assert wait_until(lambda: _idle(warm), timeout_s=10)


def test_a_small_budget_evicts_and_a_full_cache_is_a_cold_prefill(engines, loop):
    warm, cold = engines
    small = _engine(cold.config.device, max_seq_len=256, prefix_cache_bytes=10 * warm.core.prefix.block_bytes)
    loop.run_until_complete(small.start())
    try:
        prefix = small.core.prefix
        assert prefix.num_blocks == 10
        prompts = [_ids(100 + i, 100) for i in range(12)]  # 3 blocks each
        for prompt in prompts:
            tokens, logprobs, _ = _run(loop, small, prompt, max_tokens=16, logprobs=1)
            assert (tokens, logprobs) == _run(loop, cold, prompt, max_tokens=16, logprobs=1)[:2]
        assert prefix.stats.evicted_blocks > 0 and prefix.cached_blocks <= 10
        assert _run(loop, small, prompts[-1], max_tokens=4)[2] == 99  # the newest are kept (all but one token)

        async def together():  # 8 x 6 blocks held at once: more than the budget
            return await asyncio.gather(*(collect_logprobs(small, request(_ids(200 + i, 200), max_tokens=16))
                                          for i in range(8)))

        for i, (tokens, _, _, last) in enumerate(loop.run_until_complete(together())):
            assert last.finish_reason == "length"
            assert tokens == _run(loop, cold, _ids(200 + i, 200), max_tokens=16)[0]
        assert wait_until(lambda: _idle(small), timeout_s=10)
        stats = small.stats()
        assert stats.prefix_cached_blocks == prefix.cached_blocks and stats.prefix_evicted_blocks > 0
        assert 0 < stats.prefix_hit_tokens < stats.prefix_prompt_tokens
    finally:
        loop.run_until_complete(small.shutdown())


def test_a_tight_kv_budget_preempts_and_every_request_resumes_exactly(engines, loop):
    # The paged cache holds one window and 16 pages more, shared with the prefix cache: 8
    # requests of ~450 tokens need ~120 pages at once, so the newest wait and resume (their
    # output prefilled again) once others have ended. Each equals the same request alone on
    # the cold engine, token for token and logprob for logprob, sampled ones included.
    warm, cold = engines
    if not isinstance(warm.core.cache, PagedKVCache):
        pytest.skip("the paged KV cache is the native CPU forward's")
    page = warm.core.cache.page_bytes
    tight = _engine("cpu", kv_cache_bytes=(MAX_SEQ_LEN // BLOCK_TOKENS + 16) * page)
    loop.run_until_complete(tight.start())
    try:
        cache = tight.core.cache
        assert cache.num_pages == MAX_SEQ_LEN // BLOCK_TOKENS + 16
        prompts = [_ids(300 + i, 350) for i in range(8)]
        settings = [dict(mode="auto", logprobs=2), dict(mode="off", temperature=0.8, seed=11)] * 4

        seen = []  # (kv_cache_usage, waiting) as the replica's gauges would read them

        async def watch():
            while True:
                stats = tight.stats()
                seen.append((stats.kv_cache_usage, stats.waiting))
                await asyncio.sleep(0.05)

        async def together():
            watcher = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(*(collect_logprobs(tight, request(p, max_tokens=100, **kw))
                                              for p, kw in zip(prompts, settings)))
            finally:
                watcher.cancel()

        for prompt, kw, (tokens, _, logprobs, last) in zip(prompts, settings, loop.run_until_complete(together())):
            assert last.finish_reason == "length"
            assert (tokens, logprobs) == _run(loop, cold, prompt, max_tokens=100, **kw)[:2]
            assert last.cached_tokens == 0  # unlike prompts, prefilled cold: a readmission's own blocks are no hit
        # one sent back waits for a request to end: no sending back the same one step after step
        # (whether a running one is sent back at all depends on timing: most wait at admission)
        assert tight.core.preemptions <= len(prompts)
        stats = tight.core.prefix.stats  # each request's prompt counted once, when first admitted
        assert (stats.prompt_tokens, stats.hit_tokens) == (sum(map(len, prompts)), 0)
        assert wait_until(lambda: _idle(tight), timeout_s=10)
        assert cache.free_pages == cache.num_pages - tight.core.prefix.cached_blocks  # the rest are the cache's
        # the pool ran near full (requests waited for pages); the prefix cache's blocks count as free
        assert max(usage for usage, _ in seen) > 0.75 and max(waiting for _, waiting in seen) > 0
        assert (tight.stats().kv_cache_usage, tight.stats().waiting) == (0, 0)
    finally:
        loop.run_until_complete(tight.shutdown())


def test_a_request_with_no_pages_at_admission_waits_and_is_no_preemption(engines, loop):
    """Pages for one window and 2 more: a long prompt holds nearly all of them, so a short one
    sent beside it finds none at admission. It waits for the first to end (counted waiting, not
    preempted: it had never run) and then runs as it would alone."""
    warm, cold = engines
    if not isinstance(warm.core.cache, PagedKVCache):
        pytest.skip("the paged KV cache is the native CPU forward's")
    tight = _engine("cpu", kv_cache_bytes=(MAX_SEQ_LEN // BLOCK_TOKENS + 2) * warm.core.cache.page_bytes,
                    prefix_cache_bytes=0)
    loop.run_until_complete(tight.start())
    try:
        long_prompt, short_prompt = _ids(500, MAX_SEQ_LEN - 100), _ids(501, 300)
        waiting = []

        async def both():
            first = asyncio.ensure_future(collect_logprobs(tight, request(long_prompt, max_tokens=16)))
            await async_wait_until(lambda: tight.core.running, timeout_s=30)
            second = asyncio.ensure_future(collect_logprobs(tight, request(short_prompt, max_tokens=16)))
            while not second.done():
                waiting.append(tight.stats().waiting)
                await asyncio.sleep(0.01)
            return await first, await second

        _, (tokens, _, logprobs, _) = loop.run_until_complete(both())
        assert max(waiting) == 1 and tight.core.preemptions == 0
        assert (tokens, logprobs) == _run(loop, cold, short_prompt, max_tokens=16)[:2]
    finally:
        loop.run_until_complete(tight.shutdown())


def test_a_running_request_short_of_pages_is_preempted_and_resumes_exactly(engines, loop):
    """Pages for exactly two 1,000-token prompts and a block each: both run, and the first to
    need another page takes the newer one's, which is sent back (a preemption) and resumes,
    once the other has ended, with what it would have produced alone."""
    warm, cold = engines
    if not isinstance(warm.core.cache, PagedKVCache):
        pytest.skip("the paged KV cache is the native CPU forward's")
    prompts = [_ids(510, 1000), _ids(511, 1000)]
    pages = 2 * -(-(1000 + BLOCK_TOKENS) // BLOCK_TOKENS)
    tight = _engine("cpu", kv_cache_bytes=pages * warm.core.cache.page_bytes, prefix_cache_bytes=0)
    loop.run_until_complete(tight.start())
    try:
        async def deltas(prompt):
            return [delta async for delta in tight.generate(request(prompt, max_tokens=96))]

        async def both():
            return await asyncio.gather(*map(deltas, prompts))

        paused = []
        for prompt, streamed in zip(prompts, loop.run_until_complete(both())):
            tokens = [t for d in streamed for t in d.token_ids]
            logprobs = [lp for d in streamed for lp in d.logprobs]
            assert (tokens, logprobs) == _run(loop, cold, prompt, max_tokens=96)[:2]
            # the one sent back says so, once, with nothing new: the server's idle timer stops
            paused += [d for d in streamed if d.waiting]
            assert all(not (d.token_ids or d.text or d.finish_reason) for d in streamed if d.waiting)
        assert tight.core.preemptions == 1 and len(paused) == 1
    finally:
        loop.run_until_complete(tight.shutdown())


def test_aborting_during_prefill_leaves_the_cache_consistent(engines, loop, monkeypatch):
    """An abort takes effect between two chunks of a long prompt's prefill (not once the whole
    prompt is in); the whole blocks that went in before it were stored, and they are sound."""
    warm = engines[0]
    prompt = _ids(300, 1500)
    monkeypatch.setattr(warm.core, "max_prefill_tokens", 64)  # 24 chunks, a step each: on any device

    def prefilling():
        return next((s for s in warm.core.running if s.request_id == "long" and s.num_cached), None)

    async def abort_while_prefilling():
        task = asyncio.ensure_future(collect_logprobs(warm, request(prompt, max_tokens=8, rid="long")))
        assert await async_wait_until(prefilling, timeout_s=30, interval_s=0.002)
        seq = prefilling()
        await warm.abort("long")
        return (await task)[3], seq

    last, seq = loop.run_until_complete(abort_while_prefilling())
    assert last.finish_reason == "abort" and not last.token_ids
    assert wait_until(lambda: _idle(warm), timeout_s=10)
    assert warm.core.max_prefill_tokens <= seq.num_cached < len(prompt)
    assert _same_as_cold(loop, engines, prompt, max_tokens=8) == seq.num_cached // BLOCK_TOKENS * BLOCK_TOKENS


def test_sizes_short_of_one_context_window_are_refused_naming_the_key(loop):
    cache = KVCache(2, 1, 256, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="prefix_cache_bytes: .* needs 8"):
        PrefixCache(cache, 16, 7 * (2 * 2 * 32 * 8 * 2 + 32 * 16 * 4))
    assert PrefixCache(cache, 16, 8 * (2 * 2 * 32 * 8 * 2 + 32 * 16 * 4)).num_blocks == 8
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        TorchEngineConfig(prefix_cache_bytes=-1)
    engine = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=256, prefix_cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="prefix_cache_bytes: .* needs 8"):
        loop.run_until_complete(engine.start())
    loop.run_until_complete(engine.shutdown())
    engine = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=256, device="cpu", kv_cache_bytes=1 << 20))
    with pytest.raises(ValueError, match=r"kv_cache_bytes: 1048576 bytes hold 1 pages .* needs 8"):
        loop.run_until_complete(engine.start())
    loop.run_until_complete(engine.shutdown())
    for sizes, named in [(dict(max_batch_size=10**9), r"max_batch_size x max_seq_len \(kv_cache_bytes 0\): the KV "),
                         (dict(kv_cache_bytes=1 << 50), r"kv_cache_bytes: the KV cache's 1048576\.0 GiB"),
                         (dict(prefix_cache_bytes=1 << 50), r"prefix_cache_bytes' 1048576\.0 GiB are more than")]:
        # more than this machine's memory: refused before any of it is allocated
        engine = TorchEngine(TorchEngineConfig(**{"max_batch_size": 1, "max_seq_len": 256, "device": "cpu",
                                                  "prefix_cache_bytes": 0, **sizes}))
        with pytest.raises(ValueError, match=named):
            loop.run_until_complete(engine.start())
        loop.run_until_complete(engine.shutdown())
    positions = model_config(DEFAULT_MODEL).max_position_embeddings  # RoPE has no angle past the last
    engine = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=positions + 32, prefix_cache_bytes=0))
    with pytest.raises(ValueError, match=f"max_seq_len: {positions + 32} is past the model's {positions} positions"):
        loop.run_until_complete(engine.start())
    loop.run_until_complete(engine.shutdown())


def test_a_pool_full_of_held_blocks_is_offered_each_block_once(engines, loop):
    """Two requests that would hold more blocks than the pool has: a refused block is not
    offered again every step (each offer copies all pending hidden rows and scans the pool)."""
    warm, cold = engines
    small = _engine(cold.config.device, max_batch_size=2, max_seq_len=256,
                    prefix_cache_bytes=10 * warm.core.prefix.block_bytes)
    loop.run_until_complete(small.start())
    prefix, offers = small.core.prefix, []
    extend = prefix.extend
    prefix.extend = lambda *args, **kwargs: offers.append(args[2]) or extend(*args, **kwargs)
    prompts = [_ids(300 + i, 100) for i in range(2)]
    try:
        async def together():  # a token per step, 2 x 7 whole blocks; the pool has 10
            return await asyncio.gather(*(collect_logprobs(small, request(p, max_tokens=150, ignore_eos=True, mode="off"))
                                          for p in prompts))

        for prompt, (tokens, _, _, last) in zip(prompts, loop.run_until_complete(together())):
            assert last.finish_reason == "length"
            assert tokens == _run(loop, cold, prompt, max_tokens=150, ignore_eos=True)[0]
        assert prefix.cached_blocks == prefix.num_blocks
        assert len(offers) <= 2 * (250 // BLOCK_TOKENS + 1)  # each whole block once, then the tail
    finally:
        loop.run_until_complete(small.shutdown())


def test_the_copied_store_takes_a_window_of_whole_blocks_only():
    """CUDA's cache of a max_seq_len that is no multiple of 32 (100) had a last block of 4
    positions, which the copied store could not keep or lend: a request ending there raised,
    and the failure lost it. The engine now rounds its window up, as the native cache does, and
    a window of part blocks is refused naming the key; a last block is kept and lent."""
    cache = KVCache(1, 2, 128, 2, 8)
    prefix = PrefixCache(cache, 0, 1 << 20)
    tokens, slot, chain = _ids(950, 99), cache.allocate(), []
    cache.lengths[slot] = 98
    prefix.extend(chain, tokens, 98, slot, None, tail=True)
    assert len(chain) == 3 and cache.lengths[slot] == 98
    later = cache.allocate()
    held, _ = prefix.admit(tokens, later)
    assert len(held) == 3 and cache.lengths[later] == 98  # 3 whole blocks held, then the tail's 2 positions
    with pytest.raises(ValueError, match="max_seq_len: the cache's 100 positions are not whole blocks of 32"):
        PrefixCache(KVCache(1, 1, 100, 1, 8), 0, 1 << 20)


def test_a_failed_last_block_store_still_finishes_and_frees_the_request(engines, loop, monkeypatch):
    """Keeping a finished request's last block is worth having, not failing for: when it
    raised, the request had left the running list, so its client never got a final delta and
    its slot and blocks leaked."""
    warm, _ = engines
    extend = warm.core.prefix.extend

    def failing_tail(*args, tail=False, **kwargs):
        if tail:
            raise RuntimeError("injected: the last block's store failed")
        return extend(*args, tail=tail, **kwargs)

    monkeypatch.setattr(warm.core.prefix, "extend", failing_tail)
    tokens, _, _, last = loop.run_until_complete(asyncio.wait_for(
        collect_logprobs(warm, request(_ids(951, 70), max_tokens=4, ignore_eos=True)), timeout=60))
    assert len(tokens) == 4 and last.finish_reason == "length"
    assert wait_until(lambda: _idle(warm), timeout_s=10)


def test_a_resumed_request_counts_its_prompt_not_its_output_in_the_hit_rate(engines, loop):
    """The prefix stats are of prompt tokens: a resumed request's context holds the output it
    delivered before, which counted as prompt (and its hits) there."""
    import dataclasses

    from replicas.engine import Resume

    warm, _ = engines
    prompt = _ids(952, 40)
    first, _, _ = _run(loop, warm, prompt, max_tokens=30, ignore_eos=True)
    before = warm.stats()
    resumed = dataclasses.replace(request(prompt, max_tokens=30, ignore_eos=True), resume=Resume(tuple(first[:25])))
    last = loop.run_until_complete(collect_logprobs(warm, resumed))[-1]
    after = warm.stats()
    assert after.prefix_prompt_tokens - before.prefix_prompt_tokens == len(prompt)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == last.cached_tokens == len(prompt)  # +63 before


def test_a_health_probe_stays_out_of_the_hit_rate(engines, loop):
    """A quiet replica's health checks (GenerationRequest.probe) would dilute it with misses,
    and keep their prompt's block."""
    import dataclasses

    warm, _ = engines
    prompt = _ids(953, 40)
    _run(loop, warm, prompt, max_tokens=2)
    before = warm.stats()
    probe = dataclasses.replace(request(prompt, max_tokens=1), probe=True)
    tokens, _, _, last = loop.run_until_complete(collect_logprobs(warm, probe))
    assert len(tokens) == 1 and last.cached_tokens > 0  # served from the cache all the same
    after = warm.stats()
    assert (after.prefix_prompt_tokens, after.prefix_hit_tokens) == (before.prefix_prompt_tokens,
                                                                      before.prefix_hit_tokens)
    _run(loop, warm, prompt, max_tokens=2)
    assert warm.stats().prefix_prompt_tokens - before.prefix_prompt_tokens == len(prompt)
    blocks = warm.stats().prefix_cached_blocks
    short = dataclasses.replace(request(_ids(977, 3), max_tokens=1), probe=True)  # as the Replica's ("ok")
    assert len(loop.run_until_complete(collect_logprobs(warm, short))[0]) == 1
    assert warm.stats().prefix_cached_blocks == blocks  # no block kept for it (one was, its tail)
