"""What every benchmark records about the machine it ran on: CPU model, features, bandwidth."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path


# What caps the code paths a process runs below what its CPU has: our kernels, then torch's,
# oneDNN's, MKL's and numpy's (the Makefile's AVX2_ONLY sets them all).
ISA_CAPS = ("SPECSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
            "NPY_DISABLE_CPU_FEATURES")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_description() -> dict:
    """Model, family/model numbers (AMD reports every EPYC as 'AMD EPYC'), SIMD features, cores,
    the ISA_CAPS this process runs under and the native forward's kernel path they leave it."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
        if not line.strip():
            break
    flags = set(info.get("flags", "").split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_int8", "amx_bf16")
    return {
        "model": info.get("model name", "unknown"),
        "vendor": info.get("vendor_id", "unknown"),
        "family": info.get("cpu family"), "model_number": info.get("model"),
        "features": [f for f in wanted if f in flags],
        "cpus": len(os.sched_getaffinity(0)),
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)},
        "kernel_path": kernel_path(),
    }


def kernel_path() -> str:
    """The native forward's kernel path in this process (SPECSERVE_CPU_ISA heeded); "none"
    where the module is not built."""
    try:
        from replicas.torch_engine import _cpu_forward
    except ImportError:
        return "none"
    return _cpu_forward.best_isa()


def read_bandwidth_gbs(threads: int, size_mb: int = 512, repeats: int = 5) -> float:
    """Best-of read bandwidth: torch summing a buffer far larger than the caches."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(size_mb * (1 << 20) // 4)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
        return buffer.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range and above Ray's worker ports
    (10002-19999). One the kernel picked (bind to port 0) was in that range, where an
    outgoing connection or a port Ray picks the same way could take it before Serve's proxy
    bound it: a CI run lost a test module's cluster so ("Failed to bind to address")."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    below = range(20000, ephemeral_low)  # empty where the ephemeral range starts lower
    for port in [*random.sample(below, min(200, len(below))), 0]:  # 0: the kernel's pick, the last resort
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")
