"""Constrained output on the TensorRT-LLM engine (the contract fake): a request's grammar goes
to upstream's guided decoding, or, where upstream cannot mask the drafts it verifies, is refused
naming its field; an optional grammar (tools under auto) runs unconstrained there instead."""

from __future__ import annotations

import dataclasses
import json

import pytest

from replicas.engine import JSON_LAYOUT, GrammarSpec, RequestError
from tests.trtllm.conftest import collect, engine_config, joined, request, run, started

PROMPT = "def f(x):\n    return x\n"


@pytest.mark.parametrize("mode, gate, refused", [
    ("mtp", 4, False), ("off", 4, False), ("hybrid", 0, False),  # no SA draft is ever verified
    ("hybrid", 4, True), ("sa", 4, True),
])
def test_a_grammar_is_guided_decoding_or_a_refusal_naming_the_field(mode, gate, refused):
    grammar = GrammarSpec("json_schema", json.dumps({"type": "object"}), "response_format.json_schema.schema")

    async def go():
        engine = await started(engine_config(mode, drafter="mtp", batch_gate=gate))
        submitted = []
        submit = engine._llm.generate_async
        engine._llm.generate_async = lambda *a, **kw: submitted.append(kw["sampling_params"]) or submit(*a, **kw)
        try:
            if refused:
                with pytest.raises(RequestError, match="suffix-automaton") as info:
                    engine.generate(dataclasses.replace(request(PROMPT), grammar=grammar))
                assert info.value.param == grammar.param
                return None
            await collect(engine, dataclasses.replace(request(PROMPT), grammar=grammar))
            return submitted[0].guided_decoding
        finally:
            await engine.shutdown()

    guide = run(go())
    if not refused:
        assert guide.json == {"type": "object", "x-guidance": JSON_LAYOUT}


@pytest.mark.parametrize("mode, guided", [("mtp", True), ("hybrid", False)])
def test_an_optional_grammar_is_guided_decoding_or_runs_unconstrained(mode, guided):
    """Tool calls under auto: guided, the grammar ends the text and stop_after is not matched;
    where upstream cannot constrain the request (SA drafts verified) it runs unguided instead of
    being refused, ended after its stop_after string."""
    grammar = GrammarSpec("lark", "start: /(.|\\n)*/", "tools", optional=True)

    async def go():
        engine = await started(engine_config(mode, drafter="mtp"))
        submitted = []
        submit = engine._llm.generate_async
        engine._llm.generate_async = lambda *a, **kw: submitted.append(kw["sampling_params"]) or submit(*a, **kw)
        try:
            req = request("one two. three ", max_tokens=60, stop_after=("o. t",))
            deltas = await collect(engine, dataclasses.replace(req, grammar=grammar))
            return joined(deltas)[0], submitted[0].guided_decoding
        finally:
            await engine.shutdown()

    text, guide = run(go())
    if guided:
        assert guide.grammar == grammar.text and text.startswith("one two. three")
    else:
        assert guide is None and text == "one two. t"


def test_no_guided_decoding_backend_refuses_grammars():
    async def go():
        engine = await started(engine_config("mtp", drafter="mtp", guided_decoding_backend="none"))
        try:
            with pytest.raises(RequestError, match="no guided decoding") as info:
                engine.generate(dataclasses.replace(request(PROMPT), grammar=GrammarSpec("json_object")))
            assert info.value.param == "response_format"
            assert "guided_decoding_backend" not in engine._llm.args.model_fields_set
        finally:
            await engine.shutdown()

    run(go())


def test_a_prefilled_answer_under_a_format_is_refused_naming_the_field():
    """Upstream's guide holds the output alone: a prefix the output must continue is refused."""
    grammar = GrammarSpec("json_object", prefix='{"a":')

    async def go():
        engine = await started(engine_config("mtp", drafter="mtp"))
        try:
            with pytest.raises(RequestError, match="prefilled answer") as info:
                engine.generate(dataclasses.replace(request(PROMPT), grammar=grammar))
            assert info.value.param == grammar.param
        finally:
            await engine.shutdown()

    run(go())
