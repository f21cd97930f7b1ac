"""Fake `tensorrt_llm.llmapi` config classes: the real names, fields and strictness.

Mirrors the pinned 1.3.0rc27 signatures (nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/
reference/{MTP,Eagle3,SA}DecodingConfig, SAEnhancerConfig, DecodeCudaGraphConfig) and the
validators of tensorrt_llm/llmapi/llm_args.py as read in upstream's source: every model
forbids unknown fields (upstream's StrictBaseModel); a draft_len_schedule's keys are >= 1,
its lengths >= 0 and <= max_draft_len, its smallest key maps to max_draft_len; it and
max_concurrency are mutually exclusive, except that upstream itself turns max_concurrency
into {max_concurrency: max_draft_len} for the modes that follow a schedule at run time;
SADecodingConfig refuses max_matching_ngram_size 0 (and, with the global pool, anything
but -1 or 1..64) and a global_pool_size without the global pool; an unset CUDA-graph
batch-size list is generated from max_batch_size (128 when 0).

The suffix-automaton enhancer is `sa_config=SAEnhancerConfig(threshold, enable_global_pool)`
on Eagle3DecodingConfig and MTPDecodingConfig; the pinned release has no other form.

Still unverifiable here (marked where they are modelled): which modes 1.3.0rc27 lets follow
a schedule (`supports_dynamic_draft_len`), the floor its run time puts under a scheduled
draft length (`min_runtime_draft_len`), and CUDA-graph batch sizes above 128 (upstream's
generator differs between builds there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Literal, Optional, Set, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, PrivateAttr, model_validator


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
    _translated_from_max_concurrency: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _check_schedule(self):
        schedule = self.draft_len_schedule
        if schedule:
            if any(b < 1 or d < 0 for b, d in schedule.items()):
                raise ValueError("draft_len_schedule: batch sizes >= 1, draft lengths >= 0")
            if self.max_draft_len is not None:
                if schedule[min(schedule)] != self.max_draft_len:
                    raise ValueError("draft_len_schedule[smallest] must equal max_draft_len")
                if max(schedule.values()) > self.max_draft_len:
                    raise ValueError("draft_len_schedule: all draft lengths must be <= max_draft_len")
            self.draft_len_schedule = dict(sorted(schedule.items()))
        return self

    @model_validator(mode="after")
    def _max_concurrency_to_schedule(self):
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            if self._translated_from_max_concurrency:
                return self
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive.")
        if self.max_concurrency is not None and self.max_draft_len is not None and self.supports_dynamic_draft_len:
            self.draft_len_schedule = {self.max_concurrency: self.max_draft_len}
            self._translated_from_max_concurrency = True
        return self

    @property
    def supports_dynamic_draft_len(self) -> bool:
        """SpeculativeDecodingMode.support_dynamic_draft_len (_torch/speculative/interface.py):
        one-model EAGLE-3 in the 1.3 line read. UNVERIFIED for 1.3.0rc27 exactly: later builds
        add one-model MTP-Eagle, SA and others (each floored, see min_runtime_draft_len)."""
        return False

    @property
    def min_runtime_draft_len(self) -> int:
        """The floor under a scheduled draft length: 1 with the SA enhancer, whose automaton a
        zero-length step leaves stale (upstream's fix for TensorRT-LLM #16888), else 0 (the
        EAGLE-3 drafter is kept warm). UNVERIFIED for 1.3.0rc27: builds before that fix draft
        0 here, builds between it and keep-warm floor every one-engine mode at 1."""
        return 1 if getattr(self, "sa_config", None) is not None else 0

    def runtime_draft_len(self, batch_size: int) -> int:
        """Drafts per request in a step of `batch_size` (the fake's run time): the schedule's
        entry for the smallest key >= batch_size (0 above the largest), floored, where the
        mode follows a schedule; max_draft_len otherwise, for the one-engine modes "cannot
        turn off spec decode at runtime" (_torch/pyexecutor/model_engine.py)."""
        schedule = self.draft_len_schedule
        if not (schedule and self.supports_dynamic_draft_len):
            return self.max_draft_len or 0
        scheduled = next((d for b, d in schedule.items() if batch_size <= b), 0)
        return max(scheduled, self.min_runtime_draft_len)


class Eagle3DecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Eagle3"] = "Eagle3"
    eagle_choices: Optional[List[List[int]]] = None
    use_dynamic_tree: Optional[bool] = False
    dynamic_tree_max_topK: Optional[int] = None
    num_eagle_layers: Optional[int] = None
    max_non_leaves_per_layer: Optional[int] = None
    eagle3_one_model: Optional[bool] = True
    eagle3_layers_to_capture: Optional[Set[int]] = None
    eagle3_model_arch: Literal["llama3", "mistral_large3"] = "llama3"
    sa_config: Optional[SAEnhancerConfig] = None

    @model_validator(mode="after")
    def _check_eagle(self):
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for Eagle")
        if self.speculative_model is None:
            raise ValueError("Draft model must be provided for EAGLE")
        return self

    @property
    def supports_dynamic_draft_len(self) -> bool:
        return bool(self.eagle3_one_model)


class MTPDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["MTP"] = "MTP"
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: PositiveInt = 1
    relaxed_delta: float = 0.0
    use_mtp_vanilla: bool = False
    mtp_eagle_one_model: bool = True
    num_nextn_predict_layers: Optional[int] = None
    begin_thinking_phase_token: NonNegativeInt = 128798
    end_thinking_phase_token: NonNegativeInt = 128799
    sa_config: Optional[SAEnhancerConfig] = None


class SADecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["SA"] = "SA"
    max_matching_ngram_size: int = -1
    enable_global_pool: bool = False
    global_pool_size: Optional[PositiveInt] = None

    @model_validator(mode="after")
    def _check_sa(self):
        if self.max_matching_ngram_size == 0:
            raise ValueError("max_matching_ngram_size must be > 0 (fixed ngram) or -1 (longest match). Got 0.")
        if self.enable_global_pool and self.max_matching_ngram_size != -1 \
                and not 1 <= self.max_matching_ngram_size <= 64:
            raise ValueError("max_matching_ngram_size must be -1 (longest match) or in [1, 64] "
                             f"when enable_global_pool is True. Got {self.max_matching_ngram_size}.")
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for SA")
        if self.global_pool_size is not None and not self.enable_global_pool:
            raise ValueError("global_pool_size requires enable_global_pool=True")
        return self

    def effective_pool_size(self, max_batch_size: int) -> int:
        """SA slots (the SuffixAutomatonManager's pool, _torch/speculative/suffix_automaton.py):
        one per request without the global pool, else global_pool_size or max(64, batch)."""
        if not self.enable_global_pool:
            return max_batch_size
        return self.global_pool_size or max(64, max_batch_size)


SpeculativeConfig = Union[Eagle3DecodingConfig, MTPDecodingConfig, SADecodingConfig]


class KvCacheConfig(StrictBaseModel):
    """The pinned reference's KvCacheConfig, the fields the adapter or the fake reads:
    `enable_block_reuse` (default True) turns the prefix cache on, which reuses whole blocks
    of `tokens_per_block` (default 32) prompt tokens."""

    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None
    tokens_per_block: int = 32


def default_cuda_graph_batch_sizes(max_batch_size: int, enable_padding: bool) -> list[int]:
    """What upstream captures when no batch sizes are given: with padding 1, 2, 4 and the
    multiples of 8 up to 128, else 1..31, 32, 64, 128; cut at max_batch_size, which is
    added. UNVERIFIED above 128 (upstream builds differ there), so the fake refuses it."""
    if max_batch_size > 128:
        raise NotImplementedError("the fake does not know 1.3.0rc27's CUDA-graph batch sizes above 128")
    sizes = [1, 2, 4, *range(8, 129, 8)] if enable_padding else [*range(1, 32), 32, 64, 128]
    kept = [s for s in sizes if s <= max_batch_size]
    return kept if kept[-1] == max_batch_size else kept + [max_batch_size]


class _CudaGraphConfig(StrictBaseModel):
    batch_sizes: Optional[List[int]] = None
    max_batch_size: NonNegativeInt = 0
    enable_padding: bool = False

    @model_validator(mode="after")
    def _batch_sizes(self):
        if self.batch_sizes:
            derived = max(self.batch_sizes)
            if self.max_batch_size not in (0, derived):
                raise ValueError("max_batch_size must equal max(batch_sizes) when both are provided")
            self.batch_sizes, self.max_batch_size = sorted(set(self.batch_sizes)), derived
        else:
            self.max_batch_size = self.max_batch_size or 128
            self.batch_sizes = default_cuda_graph_batch_sizes(self.max_batch_size, self.enable_padding)
        return self


class DecodeCudaGraphConfig(_CudaGraphConfig):
    mode: Literal["decode"] = "decode"


class CudaGraphConfig(_CudaGraphConfig):  # the older name of DecodeCudaGraphConfig
    pass


class TorchLlmArgs(StrictBaseModel):
    """The LLM(...) keywords the fake accepts (a subset of upstream's; unknown ones fail).
    `speculative_config` must be one of the typed decoding configs (or its dict with
    `decoding_type`), as upstream's union of them is."""

    model: Union[str, Path]
    tokenizer: Optional[Union[str, Path]] = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    max_batch_size: Optional[int] = None
    max_num_tokens: Optional[int] = None
    max_seq_len: Optional[int] = None
    enable_chunked_prefill: bool = False
    kv_cache_config: Optional[KvCacheConfig] = None
    cuda_graph_config: Optional[Union[DecodeCudaGraphConfig, CudaGraphConfig]] = None
    speculative_config: Optional[SpeculativeConfig] = Field(None, discriminator="decoding_type")
    enable_iter_perf_stats: bool = False
    return_perf_metrics: bool = False
    orchestrator_type: Optional[Literal["rpc", "ray"]] = None
    guided_decoding_backend: Optional[Literal["xgrammar", "llguidance"]] = None


SPEC_CLASSES = {cls.__name__: cls for cls in (Eagle3DecodingConfig, MTPDecodingConfig, SADecodingConfig,
                                              SAEnhancerConfig)}
