"""The pure translation: our settings -> TensorRT-LLM kwargs, for both SA field generations.

Field tables come from the contract fake, whose classes carry upstream's field names.
"""

from __future__ import annotations

import dataclasses

import pytest

from replicas.engine import JSON_LAYOUT, GrammarSpec, SamplingParams
from replicas.trtllm.translate import (
    UnsupportedRelease, draft_len_schedule, guided_decoding_kwargs, llm_kwargs, plan_speculation, sampling_kwargs,
)
from tests.trtllm.conftest import EAGLE3_HEAD, engine_config, fake_api

NEW, LEGACY = "sa_config", "use_sa_spec"


def plan(config, generation=NEW):
    return plan_speculation(config, config.speculation, fake_api(generation).spec_fields())


# (mode, drafter, generation) -> (config class, source, expected kwargs subset, sa_enhancer)
MODES = [
    ("off", "eagle3", NEW, None, "", {}, None),
    ("sa", "eagle3", NEW, "SADecodingConfig", "sa", {"max_draft_len": 4}, None),
    ("sa", "mtp", LEGACY, "SADecodingConfig", "sa", {"max_draft_len": 4}, None),
    ("mtp", "eagle3", NEW, "Eagle3DecodingConfig", "mtp", {"speculative_model": EAGLE3_HEAD}, None),
    ("mtp", "mtp", LEGACY, "MTPDecodingConfig", "mtp", {"max_draft_len": 4}, None),
    ("hybrid", "eagle3", NEW, "Eagle3DecodingConfig", "mtp", {"speculative_model": EAGLE3_HEAD}, {"threshold": 3}),
    ("hybrid", "mtp", NEW, "MTPDecodingConfig", "mtp", {"max_draft_len": 4}, {"threshold": 3}),
    ("hybrid", "eagle3", LEGACY, "Eagle3DecodingConfig", "mtp",
     {"use_sa_spec": True, "sa_spec_threshold": 3}, None),
    ("hybrid", "mtp", LEGACY, "MTPDecodingConfig", "mtp", {"use_sa_spec": True, "sa_spec_threshold": 3}, None),
]


@pytest.mark.parametrize("mode,drafter,generation,cls,source,subset,enhancer", MODES)
def test_mode_table(mode, drafter, generation, cls, source, subset, enhancer):
    p = plan(engine_config(mode, drafter, sa_threshold=3), generation)
    assert p.config_class == cls
    assert p.source == source
    assert subset.items() <= p.kwargs.items()
    assert p.sa_enhancer == enhancer
    if mode != "hybrid":
        assert not {"use_sa_spec", "sa_config"} & set(p.kwargs)


def test_gate_zero_means_no_speculation():
    assert plan(engine_config("hybrid", batch_gate=0)).config_class is None


@pytest.mark.parametrize("gate,taper,expected", [
    (8, (), {}),  # gate == max_batch_size never trips: speculation always on
    (12, (), {}),
    (4, (), {"max_concurrency": 4}),
    (6, ((2, 4), (4, 2)), {"draft_len_schedule": {2: 4, 4: 2, 6: 2}}),
])
def test_gate_mapping(gate, taper, expected):
    p = plan(engine_config("hybrid", batch_gate=gate, draft_len_taper=taper))
    got = {k: v for k, v in p.kwargs.items() if k in ("max_concurrency", "draft_len_schedule")}
    assert got == expected


def test_taper_falls_back_to_max_concurrency_with_a_note():
    fields = fake_api(NEW).spec_fields()
    fields["Eagle3DecodingConfig"] -= {"draft_len_schedule"}
    config = engine_config("hybrid", batch_gate=4, draft_len_taper=((2, 4),))
    p = plan_speculation(config, config.speculation, fields)
    assert p.kwargs["max_concurrency"] == 4 and p.notes


