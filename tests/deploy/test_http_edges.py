"""The HTTP edge against a fake engine on a real Serve cluster: bad input, API keys,
backpressure, the gate hold and a schemathesis run over the served OpenAPI schema (a
replica's failures and losses: test_replica_loss.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import time
import tomllib
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from deploy.app import compose_app
from deploy.config import AppArgs
from replicas.engine import SpeculationConfig
from tests.deploy.bad_input import AUTH, BAD_INPUT, KEY, chat, completion, message, respond
from tests.deploy.fakes import FakeEngine, fake_args, small_window_engine
from tests.polling import async_wait_until, wait_until

pytestmark = pytest.mark.ray  # conftest's `serve_url`: a local Ray cluster with Serve

SERVE_ENV = {"SPECSERVE_TEST_KEYS": f"{KEY}, sk-second"}


@pytest.fixture(scope="module")
def url(serve_url):
    from ray import serve

    serve.run(compose_app(fake_args(), small_window_engine), name="default", route_prefix="/")
    # a second app, tiny admission limits, for the backpressure test; `gate_router: false`'s router
    serve.run(compose_app(fake_args(max_ongoing_requests=1, max_queued_requests=1, gate_router=False),
                          small_window_engine),
              name="tight", route_prefix="/tight")
    return serve_url


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD_INPUT, ids=[row[0] for row in BAD_INPUT])
def test_bad_input(url, name, path, body, headers, status, param):
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        if body is None:
            response = client.get(path, headers=headers)
        elif isinstance(body, bytes):
            response = client.post(path, content=body, headers={"Content-Type": "application/json", **headers})
        else:
            response = client.post(path, json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param, error


@pytest.mark.parametrize("body,content_type,says", [
    (b'{"model": "fake", "prompt": "hi"}', "application/x-www-form-urlencoded", "Content-Type: application/json"),
    # a media type that only contains "json" is none (was "must be a JSON object")
    (b'{"model": "fake", "prompt": "hi"}', "application/jsonx", "Content-Type: application/json"),
    (b'{"model": "fake", "prompt": "hi"}', "application/json, text/plain", "Content-Type: application/json"),
    (b'{"model": "fake", "prompt": "\xff\xfe"}', "application/json", "not readable as JSON (not UTF-8"),
    (b'{"model": "fake", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", "over 4,300 digits"),
    (b'{"model": "fake", "prompt": "hi", "temperature": NaN}', "application/json", "temperature: Input should be a "
                                                                                   "finite number"),
    # a tagged union's value with no tag (was pydantic's "Unable to extract tag using discriminator")
    (b'{"model": "fake", "prompt": "hi", "response_format": "json"}', "application/json",
     'response_format: must be an object with a "type", got "json"'),
])
def test_a_body_that_is_not_json_says_why(url, body, content_type, says):
    response = httpx.post(f"{url}/v1/completions", content=body, headers={**AUTH, "Content-Type": content_type})
    assert response.status_code == 400 and says in response.json()["error"]["message"], response.text


@pytest.fixture(scope="module")
def wide_url(url):
    """An app whose limits fit a tools prompt (the byte-level fake tokenizer makes it long)."""
    from ray import serve

    args = AppArgs(engine={"max_seq_len": 4096}, served_model_name="fake", api_keys_env="SPECSERVE_TEST_KEYS",
                   limits={"max_body_bytes": 65536, "max_tokens": 1024}, replica={"num_cpus": 0})
    serve.run(compose_app(args, partial(FakeEngine, max_seq_len=4096)), name="wide", route_prefix="/wide")
    return f"{url}/wide"


def _calls_answer(n: int, after: str = "") -> str:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    return "ECHO:" + "\n".join(call % city for city in ("Paris", "Rome", "Oslo")[:n]) + after


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_off_answers_the_first_call_in_every_api(wide_url, stream):
    """With `auto`, nothing constrains how many calls the model writes: where parallel calls are
    not allowed the answer ends at its first (chat, Responses, Messages; streamed or not)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ask = _calls_answer(3, after="\nDone.")
    client = openai.OpenAI(base_url=f"{wide_url}/v1", api_key=KEY, max_retries=0)

    def chat_calls(content: str, parallel: bool) -> list[str]:
        kw = dict(model="fake", messages=[{"role": "user", "content": content}], max_tokens=400, tools=[tool],
                  parallel_tool_calls=parallel)
        if not stream:
            answer = client.chat.completions.create(**kw)
            calls = answer.choices[0].message.tool_calls or []
            if not parallel:  # the engine ended the output at the first close tag (our stop: no stop_reason)
                first = content.removeprefix("ECHO:").split("</tool_call>")[0] + "</tool_call>"
                assert answer.usage.completion_tokens == len(first)  # a token a character
                assert answer.choices[0].model_extra["stop_reason"] is None
            return [c.function.arguments for c in calls]
        calls: dict[int, str] = {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices[0].delta.tool_calls or []:
                calls[c.index] = calls.get(c.index, "") + (c.function.arguments or "")
        return list(calls.values())

    assert chat_calls(ask, parallel=False) == ['{"city": "Paris"}']
    # prose after the calls is content beside them, as the stream (which sent them) has it
    assert chat_calls(_calls_answer(2, after="\nDone."), parallel=True) == ['{"city": "Paris"}', '{"city": "Rome"}']
    flat = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    body = respond(input=ask, max_output_tokens=400, tools=[flat], parallel_tool_calls=False, stream=stream)
    response = httpx.post(f"{wide_url}/v1/responses", json=body, headers=AUTH, timeout=30)
    calls = [line for line in response.text.splitlines() if '"response.output_item.added"' in line
             and '"function_call"' in line] if stream else \
        [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert len(calls) == 1
    anthropic_tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    body = message(messages=[{"role": "user", "content": ask}], max_tokens=400, tools=[anthropic_tool],
                   tool_choice={"type": "auto", "disable_parallel_tool_use": True}, stream=stream)
    answer = httpx.post(f"{wide_url}/v1/messages", json=body, headers=AUTH, timeout=30)
    uses = answer.text.count('"type": "tool_use"') if stream else \
        sum(block["type"] == "tool_use" for block in answer.json()["content"])
    assert uses == 1


def test_anthropic_clients_send_their_key_as_x_api_key_and_get_their_error_shape(url):
    def post(path, body, **headers):
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)

    assert post("/v1/messages", message(), **{"x-api-key": KEY}).json()["content"] == [{"type": "text", "text": "abcd"}]
    assert post("/v1/chat/completions", chat(), **{"x-api-key": KEY}).status_code == 200
    unknown = post("/v1/messages", message(), **{"x-api-key": "sk-wrong"})
    huge = post("/v1/messages", message(messages=[{"role": "user", "content": "x" * 20000}]), **{"x-api-key": KEY})
    refused = post("/v1/messages", message(temperature=3), **{"x-api-key": KEY})
    # the middleware's refusals (key, body size) as the endpoint's own: in Anthropic's shape
    assert [(r.status_code, r.json()["type"]) for r in (unknown, huge, refused)] == [
        (401, "error"), (413, "error"), (400, "error")]
    assert refused.json()["error"]["type"] == "invalid_request_error" and refused.json()["error"]["message"]
    # under a route prefix, the endpoint's own refusals too (they were OpenAI's shape there)
    prefixed = [post("/tight/v1/messages", message(**bad), **{"x-api-key": KEY})
                for bad in ({"temperature": 3}, {"model": "other"}, {"max_tokens": 10**9})]
    assert [(r.status_code, r.json()["type"]) for r in prefixed] == [(400, "error"), (404, "error"), (400, "error")]
    # a key in either header passes, whatever the other holds (an OAuth token beside an API key)
    both = {"x-api-key": KEY, "Authorization": "Bearer sk-oauth-token"}
    assert post("/v1/messages", message(), **both).status_code == 200
    assert post("/v1/messages", message(), **{"x-api-key": "sk-wrong", "Authorization": f"Bearer {KEY}"}).status_code \
        == 200
    # two different keys: whose would what it stores be? (the Bearer one was taken silently: QA)
    two = post("/v1/messages", message(), **{"x-api-key": KEY, "Authorization": "Bearer sk-second"})
    assert two.status_code == 401 and "two different API keys" in two.json()["error"]["message"]
    assert post("/v1/messages", message(), **{"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}).status_code == 200
    # Anthropic's request-id header on each (the anthropic SDK's `_request_id`), one per request:
    # Serve's request id, which its logs carry (x-request-id, sent or made)
    answered = post("/v1/messages", message(), **{"x-api-key": KEY})
    ids = [r.headers.get("request-id") for r in (answered, unknown, huge, refused)]
    assert ids == [f"req_{r.headers['x-request-id']}" for r in (answered, unknown, huge, refused)]
    assert len(set(ids)) == 4, ids
    quoted = post("/v1/messages", message(), **{"x-api-key": KEY, "x-request-id": "qa-anth-1"})
    assert quoted.headers["request-id"] == "req_qa-anth-1"
    assert "request-id" not in post("/v1/chat/completions", chat(), **AUTH).headers
    assert "type" not in post("/v1/chat/completions", chat(), **{"x-api-key": "sk-wrong"}).json()
    assert "type" not in post("/v1/chat/completions", chat(temperature=3), **AUTH).json()  # OpenAI's shape


def test_a_context_overflow_is_worded_for_messages_clients_as_anthropics_api_words_it(url):
    """Anthropic's words for it ("prompt is too long: ...") to Messages clients; ours to OpenAI's."""
    def error(path, body):
        return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=30).json()["error"]

    long = [{"role": "user", "content": "x" * 300}]
    assert error("/v1/messages", message(messages=long))["message"].startswith("prompt is too long: ")
    # 200 prompt tokens (the limit) and 64 more in a window of 256
    tight = error("/v1/messages", message(messages=[{"role": "user", "content": "x" * 180}], max_tokens=64))
    assert tight["message"].startswith("input length and `max_tokens` exceed context limit: 200 + 64 > 256, ")
    assert tight["param"] == "max_tokens" and tight["code"] == "context_length_exceeded"
    assert error("/v1/chat/completions", chat(messages=long))["message"].startswith("messages: ")


class _EngineThatNeverStarts(FakeEngine):
    async def start(self) -> None:
        raise RuntimeError("this engine never starts")


def test_health_is_a_503_while_no_engine_replica_runs(url):
    # the ingress up, its Replicas failing to start: not a server that can generate (was 200)
    from ray import serve

    serve._run(compose_app(fake_args(), _EngineThatNeverStarts), name="broken", route_prefix="/broken",
              _blocking=False)
    try:
        assert wait_until(lambda: httpx.get(f"{url}/broken/healthz", timeout=30).status_code != 404, timeout_s=60,
                          interval_s=0.5)
        for path in ("/broken/healthz", "/broken/health"):
            response = httpx.get(f"{url}{path}", timeout=30)
            assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1, response.text
            assert "engine replica" in response.json()["error"]["message"]
    finally:
        serve.delete("broken")
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_the_settings_replicas_took_go_with_their_application_not_with_a_replica(url):
    """What a replica starting under a refused user_config falls back on (LastSettings): kept
    when a replica stops (here a scale-in), gone with `serve delete`, so a later application of
    the same name starts from its own user_config (they outlived the delete: found by QA), even
    where no Replica's own stop runs (forgotten by the ResponseStore's)."""
    from ray import serve
    from ray.experimental import internal_kv

    key = b"specserve/user_config/kept/Replica"

    def replica_states() -> dict:
        return dict(serve.status().applications["kept"].deployments["Replica"].replica_states)

    serve.run(compose_app(fake_args(num_replicas=2), small_window_engine), name="kept", route_prefix="/kept")
    try:
        assert json.loads(internal_kv._internal_kv_get(key)) == dataclasses.asdict(SpeculationConfig())
        # no grace at all: Serve kills a stopping Replica at once, its own stop never runs (as one
        # killed with a long stream at the end of its grace); the ResponseStore forgets for it
        serve.run(compose_app(fake_args(num_replicas=1, graceful_shutdown_timeout_s=0), small_window_engine),
                  name="kept", route_prefix="/kept")
        assert wait_until(lambda: replica_states() == {"RUNNING": 1}, timeout_s=60, interval_s=0.2)
        assert internal_kv._internal_kv_get(key) is not None
    finally:
        serve.delete("kept")
    assert wait_until(lambda: internal_kv._internal_kv_get(key) is None, timeout_s=30, interval_s=0.2)


def test_healthz_needs_no_key_and_everything_else_does(url):
    assert httpx.get(f"{url}/healthz").status_code == httpx.get(f"{url}/health").status_code == 200
    assert httpx.head(f"{url}/healthz").status_code == httpx.head(f"{url}/health").status_code == 200  # (was 405)
    assert httpx.get(f"{url}/ping").status_code == httpx.post(f"{url}/ping").status_code == 200  # vLLM's, SageMaker's
    assert httpx.get(f"{url}/v1/models").status_code == httpx.get(f"{url}/version").status_code == 401
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert httpx.get(f"{url}/version", headers=AUTH).json() == {"version": project["version"]}  # vLLM's
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-second"}).json()
    assert [m["id"] for m in models["data"]] == ["fake"]


def test_both_sdks_list_the_model(url):
    """One model object for both: OpenAI's fields and Anthropic's (its SDK read None for them)."""
    import anthropic

    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    (model,) = claude.models.list().data
    assert (model.id, model.type, model.display_name) == ("fake", "model", "fake")
    assert claude.models.retrieve("fake") == model
    (card,) = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY).models.list().data
    assert (card.id, card.owned_by, card.created) == ("fake", "specserve", int(model.created_at.timestamp()))
    assert card.model_extra["max_model_len"] == 256  # vLLM's: the engine's window (fake_args)


def test_openai_client_with_key(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    out = client.completions.create(model="fake", prompt="hi", max_tokens=5, temperature=0)
    assert out.choices[0].text == "abcde" and out.usage.completion_tokens == 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope").models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other", prompt="hi", max_tokens=5)
    assert err.value.body["param"] == "model"


def test_a_stored_response_is_its_keys_alone(url):
    """What one API key stored, another key cannot read, list, continue, reference, cancel or
    delete: to it the response is not kept (as OpenAI scopes them to a project)."""
    alice = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    bob = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-second", max_retries=0)
    made = alice.responses.create(model="fake", input="hi", max_output_tokens=4)
    msg_id = made.output[0].id
    for attempt in (lambda: bob.responses.retrieve(made.id), lambda: bob.responses.input_items.list(made.id),
                    lambda: bob.responses.cancel(made.id), lambda: bob.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.BadRequestError) as err:
        bob.responses.create(model="fake", input="more", previous_response_id=made.id, max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        bob.responses.create(model="fake", input=[{"type": "item_reference", "id": msg_id}], max_output_tokens=4)
    assert err.value.body["code"] == "item_not_found"
    assert alice.responses.retrieve(made.id).output[0].id == msg_id  # bob's delete deleted nothing
    follow_up = alice.responses.create(model="fake", input=[{"role": "user", "content": "hi"},
                                                            {"type": "item_reference", "id": msg_id}],
                                       max_output_tokens=4)
    assert alice.responses.input_items.list(follow_up.id).data[0].id == msg_id  # (newest first)
    alice.responses.delete(made.id)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(user="u1", metadata={"team": "a"}, store=False, service_tier="auto",
                                  safety_identifier="h1", prompt_cache_key="k1", modalities=["text"], audio=None,
                                  reasoning_effort="none", verbosity="low", prompt_cache_retention="24h",
                                  add_special_tokens=False, skip_special_tokens=True)),
    ("/v1/responses", respond(user="u1", metadata={"team": "a"}, service_tier="default", safety_identifier="h1",
                              prompt_cache_key="conversation-7", include=["reasoning.encrypted_content"],
                              reasoning={"effort": "none", "summary": "auto"}, text={"verbosity": "medium"},
                              prompt_cache_retention="in_memory", max_tool_calls=3)),
    ("/v1/messages", message(thinking={"type": "adaptive", "budget_tokens": 0}, metadata={"user_id": "u1"})),
    ("/v1/messages", message(thinking={"type": "enabled", "budget_tokens": 1024, "display": "summarized"})),
])
def test_labels_and_neutral_settings_are_taken_and_change_nothing(url, path, body):
    body = _asking_settings(body)  # each answer a digest of its engine request's settings
    bare = {k: v for k, v in body.items() if k in ("model", "messages", "input", "max_tokens", "max_output_tokens")}
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        labelled, plain = client.post(path, json=body), client.post(path, json=bare)
    assert labelled.status_code == plain.status_code == 200, labelled.text
    labelled, plain = labelled.json(), plain.json()
    if "choices" in labelled:
        assert labelled["choices"][0]["message"] == plain["choices"][0]["message"]
    elif path == "/v1/messages":  # no thinking blocks: the model does not think
        assert labelled["content"] == plain["content"]
    else:  # a response shows its metadata back, as OpenAI's
        assert labelled["output"][0]["content"] == plain["output"][0]["content"]
        assert labelled["metadata"] == {"team": "a"} and plain["metadata"] == {}


