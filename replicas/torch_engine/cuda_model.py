"""The torch forward on a CUDA GPU, made row-invariant like the native CPU forward.

Stock CUDA kernels are not row-invariant: cuBLAS and the reductions behind RMSNorm choose
their tiling (and whether to split a reduction) by the number of rows, and SDPA chooses its
backend and KV split by the shapes, so a K-row verify does not compute what K one-row
decodes would and greedy output flips at near-ties. This forward gets equal bits by
construction:

- every dense op (norms, matmuls, the head) runs on blocks of exactly `ROW_BLOCK` rows, the
  step's rows padded with zero rows: each kernel always sees the same shape, and no kernel
  mixes rows, so a row's result cannot depend on what else the step holds;
- attention is our kernel (`csrc/cuda/attention.cu`): one warp per (row, head), over the
  row's own positions [0, p] of its slot in fixed blocks of 32 keys;
- everything else (embedding, RoPE, SiLU, residuals, the K/V writes: `write_kv`) is elementwise.

Weights, activations and the KV cache are fp32 (the kernel reads fp32); on a model this
small a step is bound by kernel launches, not by bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from replicas.torch_engine.kv_cache import KVCache
from replicas.torch_engine.model import DecoderLayer, LlamaModel, SeqSpan, apply_rope, validate_step
from replicas.torch_engine.model_config import ModelConfig

ROW_BLOCK = 64  # rows every dense kernel runs on: a batch of 8 verifying 7 drafts fits one block


def _blockwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """`fn` over `x [P, ...]` in blocks of ROW_BLOCK rows (P is a multiple of it)."""
    if x.shape[0] == ROW_BLOCK:
        return fn(x)
    return torch.cat([fn(block) for block in x.split(ROW_BLOCK)])


def _padded(x: Tensor) -> Tensor:
    """`x [N, ...]` with zero rows appended up to a multiple of ROW_BLOCK."""
    pad = -x.shape[0] % ROW_BLOCK
    return x if pad == 0 else torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])


class CudaLlamaModel(LlamaModel):
    """`LlamaModel` whose forward and head are row-invariant on a CUDA device (fp32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        try:
            from replicas.torch_engine import _cuda_forward
        except ImportError as err:
            raise ImportError("the CUDA forward's kernels (replicas/torch_engine/_cuda_forward*.so) are not built: "
                              "`make native` builds them where nvcc is installed") from err
        self._kernels = _cuda_forward

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> Tensor:
        """input_ids [N] packed in span order -> hidden [N, d] after the final norm.

        Sets `cache.lengths[slot] = start + length` for every span.
        """
        validate_step(self.cfg, input_ids, spans, cache)
        n = input_ids.shape[0]
        slots = [span.slot for span in spans for _ in range(span.length)]
        positions = [p for span in spans for p in range(span.start, span.start + span.length)]
        pad = -n % ROW_BLOCK
        rows = torch.tensor([slots + [0] * pad, positions + [-1] * pad], dtype=torch.int32).to(self.device)
        rope = self.rope(rows[1].clamp(min=0).long())
        x = self.embed_tokens(_padded(input_ids.to(self.device)))
        for i, layer in enumerate(self.layers):
            x = self._layer(layer, x, rope, rows, cache.k[i], cache.v[i])
        for span in spans:
            cache.lengths[span.slot] = span.start + span.length
        return _blockwise(self.norm, x)[:n]

    def _layer(self, layer: DecoderLayer, x: Tensor, rope: tuple[Tensor, Tensor], rows: Tensor, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
        """One decoder layer over the padded rows; `rows [2, P]` int32: each row's slot, position (-1: padding)."""
        attn = layer.self_attn
        h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = _blockwise(lambda block: attn.project(layer.input_layernorm(block)), x)  # [P, (h + 2 kvh) hd]
        qk = apply_rope(qkv[:, : (h + kvh) * hd].view(-1, h + kvh, hd), rope[0][:, None], rope[1][:, None])
        stream = torch.cuda.current_stream(x.device).cuda_stream
        geometry = dict(row_slot=rows[0].data_ptr(), row_pos=rows[1].data_ptr(), rows=x.shape[0], kv_heads=kvh,
                        head_dim=hd, slots=k_cache.shape[0], max_seq_len=k_cache.shape[2], stream=stream,
                        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr())
        # Every new K/V first (a span's rows attend to each other), then every row attends.
        self._kernels.write_kv(k=qk[:, h:].data_ptr(), k_row_stride=(h + kvh) * hd,
                               v=qkv[:, (h + kvh) * hd:].data_ptr(), v_row_stride=qkv.shape[1], **geometry)
        out = torch.empty(x.shape[0], h * hd, dtype=x.dtype, device=x.device)
        self._kernels.attention(q=qk.data_ptr(), q_row_stride=(h + kvh) * hd, out=out.data_ptr(), heads=h,
                                scale=1.0 / math.sqrt(hd), **geometry)
        x = x + _blockwise(attn.o_proj, out)
        return x + _blockwise(lambda block: layer.mlp(layer.post_attention_layernorm(block)), x)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, d] -> logits [M, V] float32, each row as if it were alone."""
        return _blockwise(self.lm_head, _padded(hidden))[: hidden.shape[0]].float()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | torch.device = "cuda",
                        dtype: torch.dtype = torch.float32, cfg: ModelConfig | None = None) -> "CudaLlamaModel":
        if dtype != torch.float32:
            raise ValueError(f"dtype: the CUDA forward's attention kernel reads float32, got {dtype}")
        if torch.device(device).type != "cuda":
            raise ValueError(f"device: CudaLlamaModel runs on a CUDA device, got {device!r}")
        return super().from_pretrained(model_dir, device=device, dtype=dtype, cfg=cfg)