def test_gate_without_max_concurrency_is_an_error():
    fields = fake_api(NEW).spec_fields()
    fields["Eagle3DecodingConfig"] -= {"max_concurrency", "draft_len_schedule"}
    config = engine_config("hybrid", batch_gate=4)
    with pytest.raises(UnsupportedRelease, match="max_concurrency"):
        plan_speculation(config, config.speculation, fields)
    wide = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, batch_gate=8))
    assert "max_concurrency" not in plan_speculation(wide, wide.speculation, fields).kwargs


def test_hybrid_needs_an_sa_field_generation():
    fields = fake_api(LEGACY).spec_fields()
    fields["MTPDecodingConfig"] -= {"use_sa_spec", "sa_spec_threshold"}
    config = engine_config("hybrid", "mtp")
    with pytest.raises(UnsupportedRelease, match="sa_config or use_sa_spec"):
        plan_speculation(config, config.speculation, fields)


def test_speculative_model_dir_on_older_releases():
    fields = fake_api(NEW).spec_fields()
    fields["Eagle3DecodingConfig"] = fields["Eagle3DecodingConfig"] - {"speculative_model"} | {"speculative_model_dir"}
    config = engine_config("mtp")
    assert plan_speculation(config, config.speculation, fields).kwargs["speculative_model_dir"] == EAGLE3_HEAD


def test_sa_global_pool():
    assert plan(engine_config("sa", sa_global_pool=True)).kwargs["enable_global_pool"] is True
    assert plan(engine_config("hybrid", sa_global_pool=True)).sa_enhancer == {"threshold": 4, "enable_global_pool": True}
    with pytest.raises(UnsupportedRelease, match="global pool"):
        plan(engine_config("hybrid", sa_global_pool=True), LEGACY)


def test_eagle3_without_its_head_is_rejected():
    with pytest.raises(ValueError, match="draft_model"):
        engine_config("hybrid", draft_model=None)
    config = engine_config("sa", draft_model=None)  # fine for SA alone ...
    hybrid = dataclasses.replace(config.speculation, mode="hybrid")
    with pytest.raises(ValueError, match="draft_model"):  # ... until a reconfigure asks for EAGLE-3
        plan_speculation(config, hybrid, fake_api().spec_fields())


@pytest.mark.parametrize("k,gate,taper,expected", [
    (4, 8, (), {8: 4}),
    (4, 8, ((2, 4), (4, 2)), {2: 4, 4: 2, 8: 2}),
    (4, 4, ((2, 4), (4, 1), (16, 1)), {2: 4, 4: 1}),  # keys past the gate are dropped
    (4, 8, ((1, 9), (3, 1)), {1: 4, 3: 1, 8: 1}),  # draft lengths clip to max_draft_len
])
def test_draft_len_schedule(k, gate, taper, expected):
    assert draft_len_schedule(k, gate, taper) == expected


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
    (SamplingParams(), {}, {"presence_penalty", "frequency_penalty"}),
])
def test_sampling_kwargs(sampling, expected, absent):
    have = fake_api().sampling_fields
    kwargs = sampling_kwargs(sampling, have)
    assert expected.items() <= kwargs.items()
    assert not absent & set(kwargs)
    assert kwargs["return_perf_metrics"] is True
    assert "return_perf_metrics" not in sampling_kwargs(sampling, have - {"return_perf_metrics"})


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
    kwargs = llm_kwargs(engine_config(tokenizer="tok", orchestrator="ray"), have)
    assert kwargs["enable_iter_perf_stats"] is True
    assert kwargs["orchestrator_type"] == "ray" and kwargs["tokenizer"] == "tok"
    assert "orchestrator_type" not in llm_kwargs(engine_config(), have)
    assert llm_kwargs(engine_config(), frozenset())["model"]  # unknown field set: the core keys
    with pytest.raises(UnsupportedRelease, match="orchestrator_type"):
        llm_kwargs(engine_config(orchestrator="ray"), have - {"orchestrator_type"})
