"""The simulator: deterministic for a seed, conserves requests, fits step times, runs its CLI."""

import dataclasses
import json

import pytest

from autoscaling import simulate
from autoscaling.fleet import Records
from autoscaling.profiles import StepTime, fit_step_time, mixes, profiles
from autoscaling.scenario import Scenario
from autoscaling.simulate import run_scenario

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


def test_step_time_fit_weighs_each_step_by_its_own_size():
    # Steps that grow faster than linearly in the rows (attention at a long context): the
    # fit may miss the one big step, not the small ones a replica runs most.
    points = {(b, t): 4.0 + 0.6 * b + 0.9 * b * t + 0.004 * (b * t) ** 2
              for b, t in ((1, 1), (1, 2), (1, 3), (1, 5), (1, 8), (1, 9), (1, 13), (1, 17), (8, 1), (8, 9))}
    fit = fit_step_time(points)
    for (b, t), ms in points.items():
        if b * t <= 17:
            assert fit.step_ms(b, b * t) == pytest.approx(ms, rel=0.1)


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
    simulate.main(["--scales", "2", "--profiles", "cpu", "--duration-s", "60", "--seeds", "2", "--workers", "1",
                   "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * 2 * len(simulate.POLICIES)  # mixes x seeds x policies
    assert sorted({r["seed"] for r in result["rows"]}) == [0, 1]
    assert len(result["summary"]) == 2 * len(simulate.POLICIES) and {s["seeds"] for s in result["summary"]} == {2}
    assert [t["seeds"] for t in result["target"]] == [2, 2]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "TPOT p99" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(PROFILES))
def test_compiled_step_time_matches(name):
    step = PROFILES[name].step
    fast = step.compiled()
    for batch, tokens in ((1, 1), (4, 36), (16, 144), (64, 64), (64, 576)):
        assert fast(batch, tokens) == pytest.approx(step.step_ms(batch, tokens))


def test_gate_hold_keeps_replicas_speculating_through_a_burst(tmp_path):
    # a 2x burst on two cpu replicas: without the router's hold requests tip replicas over
    # the gate; with it they wait (a few seconds) for slots under it and decode faster.
    # The hold only acts where speculation pays at the gate, which the measured cpu profile
    # decides afresh at every benchmark run (on the native forward it does not): here a step
    # like the fp32 forward's (DESIGN.md's step times), where a verify row costs 3% of a step,
    # and the assumed acceptance.
    cpu = dataclasses.replace(profiles(tmp_path)["cpu"], step=StepTime(fixed_ms=240.0, per_seq_ms=4.0, per_token_ms=7.3))
    code_edit = mixes(tmp_path)[0]["code_edit"]

    def burst(gate_hold_s):
        return run_scenario(Scenario(cpu, code_edit, 2, "acceptance_aware", **(SMALL | {"gate_hold_s": gate_hold_s})))

    held, tipped = burst(5.0), burst(0.0)
    assert held["arrivals"] == tipped["arrivals"]
    assert held["speculating_pct"] > tipped["speculating_pct"]
    assert held["tpot_p50_ms"] < tipped["tpot_p50_ms"] and held["tpot_p99_ms"] < tipped["tpot_p99_ms"]
    assert held["ttft_p99_s"] > tipped["ttft_p99_s"]  # the price: the wait comes before the first token


def test_gate_hold_waits_only_while_speculation_pays():
    # chat's acceptance is under the policy's bar: nothing is held, the run is the same
    chat = dict(mix="non_repetitive", scale=4)
    assert without_wall(run_scenario(small(**chat, gate_hold_s=5.0))) == \
        without_wall(run_scenario(small(**chat, gate_hold_s=0.0)))


def _row(policy, seed, hours, p99, mix="code_edit"):
    return {"profile": "p", "scale": 10, "mix": mix, "policy": policy, "seed": seed, "replica_hours": hours,
            "tpot_p50_ms": 1.0, "tpot_p99_ms": p99, "ttft_p99_s": 1.0, "slo_miss_pct": 0.0, "dropped": 0,
            "speculating_pct": 50.0}


def test_target_is_judged_on_the_median_of_per_seed_ratios():
    from autoscaling.report import summarize, target_check

    # per seed (hours, p99) ratios: (0.9, 0.5) meets it, (1.1, 0.6) and (0.95, 0.8) do not
    rows = [_row("serve_default", s, 10.0, 100.0) for s in range(3)]
    rows += [_row("acceptance_aware", 0, 9.0, 50.0), _row("acceptance_aware", 1, 11.0, 60.0),
             _row("acceptance_aware", 2, 9.5, 80.0)]
    [check] = target_check(rows)
    assert (check["replica_hours_vs_default"], check["tpot_p99_vs_default"]) == (0.95, 0.6)
    assert check["met"] and check["seeds_met"] == 1 and check["seeds"] == 3
    assert check["replica_hours_vs_default_range"] == [0.9, 1.1]
    ours = next(r for r in summarize(rows) if r["policy"] == "acceptance_aware")
    assert (ours["replica_hours"], ours["tpot_p99_ms"], ours["seeds"]) == (9.5, 60.0, 3)

    # non-repetitive: worse on one figure only is allowed, worse on both is not
    chat = [_row("serve_default", 0, 10.0, 100.0, "chat"), _row("acceptance_aware", 0, 11.0, 90.0, "chat")]
    assert target_check(chat)[0]["met"]
    chat[1] = _row("acceptance_aware", 0, 11.0, 110.0, "chat")
    assert not target_check(chat)[0]["met"]
