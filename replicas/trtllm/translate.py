"""Our settings -> TensorRT-LLM LLM API arguments. Pure functions over plain data.

Field names are never assumed: every function takes the installed release's field names
(`TrtllmApi.spec_fields()` etc.) and uses what exists, so one adapter serves both the
`sa_config=SAEnhancerConfig(threshold=...)` generation (the pinned 1.3.0rc27) and the
earlier `use_sa_spec=True, sa_spec_threshold=...` one (PR #11434's first form).

Mode mapping (mode is SpeculationConfig.mode; drafter is TrtllmEngineConfig.drafter):
  off               -> no speculative_config
  sa                -> SADecodingConfig(max_draft_len)
  mtp               -> Eagle3DecodingConfig / MTPDecodingConfig (the learned drafter alone)
  hybrid            -> the learned drafter + the SA enhancer: SA's draft replaces the learned
                       one when its match length >= sa_threshold (upstream's SADraftEnhancer)
A request's grammar becomes `SamplingParams.guided_decoding` for upstream's llguidance
backend (`guided_decoding_kwargs`), only where no suffix-automaton draft is verified:
upstream masks the drafts of its learned drafter (MTP / EAGLE-3, two- and one-model engines)
but documents nothing for SA drafts, which its matcher has been reported to refuse.
The batch gate becomes upstream's `max_concurrency` ("speculation off above this many
requests", the same rule as gate.speculate_this_step), or a `draft_len_schedule` whose
largest key is the gate when a taper is configured; a gate at or above max_batch_size
never trips and sets neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from replicas.engine import JSON_LAYOUT, GrammarSpec, SamplingParams, SpeculationConfig
from replicas.trtllm.config import TrtllmEngineConfig

Fields = Mapping[str, frozenset[str]]


class UnsupportedRelease(ValueError):
    """The installed TensorRT-LLM lacks a field this configuration needs."""


@dataclass(frozen=True)
class SpecPlan:
    """How to build `speculative_config`; `config_class` None means no speculation."""

    config_class: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    sa_enhancer: dict[str, Any] | None = None  # SAEnhancerConfig kwargs, set as kwargs["sa_config"]
    source: str = ""  # stats bucket for upstream's draft counts: "sa" | "mtp" | ""
    notes: tuple[str, ...] = ()  # fallbacks worth a log line


def plan_speculation(config: TrtllmEngineConfig, spec: SpeculationConfig, fields: Fields) -> SpecPlan:
    """The speculative_config for `spec` on a release whose config classes have `fields`."""
    if spec.mode == "off" or spec.batch_gate == 0:  # gate 0: never speculate
        return SpecPlan(config_class=None)
    k = spec.max_draft_len
    if spec.mode == "sa":
        name, source = "SADecodingConfig", "sa"
    else:
        name = "Eagle3DecodingConfig" if config.drafter == "eagle3" else "MTPDecodingConfig"
        source = "mtp"  # upstream counts SA overrides inside the learned drafter's numbers
    if name not in fields:
        raise UnsupportedRelease(f"speculation.mode={spec.mode}: this TensorRT-LLM has no {name}")
    have = fields[name]
    kwargs: dict[str, Any] = {"max_draft_len": k}
    sa_enhancer = None
    if name == "Eagle3DecodingConfig":
        if not config.draft_model:
            raise ValueError(f"draft_model: speculation.mode={spec.mode} with the eagle3 drafter needs its head")
        kwargs[_first(have, "speculative_model", "speculative_model_dir")] = config.draft_model
    if config.sa_global_pool and spec.mode == "sa":
        kwargs[_first(have, "enable_global_pool")] = True
    if spec.mode == "hybrid":
        sa_enhancer = _sa_enhancer(config, spec, have, fields, kwargs)
    gate_kwargs, notes = _gate(config, spec, have)
    kwargs.update(gate_kwargs)
    return SpecPlan(name, kwargs, sa_enhancer, source, notes)


def _sa_enhancer(config, spec, have, fields, kwargs) -> dict[str, Any] | None:
    """SA on top of the learned drafter: the newer sa_config object, else the legacy flags."""
    if "sa_config" in have and "SAEnhancerConfig" in fields:
        enhancer = {"threshold": spec.sa_threshold}
        if config.sa_global_pool:
            enhancer[_first(fields["SAEnhancerConfig"], "enable_global_pool")] = True
        return enhancer
    if "use_sa_spec" in have and "sa_spec_threshold" in have:
        if config.sa_global_pool:
            raise UnsupportedRelease("sa_global_pool: this release's use_sa_spec has no global pool")
        kwargs.update(use_sa_spec=True, sa_spec_threshold=spec.sa_threshold)
        return None
    raise UnsupportedRelease(
        "speculation.mode=hybrid needs the suffix-automaton enhancer (sa_config or use_sa_spec); "
        "this TensorRT-LLM has neither"
    )


def _gate(config, spec, have) -> tuple[dict[str, Any], tuple[str, ...]]:
    gate, k = spec.batch_gate, spec.max_draft_len
    if gate >= config.max_batch_size:
        return {}, ()
    notes: tuple[str, ...] = ()
    if config.draft_len_taper:
        if "draft_len_schedule" in have:
            return {"draft_len_schedule": draft_len_schedule(k, gate, config.draft_len_taper)}, ()
        notes = ("draft_len_taper ignored: this release has no draft_len_schedule; using max_concurrency",)
    if "max_concurrency" in have:
        return {"max_concurrency": gate}, notes
    raise UnsupportedRelease(
        f"speculation.batch_gate={gate} < max_batch_size needs max_concurrency, which this release lacks"
    )


def draft_len_schedule(max_draft_len: int, gate: int, taper: tuple[tuple[int, int], ...]) -> dict[int, int]:
    """Upstream's schedule {batch size threshold: draft len} from a taper, cut at the gate.

    Batch sizes above the largest key draft nothing upstream, so the largest key is the gate;
    upstream requires the smallest key to map to max_draft_len.
    """
    entries = sorted((b, min(d, max_draft_len)) for b, d in taper if b <= gate)
    schedule = dict(entries)
    schedule.setdefault(gate, entries[-1][1] if entries else max_draft_len)
    if schedule[min(schedule)] != max_draft_len:
        raise ValueError(f"draft_len_taper: the smallest batch size must draft max_draft_len={max_draft_len}")
    return schedule


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
    for penalty in ("presence_penalty", "frequency_penalty"):
        if getattr(sampling, penalty):
            kwargs[penalty] = getattr(sampling, penalty)
    if "return_perf_metrics" in have:  # per-request speculative_decoding figures
        kwargs["return_perf_metrics"] = True
    return kwargs


def guided_decoding_refusal(config: TrtllmEngineConfig, spec: SpeculationConfig, has_guides: bool) -> str | None:
    """Why this deployment cannot constrain a request's output, or None if it can."""
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
