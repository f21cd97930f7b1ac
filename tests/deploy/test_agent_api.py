"""What agent clients send, against the real application (real model, MTP on) over HTTP with the
official `openai` client: structured output (`parse`, json_schema, json_object), tool calls
(forced, named, streamed, under auto, a whole round trip), logprobs, logit_bias and predicted outputs,
exact under speculation."""

from __future__ import annotations

import json
from typing import List, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field


pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local Serve cluster running the real model

MODEL = "smollm2-135m-instruct"
OFF = {"speculation": {"mode": "off"}}


class Pet(BaseModel):
    name: str = Field(max_length=30)
    species: Literal["cat", "dog", "parrot"]
    age_years: int = Field(ge=0, le=40)
    tricks: List[str] = Field(max_length=3)


PET_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "species": {"enum": ["cat", "dog", "parrot"]},
                   "age_years": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["name", "species", "age_years"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_parse_returns_a_validated_object(agent_client):
    completion = agent_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a pet and describe it."}],
        response_format=Pet, max_completion_tokens=120, temperature=0)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, Pet)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_over_prompts_and_seeds(agent_client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}
    for topic in ("a farm animal", "a lazy cat", "a loud parrot"):
        for seed in (1, 2):
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
                          response_format=response_format, max_tokens=100, temperature=1.0, seed=seed)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in agent_client.chat.completions.create(
                    **kwargs, stream=True) if c.choices)
            else:
                text = agent_client.chat.completions.create(**kwargs).choices[0].message.content
            jsonschema.validate(json.loads(text), PET_SCHEMA)


def test_json_object_on_completions(agent_client):
    out = agent_client.completions.create(model=MODEL, prompt="A JSON object describing the planet Mars:\n",
                                    max_tokens=150, temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_constrained_output_identical_with_speculation_off(agent_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a dog as JSON."}], max_tokens=80,
                  temperature=0, logprobs=True, top_logprobs=2,
                  response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}})
    spec = agent_client.chat.completions.create(**kwargs)
    off = agent_client.chat.completions.create(**kwargs, extra_body=OFF)
    assert spec.choices[0].message.content == off.choices[0].message.content
    assert spec.choices[0].logprobs == off.choices[0].logprobs  # floats compared exactly
    assert spec.usage.model_extra["speculation"]["draft_tokens"] > 0  # grammar-forced tokens at least
    assert off.usage.model_extra["speculation"]["steps"] == 0


def test_tool_round_trip(agent_client):
    first = agent_client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                           temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"])
    history = WEATHER_CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    final = agent_client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=40,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls
    # the answer sent back as the SDK dumps it (refusal, annotations, audio and function_call null)
    dumped = choice.message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    again = agent_client.chat.completions.create(model=MODEL, messages=[*WEATHER_CHAT, dumped, history[-1]],
                                           tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    said = [(m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []])
            for m in (again.choices[0].message, final.choices[0].message)]  # call ids are new each time
    assert said[0] == said[1]


class GetWeather(BaseModel):
    city: str = Field(max_length=40)


def test_an_answer_goes_back_as_the_sdks_helpers_return_it(agent_client):
    """The tool loop appends the message itself; parse() returns it with `parsed` and each call's
    `parsed_arguments`, the stream helper's final completion with each call's `index`: all three
    were 400s (found by QA with the official SDK)."""
    import openai

    tool = openai.pydantic_function_tool(GetWeather)
    kwargs = dict(model=MODEL, messages=WEATHER_CHAT, tools=[tool], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=40, temperature=0)
    parsed = agent_client.chat.completions.parse(**kwargs).choices[0].message
    with agent_client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert isinstance(parsed.tool_calls[0].function.parsed_arguments, GetWeather)
    assert streamed.tool_calls[0].index == 0
    for message in (parsed, streamed):
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}
        again = agent_client.chat.completions.parse(**{**kwargs, "tool_choice": "none",
                                                       "messages": [*WEATHER_CHAT, message, result]})
        assert again.choices[0].message.content


