"""The pure translation: our settings -> TensorRT-LLM kwargs, and the gate each mode really gets.

Field tables come from the contract fake, whose classes carry upstream's field names.
"""

from __future__ import annotations

import dataclasses

import pytest

from replicas.engine import JSON_LAYOUT, GrammarSpec, RequestError, SamplingParams
from replicas.stats import NOT_GATED
from replicas.trtllm.gate import draft_len_schedule
from replicas.trtllm.translate import (
    SINGLE_PROCESS_ENV, UnsupportedRelease, guided_decoding_kwargs, llm_kwargs, plan_speculation, sampling_kwargs,
    worker_env,
)
from tests.trtllm.conftest import EAGLE3_HEAD, engine_config, fake_api


def plan(config):
    return plan_speculation(config, config.speculation, fake_api().spec_fields())


# (mode, drafter) -> (config class, source, expected kwargs subset, sa_enhancer)
MODES = [
    ("off", "eagle3", None, "", {}, None),
    ("sa", "eagle3", "SADecodingConfig", "sa", {"max_draft_len": 4}, None),
    ("sa", "mtp", "SADecodingConfig", "sa", {"max_draft_len": 4}, None),
    ("mtp", "eagle3", "Eagle3DecodingConfig", "mtp", {"speculative_model": EAGLE3_HEAD}, None),
    ("mtp", "mtp", "MTPDecodingConfig", "mtp", {"max_draft_len": 4}, None),
    ("hybrid", "eagle3", "Eagle3DecodingConfig", "mtp", {"speculative_model": EAGLE3_HEAD}, {"threshold": 3}),
    ("hybrid", "mtp", "MTPDecodingConfig", "mtp", {"max_draft_len": 4}, {"threshold": 3}),
]


@pytest.mark.parametrize("mode,drafter,cls,source,subset,enhancer", MODES)
def test_mode_table(mode, drafter, cls, source, subset, enhancer):
    p = plan(engine_config(mode, drafter, sa_threshold=3))
    assert p.config_class == cls
    assert p.source == source
    assert subset.items() <= p.kwargs.items()
    assert p.sa_enhancer == enhancer
    assert "sa_config" not in p.kwargs  # the engine builds SAEnhancerConfig from sa_enhancer
    assert p.kwargs.get("enable_penalty") is (True if cls else None)  # else penalised requests are refused


def test_gate_zero_means_no_speculation():
    p = plan(engine_config("hybrid", batch_gate=0))
    assert p.config_class is None and p.batch_gate == NOT_GATED and not p.speculates_at(1)


# (mode, drafter, gate, taper) -> (gate kwargs, gate in force); max_batch_size 8, K 4
GATES = [
    ("mtp", "eagle3", 4, (), {"max_concurrency": 4}, 4),  # EAGLE-3 alone: upstream's own cut-off
    ("mtp", "eagle3", 6, ((2, 4), (4, 2)), {"draft_len_schedule": {2: 4, 4: 2, 6: 2}}, 6),
    ("mtp", "eagle3", 8, (), {}, NOT_GATED),  # gate == max_batch_size never trips
    ("mtp", "eagle3", 12, (), {}, NOT_GATED),
    ("hybrid", "eagle3", 4, (), {"draft_len_schedule": {4: 4, 8: 1}}, NOT_GATED),  # floored at 1 draft
    ("hybrid", "eagle3", 6, ((2, 4), (4, 0)), {"draft_len_schedule": {2: 4, 4: 1, 6: 1, 8: 1}}, NOT_GATED),
    ("hybrid", "mtp", 4, (), {}, NOT_GATED),  # one-engine MTP: max_concurrency would do nothing
    ("mtp", "mtp", 4, ((2, 4),), {}, NOT_GATED),
    ("sa", "mtp", 4, (), {}, NOT_GATED),
]


