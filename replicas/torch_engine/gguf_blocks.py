"""GGUF block formats the kernels do not read, re-encoded as ones they do, value for value.

The kernels read Q4_1 (w = d * q + m, q in 0..15) and Q8_0 (w = d * q, q in -127..127), fp16
d and m, blocks of 32. Three common formats map onto them without quantising again:
- Q4_0 (w = d * (q - 8)) is Q4_1 with m = -8 d: exact.
- Q5_0 (w = d * (q - 16), q in 0..31) is Q8_0 with q - 16: exact.
- Q4_K (Q4_K_M's main format: super-blocks of 256 in 8 sub-blocks of 32, w = d * sc * q -
  dmin * mn with 6-bit sc, mn) is Q4_1 per sub-block with d = fp16(d * sc), m = fp16(-dmin *
  mn): the same nibbles; only the two products round to fp16 (a weight moves by at most
  2^-11 of its sub-block's range and offset, or 2^-25 where a product is that small, where
  quantising the values to Q8_0 again moved it by up to 1/254 of its block's largest
  magnitude, and kept 8.5 bits a weight, not 5).
Other formats (F32, F16, BF16, Q5_1, Q5_K, Q6_K, IQ*) are quantised to Q8_0 from their values
by the caller.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K = 2, 3, 6, 8, 12  # GGML type numbers


def _q4_1(d: np.ndarray, m: np.ndarray, nibbles: np.ndarray) -> np.ndarray:
    """Q4_1 blocks [..., 20] from fp16 d, m [...] and values 0..15 [..., 32]."""
    packed = (nibbles[..., :16] | (nibbles[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), packed], axis=-1)


def _q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    qs = blocks[..., 2:]
    return _q4_1(d, -8 * d, np.concatenate([qs & 15, qs >> 4], axis=-1))


def _q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, 22)
    high = np.unpackbits(np.ascontiguousarray(blocks[..., 2:6]), axis=-1, bitorder="little")  # bit j: element j
    qs = blocks[..., 6:]
    q = (np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)).astype(np.int16) - 16
    return np.concatenate([blocks[..., :2], q.astype(np.int8).view(np.uint8)], axis=-1)


def _q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, 144)
    d, dmin = (np.ascontiguousarray(blocks[..., i:i + 2]).view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
    s = blocks[..., 4:16].astype(np.uint8)  # 8 six-bit scales and 8 six-bit mins
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    with np.errstate(over="ignore"):  # a product past fp16's range: the caller sees an infinity
        scale = (d[..., None] * sc).astype(np.float16)  # exact in float32, rounded once here
        offset = (-dmin[..., None] * mn).astype(np.float16)
    # 32 bytes per pair of sub-blocks: 2c's values in the low nibbles, 2c + 1's in the high.
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    values = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*blocks.shape[:2], 8, 32)
    return _q4_1(scale, offset, values).reshape(raw.shape[0], -1)


_AS_NATIVE = {Q4_0: (_q4_0_as_q4_1, Q4_1), Q5_0: (_q5_0_as_q8_0, Q8_0), Q4_K: (_q4_k_as_q4_1, Q4_1)}


def row_chunks(rows, budget: int = 1 << 22) -> Iterator:
    """`rows` [n, ...] (numpy or torch) a chunk at a time, each about `budget` elements (one
    row at least): what a conversion holds at once, however large the matrix."""
    step = max(1, budget // max(1, int(np.prod(rows.shape[1:]))))
    for start in range(0, len(rows), step):
        yield rows[start:start + step]


def as_native(raw: np.ndarray, kind: int) -> tuple[np.ndarray, int] | None:
    """GGUF rows [n, bytes] of type `kind` as Q4_1 or Q8_0 rows, or None if no exact mapping
    exists (the kernels read it as it is, or it is to be quantised again)."""
    if kind not in _AS_NATIVE:
        return None
    convert, native = _AS_NATIVE[kind]
    return np.concatenate([convert(chunk).reshape(len(chunk), -1) for chunk in row_chunks(raw)]), native


def block_scales(raw: np.ndarray, kind: int) -> np.ndarray:
    """The fp16 scales (and Q4_1's mins) of a Q8_0 or Q4_1 matrix's blocks."""
    block, halves = (34, 1) if kind == Q8_0 else (20, 2)
    return np.ascontiguousarray(raw.reshape(raw.shape[0], -1, block)[..., :2 * halves]).view(np.float16)
