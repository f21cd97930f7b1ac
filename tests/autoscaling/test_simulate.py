"""The simulator: deterministic for a seed, conserves requests, fits step times, runs its CLI."""

import dataclasses
import json

import pytest

from autoscaling import simulate
from autoscaling.fleet import Records
from autoscaling.profiles import StepTime, fit_step_time, mixes, profiles
from autoscaling.simulate import Scenario, run_scenario

PROFILES = profiles()
MIXES, _ = mixes()
SMALL = dict(duration_s=120.0, warmup_s=30.0, bursts=1, burst_s=30.0, burst_factor=2.0, drain_limit_s=600.0)


def small(profile="gpu-h100-llama8b", mix="code_edit", policy="acceptance_aware", scale=3, **kw):
    return Scenario(PROFILES[profile], MIXES[mix], scale, policy, **(SMALL | kw))


def without_wall(summary):
    return {k: v for k, v in summary.items() if k not in ("wall_s", "cpu_s")}


@pytest.mark.parametrize("policy", simulate.POLICIES)
def test_same_seed_same_result(policy):
    assert without_wall(run_scenario(small(policy=policy))) == without_wall(run_scenario(small(policy=policy)))


def test_other_seed_other_arrivals():
    assert run_scenario(small(seed=1))["arrivals"] != run_scenario(small(seed=2))["arrivals"]


def test_every_policy_sees_the_same_arrivals():
    counts = {run_scenario(small(policy=p))["arrivals"] for p in simulate.POLICIES}
    assert len(counts) == 1


@pytest.mark.parametrize("profile,mix", [("cpu", "code_edit"), ("gpu-h100-llama8b", "non_repetitive")])
def test_every_arrival_is_served_or_dropped(profile, mix):
    out = run_scenario(small(profile=profile, mix=mix))
    assert out["arrivals"] > 0 and out["unfinished"] == 0
    assert out["arrivals"] == out["completed"] + out["dropped"]
    assert out["measured"] <= out["arrivals"]


def test_conservation_holds_when_requests_are_dropped():
    tight = dataclasses.replace(PROFILES["gpu-h100-llama8b"], max_ongoing=4, queue_timeout_s=1.0,
                                graceful_shutdown_s=1.0)
    sc = Scenario(tight, MIXES["code_edit"], 3, "serve_default", **(SMALL | {"upscale_delay_s": 60.0}))
    out = run_scenario(sc)
    assert out["dropped"] > 0 and out["measured_dropped"] > 0
    assert out["arrivals"] == out["completed"] + out["dropped"] + out["unfinished"]
    assert out["slo_misses"] >= out["measured_dropped"]


def test_drain_limit_leaves_requests_unfinished_but_counted():
    out = run_scenario(small(drain_limit_s=0.0, upscale_delay_s=1e6))
    assert out["arrivals"] == out["completed"] + out["dropped"] + out["unfinished"]


def test_acceptance_aware_spreads_on_a_repetitive_mix():
    ours = run_scenario(small(scale=6, duration_s=300.0, bursts=0))
    default = run_scenario(small(scale=6, duration_s=300.0, bursts=0, policy="serve_default"))
    assert ours["speculating_pct"] > default["speculating_pct"]
    assert ours["tpot_p50_ms"] < default["tpot_p50_ms"]


def test_acceptance_aware_packs_on_a_non_repetitive_mix():
    ours = run_scenario(small(mix="non_repetitive", scale=6, duration_s=300.0, bursts=0))
    default = run_scenario(small(mix="non_repetitive", scale=6, duration_s=300.0, bursts=0, policy="serve_default"))
    assert ours["replica_hours"] == pytest.approx(default["replica_hours"], rel=0.15)


def test_trace_arrivals(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": 0.1 * i, "class": "chat", "output_tokens": 50}) + "\n"
                             for i in range(200)))
    out = run_scenario(small(mix="non_repetitive", trace=trace, duration_s=60.0))
    assert out["arrivals"] == out["completed"] == out["measured"] == 200


@pytest.mark.parametrize("truth", [StepTime(100.0, 5.0, 2.0), StepTime(20.0, 0.0, 1.5), StepTime(7.0, 1.0, 0.0)])
def test_step_time_fit_recovers_a_linear_model(truth):
    points = {(b, t): truth.step_ms(b, b * t) for b in (1, 4, 8) for t in (1, 5, 9)}
    fit = fit_step_time(points)
    for (b, t), ms in points.items():
        assert fit.step_ms(b, b * t) == pytest.approx(ms, rel=1e-6)
    assert min(fit.fixed_ms, fit.per_seq_ms, fit.per_token_ms) >= 0


def test_profiles_are_calibrated_from_results_when_present(tmp_path):
    rows = [{"threads": 2, "batch": b, "new_tokens": t, "ours_ms": 10.0 + 2.0 * b + 0.5 * b * t}
            for b, t in ((1, 1), (1, 9), (8, 1), (8, 9))]
    (tmp_path / "forward.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "engine.json").write_text(json.dumps({"batch1": {
        "code_edit/hybrid": {"mat": 4.2, "accepted_tokens": 320, "draft_tokens": 600},  # 100 steps, 6 drafted each
        "chat/hybrid": {"mat": 1.5}}}))
    cpu = profiles(tmp_path)["cpu"]
    assert "forward.json" in cpu.source
    assert cpu.step.step_ms(8, 72) == pytest.approx(10.0 + 16.0 + 36.0)
    found, source = mixes(tmp_path)
    assert "engine.json" in source
    assert found["code_edit"].classes[0].acceptance_levels[1] == 4.2
    assert found["code_edit"].classes[0].draft_len == 6
    assert found["code_edit"].classes[1].draft_len == 3  # no counts for chat: the assumed length
    fallback_profiles, fallback_mixes = profiles(tmp_path / "none"), mixes(tmp_path / "none")
    assert "fallback" in fallback_profiles["cpu"].source and "fallback" in fallback_mixes[1]


def test_break_even_grows_with_step_cost():
    gpu = PROFILES["gpu-h100-llama8b"]
    assert 1.0 < gpu.break_even_acceptance(3) <= gpu.break_even_acceptance(8)


def test_records_count_only_measured_requests():
    rec = Records(tpot_slo_s=0.01, ttft_slo_s=1.0, measure_from_s=10.0)
    rec.complete((5.0, 5.5, 10), 6.0)  # warm-up: counted for conservation only
    rec.complete((11.0, 11.2, 11), 11.4)  # tpot 20 ms: an SLO miss
    rec.drop(12.0)
    assert (rec.completed, rec.dropped, rec.measured, rec.slo_misses) == (2, 1, 2, 2)
    assert list(rec.tpot_s) == [pytest.approx(0.02)]


def test_cli_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "autoscaling.json"
    simulate.main(["--scales", "2", "--profiles", "cpu", "--duration-s", "60", "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * len(simulate.POLICIES)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "TPOT p99" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(PROFILES))
def test_compiled_step_time_matches(name):
    step = PROFILES[name].step
    fast = step.compiled()
    for batch, tokens in ((1, 1), (4, 36), (16, 144), (64, 64), (64, 576)):
        assert fast(batch, tokens) == pytest.approx(step.step_ms(batch, tokens))
