"""Building the LLM against the contract fake: every mode, and the fake as strict as upstream.

The fake's configs reject unknown fields and enforce upstream's validators, so an LLM that
builds here got kwargs the pinned release's classes accept.
"""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from replicas.stats import NOT_GATED
from replicas.trtllm.translate import SINGLE_PROCESS_ENV
from replicas.trtllm_engine import TrtllmEngine
from tests.trtllm.conftest import EAGLE3_HEAD, engine_config, fake_api, run, started
from tests.trtllm.fake_tensorrt_llm import build

CASES = [(mode, drafter) for mode in ("off", "sa", "mtp", "hybrid") for drafter in ("eagle3", "mtp")]


@pytest.mark.parametrize("mode,drafter", CASES)
def test_every_mode_builds(mode, drafter):
    async def go():
        engine = await started(engine_config(mode, drafter, batch_gate=4, sa_threshold=3))
        args = engine._llm.args
        await engine.shutdown()
        return args

    args = run(go())
    spec = args.speculative_config
    assert args.enable_iter_perf_stats and args.kv_cache_config.free_gpu_memory_fraction == 0.85
    assert args.cuda_graph_config.max_batch_size == 8 and args.cuda_graph_config.enable_padding
    assert args.cuda_graph_config.batch_sizes == [1, 2, 4, 8]  # upstream's padded default
    if mode == "off":
        assert spec is None
        return
    expected = "SA" if mode == "sa" else ("Eagle3" if drafter == "eagle3" else "MTP")
    assert spec.decoding_type == expected and spec.max_draft_len == 4
    if expected == "Eagle3":
        assert spec.speculative_model == EAGLE3_HEAD
    if expected != "SA":
        assert (spec.sa_config is not None) == (mode == "hybrid")
        assert spec.sa_config is None or spec.sa_config.threshold == 3


# (mode, drafter) -> the gate 4 in force, and drafts per request at batch 1 / 5 / 8 in the fake
GATES = [
    (("mtp", "eagle3"), 4, (4, 0, 0)),  # EAGLE-3 alone: a real cut-off
    (("hybrid", "eagle3"), NOT_GATED, (4, 1, 1)),  # the SA enhancer never drafts 0
    (("hybrid", "mtp"), NOT_GATED, (4, 4, 4)),  # one-engine MTP cannot switch drafting off
    (("mtp", "mtp"), NOT_GATED, (4, 4, 4)),
    (("sa", "eagle3"), NOT_GATED, (4, 4, 4)),
]


@pytest.mark.parametrize("mode_drafter,gate,drafts", GATES, ids=["-".join(c[0]) for c in GATES])
def test_the_gate_reported_is_the_one_the_built_engine_applies(mode_drafter, gate, drafts):
    engine = TrtllmEngine(engine_config(*mode_drafter, batch_gate=4), api=fake_api())
    spec = engine._build_llm().args.speculative_config
    assert engine.stats().batch_gate == gate
    assert tuple(spec.runtime_draft_len(b) for b in (1, 5, 8)) == drafts
    assert engine._plan.notes if gate == NOT_GATED else not engine._plan.notes  # a log line says why


def test_older_cuda_graph_class_name():
    from replicas.trtllm.api import api_from_modules

    module = build(cuda_graph_class="CudaGraphConfig")
    engine = TrtllmEngine(engine_config(), api=api_from_modules(module, module.llmapi))
    assert type(engine._build_llm().args.cuda_graph_config).__name__ == "CudaGraphConfig"


def test_building_at_tp1_keeps_the_worker_in_the_replica_process():
    fake = build()
    with pytest.raises(RuntimeError, match="MPI_ERR_SPAWN"):  # what a plain process gets from upstream
        fake.LLM(model="m")
    engine = TrtllmEngine(engine_config(), api=fake_api())
    assert engine._build_llm().args.tensor_parallel_size == 1
    assert os.environ[SINGLE_PROCESS_ENV] == "1"
    assert fake.LLM(model="m", tensor_parallel_size=2, orchestrator_type="ray")  # TP>1: Ray, no spawn