@pytest.mark.parametrize("mode,drafter,gate,taper,kwargs,in_force", GATES)
def test_gate_mapping(mode, drafter, gate, taper, kwargs, in_force):
    p = plan(engine_config(mode, drafter, batch_gate=gate, draft_len_taper=taper))
    assert {k: v for k, v in p.kwargs.items() if k in ("max_concurrency", "draft_len_schedule")} == kwargs
    assert p.batch_gate == in_force
    assert [p.speculates_at(b) for b in (1, 4, 5, 8)] == [in_force == NOT_GATED or b <= in_force for b in (1, 4, 5, 8)]
    if gate < 8:  # a gate the engine does not apply as a cut-off is logged, never silent
        assert bool(p.notes) == (in_force == NOT_GATED)


def test_a_gate_needs_the_field_upstream_applies_it_with():
    fields = fake_api().spec_fields()
    fields["Eagle3DecodingConfig"] -= {"max_concurrency", "draft_len_schedule"}
    for mode, missing in (("mtp", "max_concurrency"), ("hybrid", "draft_len_schedule")):
        config = engine_config(mode, batch_gate=4)
        with pytest.raises(UnsupportedRelease, match=missing):
            plan_speculation(config, config.speculation, fields)
    wide = engine_config("mtp", batch_gate=8)
    assert "max_concurrency" not in plan_speculation(wide, wide.speculation, fields).kwargs


def test_hybrid_needs_the_sa_enhancer():
    fields = fake_api().spec_fields()
    fields["MTPDecodingConfig"] -= {"sa_config"}
    config = engine_config("hybrid", "mtp")
    with pytest.raises(UnsupportedRelease, match="sa_config"):
        plan_speculation(config, config.speculation, fields)


@pytest.mark.parametrize("tp,orchestrator,env", [(1, "mpi", {SINGLE_PROCESS_ENV: "1"}), (2, "ray", {})])
def test_worker_env(tp, orchestrator, env):
    assert worker_env(engine_config(tensor_parallel_size=tp, orchestrator=orchestrator)) == env


@pytest.mark.parametrize("tp,orchestrator", [(1, "ray"), (2, "mpi")])
def test_the_orchestrator_follows_tensor_parallelism(tp, orchestrator):
    with pytest.raises(ValueError, match="^orchestrator"):
        engine_config(tensor_parallel_size=tp, orchestrator=orchestrator)


def test_speculative_model_dir_on_older_releases():
    fields = fake_api().spec_fields()
    fields["Eagle3DecodingConfig"] = fields["Eagle3DecodingConfig"] - {"speculative_model"} | {"speculative_model_dir"}
    config = engine_config("mtp")
    assert plan_speculation(config, config.speculation, fields).kwargs["speculative_model_dir"] == EAGLE3_HEAD


def test_sa_global_pool():
    assert plan(engine_config("sa", sa_global_pool=True)).kwargs["enable_global_pool"] is True
    assert plan(engine_config("hybrid", sa_global_pool=True)).sa_enhancer == {"threshold": 4, "enable_global_pool": True}


def test_eagle3_without_its_head_is_rejected():
    with pytest.raises(ValueError, match="draft_model"):
        engine_config("hybrid", draft_model=None)
    config = engine_config("sa", draft_model=None)  # fine for SA alone ...
    hybrid = dataclasses.replace(config.speculation, mode="hybrid")
    with pytest.raises(ValueError, match="draft_model"):  # ... until a reconfigure asks for EAGLE-3
        plan_speculation(config, hybrid, fake_api().spec_fields())


