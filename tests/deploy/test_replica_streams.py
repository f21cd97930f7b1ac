"""`ReplicaStreams` on its own (no Serve): a call given up, because the client left, ends
without asyncio logging an outcome nobody read; a redeploy's status is read, never a KeyError."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from types import SimpleNamespace

from deploy.config import AppArgs, IngressConfig
from deploy.replica_streams import ReplicaStreams


class _Replica:  # what ReplicaStreams reads of a deployment handle before a call
    app_name, deployment_name = "specserve", "Replica"

    def options(self, **_):
        return self


def test_a_call_given_up_leaves_no_unread_outcome():
    """A client gone while its call waited: the call is cancelled, and the error it ends with
    (Serve's RequestCancelledError) is read. It once went to asyncio's "Task exception was
    never retrieved" log on every early disconnect (found by QA)."""
    config = IngressConfig.from_args(AppArgs())
    unread = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unread.append(context))
        started = asyncio.Event()

        async def call():
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                raise RuntimeError("cancelled, as Serve's call raises it") from None

        waiting = asyncio.ensure_future(ReplicaStreams(_Replica(), config).answered(call()))
        await started.wait()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(go())
    assert unread == []


def test_what_serves_is_read_from_a_redeploys_status(monkeypatch):
    """Serve's status during a redeploy that replaces the application lists its deployments
    empty for a moment, and a deploy whose build failed lists none while the version before it
    serves on: then what the Ingress's router can send to tells (a failed build was "none
    running": /healthz a 503 and requests waiting given up, found by QA; the status alone
    cannot tell the old version serving from a dead one). A replica applying a user_config
    (UPDATING) serves: /healthz was a 503 at every change of one."""
    from ray import serve

    from deploy import replica_streams

    def status(deployments, app_status="DEPLOYING"):
        return SimpleNamespace(applications={"specserve": SimpleNamespace(status=app_status,
                                                                          deployments=deployments)})

    def replicas(**states):
        return {"Replica": SimpleNamespace(replica_states=states)}

    streams = ReplicaStreams(_Replica(), IngressConfig.from_args(AppArgs()))
    for shown, routable, running in (
            (status({}), None, False), (status({}, "DEPLOY_FAILED"), 0, False), (status({}, "DEPLOY_FAILED"), 1, True),
            (status({}), 2, True), (SimpleNamespace(applications={}), None, False),
            (status(replicas(STARTING=1), "DEPLOY_FAILED"), 1, False), (status(replicas(STOPPING=1, STARTING=1)), 2, False),
            (status(replicas(RUNNING=1), "RUNNING"), 0, True), (status(replicas(UPDATING=1), "RUNNING"), 1, True),
            (status(replicas(PENDING_MIGRATION=1, STARTING=1)), 1, True)):
        monkeypatch.setattr(serve, "status", lambda: shown)
        monkeypatch.setattr(replica_streams, "routable_replicas",
                            lambda app, model=None: routable if app == "specserve" else None)
        assert asyncio.run(streams.engine_running()) is running, (shown, routable)
    # Replicas running, but none of the Ingress's model (a deploy changing the model whose new
    # Replicas fail to start: /healthz was 200 while every request was refused); a router
    # just built, listing none yet, or none built, leaves Serve's word
    monkeypatch.setattr(serve, "status", lambda: status(replicas(RUNNING=2), "DEPLOY_FAILED"))
    for routable, of_model, running in ((2, 0, False), (2, 1, True), (0, 0, True), (None, None, True)):
        monkeypatch.setattr(replica_streams, "routable_replicas",
                            lambda app, model=None: routable if model is None else of_model)
        assert asyncio.run(streams.engine_running()) is running, (routable, of_model)


def test_health_probes_at_once_ask_the_controller_once_a_second(monkeypatch):
    """A flood of /health probes cost a controller call each (QA: 58 probes/s slowed other
    clients' chats 0.07 -> 0.59 s): those that come while a question is in flight, or within
    the second after, take its answer."""
    import time

    from ray import serve

    from deploy import replica_streams

    calls = []

    def status():
        calls.append(time.monotonic())
        time.sleep(0.05)  # a controller's answer takes a while
        return SimpleNamespace(applications={"specserve": SimpleNamespace(
            status="RUNNING", deployments={"Replica": SimpleNamespace(replica_states={"RUNNING": 1})})})

    monkeypatch.setattr(serve, "status", status)
    monkeypatch.setattr(replica_streams, "routable_replicas", lambda app, model=None: 1)
    streams = ReplicaStreams(_Replica(), IngressConfig.from_args(AppArgs()))

    async def probes() -> list[bool]:
        return await asyncio.gather(*(streams.engine_running(max_age_s=1.0) for _ in range(20)))

    assert asyncio.run(probes()) == [True] * 20 and len(calls) == 1
    assert asyncio.run(streams.engine_running()) and len(calls) == 2  # max_age_s 0: asked again


