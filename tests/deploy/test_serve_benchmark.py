"""`make bench-serve` runs end to end: no other test runs its code, and a lost `""` once made
every one of its requests raise, unseen for sessions. The smallest load, one setting, over
real HTTP against the real model, in a Ray cluster of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_the_serve_benchmark_runs_and_reports_every_request_answered(tmp_path):
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "benchmarks/serve.py", "--settings", "gate", "--workload", "code",
                          "--concurrency", "1", "--max-tokens", "4", "--min-requests", "2", "--overhead-pairs", "1",
                          "--out", str(out)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"},
                         timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    (setting,) = report["results"].values()
    (level,) = setting.values()
    assert (level["requests"], level["errors"]) == (2, 0) and level["tokens_per_s"] > 0, level
    assert report["ray_overhead_per_request"]["pairs"] == 1
    assert out.with_suffix(".png").stat().st_size > 0
