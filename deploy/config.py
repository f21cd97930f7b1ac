"""Typed arguments of the Serve application: what `deploy.yaml`'s `args:` may say.

Every model forbids unknown keys (Serve's own schema drops them silently), takes no value of
another type (a quoted "8" or YAML's `true` for a number) and is frozen.
Each component is handed its own sub-config: the engine factory gets `EngineArgs`, the
ingress `IngressConfig`. The speculation settings are not here: they are the Replica's
`user_config` (`replicas.engine.SpeculationConfig`), the one way they reach a replica,
at start and live. Importing this never loads torch.
"""

import dataclasses
import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from replicas.engine import DEFAULT_MODEL, SpeculationConfig
from replicas.speculation.affinity import AFFINITY_MAX_EXTRA_LOAD, AFFINITY_PREFIX_CHARS
from replicas.speculation.ranking import GATE_HOLD_MIN_ACCEPTANCE, GATE_HOLD_S


DEFAULT_MAX_TOKENS = 256  # a request's max_tokens when it gives none and the config says nothing


MIN_GLOBAL_POOL_TOKENS, MAX_GLOBAL_POOL_TOKENS = 4, 1 << 29  # the suffix automaton's cross-request pool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class EngineArgs(_Strict):
    """What the replica's engine is built from (the engine factory's whole input)."""

    kind: Literal["torch", "trtllm"] = "torch"
    model: str = DEFAULT_MODEL  # the embedded default, a Llama .gguf file or a checkpoint directory
    max_batch_size: int = Field(8, ge=1)
    max_seq_len: int = Field(4096, ge=16)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int = Field(0, ge=0, description="native forward threads (on CUDA: torch's); 0 = torch's "
                             "default (under Serve: the replica's num_cpus). On CPU, torch's own ops between "
                             "steps run on the engine's thread alone")
    mtp_weights: Optional[str] = "default"  # None disables MTP drafting
    sa_global_pool_tokens: int = Field(1 << 20, ge=0)
    prefix_cache_bytes: int = Field(256 << 20, ge=0, description=(
        "kind=torch: KV blocks kept for prompts that start alike; 0 = off; at least one context window"))
    kv_cache_bytes: int = Field(0, ge=0, description=(
        "kind=torch on CPU: KV pages the running requests and the prefix cache share; 0 = every slot's whole "
        "window; at least one context window. Short of pages, the newest requests wait and resume exactly"))
    max_prefill_tokens: int = Field(512, ge=1, description=(
        "kind=torch: context positions one engine step prefills; a longer prompt goes in over several steps"))
    @field_validator("sa_global_pool_tokens")
    @classmethod
    def _global_pool(cls, tokens: int) -> int:  # the native pool's range, checked before a replica starts
        if tokens != 0 and not MIN_GLOBAL_POOL_TOKENS <= tokens <= MAX_GLOBAL_POOL_TOKENS:
            raise ValueError(f"must be 0 (off) or in [{MIN_GLOBAL_POOL_TOKENS}, {MAX_GLOBAL_POOL_TOKENS}], got {tokens}")
        return tokens

    @field_validator("model")
    @classmethod
    def _model(cls, model: str, info: ValidationInfo) -> str:  # a typo of the default failed only at start
        # (TensorRT-LLM also takes a Hub id, which may have no "/")
        if (info.data.get("kind") == "torch" and model != DEFAULT_MODEL and "/" not in model
                and not os.path.exists(os.path.expanduser(model))):
            raise ValueError(f"{model!r} is neither {DEFAULT_MODEL!r} nor a path to a .gguf file or a checkpoint "
                             "directory")
        return model

    # kind=trtllm only: TrtllmEngineConfig fields beyond the shared ones (drafter, draft_model,
    # tensor_parallel_size, ...); checked by building the real config in AppArgs below
    trtllm: Optional[dict[str, Any]] = None

    @property
    def identity(self) -> str:
        """The model (and tokenizer, where another is named) a prompt is tokenized for, paths
        normalised: a Replica of another identity refuses it. A deploy that changes the model
        rolls the Ingress and the Replicas separately, so for a while a new Ingress sends to old
        Replicas (or the reverse). New weights written over the same path keep the identity."""
        model = os.path.normpath(os.path.expanduser(self.model))
        tokenizer = (self.trtllm or {}).get("tokenizer")
        tokenizer = os.path.normpath(os.path.expanduser(tokenizer)) if isinstance(tokenizer, str) else model
        return model if tokenizer == model else f"{model} (tokenizer {tokenizer})"

    def trtllm_config(self, speculation: SpeculationConfig):
        """The TrtllmEngineConfig these args describe (raises ValueError naming a bad field)."""
        from replicas.trtllm.config import TrtllmEngineConfig

        # set under trtllm, these were dropped (speculation) or took the engine's alone, the
        # served name, Serve's defaults and the edge limits keeping the engine-level ones
        given, elsewhere = set(self.trtllm or {}), {*SHARED_ENGINE_KEYS, "speculation"}
        if given & elsewhere:
            raise ValueError(f"engine.trtllm: {sorted(given & elsewhere)} are set beside it (engine.<key>; "
                             "speculation in the Replica's user_config), not under it")
        under = {f.name for f in dataclasses.fields(TrtllmEngineConfig)} - elsewhere
        if given - under:
            raise ValueError(f"engine.trtllm: unknown keys {sorted(given - under)}; known: {sorted(under)}")
        try:
            return TrtllmEngineConfig.from_mapping({
                **{key: getattr(self, key) for key in SHARED_ENGINE_KEYS}, **(self.trtllm or {}),
                "speculation": speculation,
            })
        except ValueError as exc:  # "field: ..." -> "engine.trtllm.field: ..." (the engine-level ones: engine.field)
            field, _, message = str(exc).partition(": ")
            where = "engine" if field in (*SHARED_ENGINE_KEYS, "trtllm") else "engine.trtllm"
            raise ValueError(f"{where}.{field}: {message}") from None


