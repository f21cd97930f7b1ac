"""GGUF formats the kernels do not read, re-encoded as Q4_1 / Q8_0 value for value
(`gguf_blocks`): against gguf-py's own dequantisation, and through the loader into the forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from replicas.torch_engine.gguf_blocks import as_native
from replicas.torch_engine.gguf_weights import GgufWeights
from replicas.torch_engine.model import SeqSpan
from replicas.torch_engine.native_model import NativeLlamaModel
from tests.torch_engine.gguf_files import llama_gguf, random_q4_k


def _values(raw: np.ndarray, kind) -> np.ndarray:
    return quants.dequantize(raw, kind).reshape(raw.shape[0], -1)


def test_the_q4_k_packer_holds_the_integers_it_is_given():
    """The tests' Q4_K blocks mean what gguf-py reads from them."""
    raw, (d, dmin, sc, mn, q) = random_q4_k(np.random.default_rng(0), 3, 512)
    expected = d[..., None, None].astype(np.float32) * sc[..., None] * q.reshape(3, 2, 8, 32) \
        - dmin[..., None, None].astype(np.float32) * mn[..., None]
    assert np.array_equal(_values(raw, T.Q4_K), expected.reshape(3, 512))


@pytest.mark.parametrize("kind, native", [(T.Q4_0, T.Q4_1), (T.Q5_0, T.Q8_0)])
def test_q4_0_and_q5_0_become_blocks_the_kernels_read_of_the_same_values(kind, native):
    weights = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    weights[0, :32] = 0  # a block of zeros: scale 0
    raw = quants.quantize(weights, kind)
    converted, got = as_native(raw, int(kind))
    assert got == int(native) and converted.shape == (5, 8 * (20 if native == T.Q4_1 else 34))
    assert np.array_equal(_values(converted, native), _values(raw, kind))


def test_q4_k_becomes_q4_1_moving_each_weight_by_its_scales_rounding_only():
    """Each sub-block's d * sc and dmin * mn rounded to fp16 (half an ulp: 2^-11 of each), the
    nibbles unchanged; far closer to the file's values than quantising them to Q8_0 again."""
    raw, (d, dmin, sc, mn, _) = random_q4_k(np.random.default_rng(2), 4, 1024)
    converted, kind = as_native(raw, int(T.Q4_K))
    assert kind == int(T.Q4_1) and converted.shape == (4, 32 * 20)
    exact, got = _values(raw, T.Q4_K), _values(converted, T.Q4_1)
    scale = (d[..., None].astype(np.float32) * sc).repeat(32, axis=-1).reshape(4, 1024)
    offset = (dmin[..., None].astype(np.float32) * mn).repeat(32, axis=-1).reshape(4, 1024)
    assert (np.abs(got - exact) <= (15 * scale + offset) * 2.0 ** -11 * (1 + 2.0 ** -20)).all()
    requantised = _values(quants.quantize(exact, T.Q8_0), T.Q8_0)
    assert np.sqrt(np.mean((got - exact) ** 2)) < np.sqrt(np.mean((requantised - exact) ** 2)) / 4


def test_a_conversion_a_chunk_of_rows_at_a_time_gives_the_same_blocks(tmp_path, monkeypatch):
    """Conversions hold a bounded chunk of rows at once (a whole F16 embedding of 131M values
    had peaked at 1.3 GB while loading); the blocks are those of the whole matrix at once."""
    from replicas.torch_engine import gguf_blocks

    raw = random_q4_k(np.random.default_rng(5), 40, 512)[0]
    llama_gguf(tmp_path / "f16.gguf", tensors={"blk.0.ffn_down.weight": (
        T.F16, np.random.default_rng(6).standard_normal((64, 128)).astype(np.float32))})
    whole = as_native(raw, int(T.Q4_K)), next(GgufWeights(tmp_path / "f16.gguf").layers()).down
    monkeypatch.setattr(gguf_blocks.row_chunks, "__defaults__", (700,))  # 2 rows of 288 bytes, 5 of 128 values
    assert len(list(gguf_blocks.row_chunks(raw))) == 20
    chunked = as_native(raw, int(T.Q4_K)), next(GgufWeights(tmp_path / "f16.gguf").layers()).down
    for (a, kind_a), (b, kind_b) in zip(whole, chunked):
        assert kind_a == kind_b and np.array_equal(a, b)


def test_other_formats_have_no_exact_mapping():
    assert all(as_native(np.zeros((1, 210), np.uint8), int(k)) is None for k in (T.Q6_K, T.Q5_1, T.F16))


