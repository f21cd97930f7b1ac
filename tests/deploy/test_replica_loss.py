"""A replica's failures and losses, against a fake engine on a real Serve cluster: a stream
that fails ends with each API's error events; a replica that dies before the first token costs
a retry, after it a resume, and neither loses nor repeats a token; with no retry left, a 503.
The Ingress counts which it did (`ray_request_retries_total{kind}`), read from Prometheus."""

from __future__ import annotations

import asyncio
import json
import re
import time
from functools import partial

import httpx
import openai
import pytest

from deploy.app import compose_app
from tests.deploy.bad_input import AUTH, KEY, completion, message, respond
from tests.deploy.fakes import NextModelEngine, engine_unless, fake_args, small_window_engine
from tests.polling import wait_until
from tests.serve_support import metrics_url

pytestmark = pytest.mark.ray  # conftest's `serve_url`: a local Ray cluster with Serve

SERVE_ENV = {"SPECSERVE_TEST_KEYS": KEY}


@pytest.fixture(scope="module")
def url(serve_url):
    from ray import serve

    serve.run(compose_app(fake_args(), small_window_engine), name="default", route_prefix="/")
    # two replicas, for a replica lost before the first token
    serve.run(compose_app(fake_args(num_replicas=2), small_window_engine), name="pair", route_prefix="/pair")
    # one replica serving one request at a time, a 1 s idle timeout, nothing sent again when it dies
    serve.run(compose_app(fake_args({"replica_loss_retry_s": 0, "stream_idle_timeout_s": 1}, max_ongoing_requests=1),
                          small_window_engine), name="lossy", route_prefix="/lossy")
    return serve_url


def pair_retries(app: str = "pair") -> dict[str, float]:
    """The pair app's requests sent again, by kind ("retry", "resume"), as Prometheus has them."""
    text = httpx.get(metrics_url(), timeout=10).text
    counts = {"retry": 0.0, "resume": 0.0}
    for labels, value in re.findall(r"^ray_request_retries_total\{([^}]*)\} (\S+)$", text, re.M):
        kind = re.search(r'kind="(\w+)"', labels)
        if f'application="{app}"' in labels and kind:
            counts[kind.group(1)] = counts.get(kind.group(1), 0.0) + float(value)
    return counts


def swap_retries() -> dict[str, float]:
    return pair_retries("swap")


def settled_pair_retries() -> dict[str, float]:
    """pair_retries once two reads two metric reports apart (1 s each) agree: what earlier tests
    caused has all arrived."""
    reads = [pair_retries()]

    def unchanged() -> bool:
        reads.append(pair_retries())
        return reads[-1] == reads[-2]

    assert wait_until(unchanged, timeout_s=30, interval_s=2.5), reads
    return reads[-1]


def assert_counted_once(before: dict[str, float], kind: str) -> None:
    """Since `before` (settled), the Ingress counted one request sent again, of `kind`."""
    expected = {**before, kind: before[kind] + 1}
    assert wait_until(lambda: pair_retries() == expected, timeout_s=30, interval_s=0.5), (expected, pair_retries())


@pytest.mark.parametrize("prompt", ["FAIL_RAISE", "FAIL_DELTA"])
def test_replica_failure_mid_stream_ends_with_an_error_event(url, prompt):
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        response = client.post("/v1/completions", json=completion(prompt=prompt, max_tokens=10, stream=True))
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]  # OpenAI's error object: a string or null code
    assert error["type"] == "server_error" and "code" in error and not isinstance(error["code"], int), error
    assert len(events) == 4  # two tokens, the error, [DONE]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="fake", prompt=prompt, max_tokens=10, stream=True):
            pass