# EngineArgs' fields TensorRT-LLM's config takes from beside its `trtllm` block.
SHARED_ENGINE_KEYS = ("model", "max_batch_size", "max_seq_len")
# EngineArgs' fields that only the embedded engine reads: set with kind trtllm, an error.
TORCH_ONLY = frozenset({"device", "num_threads", "mtp_weights", "sa_global_pool_tokens", "prefix_cache_bytes",
                        "kv_cache_bytes", "max_prefill_tokens"})


class LimitArgs(_Strict):
    """Edge limits, checked by the ingress before any work is queued."""

    max_body_bytes: int = Field(1 << 20, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0, description=(
        "longest a request's body may take to arrive (then a 408): one that waits for its body "
        "holds an Ingress request slot"))
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="default: max_seq_len - 1")
    max_tokens: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: Optional[int] = Field(None, ge=1, description=(
        f"when a request gives none; default: {DEFAULT_MAX_TOKENS}, or max_tokens where that is lower"))
    stream_idle_timeout_s: float = Field(300.0, gt=0, description=(
        "longest wait for a request's next token once it has one (before, it may be waiting "
        "for a batch slot, as one sent back for KV pages waits again; a stalled engine fails its "
        "health check)"))
    replica_loss_retry_s: float = Field(30.0, ge=0, description=(
        "a request whose replica dies is sent again, to any replica, for up to this long: whole "
        "before its first token, as a continuation after it (0: never)"))
    stored_responses: int = Field(1024, ge=0, description=(
        "/v1/responses: the most finished responses (store=true) kept in memory (the ResponseStore "
        "deployment, on the head node) for previous_response_id and GET /v1/responses/{id}; the oldest go first "
        "(0: none kept)"))

    @field_validator("default_max_tokens")
    @classmethod
    def _default_within_limit(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        limit = info.data.get("max_tokens")  # absent where it failed its own check
        if value is not None and limit is not None and value > limit:
            raise ValueError(f"{value} is over max_tokens ({limit}), the most a request may ask for")
        return value

    @property
    def request_default_max_tokens(self) -> int:
        return self.default_max_tokens or min(DEFAULT_MAX_TOKENS, self.max_tokens)


class ReplicaArgs(_Strict):
    """Serve options of the engine deployment."""

    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: Optional[int] = Field(None, ge=1, description="default: 2 x max_batch_size")
    max_queued_requests: int = Field(64, ge=1, description="past this, 503 + Retry-After")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(60.0, gt=0)
    gate_router: bool = True  # the speculation-gate router; False = power-of-two choices (Serve's default rule)
    routing_stats_period_s: float = Field(1.0, gt=0)
    gate_hold_s: float = Field(GATE_HOLD_S, ge=0, description=(
        "gate router: longest a request waits for a slot under a batch gate rather than tip a "
        "speculating replica over it (0: never wait)"))
    gate_hold_min_acceptance: float = Field(GATE_HOLD_MIN_ACCEPTANCE, ge=1, description=(
        "gate router: hold only while the replicas' acceptance length averages at least this"))
    prefix_affinity_chars: int = Field(AFFINITY_PREFIX_CHARS, ge=0, description=(
        "gate router: prompts that share their first this many characters go to the same replica "
        "(its prefix cache), unless that one is over its gate or busier; 0: no affinity"))
    prefix_affinity_max_extra_load: int = Field(AFFINITY_MAX_EXTRA_LOAD, ge=0, description=(
        "gate router: requests the prefix's replica may hold beyond the least loaded one"))
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0, description=(
        "a Replica being stopped (scale-down, node drain, redeploy) takes no new requests and "
        "finishes its own for up to this long; the rest are killed with it and resumed on another "
        "Replica (limits.replica_loss_retry_s)"))