def test_a_call_made_under_auto_is_held_to_its_schema_as_with_speculation_off(agent_client):
    """tool_choice auto: the model decides (here it calls, as it did earlier in the chat), and the
    call it begins is held to the format and the schema by the optional grammar, ending the
    answer; bitwise as speculation off."""
    note = {"type": "function", "function": {
        "name": "write_note", "description": "Save a note verbatim.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    earlier = {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "London", "unit": "celsius"}'}}
    chat = [{"role": "user", "content": "Please get_weather for London."},
            {"role": "assistant", "content": None, "tool_calls": [earlier]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
            {"role": "assistant", "content": "It is 12 C in London."},
            {"role": "user", "content": "Please write_note the text </tool_call> for me, then get_weather for Paris."}]
    kwargs = dict(model=MODEL, messages=chat,
                  tools=[note, WEATHER], parallel_tool_calls=False, max_tokens=80, temperature=0, logprobs=True)
    spec, off = (agent_client.chat.completions.create(**kwargs, extra_body=extra) for extra in ({}, OFF))
    choice = spec.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert choice.message.content == off.choices[0].message.content
    assert [c.function for c in off.choices[0].message.tool_calls] == [call.function]
    assert choice.logprobs == off.choices[0].logprobs


def test_under_a_format_auto_answers_in_it_or_calls(agent_client):
    """Tools under auto beside a response format (an agent SDK's tools and output type): the
    model may call, or answers in the format. The format alone once held every answer to it, so
    no tool was ever called (found by QA)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    calling = agent_client.chat.completions.create(
        model=MODEL, messages=WEATHER_CHAT, tools=[WEATHER, TIME],
        response_format=fmt, parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert calling.choices[0].finish_reason == "tool_calls" and calling.choices[0].message.content is None
    (call,) = calling.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    answering = agent_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet dog as JSON."}], tools=[WEATHER, TIME],
        response_format=fmt, parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert answering.choices[0].finish_reason == "stop" and not answering.choices[0].message.tool_calls
    jsonschema.validate(json.loads(answering.choices[0].message.content), PET_SCHEMA)


def test_a_continued_answer_keeps_its_leading_space_beside_tools(agent_client):
    """A prefilled answer's continuation (` is ...` after `The weather in Paris`) keeps its
    leading whitespace with tools offered, streamed or not: the tool-call parser once dropped
    it as it does a fresh answer's (found by QA)."""
    kwargs = dict(model=MODEL, tools=[WEATHER], max_tokens=8, temperature=0, logprobs=True,
                  messages=[{"role": "user", "content": "Describe Paris"},
                            {"role": "assistant", "content": "The weather in Paris"}],
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = agent_client.chat.completions.create(**kwargs).choices[0]
    content, _, _, _ = _streamed_calls(agent_client, kwargs)
    assert plain.message.content == content == "".join(t.token for t in plain.logprobs.content)
    assert content[0].isspace()


def test_named_tool_choice_streamed_assembles_into_the_plain_call(agent_client):
    # a named function is called once, as vLLM's, parallel calls allowed or not (this 135M model
    # repeated its call until max_tokens: instructor's default mode names one and allows them)
    kwargs = dict(model=MODEL, messages=WEATHER_CHAT, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    plain = agent_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert len(plain) == 1
    _, names, arguments, finish = _streamed_calls(agent_client, kwargs)
    assert finish == "tool_calls"
    assert names == [c.function.name for c in plain] and names[0] == "get_time"
    assert arguments == [c.function.arguments for c in plain]
    assert "timezone" in json.loads(arguments[0])


def test_allowed_tools_narrow_the_calls_but_not_the_prompt(agent_client, agent_url):
    """OpenAI's `allowed_tools` tool choice (was a 400): every tool is in the prompt, calls name
    only the allowed ones; `required` calls, on chat and the Responses API alike."""
    allowed = {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}
    kwargs = dict(model=MODEL, messages=WEATHER_CHAT, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
                  parallel_tool_calls=False)  # (this model repeats a call it may repeat until max_tokens)
    narrowed = agent_client.chat.completions.create(**kwargs, tool_choice={"type": "allowed_tools",
                                                                           "allowed_tools": allowed})
    assert narrowed.choices[0].finish_reason == "tool_calls"
    assert {c.function.name for c in narrowed.choices[0].message.tool_calls} == {"get_time"}
    forced = agent_client.chat.completions.create(**kwargs, tool_choice="required")
    assert narrowed.usage.prompt_tokens == forced.usage.prompt_tokens  # both tools offered
    response = agent_client.responses.create(
        model=MODEL, input=WEATHER_CHAT[0]["content"], max_output_tokens=80, temperature=0, parallel_tool_calls=False,
        tools=[{"type": "function", **t["function"]} for t in (WEATHER, TIME)],
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]})
    assert [item.name for item in response.output] == [c.function.name for c in narrowed.choices[0].message.tool_calls]
    refused = httpx.post(f"{agent_url}/v1/chat/completions", json={**kwargs, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "get_news"}}]}}}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice", refused.text