def test_the_fake_is_strict_like_upstream():
    llmapi = build().llmapi
    with pytest.raises(ValidationError):  # the pre-release form the pinned release does not have
        llmapi.MTPDecodingConfig(max_draft_len=2, use_sa_spec=True)
    with pytest.raises(ValidationError):
        llmapi.SAEnhancerConfig(threshold=4, min_match=2)
    with pytest.raises(ValidationError, match="mutually exclusive"):
        llmapi.MTPDecodingConfig(max_draft_len=2, max_concurrency=4, draft_len_schedule={1: 2})
    with pytest.raises(ValidationError, match="max_draft_len"):
        llmapi.MTPDecodingConfig(max_draft_len=4, draft_len_schedule={1: 2, 4: 1})
    with pytest.raises(ValidationError, match="max_matching_ngram_size"):
        llmapi.SADecodingConfig(max_draft_len=4, max_matching_ngram_size=0)
    with pytest.raises(ValidationError, match="max_matching_ngram_size"):
        llmapi.SADecodingConfig(max_draft_len=4, enable_global_pool=True, max_matching_ngram_size=65)
    with pytest.raises(ValidationError, match="requires enable_global_pool"):
        llmapi.SADecodingConfig(max_draft_len=4, global_pool_size=64)
    with pytest.raises(ValueError, match="Invalid argument"):
        build().LLM(model="m", speculative_decoding=None)
    with pytest.raises(TypeError):
        build().SamplingParams(max_new_tokens=3)
    assert "sa_config" in fake_api().spec_fields()["Eagle3DecodingConfig"]


def test_speculative_config_must_be_typed(monkeypatch):
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    fake = build()
    with pytest.raises(ValidationError):
        fake.LLM(model="m", speculative_config={"max_draft_len": 4})  # no decoding_type
    with pytest.raises(ValidationError):
        fake.LLM(model="m", speculative_config=object())
    llm = fake.LLM(model="m", speculative_config={"decoding_type": "SA", "max_draft_len": 4})
    assert type(llm.args.speculative_config).__name__ == "SADecodingConfig"


def test_the_sa_pool_must_hold_every_running_request(monkeypatch):
    monkeypatch.setenv(SINGLE_PROCESS_ENV, "1")
    fake = build()
    small = fake.llmapi.SADecodingConfig(max_draft_len=4, enable_global_pool=True, global_pool_size=16)
    with pytest.raises(ValueError, match=r"global_pool_size \(16\) must be >= max_batch_size \(64\)"):
        fake.LLM(model="m", max_batch_size=64, speculative_config=small)
    assert fake.LLM(model="m", max_batch_size=16, speculative_config=small)


def test_upstream_turns_max_concurrency_into_a_schedule_only_where_it_is_followed():
    llmapi = build().llmapi
    eagle = llmapi.Eagle3DecodingConfig(max_draft_len=4, speculative_model=EAGLE3_HEAD, max_concurrency=6)
    assert eagle.draft_len_schedule == {6: 4} and eagle.max_concurrency == 6
    mtp = llmapi.MTPDecodingConfig(max_draft_len=4, max_concurrency=6)
    assert mtp.draft_len_schedule is None and mtp.runtime_draft_len(64) == 4


def test_taper_builds_a_schedule_upstream_accepts():
    async def go():
        engine = await started(engine_config("mtp", batch_gate=6, draft_len_taper=((2, 4), (4, 2))))
        spec = engine._llm.args.speculative_config
        await engine.shutdown()
        return spec

    spec = run(go())
    assert spec.draft_len_schedule == {2: 4, 4: 2, 6: 2} and spec.max_concurrency is None
    assert [spec.runtime_draft_len(b) for b in (2, 3, 6, 7)] == [4, 2, 2, 0]
