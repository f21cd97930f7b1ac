"""The in-process benchmarks run end to end in their smallest configurations and report what
they measured: no other test runs their code, and a smoke run of each found figures that
misreported (a transformers rate of 7,000,000 tok/s, a structured-output target "met" by
outputs that were all invalid, a benchmark that overwrote the committed result). Speed is not
asserted here (the benchmarks measure it); that they ran, what they say, and that every mode's
output agreed are. `make bench-serve`'s own smoke run: tests/deploy/test_serve_benchmark.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each loads the real model

REPO = Path(__file__).resolve().parents[1]


def bench(script: str, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, f"benchmarks/{script}.py", *args, *(("--out", str(out)) if out else ())]
    return subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"},
                          timeout=600, capture_output=True, text=True)


def report(run: subprocess.CompletedProcess, out: Path) -> dict:
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    machine = result.get("machine") or result.get("cpu") or result["versions"]["cpu"]
    assert machine["model"] and machine["kernel_path"] in ("avx2", "avx512", "amx", "scalar")
    return result


def rate(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_long_output(tmp_path):
    out = tmp_path / "long.json"
    result = report(bench("long_output", "--max-tokens", "16", "--batches", "1", out=out), out)
    assert all(rate(run["tokens_per_s"]) for runs in result["runs"].values() for run in runs)
    assert result["identical_to_first_mode"] and all(result["identical_to_first_mode"].values())
    assert out.with_suffix(".png").stat().st_size > 0


def test_predicted_outputs(tmp_path):
    out = tmp_path / "predicted.json"
    result = report(bench("predicted", "--prompts", "1", "--max-tokens", "16", out=out), out)
    assert all(r["identical_to_off"] and rate(r["tokens_per_s"]) for r in result["results"].values())
    assert result["ratios"] and all(rate(v) for v in result["ratios"].values())


def test_structured_output_target_is_not_met_by_outputs_all_cut_short(tmp_path):
    out = tmp_path / "structured.json"
    result = report(bench("structured", "--prompts", "1", "--max-tokens", "24", "--no-llamacpp", out=out), out)
    ours = result["ours"]
    runs = [ours[f"{w}/{m}"] for w in ("json_records", "tool_calls") for m in result["modes"]]
    assert all(r["errors"] == 0 and r["cut_by_max_tokens"] == r["requests"] for r in runs)  # 24 tokens: all cut
    assert [c["outputs_sound"] for c in result["target"].values()] == [False, False]
    assert result["target_met"] == {"json_records": False, "tool_calls": False}
    assert all(ours[f"{w}/identical_across_modes"] for w in ("json_records", "tool_calls", "auto_calls"))


def test_scoring(tmp_path):
    out = tmp_path / "scoring.json"
    result = report(bench("scoring", "--texts", "2", "--tokens", "96", "--choices", "2", out=out), out)
    assert result["multiple_choice"]["identical_logprobs"] and rate(result["scored_tokens_per_s"]["ours"])
    assert result["vs_transformers_fp32"]["same_likeliest_token"] > 0.5  # the same model, other numerics
    refused = bench("scoring", "--texts", "2", "--tokens", "32", "--choices", "2", out=tmp_path / "no.json")
    assert refused.returncode == 2 and "--tokens must exceed" in refused.stderr


def test_drafters(tmp_path):
    out = tmp_path / "drafters.json"
    result = report(bench("drafters", "--pairs", "2", "--contexts", "2048", "--batches", "1", "--steps", "5",
                          "--rounds", "1", "--warmup", "1", out=out), out)
    assert result["mat"]["code_edits"]["ours SA"]["mat"] > 1.0  # code edits copy their file


def test_forward(tmp_path):
    out = tmp_path / "forward.json"
    result = report(bench("forward", "--context", "64", "--repeats", "2", "--no-llamacpp", out=out), out)
    (summary,) = result["summary"].values()
    assert summary["weight_bytes"] > 0 and rate(summary["ttft_ms"]["ours"])
    assert all(rate(row["ours_ms"]) for row in result["rows"])
