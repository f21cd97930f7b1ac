"""The shape of a Llama-architecture model (a Llama, or a Qwen2: a Llama whose q, k and v
projections have biases), read from a Hugging Face `config.json`.

Only what the lean forward needs. Anything our forward would silently compute wrong
(another architecture, scaling RoPE otherwise than by frequency, other biases, a non-SiLU
MLP, sliding windows) is rejected here, at the edge, with a ValueError naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# model_type -> (its architectures, whether q, k and v have biases)
_ARCHS = {"llama": (("LlamaForCausalLM",), False), "qwen2": (("Qwen2ForCausalLM",), True)}
# config.json keys with no default
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _reject(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and constants of a Llama decoder (all sizes in elements, not bytes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # A scaled RoPE (Llama 3's, linear): frequency i of each head is divided by factor i, as
    # llama.cpp reads a GGUF's rope_freqs; () for plain RoPE.
    rope_freq_factors: tuple[float, ...] = ()
    qkv_bias: bool = False  # Qwen2's: added to q, k and v before RoPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in self.rope_freq_factors))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _reject(getattr(self, name) >= 1, f"{name}: must be >= 1, got {getattr(self, name)}")
        _reject(self.num_heads % self.num_kv_heads == 0,
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _reject(self.head_dim % 2 == 0, f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        _reject(self.rope_theta > 0, f"rope_theta: must be > 0, got {self.rope_theta}")
        _reject(self.rms_norm_eps > 0, f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        factors = self.rope_freq_factors
        _reject(not factors or (len(factors) == self.head_dim // 2 and all(0 < f < math.inf for f in factors)),
                f"rope_freq_factors: {self.head_dim // 2} positive finite factors (one per frequency), got "
                f"{len(factors)}{'' if all(0 < f < math.inf for f in factors) else ', not all positive and finite'}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        """Read `path/config.json`; ValueError for anything but a plain Llama."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{path}: no config.json")
        try:
            raw = json.loads(config_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_path}: not a JSON document ({exc})") from None
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "ModelConfig":
        _reject(isinstance(raw, dict), f"config.json: an object expected, got {type(raw).__name__}")
        # Converted GGUFs carry architectures=null, so model_type is the primary check; before
        # the keys a Llama needs (a GPT-2 lacks them: its architecture is what is wrong)
        archs = raw.get("architectures") or []
        named = {arch: kind for kind, (names, _) in _ARCHS.items() for arch in names}
        kind = raw.get("model_type") if raw.get("model_type") in _ARCHS else next(
            (named[a] for a in archs if a in named), None)
        _reject(kind is not None, f"unsupported architecture: model_type={raw.get('model_type')!r}, "
                                  f"architectures={archs} (only Llama's and Qwen2's)")
        _reject(all(named.get(a) == kind for a in archs),
                f"unsupported architectures {archs}: only {list(_ARCHS[kind][0])} for model_type {kind!r}")
        missing = [key for key in _REQUIRED if key not in raw]
        _reject(not missing, f"config.json: {', '.join(missing)} missing")
        # transformers' ACT2FN runs "swish" as SiLU too
        _reject(raw.get("hidden_act", "silu") in ("silu", "swish"),
                f"hidden_act: only 'silu' (or 'swish'), got {raw.get('hidden_act')!r}")
        _reject(not raw.get("attention_bias", False), "attention_bias: biased projections are not supported")
        _reject(not raw.get("mlp_bias", False), "mlp_bias: biased MLP is not supported")
        _reject(raw.get("pretraining_tp", 1) == 1, "pretraining_tp: only 1 is supported")
        # transformers computes each layer's attention as layer_types says, where a config has
        # them (use_sliding_window with max_window_layers past the last layer: all full)
        if layer_types := raw.get("layer_types"):
            _reject(all(t == "full_attention" for t in layer_types),
                    f"layer_types: only full attention is supported, got {sorted(set(layer_types))}")
        else:
            _reject(not raw.get("use_sliding_window", False),
                    "use_sliding_window: sliding-window attention is not supported")

        # transformers 5 moved rope settings into rope_parameters; 4.x had rope_theta and
        # rope_scaling at the top level. Accept both. Each is read: one naming a scaling applies
        # whatever the other says (transformers reads rope_scaling's over a default
        # rope_parameters); two naming different ones are refused.
        rope = dict(raw.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scalings = [(key, settings)
                    for key, settings in (("rope_parameters", rope), ("rope_scaling", raw.get("rope_scaling") or {}))
                    if (settings.get("rope_type", settings.get("type")) or "default") != "default"]
        _reject(len(scalings) < 2 or scalings[0][1] == scalings[1][1],
                "rope_parameters and rope_scaling name different RoPE scalings")
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        factors = _rope_factors(*scalings[-1], head_dim, rope_theta) if scalings else ()
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_freq_factors=factors,
            qkv_bias=_ARCHS[kind][1],
        )


def _rope_factors(key: str, settings: dict, head_dim: int, theta: float) -> tuple[float, ...]:
    """Each RoPE frequency's divisor under a config's scaling (`key` names where it was found):
    'linear' divides every frequency by `factor`; 'llama3' (Llama 3.1-3.3's) divides the low
    ones by `factor`, leaves the high ones and blends between, as transformers computes it and
    llama.cpp's converter writes it to a GGUF's rope_freqs. Others (yarn, dynamic, longrope
    scale attention too, or by the sequence's length) are refused."""
    kind = settings.get("rope_type", settings.get("type"))
    _reject(kind in ("linear", "llama3"),
            f"{key}: rope scaling {kind!r} is not supported (only 'default', 'linear' and 'llama3')")
    needed = ("factor",) + (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                            if kind == "llama3" else ())
    values = {}
    for name in needed:
        value = settings.get(name)
        _reject(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf,
                f"{key}.{name}: a positive number for {kind!r} RoPE scaling, got {value!r}")
        values[name] = float(value)
    factor = values["factor"]
    if kind == "linear":
        return (factor,) * (head_dim // 2)
    low, high = values["low_freq_factor"], values["high_freq_factor"]
    context = values["original_max_position_embeddings"]
    _reject(high > low, f"{key}: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)