@pytest.mark.parametrize("path, body, model", [
    ("/v1/chat/completions", chat(), "deploy.chat_protocol.ChatCompletionRequest"),
    ("/v1/completions", completion(), "deploy.protocol.CompletionRequest"),
    ("/v1/responses", respond(), "deploy.responses.ResponsesRequest"),
    ("/v1/messages", message(), "deploy.messages.MessagesRequest"),
])
def test_an_explicit_null_is_the_fields_default(url, path, body, model):
    # OpenAI's optional fields are nullable: a client's "temperature": null means "not set".
    # Every field with a default sent as null answers as the bare request does.
    module, name = model.rsplit(".", 1)
    fields = getattr(importlib.import_module(module), name).model_fields
    nulls = {key: None for key, field in fields.items() if not field.is_required() and field.default is not None}
    assert {"temperature", "stream"} <= set(nulls), nulls
    body = _asking_settings(body)  # each answer a digest of its engine request's settings
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        nulled, plain = client.post(path, json={**body, **nulls}), client.post(path, json=body)
    assert nulled.status_code == plain.status_code == 200, nulled.text
    assert _without_ids(nulled.json()) == _without_ids(plain.json())


def _asking_settings(body: dict) -> dict:
    """`body` asking the fake engine for 16 hex digits of what shapes its output (`fakes.py`):
    a setting that reaches the engine changed changes the answer."""
    asked = {"prompt": "SETTINGS"} if "prompt" in body else {"input": "SETTINGS"} if "input" in body else {
        "messages": [{"role": "user", "content": "SETTINGS"}]}
    return {**body, **asked, ("max_output_tokens" if "input" in body else "max_tokens"): 16}