def _streamed_calls(client, kwargs):
    """A streamed chat answer assembled: (content, call names, their arguments, finish_reason)."""
    content, names, arguments, finish = None, {}, {}, None  # content null until some comes (OpenAI's)
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content is not None:
            content = (content or "") + chunk.choices[0].delta.content
        indices = [fragment.index for fragment in chunk.choices[0].delta.tool_calls or []]
        assert len(indices) == len(set(indices)), indices  # a call's pieces in one chunk are one fragment
        for fragment in chunk.choices[0].delta.tool_calls or []:
            if fragment.function.name:
                names[fragment.index] = fragment.function.name
            arguments[fragment.index] = arguments.get(fragment.index, "") + (fragment.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    return content, [names[i] for i in sorted(names)], [arguments[i] for i in sorted(arguments)], finish


def test_calls_cut_by_max_tokens_are_one_answer_streamed_or_not(agent_client):
    # Parallel calls allowed: this model repeats its call until max_tokens cuts the answer. The
    # calls before the cut are calls, the cut one (named) keeps its arguments as far as written,
    # no markup is left in the content, and the answer says it was cut (as OpenAI's: "length",
    # not "tool_calls"), streamed or not.
    for max_tokens in range(40, 100, 7):
        kwargs = dict(model=MODEL, messages=WEATHER_CHAT, tools=[WEATHER, TIME], max_tokens=max_tokens,
                      temperature=0, tool_choice="required")
        plain = agent_client.chat.completions.create(**kwargs)
        calls = plain.choices[0].message.tool_calls
        content, names, arguments, finish = _streamed_calls(agent_client, kwargs)
        assert calls and "<tool_call>" not in (plain.choices[0].message.content or "") + (content or "")
        assert (content, names, arguments, finish) == (
            plain.choices[0].message.content, [c.function.name for c in calls], [c.function.arguments for c in calls],
            plain.choices[0].finish_reason)
        assert finish == "length" and plain.usage.completion_tokens == max_tokens
        for call in calls[:-1]:
            json.loads(call.function.arguments)


def test_a_call_cut_by_a_stop_string_is_one_answer_streamed_or_not(agent_client):
    """A stop string that ends the output inside a call cuts it as max_tokens does: not
    streamed, the answer once was the call's raw markup as content, while the stream had sent
    the call (found by QA). The answer says it was cut: finish_reason stop, stop_reason the string."""
    kwargs = dict(model=MODEL, messages=WEATHER_CHAT, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    whole = agent_client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0].function.arguments
    stop = whole[whole.index('"') + 1:][:4]  # inside the arguments: the start of the first key
    plain = agent_client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    content, names, arguments, finish = _streamed_calls(agent_client, dict(kwargs, stop=[stop]))
    assert plain.message.content is None and content is None
    assert [c.function.name for c in plain.message.tool_calls] == names == ["get_weather"]
    assert [c.function.arguments for c in plain.message.tool_calls] == arguments == [whole[:whole.index(stop)].rstrip()]
    assert plain.finish_reason == finish == "stop" and plain.model_extra["stop_reason"] == stop


def test_chat_logprobs_shapes_and_streaming(agent_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16,
                  temperature=0, logprobs=True, top_logprobs=3)
    plain = agent_client.chat.completions.create(**kwargs)
    content = plain.choices[0].logprobs.content
    shown = plain.usage.completion_tokens - (plain.choices[0].finish_reason == "stop")
    assert len(content) == shown
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = [e for c in agent_client.chat.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == content
    plain_off = agent_client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain_off.choices[0].logprobs is None


def test_completion_logprobs_shapes_and_speculation(agent_client):
    kwargs = dict(model=MODEL, prompt="a b c d a b c d a b c d a b", max_tokens=12, temperature=0, logprobs=2)
    spec = agent_client.completions.create(**kwargs)
    off = agent_client.completions.create(**kwargs, extra_body=OFF)
    lp = spec.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    # the 2 likeliest and the token itself where it is not one of them (OpenAI's legacy k + 1)
    assert all(len(top) <= 3 and token in top for token, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    assert spec.usage.model_extra["speculation"]["draft_tokens"] > 0
    assert spec.choices[0].text == off.choices[0].text and lp == off.choices[0].logprobs


def test_logit_bias_bans_and_forces_tokens(agent_client):
    # (exact under speculation, drafts asserted: tests/torch_engine/test_engine_exactness.py)
    from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir())
    (banana,) = tokenizer.encode(" banana", add_special_tokens=False)
    kwargs = dict(model=MODEL, prompt="a b c d a b c d a b c d a b", max_tokens=6, temperature=0)
    plain = agent_client.completions.create(**kwargs).choices[0].text
    assert agent_client.completions.create(**kwargs, logit_bias={str(banana): 100}).choices[0].text == " banana" * 6
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = agent_client.completions.create(**kwargs, logit_bias={str(first): -100})
    off = agent_client.completions.create(**kwargs, logit_bias={str(first): -100}, extra_body=OFF)
    assert banned.choices[0].text == off.choices[0].text != plain


def test_vllm_sampling_extras_reach_the_engine(agent_client):
    """vLLM's `min_tokens`, `stop_token_ids`, `repetition_penalty` and `min_p`, as its clients send
    them (`extra_body`); exact under speculation (tests/torch_engine/test_engine_grammar.py)."""
    from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir())
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Reply with the single word: yes."}],
               max_tokens=40, temperature=0)
    short = agent_client.chat.completions.create(**ask)
    ended = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and ended < 30
    held = agent_client.chat.completions.create(**ask, extra_body={"min_tokens": ended + 8})
    assert held.usage.completion_tokens >= ended + 8
    ids = tokenizer.encode(short.choices[0].message.content, add_special_tokens=False)
    at = next(i for i in range(len(ids) // 2, len(ids)) if ids[i] not in ids[:i])  # a token first met there
    cut = agent_client.chat.completions.create(**ask, extra_body={"stop_token_ids": [ids[at]]})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == tokenizer.decode(ids[:at])
    # which stop ended it (vLLM's `stop_reason`): the stop id, the stop string, or none for EOS
    assert short.choices[0].model_extra["stop_reason"] is None
    assert cut.choices[0].model_extra["stop_reason"] == ids[at]
    word = tokenizer.decode(ids[at:at + 1]).strip() or tokenizer.decode(ids[at:at + 2]).strip()
    by_string = agent_client.chat.completions.create(**ask, stop=[word])
    assert by_string.choices[0].model_extra["stop_reason"] == word
    chunks = list(agent_client.chat.completions.create(**ask, stop=[word], stream=True))
    assert [c.choices[0].model_extra.get("stop_reason") for c in chunks if c.choices[0].finish_reason] == [word]
    repeat = dict(model=MODEL, prompt="a b c d a b c d a b c d a b", max_tokens=12, temperature=0)
    plain = agent_client.completions.create(**repeat).choices[0].text
    assert agent_client.completions.create(**repeat, extra_body={"repetition_penalty": 1.8}).choices[0].text != plain
    assert agent_client.completions.create(**{**repeat, "temperature": 1.5}, seed=3,
                                           extra_body={"min_p": 1.0}).choices[0].text == plain


def test_tokenize_counts_what_the_completion_would_and_detokenize_inverts_it(agent_client, agent_url):
    """vLLM's /tokenize and /detokenize: a prompt or a chat counts the prompt tokens its completion
    uses, and the ids come back as the text."""
    prompt = "The quick brown fox jumps over the lazy dog."
    counted = httpx.post(f"{agent_url}/tokenize", json={"prompt": prompt, "return_token_strs": True}, timeout=60).json()
    used = agent_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert counted["count"] == len(counted["tokens"]) == len(counted["token_strs"]) == used
    assert counted["max_model_len"] == 1024
    chat = {"messages": WEATHER_CHAT, "tools": [WEATHER]}
    chat_count = httpx.post(f"{agent_url}/tokenize", json={"model": MODEL, **chat}, timeout=60).json()["count"]
    assert chat_count == agent_client.chat.completions.create(model=MODEL, max_tokens=1, **chat).usage.prompt_tokens
    text = httpx.post(f"{agent_url}/detokenize", json={"tokens": counted["tokens"]}, timeout=60).json()["prompt"]
    assert text == prompt


def test_tokenizer_info_is_enough_to_tokenize_and_template_on_the_client(agent_url):
    """vLLM's /tokenizer_info, what lm-evaluation-harness's remote tokenizer reads (with /tokenize
    and /detokenize): the special tokens and the chat template the server renders chats with;
    nothing of the server's file system."""
    from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir())
    response = httpx.get(f"{agent_url}/tokenizer_info", timeout=60)
    info = response.json()
    assert info["eos_token"] == tokenizer.eos_token == "<|im_end|>" and info["model_max_length"] == 1024
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"]
    assert str(resolve_model_dir()) not in response.text
    eos = httpx.post(f"{agent_url}/tokenize", json={"prompt": info["eos_token"]}, timeout=60).json()["tokens"]
    assert eos == [tokenizer.eos_token_id]


def test_grammar_errors_are_400s_naming_the_field(agent_url):
    body = {"model": MODEL, "messages": WEATHER_CHAT, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}
    response = httpx.post(f"{agent_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"


def test_a_tool_schema_past_the_grammar_engines_limits_is_named_as_each_api_names_it(agent_url):
    """A forced call to a function whose parameters have no finite instance (the grammar engine
    gives up once the arguments begin): a 400 naming that function's schema (was `tool_choice`)."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    ask = [{"role": "user", "content": "Call it."}]
    for path, body, field in (
            ("/v1/chat/completions", {"messages": ask, "max_tokens": 40, "tool_choice": {
                "type": "function", "function": {"name": "f"}}, "tools": [
                WEATHER, {"type": "function", "function": {"name": "f", "parameters": endless}}]},
             "tools[1].function.parameters"),
            ("/v1/responses", {"input": "Call it.", "max_output_tokens": 40, "tool_choice": "required",
                               "tools": [{"type": "function", "name": "f", "parameters": endless}]},
             "tools[0].parameters"),
            ("/v1/messages", {"messages": ask, "max_tokens": 40, "tool_choice": {"type": "any"},
                              "tools": [{"name": "f", "input_schema": endless}]}, "tools[0].input_schema")):
        response = httpx.post(f"{agent_url}{path}", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field, response.text


def test_predicted_outputs(agent_client, agent_url):
    # OpenAI's Predicted Outputs (`prediction`), as editors send a file they expect back: the
    # answer is the one without it, streamed or not, and usage counts the prediction's tokens
    # the answer has (accepted) and those it has not (rejected).
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a haiku about autumn leaves."}],
                  max_tokens=48, temperature=0)
    answer = agent_client.chat.completions.create(**kwargs, extra_body=OFF).choices[0].message.content
    for prediction, rejected in ((answer, 0), ("Spreadsheets of quarterly tax law amendments." + answer, 1)):
        right = agent_client.chat.completions.create(**kwargs, prediction={"type": "content", "content": prediction})
        assert right.choices[0].message.content == answer
        details = right.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= right.usage.completion_tokens - 1
        assert (details.rejected_prediction_tokens > 0) == bool(rejected)
        chunks = list(agent_client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True},
            prediction={"type": "content", "content": [{"type": "text", "text": prediction}]}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        assert chunks[-1].usage.completion_tokens_details == details
    assert agent_client.chat.completions.create(**kwargs).usage.completion_tokens_details is None  # no prediction
    response = httpx.post(f"{agent_url}/v1/chat/completions", timeout=60,
                          json={**kwargs, "prediction": {"type": "text", "content": answer}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prediction.type", response.text
