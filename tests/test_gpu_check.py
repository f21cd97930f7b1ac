"""The pure parts of `make gpu-check` (benchmarks/gpu_check.py), which itself needs a GPU:
/metrics parsing, the acceptance figures, the gate verdict, the output comparison, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from replicas.stats import NOT_GATED

REPO = Path(__file__).resolve().parents[1]

METRICS = """\
# HELP ray_spec_draft_tokens_total draft tokens proposed
# TYPE ray_spec_draft_tokens_total counter
ray_spec_draft_tokens_total{Component="core_worker",source="mtp",deployment="Replica"} 120.0
ray_spec_draft_tokens_total{Component="core_worker",source="sa",deployment="Replica"} 30.0
ray_spec_accepted_tokens_total{source="mtp"} 80.0
ray_spec_acceptance_length_bucket{le="2.0"} 3.0
ray_spec_acceptance_length_sum{deployment="Replica"} 90.0
ray_spec_acceptance_length_count{deployment="Replica"} 30.0
ray_spec_verify_steps_total{deployment="Replica"} 30.0
ray_spec_emitted_tokens_total{deployment="Replica"} 110.0
ray_engine_batch_size{replica="a"} 5.0
ray_spec_gate_open{replica="a"} 1.0
ray_request_retries_total{deployment="Ingress",kind="resume"} 2.0
ray_request_retries_total{deployment="Ingress",kind="retry"} 1.0
"""


def test_parse_metrics_sums_label_sets_and_keeps_sources_and_kinds():
    m = gpu_check.parse_metrics(METRICS)
    assert m["ray_spec_draft_tokens_total"] == 150.0
    assert m["ray_spec_draft_tokens_total{source=sa}"] == 30.0
    assert m["ray_request_retries_total{kind=resume}"] == 2.0 and m["ray_request_retries_total"] == 3.0
    assert m["ray_spec_acceptance_length_count"] == 30.0
    assert gpu_check.gate_sample(m) == {"batch_size": 5.0, "gate_open": 1.0, "draft_tokens": 150.0}


def test_speculation_delta_is_between_snapshots():
    before = gpu_check.parse_metrics(METRICS)
    after = dict(before, ray_spec_draft_tokens_total=190.0, ray_spec_accepted_tokens_total=110.0,
                 ray_spec_verify_steps_total=40.0, ray_spec_emitted_tokens_total=155.0)
    assert gpu_check.speculation_delta(before, after) == {
        "draft_tokens": 40.0, "accepted_tokens": 30.0, "verify_steps": 10.0, "acceptance_length": 4.5}
    assert gpu_check.speculation_delta(before, before)["acceptance_length"] == 0.0


def samples(*rows):
    return [{"batch_size": b, "gate_open": 0.0, "draft_tokens": d} for b, d in rows]


# (samples (batch, drafted total), reported gate, configured gate) -> (ok, verdict starts with)
VERDICTS = [
    (samples((20, 10), (20, 10), (20, 10), (2, 30)), 16, 16, True, "gated at 16"),
    (samples((20, 10), (20, 15), (20, 30)), 16, 16, False, "reports gate 16 but drafted"),
    (samples((20, 10), (20, 15), (20, 30)), NOT_GATED, 16, True, "not gated: drafts"),
    (samples((20, 10), (20, 10), (20, 10)), NOT_GATED, 16, False, "not gated: stopped"),
    (samples((20, 10), (20, 50)), 16, 16, True, "not exercised"),  # too short a run to judge
    (samples((4, 10), (8, 20)), 16, 16, True, "not exercised"),
]


@pytest.mark.parametrize("rows,reported,configured,ok,verdict", VERDICTS)
def test_gate_verdict(rows, reported, configured, ok, verdict):
    result = gpu_check.gate_verdict(rows, reported, configured)
    assert result["ok"] is ok and result["verdict"].startswith(verdict)


def report(on="abc", off="abc", drafted=12.0, gate_ok=True):
    outputs = {"speculation on": {"code-edit": on}, "deployment off": {"code-edit": off}}
    return {"outputs": outputs, "identical": gpu_check.compare_outputs(outputs),
            "speculation": {"draft_tokens": drafted, "accepted_tokens": 9.0, "acceptance_length": 3.2,
                            "verify_steps": 4.0},
            "gate": {"configured": 16, "reported": NOT_GATED, "ok": gate_ok, "verdict": "not gated: drafts ..."}}


@pytest.mark.parametrize("kwargs,ok", [
    ({}, True), ({"off": "abd"}, False), ({"drafted": 0.0}, False), ({"gate_ok": False}, False),
])
def test_passed_needs_identical_outputs_drafts_and_a_true_gate(kwargs, ok):
    assert gpu_check.passed(report(**kwargs)) is ok


def test_table_names_the_mismatch_and_the_result():
    text = gpu_check.table(report(off="abd"))
    assert "| code-edit | 3 chars | 3 chars | **NO** |" in text
    assert "acceptance length 3.20" in text and "NOT_GATED" in text and text.endswith("result: FAIL")


def test_importing_the_check_loads_neither_ray_nor_tensorrt_llm():
    code = ("import sys, benchmarks.gpu_check; "
            "print(sorted(m for m in ('ray', 'tensorrt_llm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == "[]"
