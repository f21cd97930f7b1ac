"""The native CPU kernels against float64 references, and every kernel path against the others.

Each kernel's error bound is derived from what it is allowed to lose (the activation
quantisation, fp16 K/V, float rounding), not tuned to a CPU. Paths the CPU cannot run are
skipped with the reason; the paths it can run must agree bit for bit (they compute the same
canonical arithmetic, see csrc/cpu/numerics.hpp).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from benchmarks.machine import ISA_CAPS
from replicas.torch_engine import _cpu_forward as native

ISAS = ("scalar", "avx2", "avx512", "amx")
Q4_1, Q8_0 = 3, 8
F32_EPS = float(np.finfo(np.float32).eps)


def runnable(isa: str):
    return pytest.param(isa, marks=pytest.mark.skipif(not native.cpu_supports(isa),
                                                      reason=f"this CPU cannot run the {isa} kernels"))


def quantized(rng, n: int, k: int, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF rows of a random [n, k] matrix and their dequantised values."""
    from gguf import GGMLQuantizationType, quants

    gtype = GGMLQuantizationType(kind)
    rows = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gtype)
    return rows, quants.dequantize(rows, gtype).astype(np.float64)


@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
def test_quantize_rows_rounds_to_nearest_within_half_a_step(isa):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 96)) * rng.uniform(1e-3, 1e3, (5, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    q, d, s, total = native.quantize_rows(x, isa)
    blocks = x.reshape(5, 3, 32).astype(np.float64)
    step = d[..., None].astype(np.float64)
    assert np.all(np.abs(q.reshape(5, 3, 32) * step - blocks) <= step / 2 * (1 + 1e-5) + 1e-30)
    assert np.abs(q).max() <= 127
    np.testing.assert_array_equal(total, q.reshape(5, 3, 32).astype(np.int64).sum(-1))
    np.testing.assert_array_equal(s, (d * total.astype(np.float32)).astype(np.float32))
    assert np.all(q[0, :32] == 0) and d[0, 0] == 0


@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
def test_a_block_too_small_to_scale_quantizes_to_zeros(isa):
    """127 / amax overflows under amax ~3.7e-37: the block's codes are 0, as an all-zero
    block's (they were -128 on the SIMD paths, the scalar path's conversion undefined)."""
    x = np.zeros((1, 64), np.float32)
    x[0, :3] = 1e-37, -5e-38, 3e-38
    x[0, 32] = 1.0
    q, _, s, total = native.quantize_rows(x, isa)
    assert not q[0, :32].any() and total[0, 0] == 0 and s[0, 0] == 0
    assert q[0, 32] == 127


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
def test_linear_against_float64(isa, kind):
    rng = np.random.default_rng(kind)
    rows, w = quantized(rng, 40, 192, kind)  # 5 column groups: two pairs and one alone
    x = rng.standard_normal((7, 192)).astype(np.float32)
    got = native.linear(rows, kind, x, isa, 2)
    # The kernel multiplies the dequantised weights by the row's quantised activations exactly
    # (integer block sums), then rounds one fma chain of 2 per block: that chain's error only.
    q, d, _, _ = native.quantize_rows(x, "scalar")
    xq = (q.reshape(7, 6, 32) * d[..., None].astype(np.float64)).reshape(7, 192)
    exact = xq @ w.T
    chain = 2 * 6 * F32_EPS * (np.abs(xq) @ np.abs(w).T)
    assert np.all(np.abs(got - exact) <= chain + 1e-6)
    # Against unquantised activations: at most half a step per value.
    step = np.repeat(d.astype(np.float64) / 2, 32, axis=1)
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T) <= step @ np.abs(w).T + chain + 1e-6)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_pos: int) -> np.ndarray:
    scores = q.astype(np.float64) @ k[:n_pos].astype(np.float64).T  # [group, n_pos]
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v[:n_pos].astype(np.float64)