def test_a_failure_the_request_caused_is_a_400_naming_its_field(url):
    """An engine that gives up on a request for its own input mid-answer (a grammar past the
    grammar engine's limits) fails it with the field: a 400 naming it, plain or as the stream's
    error event (both were 500s)."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        plain = client.post("/v1/completions", json=completion(prompt="FAIL_FORMAT", max_tokens=10))
        streamed = client.post("/v1/completions", json=completion(prompt="FAIL_FORMAT", max_tokens=10, stream=True))
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "response_format", plain.text
    assert plain.json()["error"]["message"].startswith("response_format: the grammar engine gave up")
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format"), error
    # the other APIs name the field as they name it (was chat's)
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        for path, body, field in (("/v1/responses", respond(input="FAIL_FORMAT"), "text.format"),
                                  ("/v1/messages", message(messages=[{"role": "user", "content": "FAIL_FORMAT"}]),
                                   "output_config.format")):
            plain = client.post(path, json=body)
            assert plain.status_code == 400 and plain.json()["error"]["param"] == field, plain.text
            assert plain.json()["error"]["message"].startswith(f"{field}: the grammar engine gave up")
            streamed = client.post(path, json={**body, "stream": True})
            events = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
                      if line.startswith("data: ")]
            error = next(e for e in events if e["type"] == "error")
            assert (error.get("param") or error["error"]["param"]) == field, error


@pytest.mark.parametrize("prompt", ["FAIL_RAISE", "FAIL_DELTA"])
def test_a_response_stream_that_fails_ends_with_error_and_failed_events(url, prompt):
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        response = client.post("/v1/responses", json=respond(input=prompt, max_output_tokens=10, stream=True))
    assert response.status_code == 200
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("prompt", ["FAIL_RAISE", "FAIL_DELTA"])
def test_a_message_stream_that_fails_ends_with_an_error_event(url, prompt):
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        response = client.post("/v1/messages", json=message(messages=[{"role": "user", "content": prompt}],
                                                             max_tokens=10, stream=True))
    assert response.status_code == 200
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
    assert events[-1]["error"]["message"] and not any(e["type"] == "message_stop" for e in events)


def test_a_response_streamed_through_a_replica_death_loses_nothing(url, tmp_path_factory):
    marker = tmp_path_factory.mktemp("r") / "died"  # a short path: the prompt fits the fake's window
    before = settled_pair_retries()
    body = respond(input=f"DIE_AT:3:{marker} ", max_output_tokens=8, stream=True)
    with httpx.Client(base_url=f"{url}/pair", headers=AUTH, timeout=120) as client:
        response = client.post("/v1/responses", json=body)
    assert marker.exists() and response.status_code == 200
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"  # max_output_tokens reached
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "abcdefgh" == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert_counted_once(before, "resume")


@pytest.mark.parametrize("die_at", [0, 3], ids=["before the first token", "mid-stream"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_lost_costs_only_latency(url, tmp_path, stream, die_at):
    """Before the first token the request is sent again; after it, resumed after what the
    client already has: no error, no token lost or repeated. A non-streamed answer looks the
    same either way: the Ingress's count tells which it did."""
    marker = tmp_path / "died"
    before = settled_pair_retries()
    body = completion(prompt=f"DIE_AT:{die_at}:{marker} ", max_tokens=8, stream=stream, logprobs=1)
    with httpx.Client(base_url=f"{url}/pair", headers=AUTH, timeout=120) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                # the case is the one named: the first token came before the replica died, or after
                assert marker.with_suffix(".dead").exists() == (die_at == 0), first
                events = [first.removeprefix("data: ")] + [
                    line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        else:
            response = client.post("/v1/completions", json=body)
    assert marker.exists()  # a replica did die with the request
    assert response.status_code == 200
    if stream:
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        choices = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    else:
        choice = response.json()["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
    assert text == "abcdefgh" and "".join(tokens) == text
    assert_counted_once(before, "retry" if die_at == 0 else "resume")


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_lost_mid_stream_by_an_engine_that_cannot_resume_is_the_loss_not_a_400(url, tmp_path, stream):
    """TensorRT-LLM's engine refuses a `Resume`: the client is told the replica was lost (a 503,
    or its error event once tokens went out), not that its request was bad (a 400 naming resume)."""
    marker = tmp_path / "died"
    before = settled_pair_retries()
    body = completion(prompt=f"DIE_AT:3:{marker} NO_RESUME", max_tokens=8, stream=stream)
    response = httpx.post(f"{url}/pair/v1/completions", headers=AUTH, json=body, timeout=120)
    assert marker.exists()
    if stream:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert error["type"] == "service_unavailable" and "was lost" in error["message"], error
    else:
        assert response.status_code == 503 and "was lost" in response.json()["error"]["message"], response.text
        assert int(response.headers["Retry-After"]) >= 1
    assert_counted_once(before, "resume")  # it was tried


def test_a_replica_lost_with_no_retry_left_is_a_503_with_retry_after(url, tmp_path):
    # replica_loss_retry_s 0: the request is not sent again; the server's state, not a fault of
    # the request or a bug, so the client is told when to retry (was a 500 naming Ray's error)
    marker = tmp_path / "died"
    response = httpx.post(f"{url}/lossy/v1/completions", headers=AUTH, timeout=60,
                          json=completion(prompt=f"DIE_AT:0:{marker} "))
    assert marker.exists() and response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1 and "was lost" in response.json()["error"]["message"]


def test_the_idle_timeout_does_not_count_the_wait_for_a_slot(url):
    # the second request waits ~2 s for the replica's one slot, twice the idle timeout: waiting
    # is not idling (was a 504); once running, its tokens come within the timeout
    async def both():
        async with httpx.AsyncClient(base_url=f"{url}/lossy", headers=AUTH, timeout=60) as client:
            body = completion(prompt="SLOW", max_tokens=40, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as first:
                lines = first.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # the first holds the slot
                started = time.perf_counter()
                second = await client.post("/v1/completions", json=completion(prompt="SLOW", max_tokens=4))
                waited = time.perf_counter() - started
                rest = [line async for line in lines]
            return first.status_code, rest, second, waited

    status, rest, second, waited = asyncio.run(both())
    assert status == second.status_code == 200 and "data: [DONE]" in rest, (rest[-3:], second.text)
    assert waited > 1  # more than the idle timeout, most of it waiting for the slot


def test_with_no_replica_able_to_start_a_request_is_a_503_not_a_wait_without_end(url, tmp_path):
    """Its replica lost, and every new one failing to start (as an engine that cannot load its
    model: Serve tries on until a good deploy), a request waited in Serve's router with no
    end. Now it is a 503 once no replica has run for replica_loss_retry_s (2 s here); once one
    can start again, requests are served."""
    import os
    import signal

    from ray import serve

    marker = tmp_path / "no-start"
    serve.run(compose_app(fake_args({"replica_loss_retry_s": 2}), partial(engine_unless, str(marker))),
              name="stuck", route_prefix="/stuck")

    def running() -> int:
        return serve.status().applications["stuck"].deployments["Replica"].replica_states.get("RUNNING", 0)

    def generate() -> httpx.Response:
        return httpx.post(f"{url}/stuck/v1/completions", headers=AUTH, json=completion(max_tokens=3), timeout=120)

    try:
        assert generate().status_code == 200
        marker.touch()
        os.kill(serve.get_deployment_handle("Replica", "stuck").pid.remote().result(), signal.SIGKILL)
        assert wait_until(lambda: running() == 0, timeout_s=30, interval_s=0.2)
        started = time.monotonic()
        response = generate()
        assert response.status_code == 503 and "no engine replica is running" in response.text, response.text
        assert int(response.headers["Retry-After"]) >= 1 and time.monotonic() - started < 60
        marker.unlink()
        assert wait_until(lambda: generate().status_code == 200, timeout_s=120, interval_s=1)
    finally:
        serve.delete("stuck")


def test_replica_failure_without_stream_is_a_500(url):
    response = httpx.post(f"{url}/v1/completions", headers=AUTH, json=completion(prompt="FAIL_RAISE"), timeout=30)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


def test_a_deploy_that_changes_the_model_never_answers_with_the_model_before_it(url, tmp_path):
    """A deploy changing the model (any `args` change restarts every deployment) rolls the
    Replicas one at a time: the new Ingress, up at once, took the tokenizer of a Replica of
    the model before, kept it for good, and had that Replica answer for the new model. Now a
    Replica refuses a request (or a tokenizer) for another model, the Ingress asks again, for
    up to replica_loss_retry_s, and the router sends it to the new model's Replica once one
    runs beside the two old ones."""
    import concurrent.futures

    from ray import serve

    marker = tmp_path / "loaded"

    def args(model: str):
        three = fake_args(num_replicas=3)
        return three.model_copy(update={"engine": three.engine.model_copy(update={"model": model}),
                                        "served_model_name": model})

    def served() -> str:
        return httpx.get(f"{url}/swap/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]

    def ask(model: str) -> httpx.Response:
        return httpx.post(f"{url}/swap/v1/completions", headers=AUTH, timeout=90,
                          json={**completion(prompt="ECHO:abc</>"), "model": model})

    def healthz() -> int:
        return httpx.get(f"{url}/swap/healthz", timeout=30).status_code

    serve.run(compose_app(args("fake-a"), small_window_engine), name="swap", route_prefix="/swap")
    try:
        assert ask("fake-a").json()["choices"][0]["text"] == "abc"
        serve._run(compose_app(args("fake-b"), partial(NextModelEngine, str(marker))), name="swap",
                   route_prefix="/swap", _blocking=False)
        assert wait_until(lambda: served() == "fake-b", timeout_s=60, interval_s=0.2)  # the new Ingress
        states = serve.status().applications["swap"].deployments["Replica"].replica_states
        assert states.get("RUNNING") == 2, states  # of the model before: the new one is loading
        # no Replica of its model runs: not healthy (it was 200 while every request failed), as a
        # load balancer's probe finds before any request has reached the new Ingress (its
        # handle's router, built with it, already lists the Replicas and their models)
        assert wait_until(lambda: healthz() == 503, timeout_s=10, interval_s=0.2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask, "fake-b")
            assert not wait_until(answer.done, timeout_s=2, interval_s=0.1), answer.result().text
            marker.touch()  # the new model loaded
            assert answer.result().status_code == 200, answer.result().text
            assert answer.result().json()["choices"][0]["text"] == "ABC"
        assert wait_until(lambda: healthz() == 200, timeout_s=10, interval_s=0.2)
        # the refusals were counted, the tokenizer's among them (it counted none)
        assert wait_until(lambda: swap_retries().get("another_model", 0) > 0, timeout_s=30, interval_s=1)
    finally:
        serve.delete("swap")
