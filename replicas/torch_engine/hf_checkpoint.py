"""Reading a Hugging Face checkpoint directory into our state dict: HF Llama (and Qwen2) names
-> ours, q|k|v and gate|up fused at load, each tensor checked against config.json's shape and
for a NaN or an infinity."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from replicas.torch_engine.gguf_blocks import row_chunks
from replicas.torch_engine.model_config import ModelConfig

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def read_safetensors_file(path: Path) -> dict[str, Tensor]:
    """The tensors in one safetensors file; ValueError naming it if it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:  # a truncated file, one not there
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def _read_safetensors(model_dir: Path) -> dict[str, Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map): {exc!r}") from None
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickled = [p.name for p in model_dir.glob("pytorch_model*.bin")]
        raise ValueError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json"
                         + (f" ({pickled[0]} is a pickle, which is not read: save the model with safetensors, "
                            "save_pretrained's default)" if pickled else ""))
    raw: dict[str, Tensor] = {}
    for name in files:
        raw.update(read_safetensors_file(model_dir / name))
    return raw


def _hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The shape config.json gives the HF tensor `name` (a Llama's: [out, in])."""
    h, q, kv, i, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,),
              "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
              "gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i),
              "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
    return next(shape for suffix, shape in shapes.items() if name.endswith(suffix))


def _check_tensor(model_dir: Path, name: str, tensor: Tensor, shape: tuple[int, ...]) -> None:
    """ValueError naming a tensor of another shape than config.json gives, or with a NaN or an
    infinity (which made every logit NaN, served as token 0 without an error: QA)."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{model_dir}: {name} has shape {list(tensor.shape)}, config.json gives {list(shape)}")
    for chunk in row_chunks(tensor.reshape(-1), 1 << 24):  # a bounded temporary, however large the tensor
        if not torch.isfinite(chunk).all():
            raise ValueError(f"{model_dir}: {name} holds a NaN or an infinite value (a broken checkpoint)")


def load_hf_state(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype | None,
                   device: str | torch.device) -> dict[str, Tensor]:
    """Our state dict from an HF checkpoint (in `dtype`, None: as stored); ValueError listing
    missing/unexpected keys, or naming a tensor of the wrong shape or not finite. Each stored
    tensor is let go as it is taken: the checkpoint is not held twice (once read, once fused
    or cast)."""
    raw = {k: v for k, v in _read_safetensors(model_dir).items() if not k.endswith(_IGNORED_SUFFIXES)}
    stored = set(raw)
    used: set[str] = set()
    missing: list[str] = []

    def take(*names: str) -> Tensor | None:
        absent = [n for n in names if n not in raw]
        used.update(n for n in names if n in raw)  # a half-present fused group is "missing", not "unexpected"
        if absent:
            missing.extend(absent)
            return None
        for n in names:
            _check_tensor(model_dir, n, raw[n], _hf_shape(n, cfg))
        parts = [raw.pop(n).to(device=device, dtype=dtype) for n in names]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)

    state = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        state[ours + "self_attn.qkv_proj.weight"] = take(*(hf + f"self_attn.{p}_proj.weight" for p in "qkv"))
        if cfg.qkv_bias:
            state[ours + "self_attn.qkv_bias"] = take(*(hf + f"self_attn.{p}_proj.bias" for p in "qkv"))
        state[ours + "self_attn.o_proj.weight"] = take(hf + "self_attn.o_proj.weight")
        state[ours + "mlp.gate_up_proj.weight"] = take(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        state[ours + "mlp.down_proj.weight"] = take(hf + "mlp.down_proj.weight")
        state[ours + "input_layernorm.weight"] = take(hf + "input_layernorm.weight")
        state[ours + "post_attention_layernorm.weight"] = take(hf + "post_attention_layernorm.weight")
    if cfg.tie_word_embeddings:
        used.add("lm_head.weight")  # a tied checkpoint may still store a copy; the embedding wins
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    unexpected = sorted(stored - used)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: checkpoint does not match a {cfg.num_layers}-layer "
                         f"{'Qwen2' if cfg.qkv_bias else 'Llama'}: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    return state
