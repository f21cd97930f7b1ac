"""The real application (TorchEngine on CPU) deployed from deploy.yaml's document through
Serve's config path, driven over HTTP with the official `openai` client."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig
from replicas.speculation.draft_length import MATCH_LEN_BUCKETS
from tests.polling import wait_until
from tests.serve_support import APP, deploy_config, embedded_config as serving_config, metrics_url

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local Serve cluster running the real model

MODEL = "smollm2-135m-instruct"
CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
REPEAT_PROMPT = "\n".join(f"item_{i} = compute(item_{i - 1}, {i})" for i in range(1, 12)) + "\n"
CHAT = [{"role": "user", "content": "Name three colours."}]
PREFILL_CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."},
                {"role": "assistant", "content": "Here is the function:\n```python\ndef add("}]


def deploy(config: dict) -> None:
    deploy_config(config, APP, timeout_s=240)  # the first deploy loads the model (may convert it once)


@pytest.fixture(scope="module")
def url(serve_url):
    deploy(serving_config())
    return serve_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def replica_handle(url):
    from ray import serve

    return serve.get_deployment_handle("Replica", APP)


@pytest.fixture(scope="module")
def reference():
    """The engine itself, in this process, without speculation: the output oracle."""
    from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig

    loop = asyncio.new_event_loop()
    engine = TorchEngine(TorchEngineConfig(max_batch_size=2, max_seq_len=1024, num_threads=1, mtp_weights=None,
                                           speculation=SpeculationConfig(mode="off")))
    loop.run_until_complete(engine.start())

    def generate(prompt, max_tokens: int) -> str:
        async def run():
            request = GenerationRequest(f"ref-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens),
                                        RequestSpeculation(mode="off"))
            return "".join([d.text async for d in engine.generate(request)])
        return loop.run_until_complete(run())

    generate.tokenizer = engine.tokenizer
    yield generate
    loop.run_until_complete(engine.shutdown())
    loop.close()


def stream_text(stream, chat: bool) -> tuple[str, list]:
    text, chunks = "", []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices:
            piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            text += piece or ""
    return text, chunks


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_streamed_equals_plain_equals_engine(client, reference):
    plain = client.completions.create(model=MODEL, prompt=CODE_PROMPT, max_tokens=24, temperature=0)
    streamed, chunks = stream_text(client.completions.create(
        model=MODEL, prompt=CODE_PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=False)
    assert plain.choices[0].text == streamed == reference(CODE_PROMPT, 24)
    assert plain.choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # null until the last
    assert plain.usage.prompt_tokens == len(reference.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))


def test_chat_streamed_equals_plain_equals_engine(client, reference):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    streamed, chunks = stream_text(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}),
        chat=True)
    rendered = reference.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert plain.choices[0].message.content == streamed == reference(rendered, 24)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # the role's chunk too


def test_continuous_usage_stats_count_each_chunks_tokens(client):
    """vLLM's `stream_options.continuous_usage_stats` (guidellm sends it with every stream: was a
    400): every chunk carries its choice's usage so far, its count the tokens sent, several in
    a chunk where a verify step accepted drafts; the last is the request's usage."""
    usage = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=40, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})  # every token has a logprob (an EOS has none)
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options=usage))
    assert all(c.usage.prompt_tokens == plain.usage.prompt_tokens for c in chunks)
    sent, counts = 0, []
    for chunk in chunks[:-1]:
        sent += len(chunk.choices[0].logprobs.tokens) if chunk.choices[0].logprobs else 0
        counts.append(chunk.usage.completion_tokens)
        assert chunk.usage.completion_tokens == sent
    assert max(b - a for a, b in zip(counts, counts[1:])) > 1
    assert chunks[-1].usage.completion_tokens == sent == plain.usage.completion_tokens == 40
    # n choices: each chunk counts its own choice (the role's chunk none yet), the last all
    chat = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=3, n=2, logprobs=True, stream=True,
        stream_options=usage, extra_body={"ignore_eos": True}))
    sent_by = [0, 0]
    for chunk in chat[:-1]:
        (choice,) = chunk.choices
        sent_by[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
        assert chunk.usage.completion_tokens == sent_by[choice.index]
        assert chunk.usage.prompt_tokens == chat[-1].usage.prompt_tokens
    assert sent_by == [12, 12] and chat[-1].usage.completion_tokens == 24


def test_chat_continues_a_prefilled_answer(client, reference):
    out = client.chat.completions.create(
        model=MODEL, messages=PREFILL_CHAT, max_tokens=16, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    rendered = reference.tokenizer.apply_chat_template(
        PREFILL_CHAT, tokenize=False, continue_final_message=True, add_generation_prompt=False)
    assert rendered.endswith("def add(")
    assert out.choices[0].message.content == reference(rendered, 16)


def test_usage_reports_speculation_and_the_request_can_turn_it_off(client):
    spec = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=32, temperature=0)
    usage = spec.usage.model_extra["speculation"]
    assert usage["steps"] > 0 and usage["draft_tokens"] > 0 and usage["acceptance_length"] >= 1
    off = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=32, temperature=0,
                                    extra_body={"speculation": {"mode": "off"}})
    assert off.usage.model_extra["speculation"]["steps"] == 0
    assert off.choices[0].text == spec.choices[0].text  # greedy speculation is exact