class AppArgs(_Strict):
    """`build_app`'s whole input."""

    engine: EngineArgs = EngineArgs()
    served_model_name: Optional[str] = None  # default: the engine's model name
    limits: LimitArgs = LimitArgs()
    replica: ReplicaArgs = ReplicaArgs()
    ingress_replicas: int = Field(1, ge=1)
    ingress_placement: Literal["head", "any"] = Field("head", description=(
        "head: every Ingress replica on the Ray head node, beside the head's proxy and Serve's "
        "controller, so a worker node's death never cuts a stream held elsewhere (a proxy on "
        "any node reaches them); any: wherever Ray places them"))
    api_keys_env: str = Field("SPECSERVE_API_KEYS", min_length=1,
                              description="env var with comma-separated bearer tokens; unset = open")

    @model_validator(mode="after")
    def _engine_builds(self) -> "AppArgs":
        if self.engine.kind != "trtllm":
            if self.engine.trtllm is not None:
                raise ValueError("engine.trtllm: only with engine.kind trtllm")
            return self
        ignored = sorted(self.engine.model_fields_set & TORCH_ONLY)
        if ignored:
            raise ValueError(f"engine: {ignored} are the embedded engine's (kind torch); TensorRT-LLM ignores them")
        if self.replica.num_gpus <= 0:
            raise ValueError("replica.num_gpus: a TensorRT-LLM replica needs a GPU (1 per tensor-parallel rank)")
        # The real config's own validation of the engine's fields. The speculation settings
        # arrive with user_config: "off" asks nothing of them here, and deploy.config_check
        # builds the config again with the file's own.
        self.engine.trtllm_config(SpeculationConfig(mode="off"))
        return self

    @model_validator(mode="after")
    def _limits_fit(self) -> "AppArgs":
        prompt_limit = self.limits.max_prompt_tokens
        if prompt_limit is not None and prompt_limit >= self.engine.max_seq_len:
            raise ValueError(f"limits.max_prompt_tokens: must be < engine.max_seq_len ({self.engine.max_seq_len})")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model


class IngressConfig(_Strict):
    """What the ingress needs: names and limits, never the engine itself."""

    model_name: str
    model_identity: Optional[str]  # EngineArgs.identity: what its prompts are tokenized for (None: unchecked)
    max_seq_len: int
    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int
    max_body_bytes: int
    body_timeout_s: float
    stream_idle_timeout_s: float
    replica_loss_retry_s: float
    api_keys_env: str
    stored_responses: int

    @classmethod
    def from_args(cls, args: AppArgs) -> "IngressConfig":
        limits = args.limits
        return cls(
            model_name=args.model_name,
            model_identity=args.engine.identity,
            max_seq_len=args.engine.max_seq_len,
            max_prompt_tokens=limits.max_prompt_tokens or args.engine.max_seq_len - 1,
            max_tokens=limits.max_tokens,
            default_max_tokens=limits.request_default_max_tokens,
            max_body_bytes=limits.max_body_bytes,
            body_timeout_s=limits.body_timeout_s,
            stream_idle_timeout_s=limits.stream_idle_timeout_s,
            replica_loss_retry_s=limits.replica_loss_retry_s,
            api_keys_env=args.api_keys_env,
            stored_responses=limits.stored_responses,
        )
