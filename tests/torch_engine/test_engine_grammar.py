"""Constrained decoding and logprobs on the real engine: valid output, and bitwise the same with
speculation off, SA, MTP, hybrid, and with the grammar drafter on or off.

The grammar is part of the target distribution (row i of a verify step masked by the
matcher after `draft[:i]`), so a speculative step computes what a plain one would: tokens
and logprobs compare with ==, never a tolerance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import pytest

from replicas.engine import GrammarSpec, RequestError
from replicas.torch_engine.prefix_cache import BLOCK_TOKENS, PrefixCache
from tests.torch_engine.engine_util import chat_prompt, collect_logprobs, every_draft, request

pytestmark = pytest.mark.slow  # every test drives the real engine (conftest's `engine`)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["python", "rust", "c", "go"]}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False,
}
MODES = ["off", "sa", "mtp", "auto"]


def constrained(prompt, schema=PERSON, **kwargs):
    req = request(prompt, **kwargs)
    spec = GrammarSpec("json_schema", json.dumps(schema)) if schema else GrammarSpec("json_object")
    return dataclasses.replace(req, grammar=spec)


def run(engine, loop, req):
    """(tokens, text, logprobs, last delta) of one request."""
    return loop.run_until_complete(collect_logprobs(engine, req))


@pytest.fixture(scope="module")
def prompts(engine):
    return [
        chat_prompt(engine, "Describe a software engineer as JSON: name, age, languages, employed."),
        chat_prompt(engine, "Give me a JSON record for a retired teacher."),
        chat_prompt(engine, "Output JSON for a student who codes in rust and go."),
    ]


@pytest.fixture
def grammar_drafts(engine):
    """Turn the grammar drafter on or off for one test, restoring the server's setting."""
    def set_(on: bool):
        engine.configure(dataclasses.replace(engine.config.speculation, grammar_drafts=on))
    yield set_
    engine.configure(engine.config.speculation)


def test_output_validates_against_the_schema(engine, loop, prompts):
    for prompt in prompts:
        for seed in (None, 1, 2):
            sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {}
            _, text, _, last = run(engine, loop, constrained(prompt, max_tokens=120, **sampling))
            assert last.finish_reason == "stop", text
            jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_an_object(engine, loop, prompts):
    _, text, _, last = run(engine, loop, constrained(prompts[0], schema=None, max_tokens=200))
    if last.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert text.startswith("{")


def test_a_prefilled_answer_is_held_to_the_format_with_the_output(engine, loop):
    """The output continues a prefilled answer the prompt ends with: the grammar holds prefix +
    output (once it held the output alone, which began the object again after the prefix)."""
    prefill = '{"name": "Ada", "age":'
    prompt = chat_prompt(engine, "Describe a software engineer as JSON: name, age, languages, employed.", prefill)
    req = dataclasses.replace(constrained(prompt, max_tokens=120), grammar=dataclasses.replace(
        constrained(prompt).grammar, prefix=prefill))
    _, text, _, last = run(engine, loop, req)
    assert last.finish_reason == "stop", text
    jsonschema.validate(json.loads(prefill + text), PERSON)
    whole = '{"name": "Ada", "age": 36, "languages": ["c"], "employed": true}'
    done = dataclasses.replace(req, grammar=dataclasses.replace(req.grammar, prefix=whole))
    _, text, _, last = run(engine, loop, done)
    assert (text, last.finish_reason) == ("", "stop")  # a whole output prefilled: the end alone follows
    special = '{"name": "<|im_end|>'  # a special token's text is text here too (it was the control token)
    _, text, _, last = run(engine, loop, dataclasses.replace(req, grammar=dataclasses.replace(req.grammar,
                                                                                              prefix=special)))
    jsonschema.validate(json.loads(special + text), PERSON)
    # not our layout, not an object, no such key, text past a whole output
    for refused in ('{"name":"Ada"', '["Ada"', '{"nickname": "', whole + " and more"):
        bad = dataclasses.replace(req, grammar=dataclasses.replace(req.grammar, prefix=refused))
        with pytest.raises(RequestError, match="prefilled answer") as info:
            engine.generate(bad)
        assert info.value.param == req.grammar.param


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_constrained_output_and_logprobs_identical_in_every_mode(engine, loop, prompts, grammar_drafts, sampling):
    for prompt in prompts[:2]:
        results = {}
        for mode in MODES:
            for drafts_on in (True, False):
                grammar_drafts(drafts_on)
                tokens, _, logprobs, last = run(engine, loop, constrained(prompt, max_tokens=80, mode=mode,
                                                                          logprobs=3, **sampling))
                results[mode, drafts_on] = (tokens, logprobs)
        reference = results["off", True]
        assert len(reference[1]) >= len(reference[0]) - 1 > 0
        for key, result in results.items():
            assert result == reference, key


