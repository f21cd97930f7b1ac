"""A lean Llama forward over a packed, variable-length batch, reading a preallocated KV cache.

Why not the Hugging Face forward: a verify step must cost little more than a plain step.
HF's costs 2.2x (1 core, 1k context, CPU time: 151 ms for 9 tokens vs 67 ms for 1); this
one 1.6x (94 vs 59 ms; see benchmarks/forward.py). Every matmul runs once over all tokens
of all sequences (fused QKV and gate/up weights, oneDNN-prepacked for multi-row inputs),
RoPE comes from a table built once, and only attention is per sequence, over a view of
that sequence's cache slot (no gather; no mask for 1-token spans and whole prompts, a
small [g*T, start+T] mask for a span continuing a sequence). A 1-token step is bound by
streaming the 540 MB of fp32 weights (~40 of its ~59 ms), not by overhead.

GQA trick: the `g = num_heads // num_kv_heads` query heads that share a KV head are folded
into the query-length axis ([kvh, g*T, hd]), so attention is a plain batched SDPA over the
KV heads with no expanded copy of K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replicas.torch_engine.hf_checkpoint import load_hf_state
from replicas.torch_engine.kv_cache import KVCache
from replicas.torch_engine.model_config import ModelConfig


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's tokens inside a packed batch."""

    slot: int    # KV cache slot of the sequence
    start: int   # position of the first token of this span (== tokens already cached)
    length: int  # tokens of this sequence in the packed batch


@dataclass(frozen=True)
class _SpanAttention:
    slot: int
    start: int          # first cache position written
    end: int            # attend over cache positions [0, end)
    first_row: int      # rows [first_row, first_row + end - start) of the packed batch
    mask: Tensor | None  # [g*T, end] additive (0 or -inf) for 1 < T, 0 < start; else None

    @property
    def is_prefill(self) -> bool:  # a whole sequence from position 0: SDPA's own causal mask
        return self.start == 0 and self.end > 1


