"""`/v1/responses` against the real application (real model, MTP on) over HTTP with the official
`openai` client: answers equal to the chat completion they mean, streamed events that rebuild
the response, function calls and their round trip (sent back whole or by
`previous_response_id`), structured output, stored responses, and clear 4xx errors."""

from __future__ import annotations

import json
import os
import signal
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.polling import wait_until
from tests.serve_support import APP, live_actors

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local Serve cluster running the real model

MODEL = "smollm2-135m-instruct"
OFF = {"speculation": {"mode": "off"}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK_WEATHER = "What is the weather in Paris right now?"
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    size: Literal["small", "medium", "large"]


def _events(stream) -> list:
    events = list(stream)
    for event in events:  # each as the SDK's types have it (the client itself builds them leniently)
        STREAM_EVENT.validate_python(event.model_dump(exclude_unset=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_an_answer_is_the_chat_completion_it_means_exactly_under_speculation(agent_client):
    chat = agent_client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer in one sentence."},
                               {"role": "user", "content": "Why is the sky blue?"}],
        max_completion_tokens=48, temperature=0, extra_body=OFF)
    raw = agent_client.responses.with_raw_response.create(model=MODEL, instructions="Answer in one sentence.",
                                                          input="Why is the sky blue?", max_output_tokens=48,
                                                          temperature=0)
    response = Response.model_validate(raw.http_response.json())  # every field the SDK's type requires
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finished = {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert response.status == finished
    assert response.model_extra is not None and response.id.startswith("resp_")


def test_a_stream_rebuilds_the_response_and_the_stored_one(agent_client):
    kwargs = dict(model=MODEL, input="Name three colours of the rainbow.", max_output_tokens=24, temperature=0)
    plain = agent_client.responses.create(**kwargs)
    events = _events(agent_client.responses.create(**kwargs, stream=True))
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == final.output_text == plain.output_text
    assert {e.item_id for e in deltas} == {final.output[0].id}
    assert [e.type for e in events if e.type.startswith("response.output_item")] == \
        ["response.output_item.added", "response.output_item.done"]
    assert agent_client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_logprobs_are_the_chat_completions_streamed_or_not(agent_client):
    chat = agent_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}], max_completion_tokens=24,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=OFF)
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    ask = dict(model=MODEL, input="Count from one to ten.", max_output_tokens=24, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])
    plain = agent_client.responses.create(**ask)
    assert [entry.model_dump() for entry in plain.output[0].content[0].logprobs] == expected
    events = _events(agent_client.responses.create(**ask, stream=True))
    streamed = [entry.model_dump() for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert streamed == expected and len(expected) == chat.usage.completion_tokens


def test_max_output_tokens_leaves_the_response_incomplete(agent_client):
    response = agent_client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=5,
                                       temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 5


def test_calls_a_cut_falls_after_are_complete_and_the_one_it_falls_in_is_not(agent_client):
    # parallel calls allowed: the model repeats its call until max_output_tokens cuts one
    statuses = set()
    for max_output_tokens in range(25, 70, 6):
        response = agent_client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER],
                                                 tool_choice="required", max_output_tokens=max_output_tokens,
                                                 temperature=0)
        assert response.status == "incomplete" and response.output
        for item in response.output:
            try:
                json.loads(item.arguments)
                whole = True
            except ValueError:
                whole = False
            assert item.status == ("completed" if whole else "incomplete"), (max_output_tokens, item)
            statuses.add(item.status)
    assert statuses == {"completed", "incomplete"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_and_its_round_trip(agent_client, stream):
    ask = dict(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
               temperature=0, max_output_tokens=80)
    if stream:
        events = _events(agent_client.responses.create(**ask, stream=True))
        response = events[-1].response
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.item_id, e.arguments) for e in done] == [(response.output[0].id, arguments)]
    else:
        response = agent_client.responses.create(**ask)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'}
    answer = dict(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=40)
    whole = agent_client.responses.create(**answer, input=[
        {"role": "user", "content": ASK_WEATHER}, *[item.model_dump() for item in response.output],  # nulls too
        result])
    chained = agent_client.responses.create(**answer, input=[result], previous_response_id=response.id)
    # the call named by its id, as the Vercel AI SDK sends a stored one back
    referenced = agent_client.responses.create(**answer, input=[
        {"role": "user", "content": ASK_WEATHER}, {"type": "item_reference", "id": call.id}, result])
    assert whole.output_text and chained.output_text == whole.output_text == referenced.output_text
    assert chained.previous_response_id == response.id
    # the call sent again beside the response that holds it: the model would see it twice
    with pytest.raises(openai.BadRequestError) as resent:
        agent_client.responses.create(**answer, input=[call.model_dump(), result], previous_response_id=response.id)
    assert resent.value.body["param"] == "input[0].id"