def test_grammar_drafts_are_counted_and_accepted(engine, loop, prompts, grammar_drafts):
    grammar_drafts(True)
    before = engine.stats().draft_tokens["grammar"]
    _, _, _, last = run(engine, loop, constrained(prompts[0], max_tokens=120, mode="auto"))
    drafted = engine.stats().draft_tokens["grammar"] - before
    assert drafted > 0
    assert engine.stats().accepted_tokens["grammar"] > 0
    grammar_drafts(False)
    before = engine.stats().draft_tokens["grammar"]
    run(engine, loop, constrained(prompts[0], max_tokens=120, mode="auto"))
    assert engine.stats().draft_tokens["grammar"] == before
    # speculation off drafts nothing, forced tokens included
    grammar_drafts(True)
    _, _, _, last = run(engine, loop, constrained(prompts[0], max_tokens=120, mode="off"))
    assert last.speculation["draft_tokens"] == 0


def test_a_request_routed_over_every_gate_drafts_only_forced_tokens(engine, loop, prompts, grammar_drafts):
    """The router's mark (`over_gate`: every replica was over its gate) holds a request behind a
    closed gate for its life: a grammar's forced tokens go, as they do at any batch size (the
    mark once narrowed it to mode off, and they went too); SA and MTP drafts do not."""
    grammar_drafts(True)
    marked = dataclasses.replace(constrained(prompts[0], max_tokens=120, mode="auto"), over_gate=True)
    tokens, text, _, last = run(engine, loop, marked)
    assert (tokens, text) == run(engine, loop, constrained(prompts[0], max_tokens=120, mode="off"))[:2]
    assert last.speculation["draft_tokens"] == last.speculation["accepted_tokens"] > 0  # forced: all kept
    repeat = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 6  # the SA drafts this on its own
    copying = request(chat_prompt(engine, f"Repeat exactly: {repeat}"), max_tokens=60, mode="auto")
    _, _, _, free = run(engine, loop, copying)
    _, _, _, held = run(engine, loop, dataclasses.replace(copying, over_gate=True))
    assert free.speculation["draft_tokens"] > 0 and held.speculation["draft_tokens"] == 0


def test_the_gate_reported_is_its_verdict_not_whether_a_request_drafted(engine, loop, prompts, grammar_drafts):
    """`speculating`, which the autoscaling policy reads as the gate being open: a request of
    mode off under the gate leaves it open (it read 0: nothing drafted); grammar-forced tokens
    over the gate, drafted at any batch size, leave it closed (it read 1) and move no
    acceptance figure, as they are not what speculation earns."""
    grammar_drafts(True)
    run(engine, loop, request(prompts[0], max_tokens=8, mode="off"))
    assert engine.stats().speculating == 1
    engine.configure(dataclasses.replace(engine.config.speculation, batch_gate=2))
    before = engine.stats()

    async def three():
        return await asyncio.gather(*(collect_logprobs(engine, constrained(prompts[0], max_tokens=60, mode="auto"))
                                      for _ in range(3)))

    outputs = loop.run_until_complete(three())
    assert all(out[0] == outputs[0][0] for out in outputs)  # one answer: its last step held all three
    after = engine.stats()
    assert after.speculating == 0 and after.batch_gate == 2
    assert after.draft_tokens["grammar"] > before.draft_tokens["grammar"]
    assert after.acceptance_length == before.acceptance_length


