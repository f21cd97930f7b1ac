"""Our settings -> TensorRT-LLM LLM API arguments. Pure functions over plain data.

Field names are never assumed: every function takes the installed release's field names
(`TrtllmApi.spec_fields()` etc.) and uses what exists, or raises UnsupportedRelease.

Mode mapping (mode is SpeculationConfig.mode; drafter is TrtllmEngineConfig.drafter):
  off               -> no speculative_config
  sa                -> SADecodingConfig(max_draft_len)
  mtp               -> Eagle3DecodingConfig / MTPDecodingConfig (the learned drafter alone)
  hybrid            -> the learned drafter + sa_config=SAEnhancerConfig(threshold): SA's draft
                       replaces the learned one when its match length >= sa_threshold
                       (upstream's SADraftEnhancer, _torch/speculative/sa_enhancer.py)
The batch gate becomes what upstream really applies for that mode (`replicas/trtllm/gate.py`):
a cut-off for EAGLE-3 alone, a schedule floored at one draft token with the SA enhancer,
nothing for MTP and standalone SA; the plan says which gate is in force.
A request's grammar becomes `SamplingParams.guided_decoding` for upstream's llguidance
backend (`guided_decoding_kwargs`), only where no suffix-automaton draft is verified:
upstream masks the drafts of its learned drafter (MTP / EAGLE-3, two- and one-model engines)
but documents nothing for SA drafts, which its matcher has been reported to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from replicas.engine import JSON_LAYOUT, GrammarSpec, RequestError, SamplingParams, SpeculationConfig
from replicas.speculation.gate import gates_by_batch, speculate_this_step
from replicas.stats import NOT_GATED
from replicas.trtllm.api import UnsupportedRelease
from replicas.trtllm.config import TrtllmEngineConfig
from replicas.trtllm.gate import plan_gate

Fields = Mapping[str, frozenset[str]]

SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


@dataclass(frozen=True)
class SpecPlan:
    """How to build `speculative_config`; `config_class` None means no speculation."""

    config_class: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    sa_enhancer: dict[str, Any] | None = None  # SAEnhancerConfig kwargs, set as kwargs["sa_config"]
    source: str = ""  # stats bucket for upstream's draft counts: "sa" | "mtp" | ""
    batch_gate: int = NOT_GATED  # the gate the built engine applies (replicas/trtllm/gate.py)
    notes: tuple[str, ...] = ()  # settings upstream will not apply as asked, for a log line

    def speculates_at(self, batch_size: int) -> bool:
        """Does a step over `batch_size` requests draft, in the engine this plan builds?"""
        if self.config_class is None:
            return False
        return not gates_by_batch(self.batch_gate) or speculate_this_step(batch_size, self.batch_gate)


def plan_speculation(config: TrtllmEngineConfig, spec: SpeculationConfig, fields: Fields) -> SpecPlan:
    """The speculative_config for `spec` on a release whose config classes have `fields`."""
    if spec.mode == "off" or spec.batch_gate == 0:  # gate 0: never speculate
        return SpecPlan(config_class=None)
    if spec.mode == "sa":
        name, source = "SADecodingConfig", "sa"
    else:
        name = "Eagle3DecodingConfig" if config.drafter == "eagle3" else "MTPDecodingConfig"
        source = "mtp"  # upstream counts SA overrides inside the learned drafter's numbers
    if name not in fields:
        raise UnsupportedRelease(f"speculation.mode={spec.mode}: this TensorRT-LLM has no {name}")
    have = fields[name]
    kwargs: dict[str, Any] = {"max_draft_len": spec.max_draft_len}
    if name == "Eagle3DecodingConfig":
        if not config.draft_model:
            raise ValueError(f"draft_model: speculation.mode={spec.mode} with the eagle3 drafter needs its head")
        kwargs[_first(have, "speculative_model", "speculative_model_dir")] = config.draft_model
    if config.sa_global_pool and spec.mode == "sa":
        kwargs[_first(have, "enable_global_pool")] = True
    if "enable_penalty" in have:  # off, a release that has it refuses every penalised request at admission
        kwargs["enable_penalty"] = True
    sa_enhancer = _sa_enhancer(config, spec, have, fields) if spec.mode == "hybrid" else None
    gate = plan_gate(config, spec, name, have)
    return SpecPlan(name, kwargs | gate.kwargs, sa_enhancer, source, gate.batch_gate, gate.notes)


def _sa_enhancer(config, spec, have, fields) -> dict[str, Any]:
    """SAEnhancerConfig kwargs: SA on top of the learned drafter."""
    if "sa_config" not in have or "SAEnhancerConfig" not in fields:
        raise UnsupportedRelease("speculation.mode=hybrid needs the suffix-automaton enhancer "
                                 "(sa_config=SAEnhancerConfig); this TensorRT-LLM has none")
    enhancer = {"threshold": spec.sa_threshold}
    if config.sa_global_pool:
        enhancer[_first(fields["SAEnhancerConfig"], "enable_global_pool")] = True
    return enhancer


def worker_env(config: TrtllmEngineConfig) -> dict[str, str]:
    """Environment the replica's process needs before the LLM is built.

    At TP=1 upstream's `GenerationExecutor.create` (tensorrt_llm/executor/executor.py) puts
    the GPU worker behind a proxy with `mpi_session=None`, and the proxy (executor/proxy.py)
    then spawns it through `MpiPoolSession(n_workers=1)`: mpi4py's spawn, which from a process
    not launched by mpirun (a Serve replica) is reported to die with MPI_ERR_SPAWN or hang.
    `TLLM_WORKER_USE_SINGLE_PROCESS=1` makes create() build the worker in this process
    instead (llmapi/utils.py `enable_worker_single_process_for_tp1`, read once and cached;
    upstream warns it "may hurt streaming generation performance"). TP>1 goes through Ray.
    """
    if config.tensor_parallel_size == 1 and config.orchestrator == "mpi":
        return {SINGLE_PROCESS_ENV: "1"}
    return {}


def _first(have: frozenset[str], *names: str) -> str:
    for name in names:
        if name in have:
            return name
    raise UnsupportedRelease(f"this TensorRT-LLM config has none of the fields {names}")


def sampling_kwargs(sampling: SamplingParams, have: frozenset[str]) -> dict[str, Any]:
    """tensorrt_llm.SamplingParams kwargs for our SamplingParams."""
    kwargs: dict[str, Any] = {"max_tokens": sampling.max_tokens}
    if sampling.temperature == 0:
        # Upstream decodes greedily when top_k is None or 1 and top_p is None or 0
        # (SamplingParams._greedy_decoding); temperature itself must stay > 0 or unset.
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = sampling.temperature
        if sampling.top_p < 1:
            kwargs["top_p"] = sampling.top_p
        if sampling.top_k:
            kwargs["top_k"] = sampling.top_k
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed
    if sampling.stop:
        kwargs["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        kwargs["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        kwargs["ignore_eos"] = True
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                      ("min_p", 0.0), ("min_tokens", 0)):
        if getattr(sampling, name) != off:
            if name not in have:
                raise RequestError(name, "this TensorRT-LLM release's SamplingParams has no such setting")
            kwargs[name] = getattr(sampling, name)
    if "return_perf_metrics" in have:  # per-request speculative_decoding figures
        kwargs["return_perf_metrics"] = True
    return kwargs


def guided_decoding_refusal(config: TrtllmEngineConfig, spec: SpeculationConfig, has_guides: bool,
                            grammar: GrammarSpec) -> str | None:
    """Why this deployment cannot constrain a request's output, or None if it can."""
    if grammar.prefix:  # upstream's guide holds the output alone
        return "the TensorRT-LLM engine cannot hold a prefilled answer to a format (the embedded engine can)"
    if config.guided_decoding_backend == "none" or not has_guides:
        return "this TensorRT-LLM deployment has no guided decoding (guided_decoding_backend: none, or a release without it)"
    if spec.mode in ("sa", "hybrid") and spec.batch_gate > 0:
        return (f"TensorRT-LLM constrains its learned drafter's tokens but not its suffix-automaton drafts "
                f"(speculation mode {spec.mode}); serve constrained output with mode mtp or off")
    return None