# Positions past 128 span several chunks (merged in order); group 4 runs its heads 3 + 1 and
# head_dim 72 ends on a dims tail of 8.
@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
@pytest.mark.parametrize("n_pos, rows, group, hd", [
    (1, 1, 3, 64), (31, 1, 3, 64), (32, 1, 3, 64), (33, 1, 3, 64), (100, 17, 3, 64), (70, 32, 3, 64),
    (129, 1, 3, 64), (300, 5, 3, 64), (290, 32, 4, 72), (257, 3, 1, 32)])
def test_attention_against_float64(isa, n_pos, rows, group, hd):
    rng = np.random.default_rng(n_pos * 100 + rows)
    q = (rng.standard_normal((rows, group, hd)) * 0.125).astype(np.float32)
    k = rng.standard_normal((n_pos, hd)).astype(np.float16)
    v = rng.standard_normal((n_pos, hd)).astype(np.float16)
    first = n_pos - rows + 1
    got = native.attend(q, k, v, first, isa)
    for r in range(rows):
        expected = reference_attention(q[r], k, v, first + r)
        # exp within a few ulp, scores and sums of <= n_pos terms: a few hundred ulp at most.
        assert np.abs(got[r] - expected).max() <= 64 * (first + r + 32) * F32_EPS * np.abs(v).max()


@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
def test_silu_mul_against_float64(isa):
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(1003) * 20).astype(np.float32)
    u = rng.standard_normal(1003).astype(np.float32)
    expected = g / (1 + np.exp(-g.astype(np.float64))) * u
    assert np.all(np.abs(native.silu_mul(g, u, isa) - expected) <= 8 * F32_EPS * np.abs(expected) + 1e-30)