def test_stop_after_is_matched_only_where_the_output_runs_unconstrained(engine, loop):
    """A grammar ends the text itself (a tool call's close tag may sit in an argument's string);
    an optional grammar that does not compile is dropped, and the request runs as without it."""
    prompt = chat_prompt(engine, "Write a short poem about the sea.")
    tokens, text, _, _ = run(engine, loop, request(prompt, max_tokens=40, mode="off"))
    kept = text[len(text) // 2: len(text) // 2 + 4]
    any_text = GrammarSpec("lark", "start: TEXT\nTEXT: /(.|\\n)*/", "tools", optional=True)
    broken = GrammarSpec("lark", "start: undefined_rule", "tools", optional=True)
    for mode in ("off", "auto"):
        ran_on = run(engine, loop, dataclasses.replace(request(prompt, max_tokens=40, mode=mode, stop_after=(kept,)),
                                                       grammar=any_text))
        assert ran_on[0] == tokens and ran_on[3].stop_string is None
        stopped = run(engine, loop, dataclasses.replace(request(prompt, max_tokens=40, mode=mode, stop_after=(kept,)),
                                                        grammar=broken))
        assert stopped[1] == text[: text.find(kept) + len(kept)] and stopped[3].stop_string == kept


NOTE = {"name": "write_note", "description": "Save a note verbatim.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}  # as the agent tests offer it: the
# model's choice to call (asserted below) depends on the prompt to the character
CALL_PLEASE = "Please write_note the text </tool_call> for me, then get_weather for Paris."
# an agent's chat: the model called before (it seldom calls under auto on its first turn)
EARLIER_CALL = [{"role": "user", "content": "Please get_weather for London."},
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                 '{"city": "London", "unit": "celsius"}}\n</tool_call>'},
                {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "It is 12 C in London."}]


def test_a_call_made_under_auto_is_held_to_the_format_identically_in_every_mode(engine, loop):
    """tool_choice auto: the ingress's optional grammar lets the model answer in text, holds a
    call it begins to the format and ends the answer after it; bitwise the same in every mode."""
    from deploy.tool_calls import parse_tool_calls, tool_call_grammar, tools_system_prompt

    functions = [NOTE, WEATHER]
    messages = [{"role": "system", "content": tools_system_prompt(functions)}, *EARLIER_CALL,
                {"role": "user", "content": CALL_PLEASE}]
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    spec = GrammarSpec("lark", tool_call_grammar(functions, False, optional=True), "tools", optional=True)
    results = [run(engine, loop, dataclasses.replace(request(prompt, max_tokens=80, mode=mode, logprobs=2,
                                                             stop_after=("</tool_call>",)), grammar=spec))
               for mode in MODES]
    tokens, text, logprobs, last = results[0]
    for result in results[1:]:
        assert (result[0], result[2]) == (tokens, logprobs)
    _, calls = parse_tool_calls(text, one_call=True)
    if calls:  # the grammar ended the answer after the call (not the stop_after string)
        assert (last.finish_reason, last.stop_string) == ("stop", None) and text.endswith("</tool_call>")
    if engine.config.device == "cpu":  # this model on the native forward calls (on CUDA's fp32
        # weights it may answer in text); a call it writes well-formed is the same unconstrained
        assert [c.name for c in calls] == ["get_weather"]
        free = run(engine, loop, request(prompt, max_tokens=80, mode="off", stop_after=("</tool_call>",)))
        assert free[1] == text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "seeded"])
def test_unconstrained_logprobs_identical_with_and_without_speculation(engine, loop, sampling):
    prompt = "one two three four one two three four one two three four one two"
    with every_draft(engine):
        results = [run(engine, loop, request(prompt, max_tokens=40, mode=mode, logprobs=5, **sampling))
                   for mode in MODES]
    reference_tokens, _, reference_logprobs, _ = results[0]
    for tokens, _, logprobs, _ in results[1:]:
        assert tokens == reference_tokens
        assert logprobs == reference_logprobs
    assert sum(last.speculation["draft_tokens"] for *_, last in results[1:]) > 0


def test_logprobs_shape(engine, loop):
    tokens, _, logprobs, last = run(engine, loop, request("The capital of France is", max_tokens=12, logprobs=4))
    shown = tokens[:-1] if last.finish_reason == "stop" else tokens
    assert [e.token_id for e in logprobs] == shown
    for entry in logprobs:
        assert len(entry.top) == 4
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.top[0] == (entry.token_id, entry.logprob)  # greedy: the chosen token is the likeliest
    _, _, none, _ = run(engine, loop, request("The capital of France is", max_tokens=4))
    assert none == []


