"""The native forward on CPUs this machine is not, emulated by QEMU's user mode.

CI runs on whichever machine a session has: an AVX2-only AMD EPYC Zen 3, an AMD EPYC with
AVX-512 (Zen 4, Zen 5) or an Intel Xeon with AVX-512 and AMX; a kernel path that picks, or an
instruction that slips into, code one of them cannot run shows only on another. `qemu-x86_64 -cpu MODEL` runs a process with that CPU's
CPUID and instruction set (an instruction it lacks is SIGILL), so here the same fixed forward
(forward_probe.py) runs on this machine and on an emulated Zen 3 (EPYC-Milan: AVX2 + FMA + F16C,
AMD's CPUID, which MKL and torch dispatch on too) and a pre-AVX Westmere. Each must pick the
path its CPU runs, verify 5 rows with the bits of 5 one-row decodes, and compute the very bits
this machine does (every kernel path computes the same arithmetic). Emulated vector code runs
about 1,000x slower than native (a second a token), so the probe is 18 rows: a minute in all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.machine import ISA_CAPS, cpu_model

REPO = Path(__file__).resolve().parents[2]
QEMU = shutil.which("qemu-x86_64")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(QEMU is None, reason="needs qemu-x86_64 (Debian's qemu-user; make install adds it)")]


# Each emulated CPU: the kernel path and the torch capability it must pick.
CPUS = {"EPYC-Milan-v1": ("avx2", "AVX2"), "Westmere": ("scalar", "DEFAULT")}


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    """Each probe in its own process: this machine's alone (5 s), then the emulated ones together.

    (Twice in CI this machine's probe, run beside the two QEMU processes, computed other bits;
    no run reproduced it: the README's "The embedded engine" says what was tried.)
    """
    tmp = tmp_path_factory.mktemp("probe")
    # each picks its own paths: no cap, and no OpenBLAS core named (some machines set
    # OPENBLAS_CORETYPE=Haswell, whose AVX2 kernels an emulated Westmere cannot run: numpy's
    # import-time dot product was SIGILL)
    env = {k: v for k, v in os.environ.items() if k not in (*ISA_CAPS, "OPENBLAS_CORETYPE")}

    def start(cpu: str | None):
        out, log = tmp / f"{cpu or 'here'}.npz", tmp / f"{cpu or 'here'}.log"
        command = ([QEMU, "-cpu", cpu] if cpu else []) + [sys.executable, "-m", "tests.torch_engine.forward_probe", str(out)]
        with open(log, "w") as stderr:
            return cpu, out, log, subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)

    def result(cpu, out, log, proc) -> dict:
        assert proc.wait(timeout=900) == 0, f"{cpu or 'this machine'}: {log.read_text()[-3000:]}"
        with np.load(out) as arrays:
            return {k: torch.from_numpy(v) if v.dtype == np.float32 else str(v) for k, v in arrays.items()}

    got = {None: result(*start(None))}
    for probe in [start(cpu) for cpu in CPUS]:
        got[probe[0]] = result(*probe)
    return got


def differ(a: torch.Tensor, b: torch.Tensor) -> str:
    """Which rows of two logits differ, and by how much at most."""
    rows = [r for r in range(len(a)) if not torch.equal(a[r], b[r])]
    return f"rows {rows} differ, by up to {(a - b).abs().max().item():.4g}"


@pytest.mark.parametrize("cpu", list(CPUS))
def test_an_emulated_cpu_runs_its_own_path_to_the_same_bits(probes, cpu):
    emulated, here = probes[cpu], probes[None]
    assert (emulated["isa"], emulated["torch_capability"]) == CPUS[cpu]
    # Each agrees with itself first: a failure below is then a disagreement between paths.
    for who, probe in ((f"this machine ({cpu_model()}, {here['isa']})", here), (cpu, emulated)):
        assert torch.equal(probe["verify"], probe["decodes"]), f"{who}, verify against decodes: " + differ(
            probe["verify"], probe["decodes"])
    for what in ("verify", "decodes"):
        assert torch.equal(emulated[what], here[what]), f"{what}: " + differ(emulated[what], here[what])
