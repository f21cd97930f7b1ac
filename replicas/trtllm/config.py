"""TrtllmEngineConfig: what one TensorRT-LLM replica is built with. Validated at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from replicas.engine import SpeculationConfig

Drafter = Literal["eagle3", "mtp"]
Orchestrator = Literal["mpi", "ray"]
GuidedBackend = Literal["llguidance", "none"]


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


# The fields' annotations (strings: postponed) and the types their values must have.
_FIELD_KINDS = {"str": (str,), "str | None": (str, type(None)), "int": (int,), "float": (int, float),
                "bool": (bool,)}


@dataclass(frozen=True)
class TrtllmEngineConfig:
    """One TensorRT-LLM `LLM` per replica.

    `drafter` is the neural drafter behind modes `hybrid` and `mtp` (our mode name for
    "learned drafter only"): `eagle3` needs `draft_model` (an EAGLE-3 head such as
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B); `mtp` uses the target checkpoint's own MTP layers.
    """

    model: str  # HF id or local path of the target model
    drafter: Drafter = "eagle3"
    draft_model: str | None = None  # EAGLE-3 head; required when drafter == "eagle3"
    tokenizer: str | None = None  # default: the model's own
    tensor_parallel_size: int = 1
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: int = 8192
    free_gpu_memory_fraction: float = 0.85  # KV cache share of the GPU memory left after weights
    # Upstream's prefix cache: a prompt reuses the KV blocks of an earlier one with the same
    # prefix (KvCacheConfig.enable_block_reuse); off recomputes every prompt in full.
    enable_block_reuse: bool = True
    cuda_graphs: bool = True  # capture decode CUDA graphs up to max_batch_size (padded)
    sa_global_pool: bool = False  # SA searches every live request's automaton, not only its own
    # Optional taper below the batch gate, upstream's `draft_len_schedule` format:
    # ((batch_size, draft_len), ...) = "up to batch_size requests draft draft_len tokens".
    draft_len_taper: tuple[tuple[int, int], ...] = ()
    # How upstream places its GPU workers, fixed by tensor_parallel_size inside a Serve replica:
    # "mpi" (upstream's default executor) at TP=1, where the adapter keeps the one worker in
    # the replica's process (translate.worker_env: an MPI spawn from a replica fails);
    # "ray" (upstream's Ray orchestrator, a prototype) for TP>1, one GPU actor per rank.
    orchestrator: Orchestrator = "mpi"
    # upstream's grammar engine for response_format and forced tool calls: llguidance, which
    # reads our Lark grammars and JSON layout as the CPU engine does; "none" refuses them
    guided_decoding_backend: GuidedBackend = "llguidance"
    stats_timeout_s: float = 2.0  # get_stats_async timeout; a stats read ends after this idle
    stats_poll_interval_s: float = 0.5
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # YAML's "false" or "0.85" is a str: truthy, or no number
            kinds = _FIELD_KINDS.get(f.type)
            value = getattr(self, f.name)
            if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
                raise ValueError(f"{f.name}: must be {f.type}, got {value!r}")
        _require(bool(self.model), "model", "must be a model id or path")
        _require(self.drafter in ("eagle3", "mtp"), "drafter", f"must be eagle3 or mtp, got {self.drafter!r}")
        _require(
            self.drafter != "eagle3" or self.speculation.mode in ("sa", "off") or bool(self.draft_model),
            "draft_model", "an EAGLE-3 drafter needs its head (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)",
        )
        for name in ("tensor_parallel_size", "max_batch_size", "max_num_tokens", "max_seq_len"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(0 < self.free_gpu_memory_fraction < 1, "free_gpu_memory_fraction",
                 f"must be in (0, 1), got {self.free_gpu_memory_fraction}")
        _require(self.orchestrator in ("mpi", "ray"), "orchestrator", f"must be mpi or ray, got {self.orchestrator!r}")
        _require(self.orchestrator == ("mpi" if self.tensor_parallel_size == 1 else "ray"), "orchestrator",
                 "must be mpi at tensor_parallel_size 1 (ray's worker would ask Ray for the GPU the replica "
                 "already holds) and ray above it (mpi would spawn MPI ranks from the replica: MPI_ERR_SPAWN), "
                 f"got {self.orchestrator} at {self.tensor_parallel_size}")
        _require(self.guided_decoding_backend in ("llguidance", "none"), "guided_decoding_backend",
                 f"must be llguidance or none, got {self.guided_decoding_backend!r}")
        _require(self.stats_timeout_s > 0 and self.stats_poll_interval_s > 0, "stats_timeout_s",
                 "stats timeout and poll interval must be > 0")
        for pair in self.draft_len_taper:
            _require(len(pair) == 2 and pair[0] >= 1 and pair[1] >= 0, "draft_len_taper",
                     f"entries are (batch_size >= 1, draft_len >= 0), got {pair!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TrtllmEngineConfig":
        """Build from plain data (a Serve arg); unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        _require(not unknown, "trtllm", f"unknown keys {unknown}; known: {sorted(known)}")
        data = dict(values)
        if isinstance(data.get("speculation"), Mapping):
            data["speculation"] = SpeculationConfig(**data["speculation"])
        if "draft_len_taper" in data:
            taper = data["draft_len_taper"]
            pairs = isinstance(taper, (list, tuple)) and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(type(v) is int for v in p) for p in taper)
            _require(pairs, "draft_len_taper", f"a list of [batch_size, draft_len] integer pairs, got {taper!r}")
            data["draft_len_taper"] = tuple(tuple(p) for p in taper)
        return cls(**data)