def fp16_edge_cases(rng) -> np.ndarray:
    """float32 values around every fp16 boundary: ties, subnormals, overflow, infinities, NaNs."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves) & (np.abs(halves) < 65504)]
    ulp = np.abs(np.nextafter(finite.astype(np.float16), np.float16(np.inf)).astype(np.float32) - finite)
    ties = finite + ulp / 2  # exactly halfway: rounds to the even neighbour
    raw = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaNs too
    special = np.array([65504, 65519.99, 65520, 1e30, np.inf, -np.inf, 2.0 ** -25, 2.0 ** -26, 1e-40],
                       dtype=np.float32)
    return np.concatenate([finite, ties, np.nextafter(ties, np.float32(0)), raw, special, -special])


@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
def test_to_half_rounds_to_nearest_even(isa):
    x = fp16_edge_cases(np.random.default_rng(5))
    x = x[~np.isnan(x)]  # numpy does not quieten NaNs; the paths' NaNs are compared bitwise below
    with np.errstate(over="ignore"):  # past 65504: inf, as the cache stores it
        expected = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(native.to_half(x, isa), expected)


@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS[1:]])
def test_simd_paths_equal_the_scalar_path_bitwise(isa):
    rng = np.random.default_rng(4)
    for kind, n in ((Q4_1, 64), (Q8_0, 64), (Q4_1, 56), (Q8_0, 24)):  # column groups in pairs, or one left
        rows, _ = quantized(rng, n, 256, kind)
        # Balanced row tiles (avx2: up to 4 rows, avx512: up to 8) of every size; amx: tiles of
        # 16 from 32 rows, the rest as avx512.
        for m in (11, 8, 7, 6, 3, 2, 1, 32, 37):
            x = rng.standard_normal((m, 256)).astype(np.float32)
            for threads in (1, 2):
                np.testing.assert_array_equal(native.linear(rows, kind, x, isa, threads),
                                              native.linear(rows, kind, x, "scalar", 1))
    x = (rng.standard_normal((3, 160)) * 5).astype(np.float32)
    for a, b in zip(native.quantize_rows(x, isa), native.quantize_rows(x, "scalar")):
        np.testing.assert_array_equal(a, b)
    for group, hd in ((3, 64), (4, 72), (8, 64)):  # group 8: a pass's 32 (row, head) states in two of 16
        q = (rng.standard_normal((17, group, hd)) * 0.125).astype(np.float32)
        k, v = (rng.standard_normal((2, 300, hd)) * 3).astype(np.float16)
        for first in (1, 284):  # one row alone, and 17 rows across chunk boundaries
            np.testing.assert_array_equal(native.attend(q[:1] if first == 1 else q, k, v, first, isa),
                                          native.attend(q[:1] if first == 1 else q, k, v, first, "scalar"))
    g, u = (rng.standard_normal((2, 77)) * 30).astype(np.float32)
    np.testing.assert_array_equal(native.silu_mul(g, u, isa), native.silu_mul(g, u, "scalar"))
    x = fp16_edge_cases(rng)
    np.testing.assert_array_equal(native.to_half(x, isa), native.to_half(x, "scalar"))


def test_linear_rows_are_independent_of_the_batch_and_threads():
    rng = np.random.default_rng(5)
    rows, _ = quantized(rng, 96, 128, Q4_1)
    x = rng.standard_normal((37, 128)).astype(np.float32)  # amx: two tiles of 16 and 5 rows left
    isa = native.best_isa()
    together = native.linear(rows, Q4_1, x, isa, 2)
    alone = np.concatenate([native.linear(rows, Q4_1, x[i:i + 1], isa, 1) for i in range(37)])
    np.testing.assert_array_equal(together, alone)


def test_bad_arguments_raise_value_error():
    rng = np.random.default_rng(6)
    rows, _ = quantized(rng, 8, 64, Q8_0)
    with pytest.raises(ValueError, match="x: dtype must be float32"):
        native.linear(rows, Q8_0, np.zeros((1, 64)), "scalar")
    with pytest.raises(ValueError, match="weights: dimension 1 must be"):
        native.linear(rows, Q4_1, np.zeros((1, 64), np.float32), "scalar")
    with pytest.raises(ValueError, match="x: must have 2 dimensions, got 1"):
        native.linear(rows, Q8_0, np.zeros(64, np.float32), "scalar")
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        native.linear(rows, Q8_0, np.zeros((2, 128), np.float32)[:, ::2], "scalar")
    with pytest.raises(ValueError, match="weight type must be"):
        native.linear(rows, 2, np.zeros((1, 64), np.float32), "scalar")
    with pytest.raises(ValueError, match="unknown or not supported"):
        native.linear(rows, Q8_0, np.zeros((1, 64), np.float32), "neon")
    for first_n_pos in (1, 2**31 - 1):  # the second wrapped an int past the check
        with pytest.raises(ValueError, match="first_n_pos"):
            native.attend(np.zeros((2, 1, 8), np.float32), np.zeros((1, 8), np.float16),
                          np.zeros((1, 8), np.float16), first_n_pos, "scalar")
    with pytest.raises(ValueError, match="x: must be in this machine's byte order"):
        native.quantize_rows(np.ones((1, 32), ">f4"), "scalar")
    with pytest.raises(ValueError, match="num_threads"):
        native.linear(rows, Q8_0, np.zeros((1, 64), np.float32), "scalar", 0)


def test_a_model_not_wholly_set_is_a_value_error():
    """A step needs every layer and the globals (rope, final norm): a model missing one read
    empty tables and crashed."""
    rng = np.random.default_rng(7)
    d, inter, hd = 64, 96, 32
    dims = native.ModelDims(vocab_size=64, hidden_size=d, intermediate_size=inter, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=hd, max_positions=64, rms_norm_eps=1e-5)
    ones, angles = np.ones(d, np.float32), np.zeros((64, hd // 2), np.float32)
    layer = [ones, ones]
    for n, k in ((4 * hd, d), (d, 2 * hd), (2 * inter, d), (d, inter)):
        layer += [quantized(rng, n, k, Q8_0)[0], Q8_0]
    cache = np.zeros((2, 1, 2, 32, hd), np.float16)
    step = (np.array([[0, 0, 1]], np.int32), cache, cache.copy(), np.array([[0, 1]], np.int32),
            np.empty((1, d), np.float32))

    last_layer_only = native.LlamaForward(dims, 1, "scalar")
    last_layer_only.set_layer(1, *layer)
    last_layer_only.set_globals(quantized(rng, 64, d, Q8_0)[0], Q8_0, None, Q8_0, ones, np.cos(angles), angles)
    with pytest.raises(ValueError, match="layer 0 was not set"):
        last_layer_only.forward(np.zeros(1, np.int32), *step)

    no_globals = native.LlamaForward(dims, 1, "scalar")
    for i in range(2):
        no_globals.set_layer(i, *layer)
    no_globals.set_fusion(ones, ones, quantized(rng, d, 2 * d, Q8_0)[0], Q8_0)
    with pytest.raises(ValueError, match="set_globals was not called"):
        no_globals.forward_fused(np.zeros((1, d), np.float32), np.zeros((1, d), np.float32), *step)


@pytest.mark.parametrize("throwing", [0, 1], ids=["the caller's chunk", "a worker's chunk"])
def test_an_exception_in_a_parallel_loop_is_raised_by_the_loop(throwing):
    """A chunk that throws ends only itself: the others run, the loop raises the first
    exception (a worker's ended the process; the caller's left the workers running its freed
    function), and the pool serves the next loop."""
    assert native.pool_check(2, 16, throwing) == (f"thread {throwing} failed", sum(range(16)))
    assert native.pool_check(2, 16, throwing=5) == ("", sum(range(16)))  # no thread 5: nothing thrown


def test_environment_variable_forces_a_path(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "scalar")
    assert native.best_isa() == "scalar"
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_ISA=sse9"):
        native.best_isa()


@pytest.mark.skipif(not os.environ.get("ATEN_CPU_CAPABILITY"), reason="runs under make test-avx2's caps (AVX2_ONLY)")
def test_avx2_caps_reach_every_library():
    """`make test-avx2` means to run what an AVX2-only CPU runs: each cap that can be read back
    took effect (MKL has no query for the code path MKL_ENABLE_INSTRUCTIONS picks), and each
    cap the benchmarks record (ISA_CAPS) is one this run set."""
    import torch
    from numpy._core._multiarray_umath import __cpu_features__

    assert native.best_isa() == "avx2"
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN: bf16 needs AVX-512 or AVX-NE-CONVERT
    assert not __cpu_features__["X86_V4"]  # numpy's AVX-512 loops
    assert all(os.environ.get(name) for name in ISA_CAPS)


@pytest.mark.parametrize("isa", [runnable(i) for i in ISAS])
def test_a_block_holding_a_nan_or_an_infinity_quantizes_to_a_nan_scale(isa):
    """Codes 0 and scale NaN, so whatever it feeds is NaN on every path: the scalar path's
    conversion of a NaN code was undefined (0 there, -128 on the SIMD paths), and whether a NaN
    survived the block's max depended on the order a path took it in."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    for row, (col, value) in enumerate(((0, np.nan), (31, np.nan), (40, np.inf), (95, -np.inf))):
        x[row, col] = value
    finite = x.copy()
    finite[~np.isfinite(finite)] = 0
    q, d, s, total = native.quantize_rows(x, isa)
    q_f, d_f, _, _ = native.quantize_rows(finite, isa)
    bad = np.zeros((4, 3), bool)
    bad[[0, 1, 2, 3], [0, 0, 1, 2]] = True
    assert np.isnan(d[bad]).all() and np.isnan(s[bad]).all() and not total[bad].any()
    assert not q.reshape(4, 3, 32)[bad].any()
    np.testing.assert_array_equal(d[~bad], d_f[~bad])  # the row's other blocks as without it
    np.testing.assert_array_equal(q.reshape(4, 3, 32)[~bad], q_f.reshape(4, 3, 32)[~bad])
    for kind in (Q4_1, Q8_0):
        out = native.linear(quantized(rng, 16, 96, kind)[0], kind, np.concatenate([x, finite[:1]]), isa)
        assert np.isnan(out[:4]).all() and np.isfinite(out[4]).all()


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=32, max_positions=64, rms_norm_eps=1e-5)