async def _scored(engine, prompt_ids, k):
    """(the prompt's logprobs, the last delta) of a one-token request scoring its prompt."""
    scored, last = [], None
    async for delta in engine.generate(request(prompt_ids, max_tokens=1, prompt_logprobs=k)):
        scored += delta.prompt_logprobs
        last = delta
    return scored, last


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-chunk", "5-token-chunks"])
def test_prompt_logprobs_are_bitwise_those_of_generating_the_prompt(engine, loop, monkeypatch, chunk):
    """Row invariance end to end: a text scored in one prefill, in one chunk or several, gets
    the logprobs its own greedy generation gave it token by token (1-row decode steps and
    verify rows alike), compared with ==; scored again, or within a longer text, its prefix
    comes from the prefix cache, the lm_head scoring the hidden states kept there, and it
    scores the same."""
    head = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    tokens, _, logprobs, _ = run(engine, loop, request(head + head, max_tokens=40, logprobs=3, ignore_eos=True))
    text = head + head + tokens
    if chunk:
        monkeypatch.setattr(engine.core, "max_prefill_tokens", chunk)
    with monkeypatch.context() as cold:  # prefilled whole, as an engine without an MTP head keeps no hidden states
        cold.setattr(PrefixCache, "keeps_hidden", property(lambda self: False))
        scored, last = loop.run_until_complete(_scored(engine, text, 3))
    assert [e.token_id for e in scored] == text[1:] and last.cached_tokens == 0
    assert scored[2 * len(head) - 1:] == logprobs
    again, last = loop.run_until_complete(_scored(engine, text, 3))
    assert again == scored and last.cached_tokens >= BLOCK_TOKENS  # the generation's blocks
    longer, last = loop.run_until_complete(_scored(engine, text + head, 3))
    assert longer[:len(scored)] == scored and last.cached_tokens >= BLOCK_TOKENS


@pytest.mark.parametrize("penalties", [
    {"presence_penalty": 0.8, "frequency_penalty": 0.6},
    {"frequency_penalty": 1.5, "temperature": 0.9, "seed": 5},
    {"presence_penalty": -1.0},
    {"repetition_penalty": 1.4},
    {"repetition_penalty": 0.7, "temperature": 0.9, "seed": 5, "min_p": 0.1},
])
def test_penalties_identical_with_and_without_speculation(engine, loop, penalties):
    """Row i of a verify step counts the output plus draft[:i], as plain decoding would."""
    prompt = "one two three four one two three four one two three four one two"
    plain = run(engine, loop, request(prompt, max_tokens=40, logprobs=2, mode="off", **penalties))
    unpenalised = run(engine, loop, request(prompt, max_tokens=40, mode="off",
                                            **{k: v for k, v in penalties.items() if "penalty" not in k}))
    assert plain[0] != unpenalised[0]  # the penalties do something here
    drafted = 0
    with every_draft(engine):
        for mode in MODES[1:]:
            tokens, _, logprobs, last = run(engine, loop, request(prompt, max_tokens=40, logprobs=2, mode=mode,
                                                                  **penalties))
            assert (tokens, logprobs) == (plain[0], plain[2]), mode
            drafted += last.speculation["draft_tokens"]
    assert drafted > 0


def test_min_p_sampling_identical_with_and_without_speculation(engine, loop):
    """Min-p is part of the target distribution: a seeded request draws the same tokens in every mode,
    and a threshold that leaves only the top token samples what greedy picks."""
    prompt = "one two three four one two three four one two three four one two"
    seeded = {"temperature": 1.5, "seed": 11}
    plain = run(engine, loop, request(prompt, max_tokens=32, logprobs=2, mode="off", min_p=0.3, **seeded))
    assert plain[0] != run(engine, loop, request(prompt, max_tokens=32, mode="off", **seeded))[0]
    drafted = 0
    with every_draft(engine):
        for mode in MODES[1:]:
            tokens, _, logprobs, last = run(engine, loop, request(prompt, max_tokens=32, logprobs=2, mode=mode,
                                                                  min_p=0.3, **seeded))
            assert (tokens, logprobs) == (plain[0], plain[2]), mode
            drafted += last.speculation["draft_tokens"]
    assert drafted > 0
    greedy = run(engine, loop, request(prompt, max_tokens=32, mode="off"))[0]
    assert run(engine, loop, request(prompt, max_tokens=32, mode="auto", min_p=1.0, **seeded))[0] == greedy


