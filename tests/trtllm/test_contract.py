"""Building the LLM against the contract fake: every mode, both field generations.

The fake's configs reject unknown fields and enforce upstream's validators, so an LLM that
builds here got kwargs the pinned release's classes accept.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.trtllm.conftest import EAGLE3_HEAD, engine_config, fake_api, run, started
from tests.trtllm.fake_tensorrt_llm import build

GENERATIONS = ("sa_config", "use_sa_spec")
CASES = [(mode, drafter) for mode in ("off", "sa", "mtp", "hybrid") for drafter in ("eagle3", "mtp")]


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("mode,drafter", CASES)
def test_every_mode_builds(generation, mode, drafter):
    async def go():
        engine = await started(engine_config(mode, drafter, batch_gate=4, sa_threshold=3), generation)
        args = engine._llm.args
        await engine.shutdown()
        return args

    args = run(go())
    spec = args.speculative_config
    assert args.enable_iter_perf_stats and args.kv_cache_config.free_gpu_memory_fraction == 0.85
    assert args.cuda_graph_config.max_batch_size == 8 and args.cuda_graph_config.enable_padding
    if mode == "off":
        assert spec is None
        return
    assert spec.max_draft_len == 4 and spec.max_concurrency == 4
    expected = "SA" if mode == "sa" else ("Eagle3" if drafter == "eagle3" else "MTP")
    assert spec.decoding_type == expected
    if expected == "Eagle3":
        assert spec.speculative_model == EAGLE3_HEAD
    sa_on = mode == "hybrid"
    if generation == "sa_config" and expected != "SA":
        assert (spec.sa_config is not None) == sa_on
        if sa_on:
            assert spec.sa_config.threshold == 3
    if generation == "use_sa_spec" and expected != "SA":
        assert spec.use_sa_spec == sa_on
        if sa_on:
            assert spec.sa_spec_threshold == 3


def test_older_cuda_graph_class_name():
    from replicas.trtllm.api import api_from_modules
    from replicas.trtllm_engine import TrtllmEngine

    module = build("sa_config", cuda_graph_class="CudaGraphConfig")
    engine = TrtllmEngine(engine_config(), api=api_from_modules(module, module.llmapi))
    assert type(engine._build_llm().args.cuda_graph_config).__name__ == "CudaGraphConfig"


def test_the_fake_is_strict_like_upstream():
    llmapi = build("sa_config").llmapi
    with pytest.raises(ValidationError):  # the other generation's field
        llmapi.MTPDecodingConfig(max_draft_len=2, use_sa_spec=True)
    with pytest.raises(ValidationError):
        build("use_sa_spec").llmapi.MTPDecodingConfig(max_draft_len=2, sa_config={"threshold": 4})
    with pytest.raises(ValidationError):
        llmapi.SAEnhancerConfig(threshold=4, min_match=2)
    with pytest.raises(ValidationError, match="mutually exclusive"):
        llmapi.MTPDecodingConfig(max_draft_len=2, max_concurrency=4, draft_len_schedule={1: 2})
    with pytest.raises(ValidationError, match="max_draft_len"):
        llmapi.MTPDecodingConfig(max_draft_len=4, draft_len_schedule={1: 2, 4: 1})
    with pytest.raises(ValueError, match="Invalid argument"):
        build().LLM(model="m", speculative_decoding=None)
    with pytest.raises(TypeError):
        build().SamplingParams(max_new_tokens=3)
    assert "sa_config" in fake_api().spec_fields()["Eagle3DecodingConfig"]


def test_taper_builds_a_schedule_upstream_accepts():
    async def go():
        engine = await started(engine_config("hybrid", batch_gate=6, draft_len_taper=((2, 4), (4, 2))))
        spec = engine._llm.args.speculative_config
        await engine.shutdown()
        return spec

    spec = run(go())
    assert spec.draft_len_schedule == {2: 4, 4: 2, 6: 2} and spec.max_concurrency is None
