"""Anthropic's `/v1/messages` against the real application (real model, MTP on) over HTTP with the
official `anthropic` client: answers equal to the chat completion they mean, the client's stream
helper rebuilding the same message, tool use and its round trip, token counts."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local Serve cluster running the real model

MODEL = "smollm2-135m-instruct"
OFF = {"speculation": {"mode": "off"}}
GREEDY = {"temperature": 0}  # earlier clients' setting; the current client sends none
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def claude(agent_url):
    return anthropic.Anthropic(base_url=agent_url, api_key="unused", max_retries=0, timeout=300)


def test_an_answer_is_the_chat_completion_it_means_exactly_under_speculation(claude, agent_client):
    chat = agent_client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer in one sentence."},
                               {"role": "user", "content": "Why is the sky blue?"}],
        max_completion_tokens=48, temperature=0, extra_body=OFF)
    message = claude.messages.create(model=MODEL, system="Answer in one sentence.", max_tokens=48, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Why is the sky blue?"}])
    assert [block.type for block in message.content] == ["text"]
    assert message._request_id.startswith("req_")  # the SDK's, from Anthropic's request-id header
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model=MODEL, system="Answer in one sentence.",
                                           messages=[{"role": "user", "content": "Why is the sky blue?"}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_the_stream_helper_rebuilds_the_message(claude):
    kwargs = dict(model=MODEL, max_tokens=24, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Name three colours of the rainbow."}])
    plain = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_and_its_round_trip(claude, stream):
    ask = dict(model=MODEL, max_tokens=80, extra_body=GREEDY, messages=ASK_WEATHER, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    if stream:
        with claude.messages.stream(**ask) as events:
            partial = "".join(e.delta.partial_json for e in events
                              if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
            message = events.get_final_message()
        assert json.loads(partial) == message.content[-1].input
    else:
        message = claude.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    call = message.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])

    turn = [block.model_dump(exclude_none=True) for block in message.content]
    answer = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ASK_WEATHER, {"role": "assistant", "content": turn},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}])
    assert answer.content and answer.usage.cache_read_input_tokens > 0  # the turn before is the prefix cache's


def test_the_sdks_tool_runner_goes_on_without_the_thread_it_asks_for(claude, agent_url):
    """The anthropic SDK's tool runner asks for a message thread (kept by the server) and goes
    on without one when told, in the error's details, that the server cannot keep it: it was
    a 400 naming `thread` that ended the run (found by QA)."""
    calls = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "18 C, sunny"

    replies = list(claude.beta.messages.tool_runner(
        model=MODEL, max_tokens=60, messages=ASK_WEATHER, tools=[get_weather], max_iterations=2,
        tool_choice={"type": "tool", "name": "get_weather"}))
    assert len(replies) == 2 and len(calls) == 2 and replies[0].stop_reason == "tool_use"
    refused = httpx.post(f"{agent_url}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 8, "messages": ASK_WEATHER, "thread": {"type": "create"}})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "thread"
    assert error["details"] == {"error_code": "thread_unsupported_request", "unsupported": []}


def test_output_config_format_gives_json_valid_against_the_schema(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    message = claude.messages.create(model=MODEL, max_tokens=60, messages=[
        {"role": "user", "content": "Name a large city and its country as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)
    # a prefilled answer is the JSON's start: prefill + answer validates (the answer once began
    # the object again); one the format cannot begin with is a 400 naming the format
    prefill = '{"city": "Paris", "country":'
    message = claude.messages.create(model=MODEL, max_tokens=60, messages=[
        {"role": "user", "content": "Name a large city and its country as JSON."},
        {"role": "assistant", "content": prefill}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    jsonschema.validate(json.loads(prefill + message.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(model=MODEL, max_tokens=60, messages=[
            {"role": "user", "content": "Name a large city and its country as JSON."},
            {"role": "assistant", "content": '{"town":'}],
            output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)


def test_a_stop_sequence_is_named(claude):
    kwargs = dict(model=MODEL, max_tokens=40, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Count from one to ten, in words."}])
    whole = claude.messages.create(**kwargs).content[0].text
    stop = whole.split()[2]  # the third word
    never = [f"zz{i}zz" for i in range(6)]  # more than OpenAI's 4: Anthropic documents no limit
    message = claude.messages.create(**kwargs, stop_sequences=[*never, stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == whole[:whole.find(stop)]


def test_a_tool_use_cut_short_is_one_answer_streamed_or_not(claude):
    """A forced call that max_tokens or a stop sequence cuts: its input is what the stream's
    partial_json gives the client's stream helper (not streamed it was {}; found by QA)."""
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                  extra_body=GREEDY)

    def both(**more):
        plain = claude.messages.create(**kwargs, **more)
        with claude.messages.stream(**kwargs, **more) as stream:
            final = stream.get_final_message()
        assert plain.stop_reason == final.stop_reason
        blocks = [b.model_dump(exclude={"id"}) for b in plain.content]
        assert blocks == [b.model_dump(exclude={"id"}) for b in final.content]
        return plain.stop_reason, blocks[0]["input"] if blocks else None  # none: cut before its name

    whole = both(max_tokens=60)
    assert whole[0] == "tool_use" and whole[1]["city"]
    assert both(max_tokens=60, stop_sequences=["}"]) == ("stop_sequence", whole[1])  # cut before its close
    cut = [both(max_tokens=n) for n in range(2, 40, 3)]  # before its name, in its city, after it, whole
    assert [i for r, i in cut if r == "max_tokens"][:1] == [None] and cut[-1] == whole
    assert {} in [i for _, i in cut] and whole[1] in [i for r, i in cut if r == "max_tokens"]


