"""The slice of `tensorrt_llm` the adapter uses, imported lazily and described as data.

TensorRT-LLM's config classes change field names between releases (`CudaGraphConfig`
became `DecodeCudaGraphConfig`, `speculative_model_dir` became `speculative_model`) and they
reject unknown fields, so the adapter never assumes a field: it reads the installed
classes' field names here and the pure translation in `translate.py` picks what exists, or
raises UnsupportedRelease naming what is missing.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

# The release the adapter is written and documented against (see docs/trtllm.md).
PINNED_RELEASE = "1.3.0rc27"
PINNED_IMAGE = f"nvcr.io/nvidia/tensorrt-llm/release:{PINNED_RELEASE}"

SPEC_CLASSES = ("Eagle3DecodingConfig", "MTPDecodingConfig", "SADecodingConfig", "SAEnhancerConfig")
CUDA_GRAPH_CLASSES = ("DecodeCudaGraphConfig", "CudaGraphConfig")  # newest name first


class TensorRTLLMUnavailable(RuntimeError):
    """`tensorrt_llm` cannot be imported here; the message says how to get it."""


class UnsupportedRelease(ValueError):
    """The installed TensorRT-LLM lacks a field this configuration needs."""


def install_hint(reason: str) -> str:
    return (
        f"The `trtllm` engine needs NVIDIA TensorRT-LLM, which cannot be imported here ({reason}). "
        f"It runs only on a CUDA GPU machine: use the release container {PINNED_IMAGE} "
        f"(docker run --gpus all --ipc host ...), or on a CUDA 13 host follow NVIDIA's pip route "
        f"`pip install tensorrt_llm=={PINNED_RELEASE}` after its torch/CUDA prerequisites "
        "(docs/trtllm.md has the steps). On a machine without a GPU, serve with `engine: torch`."
    )


def field_names(cls: Any) -> frozenset[str]:
    """The keyword fields of a pydantic model or a dataclass (empty if neither)."""
    fields = getattr(cls, "model_fields", None)
    if isinstance(fields, Mapping):
        return frozenset(fields)
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    return frozenset()


@dataclass(frozen=True)
class TrtllmApi:
    """What the adapter uses from one installed `tensorrt_llm`; built by `load_api`."""

    version: str
    llm_cls: Any
    sampling_params_cls: Any
    kv_cache_config_cls: Any
    cuda_graph_config_cls: Any | None
    classes: Mapping[str, Any]  # the SPEC_CLASSES this release has, by name
    llm_fields: frozenset[str]  # TorchLlmArgs fields; empty when the release does not expose it
    guided_decoding_cls: Any | None = None  # GuidedDecodingParams, None where the release lacks it

    def spec_fields(self) -> dict[str, frozenset[str]]:
        """Field names of each speculation config class present in this release."""
        return {name: field_names(cls) for name, cls in self.classes.items()}

    @property
    def sampling_fields(self) -> frozenset[str]:
        return field_names(self.sampling_params_cls)

    @property
    def kv_cache_fields(self) -> frozenset[str]:
        return field_names(self.kv_cache_config_cls)


def api_from_modules(trtllm: Any, llmapi: Any) -> TrtllmApi:
    """Describe an imported `tensorrt_llm` (or a contract fake of it)."""
    cuda_graph = next((getattr(llmapi, n) for n in CUDA_GRAPH_CLASSES if hasattr(llmapi, n)), None)
    llm_args = getattr(llmapi, "TorchLlmArgs", None)
    return TrtllmApi(
        version=str(getattr(trtllm, "__version__", "unknown")),
        llm_cls=trtllm.LLM,
        sampling_params_cls=trtllm.SamplingParams,
        kv_cache_config_cls=llmapi.KvCacheConfig,
        cuda_graph_config_cls=cuda_graph,
        classes={n: getattr(llmapi, n) for n in SPEC_CLASSES if hasattr(llmapi, n)},
        llm_fields=field_names(llm_args) if llm_args is not None else frozenset(),
        guided_decoding_cls=getattr(llmapi, "GuidedDecodingParams", None),
    )


def load_api(import_module: Callable[[str], Any] = importlib.import_module) -> TrtllmApi:
    """Import `tensorrt_llm`; raise TensorRTLLMUnavailable (no ImportError chain) if absent.

    OSError is caught too: the real wheel imports on a host without CUDA libraries fail with
    it, and PyPI's `tensorrt_llm` is a stub that only works against NVIDIA's index.
    """
    try:
        trtllm = import_module("tensorrt_llm")
        llmapi = import_module("tensorrt_llm.llmapi")
    except (ImportError, OSError) as exc:
        raise TensorRTLLMUnavailable(install_hint(f"{type(exc).__name__}: {exc}")) from None
    return api_from_modules(trtllm, llmapi)
