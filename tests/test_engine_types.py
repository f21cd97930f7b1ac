"""Engine dataclasses validate at construction and name the offending field; the stop-string
helpers the engines share."""

from __future__ import annotations

import dataclasses
import random

import pydantic
import pytest

from replicas.engine import (
    MAX_DRAFT_LEN, Engine, GenerationRequest, RequestError, RequestSpeculation, SamplingParams, SpeculationConfig,
    stop_prefix_end,
)


def field_named_by(exc: ValueError) -> str:
    """The field a validation error names: RequestError's param, or pydantic's location."""
    if isinstance(exc, RequestError):
        assert str(exc).startswith(f"{exc.param}: ")
        return exc.param
    assert isinstance(exc, pydantic.ValidationError)
    return ".".join(str(part) for part in exc.errors()[0]["loc"])


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (SamplingParams, dict(max_tokens=0), "max_tokens"),
        (SamplingParams, dict(max_tokens=-3), "max_tokens"),
        (SamplingParams, dict(temperature=-0.1), "temperature"),
        (SamplingParams, dict(temperature=float("nan")), "temperature"),
        (SamplingParams, dict(top_p=0.0), "top_p"),
        (SamplingParams, dict(top_p=1.01), "top_p"),
        (SamplingParams, dict(top_k=-1), "top_k"),
        (SamplingParams, dict(stop=("ok", "")), "stop"),
        (SpeculationConfig, dict(mode="auto"), "mode"),  # a request mode, not a server mode
        (SpeculationConfig, dict(mode="fast"), "mode"),
        (SpeculationConfig, dict(max_draft_len=0), "max_draft_len"),
        (SpeculationConfig, dict(max_draft_len=MAX_DRAFT_LEN + 1), "max_draft_len"),
        (SpeculationConfig, dict(sa_threshold=0), "sa_threshold"),
        (SpeculationConfig, dict(batch_gate=-1), "batch_gate"),
        (SpeculationConfig, dict(batch_gates=4), "batch_gates"),  # unknown keys are errors
        (RequestSpeculation, dict(mode="hybrid"), "mode"),  # server-only mode
        (RequestSpeculation, dict(mode="on"), "mode"),
        (RequestSpeculation, dict(max_draft_len=0), "max_draft_len"),
        (RequestSpeculation, dict(max_draft_len=MAX_DRAFT_LEN + 1), "max_draft_len"),
    ],
)
def test_bad_value_raises_naming_the_field(cls, kwargs, field):
    with pytest.raises(ValueError) as raised:
        cls(**kwargs)
    assert field_named_by(raised.value) == field


def test_replacing_a_setting_validates_it():
    with pytest.raises(ValueError) as raised:
        dataclasses.replace(SpeculationConfig(), batch_gate=-1)
    assert field_named_by(raised.value) == "batch_gate"


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (SamplingParams, dict()),
        (SamplingParams, dict(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)),
        (SamplingParams, dict(temperature=2.0, top_p=1e-3, top_k=1, seed=0, stop=("\n",))),
        (SpeculationConfig, dict()),
        (SpeculationConfig, dict(mode="off", max_draft_len=1, sa_threshold=1, batch_gate=0)),
        (SpeculationConfig, dict(mode="sa", max_draft_len=MAX_DRAFT_LEN)),
        (RequestSpeculation, dict()),
        (RequestSpeculation, dict(mode="off", max_draft_len=1)),
        (RequestSpeculation, dict(mode="mtp", max_draft_len=MAX_DRAFT_LEN)),
    ],
)
def test_edge_values_are_accepted(cls, kwargs):
    value = cls(**kwargs)
    for name, given in kwargs.items():
        assert getattr(value, name) == given


def test_a_temperature_too_small_to_scale_logits_samples_as_greedy():
    """Logits over 1e-38 overflow float32 (garbage tokens); under 1e-5 a request is greedy."""
    assert SamplingParams(temperature=1e-38).temperature == SamplingParams(temperature=9e-6).temperature == 0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


@pytest.mark.parametrize("cls", [SamplingParams, SpeculationConfig, RequestSpeculation])
def test_configs_are_frozen(cls):
    value = cls()
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, getattr(value, field))


def test_request_defaults():
    request = GenerationRequest("a", [1, 2])
    assert request.sampling == SamplingParams() and request.speculation == RequestSpeculation()
    assert request.sampling.temperature == 0.0 and request.speculation.mode == "auto"


def test_engine_protocol_is_runtime_checkable():
    class Partial:
        async def start(self) -> None: ...

    class Complete(Partial):
        tokenizer = None
        speculation = SpeculationConfig()
        num_live_requests = 0

        def generate(self, request): ...
        async def abort(self, request_id): ...
        def configure(self, speculation): ...
        def stats(self): ...
        async def check_health(self): ...

    assert not isinstance(Partial(), Engine)
    assert isinstance(Complete(), Engine)


def _held_back_by_prefixes(text: str, end: int, stops) -> int:
    """The oracle: each stop string in turn, every prefix length tried, longest first."""
    for s in stops:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[end - n:end] == s[:n]:
                end -= n
                break
    return end


def test_a_tail_that_may_begin_a_stop_string_is_held_back():
    """Against trying every prefix length (what release_text did, a pass over the text per
    character of a long stop string): random texts and stop strings over a small alphabet."""
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab\u00e9") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab\u00e9") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 3))]
        end = rng.randint(0, len(text))
        assert stop_prefix_end(text, end, stops) == _held_back_by_prefixes(text, end, stops), (text, end, stops)
    assert stop_prefix_end("say STO", 7, ["STOP"]) == 4 and stop_prefix_end("say ST", 6, ["xyz"]) == 6
