"""Real TensorRT-LLM on a GPU: speculative greedy output equals non-speculative output, and
KV block reuse serves a repeated prompt's prefix.

Marked `gpu` (skipped without CUDA by tests/conftest.py) and skipped without tensorrt_llm.
Run inside the pinned container on one GPU (docs/trtllm.md):

    SPECSERVE_TRTLLM_MODEL=meta-llama/Llama-3.1-8B-Instruct \
    SPECSERVE_TRTLLM_DRAFT=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B \
    python -m pytest -q -m gpu tests/trtllm/test_gpu.py

Each mode builds its own LLM (minutes each); the baseline is built once per module.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from replicas.engine import SpeculationConfig
from tests.polling import async_wait_until
from tests.trtllm.conftest import collect, request

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SPECSERVE_TRTLLM_MODEL", "meta-llama/Llama-3.1-8B-Instruct")
DRAFT = os.environ.get("SPECSERVE_TRTLLM_DRAFT", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
DRAFTER = os.environ.get("SPECSERVE_TRTLLM_DRAFTER", "eagle3")  # "mtp" for an MTP checkpoint
CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n" for i in range(12))
PROMPTS = [
    "Rewrite this file, renaming every `x` to `value`:\n\n" + CODE + "\nHere is the whole file:\n",
    "Write a short story about a lighthouse keeper.",
]


def generate_all(mode: str) -> list[list[int]]:
    from replicas.trtllm_engine import TrtllmEngine, TrtllmEngineConfig

    async def go():
        engine = TrtllmEngine(TrtllmEngineConfig(
            model=MODEL, drafter=DRAFTER, draft_model=DRAFT if DRAFTER == "eagle3" else None,
            max_batch_size=4, max_seq_len=4096, max_num_tokens=4096,
            speculation=SpeculationConfig(mode=mode, max_draft_len=4, batch_gate=4),
        ))
        await engine.start()
        try:
            outputs = []
            for i, prompt in enumerate(PROMPTS):
                deltas = await collect(engine, request(prompt, max_tokens=128, rid=f"{mode}-{i}"))
                assert deltas[-1].finish_reason in ("stop", "length"), deltas[-1]
                outputs.append([t for d in deltas for t in d.token_ids])
            if mode != "off":
                def speculated() -> bool:  # once the stats poller has read the iterations
                    stats = engine.stats()
                    return sum(stats.draft_tokens.values()) > 0 and stats.acceptance_length > 1

                assert await async_wait_until(speculated, timeout_s=30), engine.stats()
            return outputs
        finally:
            await engine.shutdown()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def baseline():
    pytest.importorskip("tensorrt_llm")
    return generate_all("off")


@pytest.mark.parametrize("mode", ["hybrid", "mtp", "sa"])
def test_speculative_greedy_output_equals_plain(baseline, mode):
    assert generate_all(mode) == baseline


def test_a_repeated_prompt_reuses_its_kv_blocks():
    """Upstream's block reuse (on by default) serves a repeated prompt's prefix from its cache."""
    pytest.importorskip("tensorrt_llm")
    from replicas.trtllm_engine import TrtllmEngine, TrtllmEngineConfig

    async def go():
        engine = TrtllmEngine(TrtllmEngineConfig(
            model=MODEL, max_batch_size=4, max_seq_len=4096, max_num_tokens=4096,
            speculation=SpeculationConfig(mode="off"),
        ))
        await engine.start()
        try:
            finals = [(await collect(engine, request(PROMPTS[0], max_tokens=16, rid=f"reuse-{i}")))[-1]
                      for i in range(2)]
            return finals, engine.stats()
        finally:
            await engine.shutdown()

    (first, again), stats = asyncio.run(go())
    assert first.cached_tokens == 0 and 0 < again.cached_tokens < again.prompt_tokens
    assert stats.prefix_hit_tokens == again.cached_tokens
    assert stats.prefix_prompt_tokens == first.prompt_tokens + again.prompt_tokens