def test_max_tokens_stops_the_message(claude):
    message = claude.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Tell me a long story."}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5


def test_a_last_assistant_message_is_a_prefill_the_answer_continues(claude, agent_client):
    question = {"role": "user", "content": "What is the capital of France?"}
    chat = agent_client.chat.completions.create(
        model=MODEL, messages=[question, {"role": "assistant", "content": "The capital of France is"}],
        max_completion_tokens=12, temperature=0,
        extra_body={**OFF, "add_generation_prompt": False, "continue_final_message": True})
    for content in ("The capital of France is", [{"type": "text", "text": "The capital of France is"}]):
        kwargs = dict(model=MODEL, messages=[question, {"role": "assistant", "content": content}])
        message = claude.messages.create(**kwargs, max_tokens=12, extra_body=GREEDY)
        assert message.content[0].text == chat.choices[0].message.content
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
        assert claude.messages.count_tokens(**kwargs).input_tokens == chat.usage.prompt_tokens
    # an empty last answer is no prefill: the answer starts a turn, as with no such message
    fresh = claude.messages.count_tokens(model=MODEL, messages=[question]).input_tokens
    assert claude.messages.count_tokens(model=MODEL, messages=[question, {"role": "assistant", "content": ""}]
                                        ).input_tokens == fresh
    with pytest.raises(anthropic.BadRequestError, match="whitespace"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[question, {"role": "assistant", "content": "It "}])


def test_a_streams_first_usage_splits_the_prompt_as_its_last(claude):
    # sent twice: the second finds its prompt in the prefix cache, and says so from its start
    kwargs = dict(model=MODEL, max_tokens=8, extra_body=GREEDY, stream=True,
                  messages=[{"role": "user", "content": "Name a colour of the rainbow, please, and only one."}])
    for _ in range(2):
        events = list(claude.messages.create(**kwargs))
        start, delta = events[0].message.usage, next(e for e in events if e.type == "message_delta").usage
        assert (start.input_tokens, start.cache_read_input_tokens) == (delta.input_tokens,
                                                                        delta.cache_read_input_tokens)
    assert start.cache_read_input_tokens > 0


def _claude_code_request(cch: str) -> dict:
    """A request shaped as Claude Code 2.1 sends them (its fields, trimmed to a small model)."""
    cached = {"type": "ephemeral", "scope": "global", "ttl": "1h"}
    return dict(
        model=MODEL, max_tokens=16, stream=True,
        system=[{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.252; cch={cch};"},
                {"type": "text", "text": "You are a coding agent. Answer briefly.", "cache_control": cached}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "List the files."}]},
                  {"role": "assistant", "content": [  # begun on Claude: its thinking is not rendered
                      {"type": "thinking", "thinking": "List them.", "signature": "sig"},
                      {"type": "redacted_thinking", "data": "opaque"},
                      {"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                      {"type": "text", "text": "main.py\nREADME.md"}, {"type": "tool_reference", "tool_name": "ls"}]}]},
                  {"role": "system", "content": "Keep answers under one line."},
                  {"role": "user", "content": [
                      {"type": "text", "text": "Which is the code?", "cache_control": cached}]}],
        tools=[{"name": "ls", "description": "List files.", "input_schema": {"type": "object", "properties": {}},
                "eager_input_streaming": True}],
        thinking={"type": "adaptive", "budget_tokens": 0}, metadata={"user_id": "user_abc@host:1"},
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}, diagnostics={"session": "s1"},
        output_config={"effort": "xhigh"})


def test_a_claude_code_request_is_answered_and_its_prompt_cached_across_requests(agent_url):
    # its billing header changes with every request: left out, the next request finds the prompt cached
    usages = []
    for cch in ("fa690", "0b1c2"):
        with httpx.Client(base_url=agent_url, timeout=300) as client:
            with client.stream("POST", "/v1/messages", json=_claude_code_request(cch)) as response:
                assert response.status_code == 200, response.read()
                events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "message_stop"
        usages.append(next(e for e in events if e["type"] == "message_delta")["usage"])
    prompt = usages[0]["input_tokens"] + usages[0]["cache_read_input_tokens"]
    assert usages[1]["input_tokens"] + usages[1]["cache_read_input_tokens"] == prompt
    assert usages[1]["cache_read_input_tokens"] >= prompt - 32  # all but its last, partial block