def _scrape(*names: str) -> tuple[float, ...]:
    """Each metric's value, summed over its label sets."""
    text = httpx.get(metrics_url(), timeout=10).text
    return tuple(sum(float(v) for v in re.findall(rf"^ray_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
                 for name in names)


def _settled(*names: str) -> tuple[float, ...]:
    """`_scrape` once three scrapes 2 s apart agree (metrics are reported every second): what an
    earlier request left has arrived."""
    seen = [_scrape(*names), _scrape(*names)]
    assert wait_until(lambda: seen.append(_scrape(*names)) or seen[-1] == seen[-2] == seen[-3], timeout_s=40,
                      interval_s=2)
    return seen[-1]


def _reaches(names: tuple[str, ...], want: tuple[float, ...]) -> bool:
    return wait_until(lambda: _scrape(*names) == want, timeout_s=30, interval_s=1)


def test_the_ingress_exports_the_time_to_first_token_beside_the_engines(client):
    """`ray_ingress_ttft_seconds` reaches Prometheus as the Replica's histogram does. How many
    observations a request makes (one per HTTP request) test_replica_streams counts exactly:
    here a count settled before may still lack an earlier request's, as one run showed (the
    Ingress's export lagging the Replica's by over 2 s), so it is a floor."""
    names = ("ingress_ttft_seconds_count", "request_ttft_seconds_count")
    ingress, engine = _settled(*names)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        n=2, stream=True))
    client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4)
    assert wait_until(lambda: all(now >= want for now, want in zip(_scrape(*names), (ingress + 2, engine + 3))),
                      timeout_s=30, interval_s=1), _scrape(*names)


def test_the_acceptance_length_counters_add_each_requests_own_figures(client):
    """The acceptance length Prometheus charts is counters' ratio (emitted tokens / verify
    steps): exact, where the histogram's _sum is not (Ray records it at bucket midpoints)."""
    names = ("spec_verify_steps_total", "spec_emitted_tokens_total")
    steps, emitted = _settled(*names)
    spec = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=32, temperature=0)
    usage = spec.usage.model_extra["speculation"]
    assert usage["steps"] > 0
    assert _reaches(names, (steps + usage["steps"], emitted + usage["accepted_tokens"] + usage["steps"]))
    rounded = 5e-5 * usage["steps"]  # usage's acceptance length has 4 places
    assert usage["accepted_tokens"] + usage["steps"] == pytest.approx(usage["acceptance_length"] * usage["steps"],
                                                                        abs=rounded)


