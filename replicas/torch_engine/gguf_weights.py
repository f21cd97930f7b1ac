"""Weights for the native CPU forward, as GGUF blocks: from a GGUF file or an HF checkpoint.

The kernels read Q4_1 and Q8_0 blocks. A GGUF's tensors in those formats are passed on as
they are (no dequantisation), Q4_0, Q5_0 and Q4_K re-encoded as them value for value
(`gguf_blocks`); anything else (F32, F16, Q6_K, ...) and every tensor of a Hugging Face
checkpoint is quantised to Q8_0 here, once, at load. Fused matrices (q|k|v,
gate|up) are the row concatenations of their parts, so fusing needs no arithmetic either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from replicas.torch_engine.gguf_blocks import Q4_1, Q8_0, as_native, block_scales, row_chunks
from replicas.torch_engine.model_config import ModelConfig

_NATIVE = (Q4_1, Q8_0)
_ARCH_NAMES = {"llama": "Llama", "qwen2": "Qwen2"}  # GGUF architectures the forward computes
_CONTROL = 3  # a GGUF token type
# Control tokens that end a turn (llama.cpp's list, of the formats a Llama or a Qwen2 is tuned to)
_END_OF_TURN = {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
                "<end_of_turn>", "<EOT>"}

Matrix = tuple[np.ndarray, int]  # GGUF rows [n, bytes per row] uint8, GGML type


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray  # [d] float32
    ffn_norm: np.ndarray
    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix
    qkv_bias: np.ndarray | None = None  # [q + 2 kv] float32: a Qwen2's


def quantize_q8_0(weight, what: str = "a matrix") -> Matrix:
    """A float matrix [n, k] (numpy, or a torch tensor of any float type) as Q8_0 rows, a chunk
    of rows at a time (gguf-py's temporaries are several times what it is given); ValueError
    naming `what` if a block's scale (its largest magnitude / 127) is past fp16's range (it
    became an infinity, and every logit NaN: QA)."""
    from gguf import GGMLQuantizationType, quants

    blocks = []
    for chunk in row_chunks(weight):
        floats = chunk.float().numpy() if hasattr(chunk, "float") else np.ascontiguousarray(chunk, dtype=np.float32)
        with np.errstate(over="ignore"):  # (a scale past fp16's range: named below)
            blocks.append(quants.quantize(np.ascontiguousarray(floats), GGMLQuantizationType.Q8_0))
        if not np.isfinite(block_scales(blocks[-1], Q8_0)).all():
            raise ValueError(f"{what}: values up to {float(np.abs(floats).max()):.3g}, past what Q8_0 blocks hold "
                             f"(fp16 scales: magnitudes under about 8.3e6)")
    return np.concatenate(blocks), Q8_0


def fuse(parts: list[tuple[np.ndarray, int, callable]], what: str = "a matrix") -> Matrix:
    """Row-concatenate matrices; if their formats differ or are not native, all go to Q8_0, a
    chunk of rows at a time (a whole F16 embedding of 131M values had peaked at 1.3 GB).

    Each part is (raw rows, type, values() -> its float rows [n, k], a chunk at a time).
    """
    types = {t for _, t, _ in parts}
    if len(types) == 1 and types <= set(_NATIVE):
        return np.ascontiguousarray(np.concatenate([raw for raw, _, _ in parts])), types.pop()
    return np.concatenate([quantize_q8_0(chunk, what)[0] for _, _, values in parts for chunk in values()]), Q8_0


def unpermute_rope_rows(num_heads: int, head_dim: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: HF row (h, i, j) is GGUF row (h, j, i).

    (i: which half of the head, j < head_dim / 2.) Whole rows move, so blocks are untouched.
    """
    return np.arange(num_heads * head_dim).reshape(num_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


class GgufWeights:
    """A llama (or qwen2) GGUF file's weights and shape. What the forward would compute wrong or
    from garbage is a ValueError naming the file and what is wrong, before a weight is used: a
    file gguf-py cannot read, a header that lacks a key or gives a shape its tensors do not
    have, a NaN or an infinity (a value, or a block's scale), a model that is no plain Llama."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self._path = path
        try:
            self._reader = GGUFReader(path)
        except Exception as exc:  # noqa: BLE001 - gguf-py's own errors for a bad file: magic, struct, reshape, mmap
            raise ValueError(f"model: {path} is not a readable GGUF file ({type(exc).__name__}: {exc}); is it "
                             "whole?") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = self._config()
        self._check_shapes()

    def _field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        if field is None:
            if default is None:
                raise ValueError(f"{self._path}: its header lacks {key}")
            return default
        value = field.parts[field.data[0]]
        return value.tobytes().decode() if value.dtype == np.uint8 else value[0].item()

    def _number(self, key: str, default=None):
        """A numeric header key (a string there was read as its number; llama.cpp refuses it)."""
        value = self._field(key, default)
        if isinstance(value, str):
            raise ValueError(f"{self._path}: {key} is the string {value!r}, not a number")
        return value

    def _config(self) -> ModelConfig:
        """Its shape from the header; ValueError for what the forward would compute wrong (as
        `ModelConfig.from_hf_dict` refuses it in a config.json): RoPE scaled otherwise than by
        frequency factors (Llama 3's rope_freqs) or linearly, partial RoPE, experts, biases
        other than a Qwen2's or any other tensor a plain Llama has not."""
        arch = self._field("general.architecture")
        if arch not in _ARCH_NAMES:
            raise ValueError(f"{self._path}: architecture {arch!r} is not supported (only llama and qwen2)")
        self._arch, name = arch, _ARCH_NAMES[arch]
        heads = int(self._number(f"{arch}.attention.head_count"))
        hidden = int(self._number(f"{arch}.embedding_length"))
        head_dim = int(self._number(f"{arch}.attention.key_length", hidden // heads))
        scaling = self._field(f"{arch}.rope.scaling.type", "linear")  # (llama.cpp's default: with a factor)
        rope_dims = self._number(f"{arch}.rope.dimension_count", head_dim)
        refused = [
            (scaling not in ("none", "", "linear"), f"RoPE scaling {scaling!r} ({arch}.rope.scaling.type)"),
            (rope_dims != head_dim, f"RoPE on {rope_dims} of {head_dim} dims ({arch}.rope.dimension_count)"),
            (int(self._number(f"{arch}.expert_count", 0)) > 0, f"experts ({arch}.expert_count)"),
        ]
        layers = int(self._number(f"{arch}.block_count"))
        parts = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
        known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"} | {
            f"blk.{i}.{part}.weight" for i in range(layers) for part in parts} | {
            f"blk.{i}.{part}.bias" for i in range(layers) for part in self._biased}
        if extra := sorted(set(self._tensors) - known):
            refused.append((True, f"tensors a plain {name} has not: {extra[:8]}{'...' if len(extra) > 8 else ''}"))
        if reasons := [reason for wrong, reason in refused if wrong]:
            raise ValueError(f"{self._path}: the forward computes a plain {name}, not {'; '.join(reasons)}")
        return ModelConfig(
            vocab_size=int(self._number(f"{arch}.vocab_size", self._tensor("token_embd.weight").shape[1])),
            hidden_size=hidden,
            intermediate_size=int(self._number(f"{arch}.feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(self._number(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(self._number(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self._number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self._number(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in self._tensors,
            rope_freq_factors=self._rope_factors(scaling, head_dim),
            qkv_bias=bool(self._biased),
        )

    @property
    def _biased(self) -> tuple[str, ...]:
        """The projections with biases: a Qwen2's q, k and v."""
        return ("attn_q", "attn_k", "attn_v") if self._arch == "qwen2" else ()

    def _rope_factors(self, scaling: str, head_dim: int) -> tuple[float, ...]:
        """Each RoPE frequency's divisor, as llama.cpp reads them: rope_freqs (Llama 3's scaled
        RoPE, written by its converter), times a linear scaling's factor (1 / freq_scale): the
        header's rope.scaling.factor, or older files' rope.scale_linear, unless the scaling type
        is none (absent: linear, as llama.cpp takes it; a factor of 0: none)."""
        fields, arch = self._reader.fields, self._arch
        key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in fields),
                   f"{arch}.rope.scaling.factor")
        linear = 1.0
        if scaling == "linear":  # a type named linear needs its factor
            linear = float(self._number(key, None if f"{arch}.rope.scaling.type" in fields else 0.0)) or 1.0
        if not 0 < linear < np.inf:
            raise ValueError(f"{self._path}: a linear RoPE scaling factor of {linear} ({key})")
        factors = np.full(head_dim // 2, linear, np.float64)
        if "rope_freqs.weight" in self._tensors:
            freqs = self._vector("rope_freqs.weight")
            if freqs.shape != factors.shape or not (freqs > 0).all():
                raise ValueError(f"{self._path}: rope_freqs.weight holds {freqs.size} factors, not {head_dim // 2} "
                                 f"positive ones (one per RoPE frequency)")
            factors *= freqs
        return () if (factors == 1).all() else tuple(factors.tolist())

    def _check_shapes(self) -> None:
        """Each tensor the forward reads, of the shape its header gives (a wrong one failed deep
        in numpy or the kernels, or read past a vocabulary: QA)."""
        c = self.config
        h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        shapes = {"token_embd.weight": (c.vocab_size, h), "output_norm.weight": (h,),
                  **({} if c.tie_word_embeddings else {"output.weight": (c.vocab_size, h)})}
        for b in (f"blk.{n}." for n in range(c.num_layers)):
            shapes.update({b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,), b + "attn_q.weight": (q, h),
                           b + "attn_k.weight": (kv, h), b + "attn_v.weight": (kv, h), b + "attn_output.weight": (h, q),
                           b + "ffn_gate.weight": (i, h), b + "ffn_up.weight": (i, h), b + "ffn_down.weight": (h, i)})
            shapes.update({f"{b}{part}.bias": (size,) for part, size in zip(self._biased, (q, kv, kv))})
        for name, shape in shapes.items():
            got = tuple(int(n) for n in reversed(self._tensor(name).shape))  # (GGML lists a row's length first)
            if got != shape:
                raise ValueError(f"{self._path}: {name} is {list(got)}, its header ({self._arch}.*) gives "
                                 f"{list(shape)}")

    def end_of_generation_ids(self) -> set[int]:
        """The tokens that end a generation, as llama.cpp takes them from a GGUF (which has no
        generation_config.json): the header's EOS, EOT and EOM ids, and each control token
        whose text ends a turn in a known chat format (a Qwen2.5's <|endoftext|> beside its EOS
        <|im_end|> did not stop it: QA)."""
        ids = {int(self._field(f"tokenizer.ggml.{kind}_token_id", -1)) for kind in ("eos", "eot", "eom")}
        types, tokens = (self._reader.fields.get(f"tokenizer.ggml.{key}") for key in ("token_type", "tokens"))
        if types is not None and tokens is not None:
            for i in np.nonzero(np.array([types.parts[j][0] for j in types.data]) == _CONTROL)[0]:
                if bytes(tokens.parts[tokens.data[i]]).decode(errors="replace") in _END_OF_TURN:
                    ids.add(int(i))
        return ids - {-1}

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise ValueError(f"{self._path}: it lacks the tensor {name}")
        return self._tensors[name]

    def _finite(self, name: str, values: np.ndarray) -> None:
        for chunk in row_chunks(values.reshape(-1), 1 << 24):  # a bounded temporary, however large the tensor
            if not np.isfinite(chunk).all():
                raise ValueError(f"{self._path}: {name} holds a NaN or an infinite value (a broken file)")

    def _part(self, name: str, rows: np.ndarray | None = None) -> tuple[np.ndarray, int, callable]:
        """Its rows (`rows` of them) as the file holds them or re-encoded as a format the
        kernels read, their type, and their values as the file holds them (checked finite), a
        chunk of rows at a time."""
        from gguf import quants

        tensor = self._tensor(name)
        held = tensor.data if rows is None else tensor.data[rows]

        def values() -> Iterator[np.ndarray]:
            for chunk in row_chunks(held):
                floats = quants.dequantize(chunk, tensor.tensor_type).reshape(len(chunk), -1)
                self._finite(name, floats)
                yield floats

        kind = int(tensor.tensor_type)
        if (native := as_native(held, kind)) is not None and np.isfinite(block_scales(*native)).all():
            return *native, values  # (a scale past fp16's range, or a broken one: from the values)
        if kind in _NATIVE:  # passed on as blocks: their scales are what may be broken
            self._finite(name, block_scales(held, kind))
        return held, kind, values

    def _matrix(self, *names: str) -> Matrix:
        return fuse([self._part(n) for n in names], f"{self._path}: {' + '.join(names)}")

    def _vector(self, name: str) -> np.ndarray:
        """A norm's weights in float32, whatever the file holds them as (BF16 bytes were read as
        floats: QA)."""
        from gguf import quants

        tensor = self._tensor(name)
        values = np.ascontiguousarray(quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1), dtype=np.float32)
        self._finite(name, values)
        return values

    def layers(self) -> Iterator[LayerWeights]:
        cfg = self.config
        # llama.cpp's converter permutes a Llama's q and k rows (its RoPE pairs neighbours); a
        # Qwen2's it leaves in transformers' order
        q_rows, k_rows = (unpermute_rope_rows(n, cfg.head_dim) if self._arch == "llama" else None
                          for n in (cfg.num_heads, cfg.num_kv_heads))
        for i in range(cfg.num_layers):
            b = f"blk.{i}."
            yield LayerWeights(
                attn_norm=self._vector(b + "attn_norm.weight"),
                ffn_norm=self._vector(b + "ffn_norm.weight"),
                qkv=fuse([self._part(b + "attn_q.weight", q_rows), self._part(b + "attn_k.weight", k_rows),
                          self._part(b + "attn_v.weight")], f"{self._path}: {b}attn_q/k/v.weight"),
                o=self._matrix(b + "attn_output.weight"),
                gate_up=self._matrix(b + "ffn_gate.weight", b + "ffn_up.weight"),
                down=self._matrix(b + "ffn_down.weight"),
                qkv_bias=(np.concatenate([self._vector(f"{b}{part}.bias") for part in self._biased])
                          if self._biased else None),
            )

    def embedding(self) -> Matrix:
        return self._matrix("token_embd.weight")

    def head(self) -> Matrix | None:
        return None if self.config.tie_word_embeddings else self._matrix("output.weight")

    def final_norm(self) -> np.ndarray:
        return self._vector("output_norm.weight")


class HfWeights:
    """A Hugging Face Llama (or Qwen2) checkpoint directory, quantised to Q8_0 as it is read."""

    def __init__(self, model_dir: Path) -> None:
        from replicas.torch_engine.hf_checkpoint import load_hf_state

        self.config = ModelConfig.from_hf_dir(model_dir)
        self._dir = model_dir
        # as stored (a bf16 checkpoint in fp32 was twice its size, all held at once); a chunk of
        # rows in float32 at a time as it is quantised
        self._state = load_hf_state(model_dir, self.config, None, "cpu")

    def layers(self) -> Iterator[LayerWeights]:
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            yield LayerWeights(
                attn_norm=self._floats(p + "input_layernorm.weight"),
                ffn_norm=self._floats(p + "post_attention_layernorm.weight"),
                qkv=self._quantized(p + "self_attn.qkv_proj.weight"),
                o=self._quantized(p + "self_attn.o_proj.weight"),
                gate_up=self._quantized(p + "mlp.gate_up_proj.weight"),
                down=self._quantized(p + "mlp.down_proj.weight"),
                qkv_bias=self._floats(p + "self_attn.qkv_bias") if self.config.qkv_bias else None,
            )

    def embedding(self) -> Matrix:
        return self._quantized("embed_tokens.weight")

    def head(self) -> Matrix | None:
        return None if self.config.tie_word_embeddings else self._quantized("lm_head.weight")

    def _floats(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self._state[name].float().numpy())

    def _quantized(self, name: str) -> Matrix:
        """Quantised, and let go (the checkpoint is not held whole beside its quantised copy)."""
        return quantize_q8_0(self._state.pop(name), f"{self._dir}: {name}")

    def final_norm(self) -> np.ndarray:
        return self._floats("norm.weight")