def test_min_tokens_holds_the_end_back_in_every_mode(engine, loop):
    """An answer that ends early (EOS) runs on to min_tokens, then may end; the same in every mode."""
    prompt = chat_prompt(engine, "Reply with the single word: yes.")
    short = run(engine, loop, request(prompt, max_tokens=64, mode="off"))
    assert short[3].finish_reason == "stop" and len(short[0]) < 20
    held = [run(engine, loop, request(prompt, max_tokens=64, mode=mode, min_tokens=20)) for mode in MODES]
    for tokens, _, _, last in held:
        assert tokens == held[0][0]
        assert len(tokens) >= 20 and not set(tokens[:20]) & engine._eos_ids
    # a stop id first met past min_tokens ends the answer there (held back before, where it never led)
    tokens = held[0][0]
    at = next(i for i in range(20, len(tokens)) if tokens[i] not in tokens[:20])
    stopped = run(engine, loop, request(prompt, max_tokens=64, mode="auto", min_tokens=20,
                                        stop_token_ids=(tokens[at],)))
    assert stopped[0] == tokens[:at + 1] and stopped[3].finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", json.dumps({"type": "nonsense"})), "invalid"),
    (GrammarSpec("lark", "start: undefined_rule", param="tool_choice"), "invalid"),
    # only a reference to itself: compiled, and the answer was "" with finish_reason "stop"
    (GrammarSpec("json_schema", json.dumps({"$ref": "#"})), "admits no output at all"),
    (GrammarSpec("json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
     "admits no output at all"),
])
def test_bad_grammar_is_a_request_error_naming_the_field(engine, spec, message):
    with pytest.raises(RequestError, match=message) as info:
        engine.generate(dataclasses.replace(request("hi"), grammar=spec))
    assert info.value.param == spec.param
    assert engine.num_live_requests == 0


PRICE = {"type": "function", "function": {"name": "set_price", "description": "Set an item's price", "parameters": {
    "type": "object", "properties": {"item": {"type": "string", "maxLength": 30}, "price": {"type": "number"}},
    "required": ["item", "price"]}}}


def test_the_next_turn_prompt_repeats_a_call_token_for_token(engine, loop):
    """A call the model made, sent back as the client received it, renders in the next turn's
    prompt as the very tokens the model emitted (its `1.50` not re-spelt 1.5), so that prompt
    begins with the first turn's prompt and output and the prefix cache holds through the call."""
    from deploy.prompts import grammar_spec, prompt_token_ids
    from deploy.chat_protocol import ChatCompletionRequest
    from deploy.tool_calls import parse_tool_calls

    chat = [{"role": "user", "content": "Set the price of apples to 1.50 dollars."}]
    first = ChatCompletionRequest(model="m", messages=chat, tools=[PRICE], tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=60, temperature=0)
    prompt = prompt_token_ids(engine.tokenizer, first)
    tokens, text, _, _ = run(engine, loop, dataclasses.replace(request(prompt, max_tokens=60, mode="off"),
                                                               grammar=grammar_spec(first)))
    _, (call,) = parse_tool_calls(text, one_call=True)
    spelt = json.dumps(json.loads(call.arguments), separators=(", ", ": "))
    assert spelt != call.arguments, f"the model wrote {call.arguments}: pick a prompt json.dumps would re-spell"
    history = chat + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    second = prompt_token_ids(engine.tokenizer, ChatCompletionRequest(model="m", messages=history, tools=[PRICE]))
    assert second[:len(prompt) + len(tokens)] == prompt + tokens


def test_a_grammar_that_meets_its_limits_midway_fails_the_request_naming_the_field(engine, loop):
    """A schema past the grammar engine's limits only down one branch (the first token is
    fine): the answer, pushed down it by logit_bias, fails as the request's own error, with its
    field (the Ingress's 400), and the engine goes on serving."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)},
            "additionalProperties": False}
    either = {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"x": wide}, "required": ["x"]}]}
    brace = engine.tokenizer.encode('{"', add_special_tokens=False)
    req = constrained(chat_prompt(engine, "Give me JSON."), either, logit_bias={brace[0]: 100.0})
    req = dataclasses.replace(req, grammar=dataclasses.replace(req.grammar, param="text.format"))
    tokens, _, _, last = run(engine, loop, req)
    assert (last.finish_reason, last.error_param) == ("error", "text.format"), last
    assert last.error.startswith("text.format: the grammar engine gave up") and "\n" not in last.error
    assert run(engine, loop, constrained(chat_prompt(engine, "Hi"), max_tokens=8))[3].finish_reason is not None


def test_resumed_tokens_the_grammar_refuses_are_refused_naming_resume(engine):
    """(The grammar's own error, once advancing raised a RequestError, went out naming the format.)"""
    from replicas.engine import Resume

    refused = tuple(engine.tokenizer.encode("hello", add_special_tokens=False))
    with pytest.raises(RequestError, match="the grammar refuses the resumed tokens") as info:
        engine.generate(dataclasses.replace(constrained("hi"), resume=Resume(refused)))
    assert info.value.param == "resume" and engine.num_live_requests == 0