def test_the_replica_exports_what_the_draft_rule_measured(client):
    """Prometheus has the measured draft rule's view of each Replica: the costs it weighs and
    what SA drafts (by match length) and MTP asks have yielded (this deployment has no MTP
    head: its gauges read 0); and the engine's queue and KV cache."""
    client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=32, temperature=0)
    gauges = {}

    def scraped() -> bool:
        text = httpx.get(metrics_url(), timeout=10).text
        for name, labels, value in re.findall(r"^ray_(spec_\w+?)(\{[^}]*\})? (\S+)$", text, re.M):
            match_len = re.search(r'match_len="([^"]+)"', labels)
            gauges[(name, match_len.group(1) if match_len else None)] = float(value)
        for name, value in re.findall(r"^ray_(engine_\w+?)(?:\{[^}]*\})? (\S+)$", text, re.M):
            gauges[(name, None)] = float(value)
        # the engine's gauges are refreshed each second: one taken mid-request may count it waiting
        return all((name, None) in gauges for name in ("spec_draft_row_cost", "spec_mtp_ask_cost",
                                                         "spec_mtp_accepted_per_ask", "engine_waiting_requests",
                                                         "engine_kv_cache_usage")) and \
            gauges[("engine_waiting_requests", None)] == 0

    assert wait_until(scraped, timeout_s=60, interval_s=1), sorted(gauges)
    sa = {match_len: v for (name, match_len), v in gauges.items() if name == "spec_sa_acceptance"}
    assert set(sa) == set(MATCH_LEN_BUCKETS) and all(0 < v < 1 for v in sa.values()), sa
    assert gauges[("spec_mtp_ask_cost", None)] == gauges[("spec_mtp_accepted_per_ask", None)] == 0
    assert 0 <= gauges[("engine_kv_cache_usage", None)] < 1  # ranges are checked in test_kv_cache


def test_a_repeated_conversation_reports_its_cached_prompt_tokens(client):
    chat = [{"role": "user", "content": "Summarise this log:\n" + "\n".join(
        f"{i:04d} worker-{i % 3} finished task {i * 7} in {i % 11} ms" for i in range(40))}]
    first = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1  # all but the token whose logits start the answer
    assert first.usage.prompt_tokens_details.cached_tokens < 64  # at most the chat template's system part
    assert again.choices[0].message.content == first.choices[0].message.content


def test_32_concurrent_streams_all_complete(url, client):
    prompts = [f"Count from {i} to {i + 20}:" for i in range(4)]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in prompts}
    async_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(prompt):
        text = ""
        async for chunk in await async_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True):
            text += chunk.choices[0].text if chunk.choices else ""
        return prompt, text

    async def all_of_them():
        try:
            return await asyncio.gather(*[one(prompts[i % len(prompts)]) for i in range(32)])
        finally:
            await async_client.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    assert all(text == expected[prompt] for prompt, text in results)


def _stat(replica_handle, name: str) -> int:
    return int(replica_handle.stats.remote().result()[name])


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_aborts_in_the_engine(url, replica_handle, n):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": True, "n": n}
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(8)) if line.startswith("data: ")]
            assert received
            assert _stat(replica_handle, "live_requests") >= n
    steps = _stat(replica_handle, "steps")  # at the disconnect
    assert wait_until(lambda: _stat(replica_handle, "live_requests") == 0, timeout_s=60, interval_s=0.2)
    # an abort takes an engine step or two; the tokens left (at most 1 + max_draft_len a step) would take many
    fewest_steps_left = (900 - len(received)) // (1 + _stat(replica_handle, "max_draft_len"))
    assert _stat(replica_handle, "steps") - steps < fewest_steps_left // 2


def test_a_client_gone_before_a_plain_answer_aborts_every_choice(url, replica_handle):
    # undrafted: with speculation the SA pool, which has seen this module's other stories, may
    # draft so much of the answer that it is done before the client gives up
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "n": 2, "speculation": {"mode": "off"}}
    gave_up = []

    def client() -> None:  # gives up waiting long before 900 tokens (minutes here)
        with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=4)) as http:
            try:
                http.post("/v1/completions", json=body)
            except httpx.ReadTimeout:
                gave_up.append(True)

    thread = threading.Thread(target=client)
    thread.start()
    assert wait_until(lambda: _stat(replica_handle, "live_requests") >= 2, timeout_s=30, interval_s=0.1)
    started = _stat(replica_handle, "steps")
    thread.join(60)
    assert gave_up
    gone = _stat(replica_handle, "steps")
    assert wait_until(lambda: _stat(replica_handle, "live_requests") == 0, timeout_s=60, interval_s=0.2)
    left = 900 - (gone - started)  # undrafted: a token a step, each choice
    assert _stat(replica_handle, "steps") - gone < left // 2  # aborted, not run to the end