def test_a_namespaced_function_is_called_as_the_same_function_offered_alone_naming_its_namespace(agent_client):
    """Codex's multi-agent tools come as a `namespace` of functions: offered to the model as the
    functions themselves (no namespace description here, so the same prompt), a call of one
    names its namespace in every event and the body, and sent back it is the same round trip."""
    weather_v1 = {"type": "namespace", "name": "weather_v1", "tools": [WEATHER]}
    ask = dict(model=MODEL, input=ASK_WEATHER, tool_choice={"type": "function", "name": "get_weather"},
               temperature=0, max_output_tokens=80)
    [flat] = agent_client.responses.create(**ask, tools=[WEATHER]).output
    events = _events(agent_client.responses.create(**ask, tools=[weather_v1], stream=True))
    [call] = events[-1].response.output
    items = [e.item for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
    assert [item.namespace for item in items] == ["weather_v1"] * 2 and call.namespace == "weather_v1"
    assert (call.name, call.arguments) == (flat.name, flat.arguments) and flat.namespace is None

    def answered(tools: list, made) -> str:
        result = {"type": "function_call_output", "call_id": made.call_id, "output": '{"temperature_c": 18}'}
        return agent_client.responses.create(model=MODEL, tools=tools, temperature=0, max_output_tokens=40, input=[
            {"role": "user", "content": ASK_WEATHER}, made.model_dump(exclude_none=True), result]).output_text

    assert answered([weather_v1], call) == answered([WEATHER], flat)


def test_a_conversation_continued_by_id_is_the_one_sent_whole_and_reuses_its_cache(agent_client):
    from replicas.torch_engine.prefix_cache import BLOCK_TOKENS

    ask = dict(model=MODEL, instructions="You are a patient teacher.", max_output_tokens=24, temperature=0)
    question = "Explain in simple words how a rainbow forms after the rain, and why its colours come in that order."
    first = agent_client.responses.create(**ask, input=question)
    follow = {"role": "user", "content": "Now explain it to a five-year-old."}
    whole = agent_client.responses.create(**ask, input=[{"role": "user", "content": question},
                                                  *[item.model_dump() for item in first.output],
                                                  follow])
    chained = agent_client.responses.create(**ask, input=[follow], previous_response_id=first.id)
    assert chained.output_text == whole.output_text and chained.usage.input_tokens == whole.usage.input_tokens
    referenced = agent_client.responses.create(**ask, input=[{"role": "user", "content": question}, *[
        {"type": "item_reference", "id": item.id} for item in first.output], follow])
    assert (referenced.output_text, referenced.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    # what each was asked with, newest first (OpenAI's order): a reference as the item it named
    listed = agent_client.responses.input_items.list(referenced.id)
    assert [(i.type, i.role) for i in listed.data] == [("message", "user"), ("message", "assistant"),
                                                       ("message", "user")]
    assert listed.data[1].id == first.output[0].id and listed.data[1].content[0].text == first.output_text
    assert [i.id for i in agent_client.responses.input_items.list(referenced.id, order="asc")] == [
        i.id for i in reversed(listed.data)]
    assert [i.content[0].text for i in agent_client.responses.input_items.list(chained.id).data] == [follow["content"]]
    # the earlier turn's prompt is the prefix cache's (in whole blocks)
    assert whole.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK_TOKENS * BLOCK_TOKENS > 0


def test_input_tokens_counts_the_prompt_a_response_sends(agent_client):
    """OpenAI's `responses.input_tokens.count`: the prompt tokens of the same request's usage,
    tools and instructions included, a conversation continued by id too (was a 405)."""
    ask = dict(instructions="Answer briefly.", input=ASK_WEATHER)
    first = agent_client.responses.create(model=MODEL, **ask, max_output_tokens=8, temperature=0)
    count = agent_client.responses.input_tokens.count(model=MODEL, **ask)
    assert (count.object, count.input_tokens) == ("response.input_tokens", first.usage.input_tokens)
    with_tools = agent_client.responses.input_tokens.count(**ask, tools=[WEATHER], tool_choice="required")
    assert with_tools.input_tokens > count.input_tokens
    follow = [{"role": "user", "content": "And in Oslo?"}]
    chained = agent_client.responses.create(model=MODEL, input=follow, previous_response_id=first.id,
                                            max_output_tokens=8, temperature=0)
    assert agent_client.responses.input_tokens.count(input=follow, previous_response_id=first.id).input_tokens \
        == chained.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        agent_client.responses.input_tokens.count(input="Hi", previous_response_id="resp_gone")
    assert err.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as err:  # nothing to count (was a 500)
        agent_client.responses.input_tokens.count(tools=[WEATHER])
    assert err.value.param == "input"


def test_parse_returns_a_validated_object(agent_client):
    response = agent_client.responses.parse(model=MODEL, input="Describe a city as JSON.", text_format=City,
                                       max_output_tokens=80, temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)


def test_json_object_format_gives_json(agent_client):
    response = agent_client.responses.create(model=MODEL, input="Give the capital of France as JSON.",
                                       text={"format": {"type": "json_object"}}, max_output_tokens=40, temperature=0)
    assert isinstance(json.loads(response.output_text), dict)


def test_store_false_keeps_nothing_and_delete_forgets(agent_client):
    unkept = agent_client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        agent_client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as err:
        agent_client.responses.create(model=MODEL, input="again", previous_response_id=unkept.id)
    # OpenAI's code, which clients (Codex's) read to send the whole conversation again
    assert (err.value.param, err.value.code) == ("previous_response_id", "previous_response_not_found")
    kept = agent_client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    agent_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        agent_client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        agent_client.responses.input_items.list(kept.id)
    for gone in (unkept, kept):  # their items cannot be named either
        with pytest.raises(openai.BadRequestError) as err:
            agent_client.responses.create(model=MODEL, max_output_tokens=4, input=[
                {"role": "user", "content": "Hi"}, {"type": "item_reference", "id": gone.output[0].id}])
        assert err.value.param == "input[1].id" and err.value.code == "item_not_found"



def _polled(client: openai.OpenAI, response_id: str, until: tuple[str, ...]) -> Response:
    seen = []
    assert wait_until(lambda: seen.append(client.responses.retrieve(response_id)) or seen[-1].status in until,
                      timeout_s=120, interval_s=0.1), seen[-1].status
    return seen[-1]


def test_a_background_response_is_queued_then_done_as_the_same_request_answered_at_once(agent_client):
    kwargs = dict(model=MODEL, instructions="Answer briefly.", input="Name three colours.", max_output_tokens=24,
                  temperature=0)
    plain = agent_client.responses.create(**kwargs)
    queued = agent_client.responses.create(**kwargs, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = _polled(agent_client, queued.id, ("completed", "incomplete", "failed"))
    assert done.status == plain.status and done.output_text == plain.output_text and done.background
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert [i.type for i in agent_client.responses.input_items.list(queued.id).data] == ["message"]
    follow = agent_client.responses.create(model=MODEL, input="One more?", max_output_tokens=4,
                                           previous_response_id=queued.id)
    assert follow.previous_response_id == queued.id
    with pytest.raises(openai.BadRequestError) as err:  # only a background response can be cancelled
        agent_client.responses.cancel(plain.id)
    assert err.value.param == "response_id" and "background" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # nor one that is done
        agent_client.responses.cancel(queued.id)
    assert err.value.param == "response_id" and done.status in err.value.message
    with pytest.raises(openai.NotFoundError):
        agent_client.responses.cancel("resp_none")
    for refused in (dict(stream=True), dict(store=False)):
        with pytest.raises(openai.BadRequestError) as err:
            agent_client.responses.create(**kwargs, background=True, **refused)
        assert err.value.param == "background"


@pytest.mark.parametrize("stop", ["cancel", "cancel in the store", "delete"])
def test_a_background_response_cancelled_or_deleted_stops_in_the_engine_and_stays_so(agent_client, stop):
    """The app runs two Ingress replicas: a cancel may reach the one running it (which stops it
    at once) or the other, which only marks it in the store, as a cancel made in the store
    itself does: the replica running it reads that within a second."""
    from ray import serve

    replica = serve.get_deployment_handle("Replica", APP)

    def live() -> int:
        return int(replica.stats.remote().result()["live_requests"])

    long = agent_client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=900,
                                         temperature=0, background=True, extra_body=OFF)
    assert _polled(agent_client, long.id, ("in_progress",)) and live() == 1
    with pytest.raises(openai.BadRequestError) as err:  # not a conversation to continue yet
        agent_client.responses.create(model=MODEL, input="And then?", previous_response_id=long.id)
    assert err.value.param == "previous_response_id" and "in_progress" in err.value.message
    if stop == "cancel":
        assert agent_client.responses.cancel(long.id).status == "cancelled"
    elif stop == "delete":
        agent_client.responses.delete(long.id)
    else:
        assert serve.get_deployment_handle("ResponseStore", APP).cancel.remote(long.id).result()["status"] == "cancelled"
    assert wait_until(lambda: live() == 0, timeout_s=60, interval_s=0.1)
    if stop != "delete":
        assert agent_client.responses.retrieve(long.id).status == "cancelled"
        assert agent_client.responses.cancel(long.id).status == "cancelled"  # again: as it is
    else:
        with pytest.raises(openai.NotFoundError):
            agent_client.responses.retrieve(long.id)


def test_auto_truncation_drops_the_oldest_turns_that_do_not_fit(agent_client):
    """A conversation past the context window (1,024 tokens here) is a 400, or with `truncation:
    "auto"` the answer to its latest whole turns that fit: the same as sending just those."""
    turns = []
    for topic in ("rivers", "mountains", "deserts", "forests"):
        turns += [{"role": "user", "content": f"Tell me about {topic}. " + "Please go on. " * 60},
                  {"role": "assistant", "content": f"{topic.title()} are wonderful. " * 40}]
    ask = dict(model=MODEL, instructions="Answer briefly.", max_output_tokens=16, temperature=0)
    items = turns + [{"role": "user", "content": "Which one did we talk about last?"}]
    with pytest.raises(openai.BadRequestError) as err:
        agent_client.responses.create(**ask, input=items)
    assert err.value.code == "context_length_exceeded"
    truncated = agent_client.responses.create(**ask, input=items, truncation="auto")
    assert truncated.truncation == "auto" and truncated.usage.input_tokens < 1024
    # counted, the prompt is what would be sent: all of it (past the window, no error) or what is kept
    count = agent_client.responses.input_tokens.count
    assert count(instructions=ask["instructions"], input=items).input_tokens > 1024
    assert count(instructions=ask["instructions"], input=items, truncation="auto").input_tokens == \
        truncated.usage.input_tokens
    for dropped in range(2, len(turns) + 1, 2):  # the longest tail of whole turns that fits
        try:
            whole = agent_client.responses.create(**ask, input=items[dropped:])
            break
        except openai.BadRequestError:
            continue
    else:
        pytest.fail("no tail of whole turns fits")
    assert whole.output_text == truncated.output_text
    assert whole.usage.input_tokens == truncated.usage.input_tokens
    # what is kept is what the model was sent: the follow-up continues the tail, not the whole
    follow = {"role": "user", "content": "And before that?"}
    chained = agent_client.responses.create(**ask, input=[follow], previous_response_id=truncated.id)
    sent = agent_client.responses.create(**ask, input=[*items[dropped:], *[o.model_dump(exclude_none=True)
                                                                          for o in truncated.output], follow])
    assert chained.output_text == sent.output_text and chained.usage.input_tokens == sent.usage.input_tokens


def test_kept_responses_outlive_the_ingress_replicas_that_made_them(agent_client, agent_url):
    """The app runs two Ingress replicas; the responses they keep live in the ResponseStore
    deployment, so after both Ingress replicas are killed and Serve has made new ones, every
    kept response is still there, and a conversation continues from it. A background response
    one of them ran is failed, not left in_progress."""
    from ray import serve

    kept = [agent_client.responses.create(model=MODEL, input=f"Name a {thing}.", max_output_tokens=6, temperature=0)
            for thing in ("colour", "fruit", "river", "planet")]
    running = agent_client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=900,
                                            temperature=0, background=True, extra_body=OFF)
    assert _polled(agent_client, running.id, ("in_progress",))
    dead = live_actors(":Ingress")
    assert len(dead) == 2
    for actor in dead:
        os.kill(actor["Pid"], signal.SIGKILL)
    gone = {actor["ActorID"] for actor in dead}

    def new_ingresses_serve() -> bool:
        states = serve.status().applications[APP].deployments["Ingress"].replica_states
        live = live_actors(":Ingress")
        if states.get("RUNNING", 0) != 2 or sum(states.values()) != 2 or len(live) != 2 \
                or gone & {a["ActorID"] for a in live}:
            return False
        try:
            return httpx.get(f"{agent_url}/healthz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(new_ingresses_serve, 120, interval_s=0.5)
    for response in kept:
        assert agent_client.responses.retrieve(response.id).output_text == response.output_text
    follow = agent_client.responses.create(model=MODEL, input="And another?", max_output_tokens=6,
                                           previous_response_id=kept[0].id)
    assert follow.previous_response_id == kept[0].id
    # the background response its killed replica ran: failed once the store missed that replica's polls
    lost = _polled(agent_client, running.id, ("failed", "completed", "incomplete"))
    assert lost.status == "failed" and "was lost" in lost.error.message


def test_a_client_gone_mid_stream_aborts_in_the_engine(agent_url):
    from ray import serve

    replica = serve.get_deployment_handle("Replica", APP)

    def live() -> int:
        return int(replica.stats.remote().result()["live_requests"])

    body = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 900, "temperature": 0, "stream": True,
            **OFF}  # undrafted, so it is far from done when the client goes
    with httpx.Client(base_url=agent_url, timeout=120) as http:
        with http.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            deltas = (line for line in response.iter_lines() if "response.output_text.delta" in line)
            assert next(deltas) and live() == 1
    assert wait_until(lambda: live() == 0, timeout_s=60, interval_s=0.2)


def test_an_openai_agents_sdk_agent_runs_its_tool(agent_url):
    """The Agents SDK's own model class (streamed Responses) drives the call; its tool's result is
    the run's answer (a 135M model, left to choose, calls the tool again rather than answer)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        asked.append(city)
        return f"It is 18 degrees and sunny in {city}."

    model = OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(base_url=f"{agent_url}/v1", api_key="unused", max_retries=0))
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80)
    agent = Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather], model=model,
                  model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, ASK_WEATHER, max_turns=2)
    assert len(asked) == 1 and 0 < len(asked[0]) <= 100
    assert result.final_output == f"It is 18 degrees and sunny in {asked[0]}."