def test_the_time_to_first_token_is_observed_once_an_http_request_from_its_arrival():
    """`ray_ingress_ttft_seconds`: the first output of an HTTP request's first choice to open
    is observed, from the Arrival middleware's clock; its other choices, a resume (its output
    began on a replica lost since), and a call outside any HTTP request are not."""
    import dataclasses

    from deploy.arrival import Arrival
    from replicas.engine import GenerationDelta, GenerationRequest, Resume, SamplingParams

    class Emitting(_Replica):  # each call's stream gives its first delta at once
        class generate:  # noqa: N801 - a handle's method, as Serve names it
            @staticmethod
            def remote(request):
                class Stream:
                    async def __anext__(self):
                        return GenerationDelta(request.request_id, (1,), "x", None)
                return Stream()

    observed = []
    streams = ReplicaStreams(Emitting(), IngressConfig.from_args(AppArgs()))
    streams._ttft = SimpleNamespace(observe=observed.append)  # (a metric needs a live Serve)
    request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=4))
    resumed = dataclasses.replace(request, resume=Resume((1,)))

    def app(*requests):
        async def serve_it(scope, receive, send):  # its choices in tasks of their own, as _sse has them
            await asyncio.gather(*(streams.open(r, asyncio.Lock()) for r in requests))
        return Arrival(serve_it)

    async def go():
        await app(request, request)({"type": "http"}, None, None)  # n = 2: one
        await app(resumed)({"type": "http"}, None, None)  # a resume alone: none
        await app(request, resumed)({"type": "http"}, None, None)  # one
        await streams.open(request, asyncio.Lock())  # no HTTP request: none

    asyncio.run(go())
    assert len(observed) == 2 and all(0 <= s < 5 for s in observed)


def test_a_request_back_in_the_engines_queue_is_not_idle():
    """A request preempted for KV pages waits in the engine's queue, as before its first token,
    for as long as the requests ahead of it run: its `waiting` delta stops the idle timer until
    its next delta (the timeout cut it off mid-stream, found by QA). Without it, the same wait
    is a timeout."""
    from deploy.errors import ApiError
    from deploy.openai_format import Accumulated
    from replicas.engine import GenerationDelta, GenerationRequest, SamplingParams

    config = IngressConfig.from_args(AppArgs(limits={"stream_idle_timeout_s": 0.2}))
    request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=3))

    async def stream(preempted: bool):
        yield GenerationDelta("r", (7,), "a")
        if preempted:
            yield GenerationDelta("r", (), "", waiting=True)
        await asyncio.sleep(0.6)  # the requests ahead run on
        yield GenerationDelta("r", (8,), "b")
        yield GenerationDelta("r", (9,), "c", "length")

    async def collect(preempted: bool) -> Accumulated:
        replica_stream = stream(preempted)
        first = await replica_stream.__anext__()
        return await ReplicaStreams(_Replica(), config).collect(request, replica_stream, first, asyncio.Lock())

    acc = asyncio.run(collect(preempted=True))
    assert (acc.token_ids, acc.text, acc.finish_reason) == ([7, 8, 9], "abc", "length")
    try:
        asyncio.run(collect(preempted=False))
    except ApiError as exc:
        assert exc.status == 504
    else:
        raise AssertionError("an idle stream was not cut off")


def test_a_client_gone_as_a_delta_comes_stops_its_request_in_the_engine():
    """The consumer cancelled as its stream's next delta comes in (a client gone in the middle
    of an engine step, the common case with a batch's deltas landing together): the replica
    stream is cancelled, which stops the request in the engine. With Python 3.11's
    `asyncio.wait_for` the delta was returned instead and the stream ran to its end for nobody
    (found by a review: 12% of such cancels lost under a synthetic load)."""
    from deploy.openai_format import Accumulated
    from replicas.engine import GenerationDelta, GenerationRequest, SamplingParams

    config = IngressConfig.from_args(AppArgs())
    request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=50))

    class Stream:  # what Serve's response generator shows the Ingress
        sent, cancelled = 0, False

        async def __anext__(self):
            await asyncio.sleep(0)  # an engine step
            self.sent += 1
            if self.sent == 3:
                consumer.cancel()  # the client goes as this delta comes
            return GenerationDelta("r", (self.sent,), "x", "length" if self.sent == 50 else None)

        def cancel(self):
            self.cancelled = True

    async def follow(stream: Stream) -> None:
        acc = Accumulated.of(request)
        deltas = ReplicaStreams(_Replica(), config).deltas(request, stream, await stream.__anext__(), acc,
                                                            asyncio.Lock())
        async with contextlib.aclosing(deltas):
            async for _ in deltas:
                pass

    async def go() -> Stream:
        nonlocal consumer
        stream = Stream()
        consumer = asyncio.ensure_future(follow(stream))
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        return stream

    consumer = None
    stream = asyncio.run(go())
    assert consumer.cancelled() and stream.cancelled and stream.sent < 50
