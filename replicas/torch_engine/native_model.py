"""The quantized, row-invariant CPU forward (csrc/cpu) behind the same face as `LlamaModel`.

Weights stay in GGUF blocks: the embedded default's Q4_1 layers and Q8_0 embedding are read
straight from the packaged GGUF (about 100 MB in memory, no fp32 copy); a GGUF's Q4_0, Q5_0
and Q4_K blocks are re-encoded as those formats (`gguf_blocks`); a Hugging Face Llama
checkpoint, or a GGUF tensor in another format, is quantised to Q8_0 at load. One native call
runs the whole decoder for a packed step, and every row of it computes the same bits whatever
else the step holds: a K-row verify equals K 1-row decodes, a request alone equals the same
request in a busy batch, and prefill in one chunk equals prefill in several.

The KV cache is paged fp16 (`PagedKVCache`); the native code writes and reads it through the
tensors' memory, finding each block's page in the cache's block table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

try:
    from replicas.torch_engine import _cpu_forward
except ImportError as err:  # pragma: no cover - depends on the build state
    raise ImportError("the native CPU forward (replicas/torch_engine/_cpu_forward*.so) is not built; "
                      "run `make native` in the repository root") from err
from replicas.torch_engine.gguf_weights import GgufWeights, HfWeights, quantize_q8_0
from replicas.torch_engine.kv_cache import KVCacheFull, PagedKVCache
from replicas.torch_engine.sizes import whole_pages
from replicas.torch_engine.model import SeqSpan, rope_tables, validate_step
from replicas.torch_engine.model_config import ModelConfig

# torch's intra-op thread count as this process began (OMP_NUM_THREADS; under Ray the
# replica's num_cpus): the pool's default. Read once: torch.set_num_threads also sets what a
# thread that first uses torch later starts with, and a CPU engine sets 1 for its own thread.
DEFAULT_THREADS = torch.get_num_threads()

Q4_1, Q8_0 = 3, 8  # GGML type numbers the kernels read
VOCAB_GROUP = 8  # the kernels take output rows in groups of 8: a vocabulary is padded to whole groups
MAX_CHUNK_TOKENS = 256  # rows per native call: bounds the step's scratch memory on long prompts


class NativeLlamaModel:
    """A Llama decoder + head on the native CPU forward; the `LlamaModel` surface the engine uses."""

    def __init__(self, cfg: ModelConfig, forward: "_cpu_forward.LlamaForward") -> None:
        self.cfg = cfg
        self._forward = forward
        self.rope_cos, self.rope_sin = rope_tables(cfg)

    @property
    def isa(self) -> str:
        """The kernel path in use: amx, avx512, avx2 or scalar."""
        return self._forward.isa

    @property
    def num_threads(self) -> int:
        return self._forward.num_threads

    @property
    def weight_bytes(self) -> int:
        return self._forward.weight_bytes

    # The MTP head runs in torch beside this model: fp32 on the CPU.
    dtype = torch.float32
    device = torch.device("cpu")

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | GgufWeights, num_threads: int = 0, isa: str = "",
             max_positions: int = 0) -> "NativeLlamaModel":
        """A `.gguf` file (or its `GgufWeights`, its header already read), or an HF Llama
        checkpoint directory (quantised to Q8_0 at load).

        num_threads 0: DEFAULT_THREADS, torch's intra-op thread count as the process began
        (under Ray, the replica's num_cpus; else the cores this process may use). isa "": the best path this CPU runs
        (the environment variable SPECSERVE_CPU_ISA forces one: scalar, avx2, avx512, amx).
        max_positions: the most it will ever be given (an engine's cache window), if fewer than
        the model's max_position_embeddings: its RoPE tables hold only these (Llama 3's 131,072
        positions of head_dim 128 cost 190 MB of tables).
        """
        if isinstance(path, GgufWeights):
            source = path
        else:
            source = GgufWeights(Path(path)) if Path(path).suffix == ".gguf" else HfWeights(Path(path))
        cfg = source.config
        if 0 < max_positions < cfg.max_position_embeddings:
            cfg = dataclasses.replace(cfg, max_position_embeddings=max_positions)
        padded = whole_groups(cfg.vocab_size)
        dims = _cpu_forward.ModelDims(
            vocab_size=padded, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, max_positions=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps)
        forward = _cpu_forward.LlamaForward(dims, num_threads or DEFAULT_THREADS, isa)
        for i, layer in enumerate(source.layers()):
            forward.set_layer(i, layer.attn_norm, layer.ffn_norm, *layer.qkv, *layer.o, *layer.gate_up, *layer.down,
                              layer.qkv_bias)
        model = cls(cfg, forward)
        half = cfg.head_dim // 2
        head = source.head()
        forward.set_globals(*zero_rows(source.embedding(), padded),
                            *(zero_rows(head, padded) if head is not None else (None, Q8_0)),
                            source.final_norm(), np.ascontiguousarray(model.rope_cos[:, :half].numpy()),
                            np.ascontiguousarray(model.rope_sin[:, :half].numpy()))
        return model

    # -- the LlamaModel surface ---------------------------------------------------------------
    def make_cache(self, max_slots: int, max_seq_len: int, num_pages: int | None = None) -> PagedKVCache:
        """A paged fp16 KV cache for this model, its length rounded up to a multiple of 32;
        `num_pages` (default: every slot's whole window) sizes the pool the slots share."""
        return PagedKVCache(self.cfg.num_layers, max_slots, whole_pages(max_seq_len),
                            self.cfg.num_kv_heads, self.cfg.head_dim, num_pages)

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, spans: Sequence[SeqSpan], cache: PagedKVCache) -> Tensor:
        """input_ids [N] packed in span order -> hidden [N, d] float32 after the final norm.

        Takes the pages the spans reach (KVCacheFull when the pool has too few) and sets
        `cache.lengths[slot] = start + length` for every span.
        """
        if not isinstance(cache, PagedKVCache):
            raise ValueError("cache: the native forward needs a PagedKVCache from make_cache()")
        validate_step(self.cfg, input_ids, spans, cache)
        reserve(cache, spans)
        ids = input_ids.to(torch.int32).numpy()
        hidden = np.empty((len(ids), self.cfg.hidden_size), dtype=np.float32)
        k, v, table = cache.k.numpy(), cache.v.numpy(), cache.block_table.numpy()
        for rows, chunk in _chunks(spans, MAX_CHUNK_TOKENS):
            self._forward.forward(np.ascontiguousarray(ids[rows]), chunk, k, v, table, hidden[rows])
        for span in spans:
            cache.lengths[span.slot] = span.start + span.length
        return torch.from_numpy(hidden)

    forward = __call__

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, d] -> logits [M, V] float32 (compute only the rows you need)."""
        h = np.ascontiguousarray(hidden.float().numpy())
        vocab = self.cfg.vocab_size
        out = np.empty((h.shape[0], whole_groups(vocab)), dtype=np.float32)
        self._forward.logits(h, out)
        return torch.from_numpy(out if out.shape[1] == vocab else np.ascontiguousarray(out[:, :vocab]))

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [N] -> dequantised embedding rows [N, d] float32 (for the MTP head)."""
        ids = tokens.to(torch.int32).numpy()
        out = np.empty((len(ids), self.cfg.hidden_size), dtype=np.float32)
        self._forward.embed(np.ascontiguousarray(ids), out)
        return torch.from_numpy(out)

    def head_rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the output head, dequantised [len(ids), d] float32 (the MTP's reduced head)."""
        idx = ids.to(torch.int32).numpy()
        out = np.empty((len(idx), self.cfg.hidden_size), dtype=np.float32)
        self._forward.head_rows(np.ascontiguousarray(idx), out)
        return torch.from_numpy(out)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [N, head_dim] for positions [N] (the MTP head's torch layer uses them)."""
        return self.rope_cos[positions], self.rope_sin[positions]


def whole_groups(vocab: int) -> int:
    return -(-vocab // VOCAB_GROUP) * VOCAB_GROUP


def zero_rows(matrix: tuple[np.ndarray, int], rows: int) -> tuple[np.ndarray, int]:
    """A quantised matrix (its blocks' bytes by row, its GGML type) padded with rows of zero
    bytes to `rows`: each is a block of scale 0 (and min 0), so its values and logits are 0,
    and the logits are cut before anyone reads them."""
    raw, kind = matrix
    if raw.shape[0] == rows:
        return matrix
    return np.concatenate([raw, np.zeros((rows - raw.shape[0], raw.shape[1]), dtype=raw.dtype)]), kind


def reserve(cache: PagedKVCache, spans: Sequence[SeqSpan]) -> None:
    """The pages every span writes; KVCacheFull, naming the shortfall, when the pool runs out."""
    for span in spans:
        if not cache.reserve(span.slot, span.start, span.start + span.length):
            raise KVCacheFull(f"KV cache: no free page for positions [{span.start}, {span.start + span.length}) "
                              f"of slot {span.slot} ({cache.free_pages} of {cache.num_pages} pages free)")


def _chunks(spans: Sequence[SeqSpan], max_tokens: int) -> Iterator[tuple[slice, np.ndarray]]:
    """Split a packed step into native calls of at most `max_tokens` rows.

    A span that crosses a boundary continues in the next call at its next position; the rows
    compute the same bits either way (row invariance), only the scratch memory is bounded.
    """
    row, pending, used, first = 0, [], 0, 0
    for span in spans:
        start, left = span.start, span.length
        while left:
            take = min(left, max_tokens - used)
            pending.append((span.slot, start, take))
            start, left, used, row = start + take, left - take, used + take, row + take
            if used == max_tokens:
                yield slice(first, row), np.asarray(pending, dtype=np.int32)
                pending, used, first = [], 0, row
    if pending:
        yield slice(first, row), np.asarray(pending, dtype=np.int32)


class NativeMtpHead:
    """An MTP head's cached step on the native forward, beside a `NativeLlamaModel` target.

    The head's layer, its input fusion and its reduced output head run as a 1-layer native
    model with Q8_0 weights (quantised here from the trained fp16/fp32 ones) and its own fp16
    KV cache: the same kernels as the target, so a drafting step costs a fraction of a
    target step instead of a torch layer's weight traffic in fp32.
    """

    def __init__(self, module, target: NativeLlamaModel, max_slots: int, max_seq_len: int) -> None:
        cfg = target.cfg
        vocab = int(module.draft_vocab.numel())
        padded = whole_groups(vocab)
        self.vocab = vocab
        dims = _cpu_forward.ModelDims(
            vocab_size=padded, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=1,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            max_positions=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps)
        self._forward = _cpu_forward.LlamaForward(dims, target.num_threads, target.isa)
        weights = {k: v.detach().float().numpy() for k, v in module.state_dict().items() if v.is_floating_point()}
        layer = "layer."
        self._forward.set_layer(
            0, weights[layer + "input_layernorm.weight"], weights[layer + "post_attention_layernorm.weight"],
            *quantize_q8_0(weights[layer + "self_attn.qkv_proj.weight"]),
            *quantize_q8_0(weights[layer + "self_attn.o_proj.weight"]),
            *quantize_q8_0(weights[layer + "mlp.gate_up_proj.weight"]),
            *quantize_q8_0(weights[layer + "mlp.down_proj.weight"]))
        self._forward.set_fusion(weights["hidden_norm.weight"], weights["embed_norm.weight"],
                                 *quantize_q8_0(weights["proj.weight"]))
        head = np.zeros((padded, cfg.hidden_size), dtype=np.float32)
        head[:vocab] = target.head_rows(module.draft_vocab).numpy()
        half = cfg.head_dim // 2
        self._forward.set_globals(None, Q8_0, *quantize_q8_0(head), weights["out_norm.weight"],
                                  np.ascontiguousarray(target.rope_cos[:, :half].numpy()),
                                  np.ascontiguousarray(target.rope_sin[:, :half].numpy()))
        self.cache = PagedKVCache(1, max_slots, whole_pages(max_seq_len), cfg.num_kv_heads,
                                  cfg.head_dim)  # every slot's whole window: a slot never runs short

    def step(self, hidden: Tensor, embeds: Tensor, spans: Sequence[SeqSpan]) -> Tensor:
        """hidden, embeds [N, d] at the spans' positions (scratch past a slot's length is
        allowed: a chained draft) -> h' [N, d]; writes their K/V."""
        out = np.empty(tuple(hidden.shape), dtype=np.float32)
        reserve(self.cache, spans)
        h, e = np.ascontiguousarray(hidden.float().numpy()), np.ascontiguousarray(embeds.float().numpy())
        k, v, table = self.cache.k.numpy(), self.cache.v.numpy(), self.cache.block_table.numpy()
        for rows, chunk in _chunks(spans, MAX_CHUNK_TOKENS):  # a long prompt's positions: bounded scratch
            self._forward.forward_fused(h[rows], e[rows], chunk, k, v, table, out[rows])
        return torch.from_numpy(out)

    def logits(self, h: Tensor) -> Tensor:
        """h' [B, d] -> logits over the draft vocabulary [B, N] float32."""
        out = np.empty((h.shape[0], self.vocab + (-self.vocab) % 8), dtype=np.float32)
        self._forward.logits(np.ascontiguousarray(h.float().numpy()), out)
        return torch.from_numpy(out[:, :self.vocab])
