"""The lazy import: a clear error without TensorRT-LLM, none of it at module import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replicas.trtllm.api import PINNED_IMAGE, PINNED_RELEASE, TensorRTLLMUnavailable, load_api
from replicas.trtllm_engine import TrtllmEngine
from tests.trtllm import fake_tensorrt_llm
from tests.trtllm.conftest import engine_config


@pytest.fixture
def no_tensorrt_llm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import raises ImportError
    monkeypatch.delitem(sys.modules, "tensorrt_llm.llmapi", raising=False)


def test_missing_tensorrt_llm_names_the_install_route(no_tensorrt_llm):
    with pytest.raises(TensorRTLLMUnavailable) as info:
        load_api()
    message = str(info.value)
    assert PINNED_IMAGE in message and f"tensorrt_llm=={PINNED_RELEASE}" in message
    assert "engine: torch" in message and "docs/trtllm.md" in message
    # raised `from None`: no ImportError traceback chained under it
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_engine_construction_raises_it_too(no_tensorrt_llm):
    with pytest.raises(TensorRTLLMUnavailable, match="GPU"):
        TrtllmEngine(engine_config())


def test_a_broken_install_is_reported_the_same_way():
    def import_module(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    with pytest.raises(TensorRTLLMUnavailable, match="libcuda"):
        load_api(import_module)


def test_the_real_import_path_with_the_fake_installed(monkeypatch):
    fake_tensorrt_llm.install(monkeypatch)
    api = load_api()
    assert api.version == fake_tensorrt_llm.VERSION
    assert "SAEnhancerConfig" in api.classes
    assert TrtllmEngine(engine_config("hybrid", "mtp")).api.version == api.version


def test_importing_the_adapter_loads_neither_tensorrt_llm_nor_torch():
    code = ("import sys, replicas.trtllm_engine, replicas.trtllm.translate; "
            "print(sorted(m for m in ('tensorrt_llm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