def tiny_model(rng, num_threads: int = 1, **dims) -> native.LlamaForward:
    """A one-layer model of random Q8_0 weights (head_dim 32, 2 query heads on 1 KV head)."""
    d = TINY | dims
    model = native.LlamaForward(native.ModelDims(**d), num_threads, "")
    h, hd, inter = d["hidden_size"], d["head_dim"], d["intermediate_size"]
    ones, angles = np.ones(h, np.float32), np.zeros((d["max_positions"], hd // 2), np.float32)
    weights = [quantized(rng, n, k, Q8_0)[0] for n, k in ((4 * hd, h), (h, 2 * hd), (2 * inter, h), (h, inter))]
    model.set_layer(0, ones, ones, *(a for w in weights for a in (w, Q8_0)))
    model.set_globals(quantized(rng, d["vocab_size"], h, Q8_0)[0], Q8_0, None, Q8_0, ones, np.cos(angles), angles)
    return model


@pytest.mark.parametrize("dims, message", [
    (dict(num_heads=2**29 + 2**14, num_kv_heads=2**14, head_dim=8), r"\(num_heads \+ 2 \* num_kv_heads\) \* head_dim"),
    (dict(hidden_size=2**30 + 32), "2 \\* hidden_size"),
    (dict(intermediate_size=2**30 + 32), "2 \\* intermediate_size"),
    (dict(max_positions=2**26), "max_positions \\* head_dim"),
    (dict(num_layers=2**31 - 1), "num_layers must be at most"),
], ids=["query and KV widths", "fused input", "gate and up", "rope tables", "layers"])
def test_dims_a_step_could_not_index_are_value_errors(dims, message):
    """num_heads * head_dim computed in int wrapped to a small width that passed every check,
    and the step wrote past its buffers; a huge layer count was a MemoryError."""
    with pytest.raises(ValueError, match="dims: " + message):
        native.LlamaForward(native.ModelDims(**TINY | dims), 1, "scalar")


def test_a_length_past_an_int_and_a_cache_shared_by_k_and_v_are_value_errors():
    model = tiny_model(np.random.default_rng(9))
    with pytest.raises(ValueError, match="tokens: dimension 0 has more than 2"):
        model.embed(np.broadcast_to(np.zeros(1, np.int32), (2**31,)), np.zeros((1, 64), np.float32))
    cache = np.zeros((1, 1, 4, 32, 32), np.float16)
    step = (np.array([[0, 0, 1]], np.int32), np.array([[0, 1]], np.int32), np.empty((1, 64), np.float32))
    for k, v in ((cache, cache), (cache[:, :, :2], cache[:, :, 1:3])):
        with pytest.raises(ValueError, match="k_cache, v_cache: must not share memory"):
            model.forward(np.zeros(1, np.int32), step[0], k, v, step[1], step[2])
    model.forward(np.zeros(1, np.int32), step[0], cache[:, :, :2], cache[:, :, 2:], step[1], step[2])


def test_weights_set_during_another_threads_step_wait_for_it():
    """Setting weights took no lock while another thread's step ran with the GIL released: the
    step read the head being replaced (logits of neither head, or freed memory)."""
    rng = np.random.default_rng(10)
    model = tiny_model(rng, num_threads=2, vocab_size=2048, hidden_size=256)
    ones, angles = np.ones(256, np.float32), np.zeros((64, 16), np.float32)
    heads = [quantized(rng, 2048, 256, Q8_0)[0] for _ in range(2)]
    hidden = rng.standard_normal((32, 256)).astype(np.float32)
    want = []
    embedding = quantized(rng, 2048, 256, Q8_0)[0]
    for head in heads:
        model.set_globals(embedding, Q8_0, head, Q8_0, ones, angles, angles)
        want.append(np.zeros((32, 2048), np.float32))
        model.logits(hidden, want[-1])
    torn, steps, done = [], [], threading.Event()

    def step() -> None:
        out = np.zeros((32, 2048), np.float32)
        while not done.is_set():
            model.logits(hidden, out)
            steps.append(1)
            if not any(np.array_equal(out, w) for w in want):
                torn.append(1)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    deadline, i = time.monotonic() + 60, 0
    while (i < 200 or len(steps) < 20) and time.monotonic() < deadline:  # heads swapped under 20 steps or more
        model.set_globals(embedding, Q8_0, heads[i % 2], Q8_0, ones, angles, angles)
        i += 1
    done.set()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(steps) >= 20 and not torn