def guided_decoding_kwargs(grammar: GrammarSpec) -> dict[str, Any]:
    """GuidedDecodingParams kwargs for upstream's llguidance backend: our JSON layout rides in
    the schema's `x-guidance`, and a Lark grammar goes as `grammar` (llguidance reads Lark)."""
    if grammar.kind == "lark":
        return {"grammar": grammar.text}
    return {"json": {**grammar.schema(), "x-guidance": JSON_LAYOUT}}


def kv_cache_kwargs(config: TrtllmEngineConfig, have: frozenset[str]) -> dict[str, Any]:
    """KvCacheConfig kwargs; `have` is its fields. Block reuse is always passed, on or off:
    upstream's default has changed (True in the LLM API's KvCacheConfig, llmapi/llm_args.py;
    false in the older executor API's `enableBlockReuse`)."""
    kwargs = {"free_gpu_memory_fraction": config.free_gpu_memory_fraction,
              "enable_block_reuse": config.enable_block_reuse}
    missing = sorted(k for k in kwargs if k not in have)
    if missing:
        raise UnsupportedRelease(f"this TensorRT-LLM's KvCacheConfig has no {missing}")
    return kwargs


def llm_kwargs(config: TrtllmEngineConfig, have: frozenset[str]) -> dict[str, Any]:
    """LLM(...) scalar kwargs; `have` is TorchLlmArgs' fields (empty: trust the core set)."""
    kwargs: dict[str, Any] = {
        "model": config.model,
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "max_seq_len": config.max_seq_len,
        "enable_iter_perf_stats": True,  # get_stats_async rows, our live stats
    }
    if config.max_num_tokens < config.max_seq_len:
        # upstream's PyTorch backend refuses a prompt over max_num_tokens unless prefills go in
        # chunks (llmapi/llm.py, _check_arguments): one the window admits failed mid-request
        kwargs["enable_chunked_prefill"] = True
    if config.tokenizer:
        kwargs["tokenizer"] = config.tokenizer
    if config.orchestrator == "ray":
        if have and "orchestrator_type" not in have:
            raise UnsupportedRelease("orchestrator=ray: this TensorRT-LLM has no orchestrator_type")
        kwargs["orchestrator_type"] = "ray"
    if "return_perf_metrics" in have:
        kwargs["return_perf_metrics"] = True
    if config.guided_decoding_backend != "none":
        kwargs["guided_decoding_backend"] = config.guided_decoding_backend
    missing = sorted(k for k in kwargs if have and k not in have)
    if missing:
        raise UnsupportedRelease(f"this TensorRT-LLM's LLM has no {missing}")
    return kwargs
