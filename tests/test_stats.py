"""Speculation counters, the acceptance-length definition, EWMA and the flat stat keys."""

from __future__ import annotations

import pytest

from replicas import stats
from replicas.stats import SOURCES, EngineStats, Ewma, SpecCounters, acceptance_length


@pytest.mark.parametrize(
    "emitted, steps, expected",
    [(0, 0, 0.0), (5, 0, 0.0), (4, 1, 4.0), (7, 2, 3.5), (1, 1, 1.0)],
)
def test_acceptance_length(emitted, steps, expected):
    assert acceptance_length(emitted, steps) == expected


def test_counters_start_at_zero():
    counters = SpecCounters()
    assert counters.draft_tokens == {s: 0 for s in SOURCES}
    assert counters.accepted_tokens == {s: 0 for s in SOURCES}
    assert counters.acceptance_length == 0.0
    assert counters.usage() == {"draft_tokens": 0, "accepted_tokens": 0,
                                "acceptance_length": 0.0, "steps": 0}


def test_record_counts_bonus_token_in_acceptance_length():
    counters = SpecCounters()
    counters.record("sa", num_draft=5, num_accepted=3)  # emits 4
    counters.record("mtp", num_draft=3, num_accepted=0)  # emits 1 (the correction)
    counters.record("sa", num_draft=2, num_accepted=2)  # emits 3
    counters.record("grammar", num_draft=4, num_accepted=4)  # emits 5
    assert counters.draft_tokens == {"sa": 7, "mtp": 3, "grammar": 4}
    assert counters.accepted_tokens == {"sa": 5, "mtp": 0, "grammar": 4}
    assert counters.verify_steps == 4
    assert counters.emitted_tokens == 13
    assert counters.acceptance_length == pytest.approx(13 / 4)
    assert counters.usage() == {"draft_tokens": 14, "accepted_tokens": 9,
                                "acceptance_length": round(13 / 4, 4), "steps": 4}


def test_counters_are_independent_objects():
    first, second = SpecCounters(), SpecCounters()
    first.record("mtp", 2, 1)
    assert second.draft_tokens["mtp"] == 0 and second.verify_steps == 0


def test_ewma_first_sample_then_blend():
    ewma = Ewma(alpha=0.25)
    assert ewma.value == 0.0
    assert ewma.update(8.0) == 8.0  # the first sample is taken as is, not blended with 0
    assert ewma.update(4.0) == pytest.approx(0.25 * 4 + 0.75 * 8)
    assert ewma.value == pytest.approx(7.0)
    for _ in range(200):
        ewma.update(2.0)
    assert ewma.value == pytest.approx(2.0)


def test_engine_stats_as_metrics():
    engine_stats = EngineStats(
        batch_size=3, waiting=1, speculating=1, acceptance_length=2.5,
        draft_tokens={"sa": 10, "mtp": 4, "grammar": 3}, accepted_tokens={"sa": 6, "mtp": 1, "grammar": 3},
        step_ms=12.5, tokens_per_s=40.0, batch_gate=8,
        prefix_hit_tokens=96, prefix_prompt_tokens=384, prefix_cached_blocks=7, prefix_evicted_blocks=2,
        kv_preemptions=5, kv_cache_usage=0.5, steps=42, draft_row_cost=0.125, mtp_ask_cost=0.25, sa_acceptance={"1-2": 0.375, "17+": 0.875},
        mtp_accepted_per_ask=1.5, sa_pool_tokens=11,
    )
    metrics = engine_stats.as_metrics()
    assert metrics == {
        stats.BATCH_SIZE: 3.0, stats.WAITING: 1.0, stats.SPECULATING: 1.0, stats.BATCH_GATE: 8.0,
        stats.ACCEPTANCE_LENGTH: 2.5, stats.STEP_MS: 12.5, stats.TOKENS_PER_S: 40.0,
        "draft_tokens_sa": 10.0, "draft_tokens_mtp": 4.0, "draft_tokens_grammar": 3.0,
        "accepted_tokens_sa": 6.0, "accepted_tokens_mtp": 1.0, "accepted_tokens_grammar": 3.0,
        stats.PREFIX_HIT_TOKENS: 96.0, stats.PREFIX_PROMPT_TOKENS: 384.0, stats.PREFIX_HIT_RATE: 0.25,
        "prefix_cached_blocks": 7.0, "prefix_evicted_blocks": 2.0, "kv_preemptions": 5.0, "kv_cache_usage": 0.5,
        "steps": 42.0,
        "draft_row_cost": 0.125, "mtp_ask_cost": 0.25, "sa_acceptance_1-2": 0.375, "sa_acceptance_17+": 0.875,
        "mtp_accepted_per_ask": 1.5, "sa_pool_tokens": 11.0,
    }
    assert all(type(v) is float for v in metrics.values())


def test_default_engine_stats_have_every_key_at_zero():
    metrics = EngineStats().as_metrics()
    assert set(metrics) >= {stats.BATCH_SIZE, stats.WAITING, stats.SPECULATING, stats.BATCH_GATE,
                            stats.ACCEPTANCE_LENGTH, stats.STEP_MS, stats.TOKENS_PER_S}
    assert metrics[stats.BATCH_GATE] == stats.NOT_GATED  # an engine that says nothing claims no gate
    assert {f"draft_tokens_{s}" for s in SOURCES} <= set(metrics)
    assert set(metrics.values()) == {0.0}