def _without_ids(body):
    """A response body less what differs between two answers alike: ids and times."""
    if isinstance(body, dict):
        return {k: _without_ids(v) for k, v in body.items() if k not in ("id", "created", "created_at", "completed_at")}
    return [_without_ids(v) for v in body] if isinstance(body, list) else body


def test_backpressure_answers_503_with_retry_after(url):
    async def one(client):
        return await client.post("/tight/v1/completions", json=completion(prompt="SLOW", max_tokens=20))

    async def burst():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*[one(client) for _ in range(8)])

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses, statuses
    assert set(statuses) <= {200, 503}
    rejected = next(r for r in responses if r.status_code == 503)
    assert int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["code"] == "overloaded"


@pytest.mark.parametrize("hold_s", [30.0, 0.0], ids=["held", "not held"])
def test_gate_hold_keeps_a_speculating_replica_under_its_gate(url, hold_s):
    """One replica at gate 1, its acceptance (the fake's 2.0) over the hold's bar: a second
    request waits for the first to finish rather than stop its speculation, and starts
    when the slot frees, not when the hold runs out; with the hold off it joins at once."""
    from ray import serve

    app = "held" if hold_s else "not-held"
    args = fake_args(gate_hold_s=hold_s, gate_hold_min_acceptance=1.5)
    serve.run(compose_app(args, FakeEngine, SpeculationConfig(batch_gate=1)), name=app, route_prefix=f"/{app}")

    async def first_token_and_end(client, tokens, seen=None):
        body = completion(prompt="SLOW", max_tokens=tokens, stream=True)
        first = None
        async with client.stream("POST", f"/{app}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    first = first or time.monotonic()
                    if seen is not None:
                        seen.append(line)
        return first, time.monotonic()

    async def both():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            seen: list = []
            long = asyncio.create_task(first_token_and_end(client, 60, seen))  # 3 s at 50 ms a token
            # the router's view of the replica catches up meanwhile
            assert await async_wait_until(lambda: len(seen) >= 20, timeout_s=30, interval_s=0.05)
            second_first, _ = await first_token_and_end(client, 4)
            _, long_end = await long
            return second_first, long_end

    try:
        second_first, long_end = asyncio.run(both())
    finally:
        serve.delete(app)
    if hold_s:
        assert second_first > long_end, "the held request joined the batch over the gate"
        assert second_first < long_end + hold_s / 2, "released by the hold running out, not by a free slot"
    else:
        assert second_first < long_end, "without the hold the request should join at once"


class _NoReplica:
    """Stands in for the Replica handle: the OpenAPI document needs no engine."""

    def options(self, **_):
        return self


def _openapi_document() -> dict:
    from deploy.config import IngressConfig
    from deploy.ingress import Ingress
    from deploy.routes import build_api

    return build_api(Ingress(_NoReplica(), None, IngressConfig.from_args(fake_args()))).openapi()


schema = schemathesis.openapi.from_dict(_openapi_document())


def test_served_schema_is_the_fuzzed_one(url):
    served, built = httpx.get(f"{url}/openapi.json", headers=AUTH).json(), _openapi_document()
    assert served["paths"] == built["paths"]


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_server_error(case, url):
    response = case.call(base_url=url, headers=AUTH, timeout=30)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