DIMS = {"llama.embedding_length": 256, "llama.feed_forward_length": 256}  # Q4_K rows: whole 256s


def test_a_q4_k_gguf_loads_as_the_q4_1_blocks_it_maps_to(tmp_path):
    """Its Q4_K layers reach the kernels as Q4_1 (a Q4_K_M's main format; it was quantised to
    Q8_0 again: 8.5 bits a weight, not 5): bitwise the logits of the same file written with the
    Q4_1 blocks built here from the same integers."""
    rng = np.random.default_rng(3)
    held = {name: random_q4_k(rng, rows, 256) for name, rows in
            (("blk.0.attn_q.weight", 256), ("blk.0.attn_k.weight", 128), ("blk.0.attn_v.weight", 128),
             ("blk.0.ffn_gate.weight", 256), ("blk.0.ffn_up.weight", 256), ("blk.0.ffn_down.weight", 256))}

    def as_q4_1(d, dmin, sc, mn, q):  # per sub-block: fp16 scale and min, the nibbles as Q4_1 packs them
        scale, low = (d[..., None].astype(np.float32) * sc).astype(np.float16), (
            -dmin[..., None].astype(np.float32) * mn).astype(np.float16)
        q = q.reshape(*q.shape[:-1], 8, 32)
        packed = (q[..., :16] | q[..., 16:] << 4).astype(np.uint8)
        return np.concatenate([scale[..., None].view(np.uint8), low[..., None].view(np.uint8), packed],
                              axis=-1).reshape(q.shape[0], -1)

    llama_gguf(tmp_path / "q4_k.gguf", dims=DIMS, tensors={n: (T.Q4_K, raw) for n, (raw, _) in held.items()})
    llama_gguf(tmp_path / "q4_1.gguf", dims=DIMS,
               tensors={n: (T.Q4_1, as_q4_1(*ints)) for n, (_, ints) in held.items()})
    (layer,) = GgufWeights(tmp_path / "q4_k.gguf").layers()
    assert [kind for _, kind in (layer.qkv, layer.gate_up, layer.down)] == [int(T.Q4_1)] * 3
    assert np.array_equal(layer.down[0], as_q4_1(*held["blk.0.ffn_down.weight"][1]))

    def logits(path):
        model = NativeLlamaModel.load(path, num_threads=1)
        cache = model.make_cache(1, 64)
        return model.logits(model(torch.arange(12), [SeqSpan(cache.allocate(), 0, 12)], cache))

    assert torch.equal(logits(tmp_path / "q4_k.gguf"), logits(tmp_path / "q4_1.gguf"))


def test_a_q4_k_scale_past_fp16_or_broken_is_taken_from_its_values(tmp_path):
    """d * sc past fp16's range (up to 2000 * 63): the tensor is quantised to Q8_0 from its
    values; values past Q8_0's range too (d up to 60000: |w| to 5.7e7; the Q8_0 scale was an
    infinity, every logit NaN: QA) and a NaN d are named."""
    rng = np.random.default_rng(4)
    (big, _), (nan, ints) = random_q4_k(rng, 256, 256, scale=2000.0), random_q4_k(rng, 256, 256)
    d = ints[0].copy()
    d[7, 0] = np.nan
    nan[7, :2] = d[7, :1].view(np.uint8)
    llama_gguf(tmp_path / "big.gguf", dims=DIMS, tensors={"blk.0.ffn_down.weight": (T.Q4_K, big)})
    (layer,) = GgufWeights(tmp_path / "big.gguf").layers()
    assert layer.down[1] == int(T.Q8_0) and np.isfinite(_values(*layer.down)).all()
    llama_gguf(tmp_path / "huge.gguf", dims=DIMS, tensors={"blk.0.ffn_down.weight": (T.Q4_K, random_q4_k(
        rng, 256, 256, scale=60000.0)[0])})
    with pytest.raises(ValueError, match=r"huge.gguf: blk.0.ffn_down.weight: values up to .* past what Q8_0"):
        list(GgufWeights(tmp_path / "huge.gguf").layers())
    llama_gguf(tmp_path / "nan.gguf", dims=DIMS, tensors={"blk.0.ffn_down.weight": (T.Q4_K, nan)})
    with pytest.raises(ValueError, match="nan.gguf: blk.0.ffn_down.weight holds a NaN or an infinite value"):
        list(GgufWeights(tmp_path / "nan.gguf").layers())
