"""A contract FAKE of the pinned `tensorrt_llm` surface (1.3.0rc27), for CPU-only tests.

Not TensorRT-LLM: it mirrors the class names, field names and strictness the adapter
relies on, and runs a toy model so streaming, abort and stats can be exercised. Build a
module with `build()`; `install(monkeypatch)` also puts it in sys.modules as
`tensorrt_llm` / `tensorrt_llm.llmapi`, for tests of the real import path.
"""

from __future__ import annotations

import sys
import types

from tests.trtllm.fake_tensorrt_llm import llmapi as _llmapi
from tests.trtllm.fake_tensorrt_llm.llm import LLM, GuidedDecodingParams, SamplingParams

VERSION = "1.3.0rc27+fake"


def build(cuda_graph_class: str = "DecodeCudaGraphConfig") -> types.ModuleType:
    """A fresh fake `tensorrt_llm` module (its `.llmapi` attribute is the submodule)."""
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    for name, cls in _llmapi.SPEC_CLASSES.items():
        setattr(llmapi, name, cls)
    llmapi.KvCacheConfig = _llmapi.KvCacheConfig
    setattr(llmapi, cuda_graph_class, getattr(_llmapi, cuda_graph_class))
    llmapi.TorchLlmArgs = _llmapi.TorchLlmArgs
    module = types.ModuleType("tensorrt_llm")
    module.__version__ = VERSION
    module.LLM = LLM
    module.SamplingParams = SamplingParams
    module.llmapi = llmapi
    llmapi.LLM, llmapi.SamplingParams, llmapi.GuidedDecodingParams = LLM, SamplingParams, GuidedDecodingParams
    return module


def install(monkeypatch) -> types.ModuleType:
    module = build()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", module.llmapi)
    return module
