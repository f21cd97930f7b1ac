"""Small Llama GGUF files for tests, and Q4_K blocks packed from their integers (gguf-py
dequantizes Q4_K but cannot quantize to it)."""

from __future__ import annotations

import numpy as np

HEADER = {"llama.block_count": 1, "llama.context_length": 256, "llama.embedding_length": 64,
          "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
          "llama.vocab_size": 96, "llama.attention.layer_norm_rms_epsilon": 1e-5}


def shapes(header: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape (rows, columns) for a 1-layer header."""
    h, ff, vocab = header["llama.embedding_length"], header["llama.feed_forward_length"], header["llama.vocab_size"]
    head_dim = h // header["llama.attention.head_count"]
    kv = head_dim * header["llama.attention.head_count_kv"]
    return {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
            "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (kv, h),
            "blk.0.attn_v.weight": (kv, h), "blk.0.attn_output.weight": (h, h), "blk.0.ffn_gate.weight": (ff, h),
            "blk.0.ffn_up.weight": (ff, h), "blk.0.ffn_down.weight": (h, ff)}


def llama_gguf(path, fields=None, tensors=None, dims=None) -> None:
    """A 1-layer llama GGUF of random F32 tensors shaped by HEADER with `dims` (header keys the
    shapes follow), then changed by `fields` (header keys they do not) and `tensors` (None:
    left out; (GGML type, float values): encoded so; (GGML type, uint8 rows): those blocks)."""
    from gguf import GGUFWriter, quants

    header = {**HEADER, **(dims or {})}
    writer = GGUFWriter(str(path), "llama")
    for key, value in {**header, **(fields or {})}.items():
        if value is not None:
            {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32,
             list: writer.add_array}[type(value)](key, value)
    rng = np.random.default_rng(0)
    for name, spec in {**shapes(header), **(tensors or {})}.items():
        if spec is None:
            continue
        if isinstance(spec[-1], np.ndarray):
            kind, values = spec
            writer.add_tensor(name, values if values.dtype == np.uint8 else quants.quantize(values, kind),
                              raw_dtype=kind)
        else:  # a shape
            writer.add_tensor(name, (0.1 * rng.standard_normal(spec)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [..., 144] (w = d * sc[j] * q - dmin * mn[j] in sub-block j) from fp16
    d, dmin [...], 6-bit sc, mn [..., 8] and 4-bit q [..., 256]."""
    sc, mn, q = (np.asarray(x, np.uint8) for x in (sc, mn, q))
    scales = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                             (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], axis=-1)
    pairs = q.reshape(*q.shape[:-1], 4, 2, 32)  # sub-blocks 2c, 2c + 1 share 32 bytes: low, high nibbles
    qs = (pairs[..., 0, :] | pairs[..., 1, :] << 4).reshape(*q.shape[:-1], 128)
    return np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, qs], axis=-1)


def random_q4_k(rng: np.random.Generator, rows: int, cols: int, scale: float = 0.01):
    """Random Q4_K rows [rows, cols / 256 * 144] and the integers they hold: d, dmin [rows,
    blocks], sc, mn [rows, blocks, 8], q [rows, blocks, 256]."""
    blocks = (rows, cols // 256)
    d, dmin = ((scale * rng.random(blocks)).astype(np.float16) for _ in range(2))
    sc, mn = (rng.integers(0, 64, (*blocks, 8), dtype=np.uint8) for _ in range(2))
    q = rng.integers(0, 16, (*blocks, 256), dtype=np.uint8)
    return pack_q4_k(d, dmin, sc, mn, q).reshape(rows, -1), (d, dmin, sc, mn, q)