@pytest.mark.parametrize("k,gate,taper,floor,expected", [
    (4, 8, (), 0, {8: 4}),
    (4, 8, ((2, 4), (4, 2)), 0, {2: 4, 4: 2, 8: 2}),
    (4, 4, ((2, 4), (4, 1), (16, 1)), 0, {2: 4, 4: 1}),  # keys past the gate are dropped
    (4, 8, ((1, 9), (3, 1)), 0, {1: 4, 3: 1, 8: 1}),  # draft lengths clip to max_draft_len
    (4, 8, (), 1, {8: 4, 64: 1}),  # a floor: max_batch_size drafts it, never 0
    (4, 8, ((2, 4), (4, 0)), 1, {2: 4, 4: 1, 8: 1, 64: 1}),
])
def test_draft_len_schedule(k, gate, taper, floor, expected):
    assert draft_len_schedule(k, gate, taper, floor, max_batch_size=64) == expected


def test_draft_len_schedule_must_start_at_max_draft_len():
    with pytest.raises(ValueError, match="smallest batch size"):
        draft_len_schedule(4, 8, ((2, 2),))


@pytest.mark.parametrize("sampling,expected,absent", [
    (SamplingParams(max_tokens=7), {"max_tokens": 7, "top_k": 1}, {"temperature", "top_p"}),
    (SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3),
     {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3}, set()),
    (SamplingParams(temperature=1.0), {"temperature": 1.0}, {"top_p", "top_k"}),
    (SamplingParams(stop=("\n\n",), stop_token_ids=(2,), ignore_eos=True),
     {"stop": ["\n\n"], "stop_token_ids": [2], "ignore_eos": True}, set()),
    (SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0),
     {"presence_penalty": 0.5, "frequency_penalty": -1.0}, set()),
    (SamplingParams(repetition_penalty=1.2, min_p=0.05, min_tokens=3),
     {"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3}, set()),
    (SamplingParams(), {}, {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"}),
])
def test_sampling_kwargs(sampling, expected, absent):
    have = fake_api().sampling_fields
    kwargs = sampling_kwargs(sampling, have)
    assert expected.items() <= kwargs.items()
    assert not absent & set(kwargs)
    assert kwargs["return_perf_metrics"] is True
    assert "return_perf_metrics" not in sampling_kwargs(sampling, have - {"return_perf_metrics"})


def test_a_setting_the_release_lacks_is_a_request_error_naming_it():
    with pytest.raises(RequestError, match="min_p") as info:
        sampling_kwargs(SamplingParams(min_p=0.1), fake_api().sampling_fields - {"min_p"})
    assert info.value.param == "min_p"


@pytest.mark.parametrize("grammar, expected", [
    (GrammarSpec("json_object"), {"json": {"type": "object", "x-guidance": JSON_LAYOUT}}),
    (GrammarSpec("json_schema", '{"type": "array"}'), {"json": {"type": "array", "x-guidance": JSON_LAYOUT}}),
    (GrammarSpec("lark", 'start: "a"', "tool_choice"), {"grammar": 'start: "a"'}),
])
def test_guided_decoding_kwargs(grammar, expected):
    assert guided_decoding_kwargs(grammar) == expected


def test_llm_kwargs():
    have = fake_api().llm_fields
    assert llm_kwargs(engine_config(), have)["guided_decoding_backend"] == "llguidance"
    assert "guided_decoding_backend" not in llm_kwargs(engine_config(guided_decoding_backend="none"), have)
    with pytest.raises(UnsupportedRelease, match="guided_decoding_backend"):
        llm_kwargs(engine_config(), have - {"guided_decoding_backend"})
    kwargs = llm_kwargs(engine_config(tokenizer="tok", tensor_parallel_size=2, orchestrator="ray"), have)
    assert kwargs["enable_iter_perf_stats"] is True
    assert kwargs["orchestrator_type"] == "ray" and kwargs["tokenizer"] == "tok"
    assert "orchestrator_type" not in llm_kwargs(engine_config(), have)
    assert llm_kwargs(engine_config(), frozenset())["model"]  # unknown field set: the core keys
    with pytest.raises(UnsupportedRelease, match="orchestrator_type"):
        llm_kwargs(engine_config(tensor_parallel_size=2, orchestrator="ray"), have - {"orchestrator_type"})
