"""TensorRT-LLM's prefix cache (KV block reuse) through the adapter, against the contract fake.

The fake reuses whole blocks of 32 prompt tokens (its tokenizer: one token per character)
within a prompt's first len - 1 tokens, as upstream's BlockManager does.
"""

from __future__ import annotations

import dataclasses

import pytest

from replicas.trtllm.outputs import cached_prompt_tokens, prefilled
from replicas.trtllm.translate import UnsupportedRelease, kv_cache_kwargs
from tests.trtllm.conftest import collect, engine_config, fake_api, request, run, started

LONG = "def total(items):\n    return sum(item.price * item.count for item in items)\n"  # 76 tokens
N = len(LONG)
SHARED = LONG[:40] + "    raise NotImplementedError('not yet, not here')\n"  # one whole block in common


async def final_deltas(engine, *prompts):
    """Each prompt run to the end in turn (so each sees the blocks of those before it)."""
    return [(await collect(engine, request(p, max_tokens=8, rid=f"r{i}")))[-1] for i, p in enumerate(prompts)]


def test_block_reuse_is_passed_on_by_default_and_can_be_turned_off():
    async def go(**overrides):
        engine = await started(engine_config(**overrides))
        built = engine._llm.args.kv_cache_config
        await engine.shutdown()
        return built

    on, off = run(go()), run(go(enable_block_reuse=False))
    assert on.enable_block_reuse is True and on.free_gpu_memory_fraction == 0.85
    assert off.enable_block_reuse is False


def test_kv_cache_kwargs_name_what_the_release_lacks():
    have = fake_api().kv_cache_fields
    assert kv_cache_kwargs(engine_config(), have) == {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True}
    assert kv_cache_kwargs(engine_config(enable_block_reuse=False), have)["enable_block_reuse"] is False
    with pytest.raises(UnsupportedRelease, match="enable_block_reuse"):
        kv_cache_kwargs(engine_config(), have - {"enable_block_reuse"})


@pytest.mark.parametrize("mode", ["off", "hybrid"])
def test_a_repeated_prompt_reports_its_reused_prefix(mode):
    async def go():
        engine = await started(engine_config(mode))
        finals = await final_deltas(engine, LONG, LONG, SHARED)
        stats = engine.stats()
        await engine.shutdown()
        return finals, stats

    (first, again, shared), stats = run(go())
    assert (first.prompt_tokens, first.cached_tokens) == (N, 0)
    assert again.cached_tokens == 64  # two whole blocks: the third would hold the last prompt token
    assert shared.cached_tokens == 32
    assert all(d.finish_reason == "length" for d in (first, again, shared))
    assert (stats.prefix_hit_tokens, stats.prefix_prompt_tokens) == (96, 2 * N + len(SHARED))
    assert stats.prefix_hit_rate == pytest.approx(96 / (2 * N + len(SHARED)))
    assert (stats.prefix_cached_blocks, stats.prefix_evicted_blocks) == (0, 0)  # upstream reports neither


def test_a_salted_request_reuses_only_its_salts_blocks():
    """The request's cache salt (an API key's, a client's) goes to generate_async's
    `cache_salt`, which limits block reuse to requests with the same one."""
    async def go():
        engine = await started(engine_config())
        finals = []
        for i, salt in enumerate(("alice", "bob", "", "alice")):
            salted = dataclasses.replace(request(LONG, max_tokens=8, rid=f"r{i}"), cache_salt=salt)
            finals.append((await collect(engine, salted))[-1].cached_tokens)
        await engine.shutdown()
        return finals

    assert run(go()) == [0, 0, 0, 64]


def test_without_block_reuse_nothing_is_cached_and_prompts_still_count():
    async def go():
        engine = await started(engine_config(enable_block_reuse=False))
        finals = await final_deltas(engine, LONG, LONG)
        stats = engine.stats()
        await engine.shutdown()
        return finals, stats

    finals, stats = run(go())
    assert [d.cached_tokens for d in finals] == [0, 0]
    assert (stats.prefix_hit_tokens, stats.prefix_prompt_tokens, stats.prefix_hit_rate) == (0, 2 * N, 0.0)


def test_a_health_probe_stays_out_of_the_totals():
    async def go():
        engine = await started(engine_config())
        await final_deltas(engine, LONG)
        probe = await collect(engine, dataclasses.replace(request(LONG, max_tokens=1, rid="probe"), probe=True))
        stats = engine.stats()
        await engine.shutdown()
        return probe[-1], stats

    probe, stats = run(go())
    assert probe.finish_reason == "length" and probe.prompt_tokens == N
    assert probe.cached_tokens == 64  # served from the cache all the same, as the torch engine's says
    assert (stats.prefix_hit_tokens, stats.prefix_prompt_tokens) == (0, N)


def test_totals_survive_a_restart():
    async def go():
        engine = await started(engine_config("mtp"))
        await final_deltas(engine, LONG, LONG)
        engine.configure(dataclasses.replace(engine.config.speculation, max_draft_len=2))
        await engine.restart()  # a fresh LLM: its cache is empty, the engine's totals are not
        restarted = await final_deltas(engine, LONG)
        stats = engine.stats()
        await engine.shutdown()
        return restarted[0].cached_tokens, stats

    cached, stats = run(go())
    assert cached == 0 and (stats.prefix_hit_tokens, stats.prefix_prompt_tokens) == (64, 3 * N)


@pytest.mark.parametrize("reported,prompt,expected", [
    (64, 78, 64), (None, 78, 0), (0, 78, 0),
    (120, 78, 78),  # a decode step's sequence length reported as cached: never above the prompt
    (-1, 78, 0),
])
def test_cached_prompt_tokens(reported, prompt, expected):
    assert cached_prompt_tokens(reported, prompt) == expected


@pytest.mark.parametrize("token_ids,finish,expected", [
    ([], None, False), ([], "cancelled", False),  # not yet scheduled, or aborted before its prefill
    ([7], None, True), ([], "stop", True), ([], "length", True),
])
def test_prefilled(token_ids, finish, expected):
    assert prefilled(token_ids, finish) is expected