@dataclass(frozen=True)
class AttentionPlan:
    """Everything about the spans that every layer reuses: built once per forward."""

    spans: tuple[_SpanAttention, ...]
    positions: Tensor  # [N] int64: cache position (= RoPE position) of each packed token

    @classmethod
    def build(cls, spans: Sequence[SeqSpan], group_size: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> "AttentionPlan":
        out, positions, row = [], [], 0
        for span in spans:
            end = span.start + span.length
            mask = None
            if span.length > 1 and span.start > 0:
                # token t (position start+t) sees cache positions <= start+t; rows are
                # ordered (query head in group, t), hence the repeat over the group.
                # Additive float: measured a little faster than bool in CPU SDPA.
                causal = torch.ones(span.length, end, dtype=torch.bool, device=device).tril(span.start)
                mask = torch.zeros(causal.shape, dtype=dtype, device=device).masked_fill_(~causal, float("-inf"))
                mask = mask.repeat(group_size, 1)
            out.append(_SpanAttention(span.slot, span.start, end, row, mask))
            positions.append(torch.arange(span.start, end, dtype=torch.int64, device=device))
            row += span.length
        return cls(tuple(out), positions[0] if len(positions) == 1 else torch.cat(positions))


def validate_spans(spans: Sequence[SeqSpan], num_tokens: int, cache: KVCache) -> None:
    """ValueError unless `spans` tile `num_tokens` packed tokens and fit their cache slots.

    A span may start before the slot's current length (that overwrites, i.e. truncates),
    never after it (that would attend over positions that were never written).
    """
    if not spans:
        raise ValueError("spans: at least one span is required")
    seen: set[int] = set()
    total = 0
    for span in spans:
        if not 0 <= span.slot < cache.max_slots:
            raise ValueError(f"span slot {span.slot} out of range [0, {cache.max_slots})")
        if not cache.is_allocated(span.slot):
            raise ValueError(f"span slot {span.slot} is not allocated")
        if span.slot in seen:
            raise ValueError(f"span slot {span.slot} appears twice in one batch")
        seen.add(span.slot)
        if span.length < 1:
            raise ValueError(f"span length must be >= 1, got {span.length}")
        if not 0 <= span.start <= cache.lengths[span.slot]:
            raise ValueError(f"span start {span.start} must be in [0, {cache.lengths[span.slot]}] (cached) for slot {span.slot}")
        if span.start + span.length > cache.max_seq_len:
            raise ValueError(f"span [{span.start}, {span.start + span.length}) exceeds the cache capacity {cache.max_seq_len}")
        total += span.length
    if total != num_tokens:
        raise ValueError(f"spans cover {total} tokens but input_ids has {num_tokens}")


def validate_step(cfg: ModelConfig, input_ids: Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> None:
    """ValueError unless `input_ids` [N] and `spans` form a step this model and cache can run."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D [N] (packed), got shape {tuple(input_ids.shape)}")
    validate_spans(spans, input_ids.shape[0], cache)
    low, high = torch.aminmax(input_ids)  # all before any KV is written (a step may go in several calls)
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(f"input_ids: ids must be in [0, {cfg.vocab_size}), got {int(low)}..{int(high)}")
    if cache.num_layers != cfg.num_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model {cfg.num_layers}")
    max_end = max(s.start + s.length for s in spans)
    if max_end > cfg.max_position_embeddings:
        raise ValueError(f"position {max_end - 1} exceeds max_position_embeddings {cfg.max_position_embeddings}")


def rope_tables(cfg: ModelConfig, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [max_positions, head_dim]: fp32 angles as transformers computes them (halves
    repeated), a scaled RoPE's frequencies divided by their factors."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if cfg.rope_freq_factors:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32, device=device)
    angles = torch.outer(torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Llama's "rotate half" RoPE: pairs are (i, i + hd/2), not adjacent elements.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """nn.Linear (no bias) that can run inference through oneDNN with prepacked weights.

    Why: MKL's fp32 sgemm slows down sharply from 4 rows on, while oneDNN's blocked weight
    layout keeps a 9-row matmul near the 1-row cost (measured, 30 gate/up matmuls, 1 core:
    1 row 12.7 ms; 9 rows 41 ms MKL vs 21 ms oneDNN). Up to `MKL_MAX_ROWS` fp32 rows MKL is
    the faster one (whole model, 2 threads, 700 cached tokens, step cost over a 1-row step:
    2 rows 1.03-1.11x MKL vs 1.13-1.24x oneDNN; 3 rows 1.10-1.15x vs 1.16-1.28x; 4 rows
    1.37-1.45x vs 1.17-1.23x), so small steps stay on MKL; bf16 always takes oneDNN (AMX).
    The packed copy is inference-only (grad mode uses the plain weight), is dropped by
    `.to()`/`.float()`, and must be redone after changing weights.
    """

    MKL_MAX_ROWS = 3

    packed: Tensor | None = None

    def prepack(self) -> None:
        # oneDNN packs bf16 only where the CPU converts it natively (AVX512BW/VL/DQ or
        # AVX-NE-CONVERT, not an AVX2-only Zen 3): elsewhere bf16 stays on F.linear.
        packable = self.weight.dtype == torch.float32 or (
            self.weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if self.weight.device.type == "cpu" and packable and _onednn_linear_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), None)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self.packed = None  # a moved or cast weight invalidates the packed copy
        return super()._apply(fn, recurse)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None and (x.shape[0] > self.MKL_MAX_ROWS or x.dtype != torch.float32) \
                and not torch.is_grad_enabled():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def prepack_linears(module: nn.Module) -> None:
    """Pack every `Linear` of `module` for fast multi-row CPU inference (~2x weight memory)."""
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.prepack()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group_size = cfg.num_heads // cfg.num_kv_heads
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)  # q|k|v rows
        # Qwen2's q|k|v biases, added after the matmul (`Linear` computes none)
        self.qkv_bias = nn.Parameter(torch.zeros(cfg.q_size + 2 * cfg.kv_size)) if cfg.qkv_bias else None
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def project(self, x: Tensor) -> Tensor:
        """q|k|v [N, (h + 2 kvh) * hd] of the normed rows x, before RoPE."""
        qkv = self.qkv_proj(x)
        return qkv if self.qkv_bias is None else qkv + self.qkv_bias

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], plan: AttentionPlan,
                k_cache: Tensor, v_cache: Tensor) -> Tensor:
        num_tokens = x.shape[0]
        h, kvh, hd, g = self.num_heads, self.num_kv_heads, self.head_dim, self.group_size
        qkv = self.project(x)
        # q and k rotate together: one RoPE pass over [N, h + kvh, hd].
        qk = apply_rope(qkv[:, : (h + kvh) * hd].view(num_tokens, h + kvh, hd), rope[0][:, None], rope[1][:, None])
        q, k = qk[:, :h], qk[:, h:]                                  # [N, h, hd], [N, kvh, hd]
        v = qkv[:, (h + kvh) * hd:].view(num_tokens, kvh, hd)        # [N, kvh, hd]
        outs = []
        for span in plan.spans:
            t = span.end - span.start
            rows = slice(span.first_row, span.first_row + t)
            # Slice copies, not one index_put over all spans: measured cheaper on CPU.
            k_cache[span.slot, :, span.start:span.end] = k[rows].transpose(0, 1)
            v_cache[span.slot, :, span.start:span.end] = v[rows].transpose(0, 1)
            keys = k_cache[span.slot: span.slot + 1, :, : span.end]   # [1, kvh, S, hd] view, no copy
            values = v_cache[span.slot: span.slot + 1, :, : span.end]
            # 4-D inputs throughout: 3-D ones fall back to SDPA's slow "math" path on CPU.
            if span.is_prefill:
                # No [T, T] mask to build (it would be g*T*T floats for a long prompt).
                o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values,
                                                   is_causal=True, enable_gqa=True)  # [1, h, T, hd]
                outs.append(o[0].transpose(0, 1).reshape(t, h * hd))
                continue
            # [T, h, hd] -> [1, kvh, g*T, hd]: query heads sharing a KV head become extra rows.
            q_span = q[rows].permute(1, 0, 2).reshape(1, kvh, g * t, hd)
            o = F.scaled_dot_product_attention(q_span, keys, values, attn_mask=span.mask)  # [1, kvh, g*T, hd]
            outs.append(o.reshape(h, t, hd).transpose(0, 1).reshape(t, h * hd))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)        # [N, h*hd]
        return self.o_proj(attn)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate|up rows
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One pre-norm Llama block; usable alone (the MTP head runs one with its own KVCache)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.group_size = cfg.num_heads // cfg.num_kv_heads
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], spans: Sequence[SeqSpan],
                k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan | None = None) -> Tensor:
        """x [N, d] packed tokens of `spans` in order; k_cache/v_cache [slots, kvh, L, hd].

        Writes each span's K/V at [start, start+length) of its slot, then attends causally
        over [0, start+length) of that slot. Spans are not validated here (hot path): check
        them once with `validate_spans`. `plan` lets a caller share one plan across layers.
        """
        if plan is None:
            plan = AttentionPlan.build(spans, self.group_size, x.device, x.dtype)
        x = x + self.self_attn(self.input_layernorm(x), rope, plan, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Llama decoder + head. `forward` returns final-normed hidden states; `logits` projects."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._build_rope_tables(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype)

    def _build_rope_tables(self, device: torch.device, dtype: torch.dtype) -> None:
        # cast once; indexing a table beats recomputing cos/sin per step
        cos, sin = rope_tables(self.cfg, device)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [N, head_dim] for positions [N]."""
        return self.rope_cos[positions], self.rope_sin[positions]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [N] -> embedding rows [N, d]."""
        return self.embed_tokens(tokens)

    def head_rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the output head [len(ids), d] (the MTP's reduced head)."""
        return self.lm_head.weight.detach()[ids]

    def make_cache(self, max_slots: int, max_seq_len: int) -> KVCache:
        """A KVCache shaped for this model (same dtype and device)."""
        w = self.embed_tokens.weight
        return KVCache(self.cfg.num_layers, max_slots, max_seq_len, self.cfg.num_kv_heads,
                       self.cfg.head_dim, dtype=w.dtype, device=w.device)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> Tensor:
        """input_ids [N] int64 packed in span order -> hidden [N, d] after the final norm.

        Sets `cache.lengths[slot] = start + length` for every span.
        """
        validate_step(self.cfg, input_ids, spans, cache)
        plan = AttentionPlan.build(spans, self.cfg.num_heads // self.cfg.num_kv_heads, input_ids.device,
                                   self.embed_tokens.weight.dtype)
        rope = self.rope(plan.positions)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, spans, cache.k[i], cache.v[i], plan=plan)
        for span in spans:
            cache.lengths[span.slot] = span.start + span.length
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, d] -> logits [M, V] float32 (compute only the rows you need)."""
        return self.lm_head(hidden).float()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, cfg: ModelConfig | None = None) -> "LlamaModel":
        """Load any HF Llama checkpoint dir (single or sharded safetensors, tied or not). `cfg`:
        the model's config where its config.json lacks some (a GGUF's converted copy: its RoPE
        factors are in the GGUF's rope_freqs alone)."""
        cfg = cfg or ModelConfig.from_hf_dir(model_dir)
        with torch.device("meta"):
            model = cls(cfg)
        state = load_hf_state(Path(model_dir), cfg, dtype, device)  # each tensor's shape checked
        model.load_state_dict(state, strict=True, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model._build_rope_tables(torch.device(device), dtype)
        prepack_linears(model)
        return model.eval()
