"""Fake `tensorrt_llm.llmapi` config classes: the real names, fields and strictness.

Mirrors the pinned 1.3.0rc27 signatures (nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/
reference/{MTP,Eagle3,SA}DecodingConfig, SAEnhancerConfig, DecodeCudaGraphConfig) and
DecodingBaseConfig's validators in tensorrt_llm/llmapi/llm_args.py: every model forbids
unknown fields (upstream's StrictBaseModel), max_concurrency and draft_len_schedule are
mutually exclusive, and a schedule's smallest key must map to max_draft_len.

Two generations of the suffix-automaton fields:
  "sa_config"   - sa_config: SAEnhancerConfig(threshold, enable_global_pool)   (1.3.0rc27)
  "use_sa_spec" - use_sa_spec: bool, sa_spec_threshold: int on the config       (PR #11434)
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Literal, Optional, Set, Union

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, create_model, model_validator

GENERATIONS = ("sa_config", "use_sa_spec")


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class SAEnhancerConfig(StrictBaseModel):
    threshold: PositiveInt = 4
    enable_global_pool: bool = False


class DecodingBaseConfig(StrictBaseModel):
    max_draft_len: Optional[NonNegativeInt] = None
    max_total_draft_tokens: Optional[int] = None
    speculative_model: Optional[Union[str, Path]] = None
    max_concurrency: Optional[PositiveInt] = None
    draft_len_schedule: Optional[Dict[int, int]] = None
    load_format: Optional[str] = None
    acceptance_rate_window_size: Optional[NonNegativeInt] = None
    acceptance_rate_threshold: Optional[float] = None
    use_rejection_sampling: bool = False
    allow_advanced_sampling: bool = False
    enable_penalty: bool = False

    @model_validator(mode="after")
    def _check_schedule(self):
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive.")
        schedule = self.draft_len_schedule
        if schedule:
            if any(b < 1 or d < 0 for b, d in schedule.items()):
                raise ValueError("draft_len_schedule: batch sizes >= 1, draft lengths >= 0")
            if self.max_draft_len is not None:
                if schedule[min(schedule)] != self.max_draft_len:
                    raise ValueError("draft_len_schedule[smallest] must equal max_draft_len")
                if max(schedule.values()) > self.max_draft_len:
                    raise ValueError("draft_len_schedule: all draft lengths must be <= max_draft_len")
        return self


class _Eagle3(DecodingBaseConfig):
    decoding_type: Literal["Eagle3"] = "Eagle3"
    eagle_choices: Optional[List[List[int]]] = None
    use_dynamic_tree: Optional[bool] = False
    dynamic_tree_max_topK: Optional[int] = None
    num_eagle_layers: Optional[int] = None
    max_non_leaves_per_layer: Optional[int] = None
    eagle3_layers_to_capture: Optional[Set[int]] = None
    eagle3_model_arch: Literal["llama3", "mistral_large3"] = "llama3"

    @model_validator(mode="after")
    def _check_eagle(self):
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for Eagle")
        if self.speculative_model is None:
            raise ValueError("Draft model must be provided for EAGLE")
        return self


class _MTP(DecodingBaseConfig):
    decoding_type: Literal["MTP"] = "MTP"
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: PositiveInt = 1
    relaxed_delta: float = 0.0
    use_mtp_vanilla: bool = False
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: Optional[int] = None
    num_nextn_predict_layers: Optional[int] = None
    begin_thinking_phase_token: NonNegativeInt = 128798
    end_thinking_phase_token: NonNegativeInt = 128799


class SADecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["SA"] = "SA"
    max_matching_ngram_size: int = -1
    enable_global_pool: bool = False
    global_pool_size: Optional[PositiveInt] = None

    @model_validator(mode="after")
    def _check_sa(self):
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for SA")
        return self


class KvCacheConfig(StrictBaseModel):
    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None


class DecodeCudaGraphConfig(StrictBaseModel):
    batch_sizes: Optional[List[int]] = None
    max_batch_size: NonNegativeInt = 0
    enable_padding: bool = False
    mode: Literal["decode"] = "decode"


class CudaGraphConfig(StrictBaseModel):  # the older name of DecodeCudaGraphConfig
    batch_sizes: Optional[List[int]] = None
    max_batch_size: NonNegativeInt = 0
    enable_padding: bool = False


class TorchLlmArgs(StrictBaseModel):
    """The LLM(...) keywords the fake accepts (a subset of upstream's; unknown ones fail)."""

    model: Union[str, Path]
    tokenizer: Optional[Union[str, Path]] = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    max_batch_size: Optional[int] = None
    max_num_tokens: Optional[int] = None
    max_seq_len: Optional[int] = None
    kv_cache_config: Optional[KvCacheConfig] = None
    cuda_graph_config: Optional[Union[DecodeCudaGraphConfig, CudaGraphConfig]] = None
    speculative_config: Optional[object] = None
    enable_iter_perf_stats: bool = False
    return_perf_metrics: bool = False
    orchestrator_type: Optional[Literal["rpc", "ray"]] = None
    guided_decoding_backend: Optional[Literal["xgrammar", "llguidance"]] = None


def spec_classes(generation: str) -> dict[str, type]:
    """The speculation config classes of one SA field generation, under their real names."""
    if generation not in GENERATIONS:
        raise ValueError(f"generation: one of {GENERATIONS}, got {generation!r}")
    if generation == "sa_config":
        sa_fields = {"sa_config": (Optional[SAEnhancerConfig], None)}
    else:
        sa_fields = {"use_sa_spec": (bool, False), "sa_spec_threshold": (PositiveInt, 4)}
    classes = {
        "Eagle3DecodingConfig": create_model("Eagle3DecodingConfig", __base__=_Eagle3, **sa_fields),
        "MTPDecodingConfig": create_model("MTPDecodingConfig", __base__=_MTP, **sa_fields),
        "SADecodingConfig": SADecodingConfig,
    }
    if generation == "sa_config":
        classes["SAEnhancerConfig"] = SAEnhancerConfig
    return classes