def _replica_log() -> str:
    """What the Replica processes of this module's cluster wrote to their Serve log files."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    return "".join(path.read_text(errors="replace") for path in sorted(logs.glob(f"replica_{APP}_Replica_*.log")))


def test_reconfigure_moves_the_gate_live(client, replica_handle):
    def gate() -> int:
        return replica_handle.stats.remote().result()["batch_gate"]

    assert gate() == 4
    pid = replica_handle.pid.remote().result()
    deploy(serving_config(batch_gate=0))  # only user_config changes: Serve reconfigures in place
    assert wait_until(lambda: gate() == 0, timeout_s=60, interval_s=0.2), gate()
    assert replica_handle.pid.remote().result() == pid, "the replica restarted instead of reconfiguring"
    # our INFO lines go to the replica's Serve log: the engine's start and the change
    assert wait_until(lambda: re.search(r"native CPU forward: \w+ kernels.*\n(.*\n)*.*speculation reconfigured: "
                                        r"SpeculationConfig\(.*batch_gate=0", _replica_log()), timeout_s=30,
                      interval_s=0.2), _replica_log()[-2000:]
    closed = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=16, temperature=0)
    assert closed.usage.model_extra["speculation"]["steps"] == 0, closed.usage  # gate 0: no step speculates

    deploy(serving_config(batch_gate=4))
    assert wait_until(lambda: gate() == 4, timeout_s=60, interval_s=0.2), gate()
    # the router's copy of the replica stats is a routing-stats period or two behind: until
    # it sees the new gate it still marks requests non-speculative
    reopened = None

    def speculates() -> bool:
        nonlocal reopened
        reopened = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=16, temperature=0)
        return reopened.usage.model_extra["speculation"]["steps"] > 0

    assert wait_until(speculates, timeout_s=30, interval_s=1.0), reopened.usage
    assert reopened.choices[0].text == closed.choices[0].text, (reopened.choices[0].text, closed.choices[0].text)


def test_a_user_config_the_replica_refuses_keeps_it_serving(client, replica_handle):
    """A bare `serve deploy` of settings the replica refuses: it keeps the settings in force and
    serves on (raising would make Serve stop it), reports the refusal in its stats, log and
    metrics, a replica started meanwhile takes the settings in force too, and the next good
    deploy is taken."""
    def refused_gauge() -> float | None:
        found = re.search(r"^ray_replica_user_config_refused(?:\{[^}]*\})? (\S+)$",
                          httpx.get(metrics_url(), timeout=10).text, re.M)
        return float(found.group(1)) if found else None

    assert _stat(replica_handle, "batch_gate") == 4 and _stat(replica_handle, "user_config_refused") == 0
    pid = replica_handle.pid.remote().result()
    deploy(serving_config(batch_gate=-1))
    assert wait_until(lambda: _stat(replica_handle, "user_config_refused") == 1, timeout_s=60, interval_s=0.2)
    assert wait_until(lambda: re.search(r"user_config refused, the settings in force are kept .*user_config\.batch_gate",
                                        _replica_log()), timeout_s=30, interval_s=0.2), _replica_log()[-2000:]
    assert wait_until(lambda: refused_gauge() == 1, timeout_s=30, interval_s=1)
    assert replica_handle.pid.remote().result() == pid and _stat(replica_handle, "batch_gate") == 4
    from ray import serve

    assert serve.status().applications[APP].status == "RUNNING"
    answer = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.model_extra["speculation"]["steps"] > 0

    # a replica starting meanwhile (here Serve's restart of a killed one) starts with the settings
    # the deployment's replicas last took, refused flag up; it failed to start until a good deploy
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        try:
            return replica_handle.pid.remote().result(timeout_s=10) != pid
        except Exception:  # noqa: BLE001 - the killed replica, until Serve has noticed
            return False

    assert wait_until(restarted, timeout_s=180, interval_s=1)
    assert _stat(replica_handle, "batch_gate") == 4 and _stat(replica_handle, "user_config_refused") == 1
    assert wait_until(lambda: re.search(r"user_config refused, starting with the settings last taken .*batch_gate=4",
                                        _replica_log()), timeout_s=30, interval_s=0.2), _replica_log()[-2000:]
    again = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == answer.choices[0].text
    pid = replica_handle.pid.remote().result()

    deploy(serving_config(batch_gate=4))
    assert wait_until(lambda: _stat(replica_handle, "user_config_refused") == 0, timeout_s=60, interval_s=0.2)
    assert wait_until(lambda: refused_gauge() == 0, timeout_s=30, interval_s=1)
    assert replica_handle.pid.remote().result() == pid


def test_a_deploy_whose_build_fails_leaves_the_version_before_it_serving_and_healthy(url, client, replica_handle):
    """A bare `serve deploy` whose build fails (here an args key the config check refuses)
    leaves the application DEPLOY_FAILED, its status listing no deployments, while the version
    before it serves on: /healthz said no engine replica ran, and requests whose first token
    waited past replica_loss_retry_s were given up as 503s (found by QA)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    pid = replica_handle.pid.remote().result()
    bad = serving_config()
    bad["applications"][0]["args"]["no_such_key"] = 1
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(bad), _blocking=False)
    try:
        assert wait_until(lambda: serve.status().applications[APP].status == "DEPLOY_FAILED", timeout_s=60,
                          interval_s=0.2)
        failed = serve.status().applications[APP]
        assert "no_such_key" in failed.message and not failed.deployments  # the status cannot tell
        answer = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=8, temperature=0)
        assert answer.choices[0].finish_reason == "length" and replica_handle.pid.remote().result() == pid
        health = httpx.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 200, health.text
    finally:
        deploy(serving_config())


