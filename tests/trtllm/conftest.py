"""Shared builders for the TensorRT-LLM adapter tests: the fake's API surface and engines."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig
from replicas.trtllm.api import TrtllmApi, api_from_modules
from replicas.trtllm.config import TrtllmEngineConfig
from replicas.trtllm.translate import SINGLE_PROCESS_ENV
from replicas.trtllm_engine import TrtllmEngine
from tests.trtllm.fake_tensorrt_llm import build

EAGLE3_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


@pytest.fixture(autouse=True)
def plain_replica_process(monkeypatch):
    """Each test starts like a fresh Serve replica: no single-process flag in the environment
    (the engine sets it when it builds an LLM; monkeypatch restores the original after)."""
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "")
    monkeypatch.delenv(SINGLE_PROCESS_ENV)


def fake_api(cuda_graph_class: str = "DecodeCudaGraphConfig") -> TrtllmApi:
    module = build(cuda_graph_class)
    return api_from_modules(module, module.llmapi)


def engine_config(mode: str = "hybrid", drafter: str = "eagle3", **overrides) -> TrtllmEngineConfig:
    spec = SpeculationConfig(mode=mode, max_draft_len=overrides.pop("max_draft_len", 4),
                             sa_threshold=overrides.pop("sa_threshold", 4),
                             batch_gate=overrides.pop("batch_gate", 4))
    base = TrtllmEngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", drafter=drafter,
                              draft_model=EAGLE3_HEAD if drafter == "eagle3" else None,
                              max_batch_size=8, max_seq_len=512, stats_timeout_s=0.05,
                              stats_poll_interval_s=0.01, speculation=spec)
    return dataclasses.replace(base, **overrides)


def request(prompt, max_tokens: int = 24, rid: str = "r1", **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt=prompt,
                             sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                             speculation=RequestSpeculation())


async def started(config: TrtllmEngineConfig) -> TrtllmEngine:
    engine = TrtllmEngine(config, api=fake_api())
    await engine.start()
    return engine


async def collect(engine: TrtllmEngine, req: GenerationRequest):
    """All deltas of one request."""
    return [delta async for delta in engine.generate(req)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def joined(deltas):
    """(the text, the token ids) of a stream's deltas."""
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]