def test_engine_errors_are_400s_naming_the_field(url):
    body = {"model": MODEL, "prompt": "hello " * 50, "max_tokens": 1000}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    body = {"model": MODEL, "prompt": [0, 10**6], "max_tokens": 4}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_n_choices_plain_and_streamed(client):
    # n seeded choices: choice i is the request alone with seed + i; streamed, each index
    # assembles into its plain choice; usage counts the prompt once and every choice's output.
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=1.0, seed=7)
    plain = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**{**kwargs, "seed": 7 + i}) for i in range(3)]
    assert [c.message.content for c in plain.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in plain.choices}) > 1
    assert plain.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert plain.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts, finishes, chunks = ["", "", ""], [None] * 3, list(client.chat.completions.create(
        **kwargs, n=3, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        assert finishes[choice.index] is None  # nothing after a choice's last chunk
        finishes[choice.index] = choice.finish_reason
    assert texts == [c.message.content for c in plain.choices]
    assert finishes == [c.finish_reason for c in plain.choices]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    greedy = client.completions.create(model=MODEL, prompt=CODE_PROMPT, max_tokens=12, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_echo_scores_a_text_as_its_generation_did_streamed_or_not(client):
    """`echo` with logprobs, what evaluation harnesses score texts with: the prompt comes back
    before the output, its first token unscored, and the tokens the model generated earlier
    score in the prompt with the very logprobs generating them had (row-invariant kernels: a
    prefill row computes what a decode step did)."""
    prompt = "a b c d a b c d a b c d a b"
    generated = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    text, made = prompt + generated.choices[0].text, generated.choices[0].logprobs
    kwargs = dict(model=MODEL, prompt=text, max_tokens=1, temperature=0, logprobs=2, echo=True)
    scored = client.completions.create(**kwargs)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text.startswith(text) and len(choice.text) > len(text)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == scored.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    ours = slice(len(lp.tokens) - 1 - len(made.tokens), -1)  # the generated tokens, in the prompt now
    assert lp.tokens[ours] == made.tokens
    assert lp.token_logprobs[ours] == made.token_logprobs and lp.top_logprobs[ours] == made.top_logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [(t, p) for c in chunks if c.logprobs for t, p in zip(c.logprobs.tokens, c.logprobs.token_logprobs)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs))
    assert client.completions.create(**{**kwargs, "logprobs": None}).choices[0].text == choice.text


def test_max_tokens_0_with_echo_scores_the_prompt_alone_streamed_or_not(client):
    """OpenAI's legacy scoring form (what older harnesses send): `max_tokens: 0` with `echo`
    gives back the prompt and its logprobs, the figures a generation past it shows for them,
    with nothing generated (no text, no logprob, 0 completion tokens, `length`)."""
    kwargs = dict(model=MODEL, prompt="def add(a, b):\n    return a + b\n", temperature=0, logprobs=2, echo=True)
    longer = client.completions.create(**kwargs, max_tokens=3)
    scored = client.completions.create(**kwargs, max_tokens=0)
    choice, lp, past = scored.choices[0], scored.choices[0].logprobs, longer.choices[0].logprobs
    assert choice.text == kwargs["prompt"] and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == longer.usage.prompt_tokens
    n = scored.usage.prompt_tokens
    assert lp.tokens == past.tokens[:n] and lp.token_logprobs == past.token_logprobs[:n]
    assert lp.top_logprobs == past.top_logprobs[:n] and lp.text_offset == past.text_offset[:n]
    chunks = list(client.completions.create(**kwargs, max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens: 0 only with echo"):
        client.completions.create(**{**kwargs, "echo": False}, max_tokens=0)


def test_vllm_prompt_logprobs_are_echos_with_ranks_on_completions_and_chat(url):
    """vLLM's `prompt_logprobs` (what scripts written against `vllm serve` score prompts with):
    null, then per prompt token {id: logprob, rank, decoded_token}, the token's own first, then
    its row's k likeliest; the same figures echo shows, each with its own number of alternatives.
    A chat's are the response's: its prompt is the rendered conversation."""
    prompt = "a b c d a b c d a b c d a b"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 3}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    scored, echoed = response["choices"][0]["prompt_logprobs"], response["choices"][0]["logprobs"]
    assert scored[0] is None and len(scored) == response["usage"]["prompt_tokens"]  # echo shows the output's too
    for entry, token, logprob, top in zip(scored[1:], echoed["tokens"][1:], echoed["token_logprobs"][1:],
                                          echoed["top_logprobs"][1:]):
        own, *likeliest = entry.values()
        assert own["decoded_token"] == token and own["logprob"] == logprob and own["rank"] >= 1
        ranks = {e["rank"] for e in likeliest} | ({own["rank"]} if own["rank"] <= 3 else set())
        assert sorted(ranks) == [1, 2, 3]  # the token's own rank among them if it is one of the 3
        best = next(e for e in (own, *likeliest) if e["rank"] == 1)
        # the likeliest, and the token's own where it is not (OpenAI's legacy k + 1)
        assert max(top.values()) == best["logprob"] and top[token] == logprob and len(top) <= 2
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
    scored = response["prompt_logprobs"]
    assert len(scored) == response["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(entry) == 1 for entry in scored[1:])  # the token's own, no alternatives


def test_a_batch_of_prompts_is_each_prompt_alone_in_order(url, client):
    """A list of token-id prompts as lm-evaluation-harness's local-completions sends it for
    loglikelihood (`max_tokens` 1, `logprobs` 1, `echo`): a choice per prompt, in order, each
    what that prompt alone gets; the usage counts every prompt."""
    from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir())
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("The sky is", "def add(a, b):\n    return")]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    batch = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    alone = [httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120).json() for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for choice, one, ids in zip(batch["choices"], alone, prompts):
        assert choice["text"] == one["choices"][0]["text"] and choice["logprobs"] == one["choices"][0]["logprobs"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert batch["usage"]["prompt_tokens"] == sum(map(len, prompts))
    kwargs = dict(model=MODEL, prompt=["The sky is", "Two plus two is"], max_tokens=4, temperature=0, n=2, echo=True)
    texts = client.completions.create(**kwargs)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3] and texts.choices[0].text == texts.choices[1].text
    assert texts.choices[2].text.startswith("Two plus two is")
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in texts.choices]
