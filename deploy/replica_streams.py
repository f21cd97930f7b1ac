"""The Ingress's streams from engine replicas: opened, followed, resumed, cancelled.

`ReplicaStreams.open` starts a request on a Replica (through the speculation-gate router) and
waits for its first delta, sending the request again whole while its replica dies before any
output or refuses it as tokenized for another model (a deploy changing the model rolls out);
`deltas` follows the stream, resuming the request on another replica as a continuation
(`Resume`) when its replica dies mid-stream, and cancels the stream (which aborts the request
in the engine) when its consumer stops early; `collect` gathers a whole answer. Every failure
leaves as an `ApiError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any, AsyncIterator

from deploy import openai_format as fmt
from deploy.arrival import first_output_s
from deploy.config import IngressConfig
from deploy.errors import RETRY_AFTER_S, ApiError, replica_lost, server_error
from deploy.router import routable_replicas
from replicas.engine import GenerationDelta, GenerationRequest, RequestRejected, Resume
from replicas.stats import METRIC_INGRESS_TTFT, METRIC_RETRIES, TTFT_BOUNDARIES_S

logger = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0  # a controller slower than this to say what runs: not healthy
REPLICA_POLL_S = 5.0  # how often a call still unanswered asks whether any Replica runs
# Serve's replica states that answer calls: a user_config being applied (UPDATING), a replica on
# a draining node (PENDING_MIGRATION) and one a restarted controller finds again (RECOVERING) too
SERVING_STATES = ("RUNNING", "UPDATING", "PENDING_MIGRATION", "RECOVERING")


async def all_choices(coroutines: list) -> list:
    """Run a request's choices together; when one fails (or the request is cancelled), cancel
    the rest (each stops its stream) and raise."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def cancel(stream) -> None:
    """Cancel a replica stream; best effort (Serve's cancel re-raises a failed assignment)."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - the request already failed; nothing left to stop
        pass


def _read_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def no_engine_replica() -> ApiError:
    return ApiError(503, "no engine replica is running, retry later", retry_after_s=RETRY_AFTER_S)


def another_model_serving() -> ApiError:
    return ApiError(503, "the engine replicas reached serve another model than this deployment names (a deploy "
                         "that changes the model is rolling out, or its replicas cannot start), retry later",
                    retry_after_s=RETRY_AFTER_S)


class _AnotherModel(Exception):
    """A Replica refused a request tokenized for another model (RequestRejected.another_model)."""


def _backoff_s(attempt: int) -> float:
    return min(RETRY_AFTER_S * attempt, 5.0)


class ReplicaStreams:
    """Streams of engine requests from the Replica deployment behind `replica` (a handle)."""

    def __init__(self, replica: Any, config: IngressConfig) -> None:
        self._replica = replica
        self._streams = replica.options(stream=True)
        self._config = config
        # the retry counter and the TTFT histogram, made on first use (a metric needs a live Serve)
        self._retries = self._ttft = None
        self._running: tuple[float, bool] = (0.0, True)  # (when asked, whether a Replica ran)
        self._asking = asyncio.Lock()  # one question to the controller at a time

    async def engine_running(self, max_age_s: float = 0.0) -> bool:
        """Whether Serve's controller counts a Replica running, of this Ingress's model where its
        routing stats say (a deploy that changes the model and whose new Replicas fail to start
        leaves the old ones running, and every request refused): asked of the controller, not of
        a replica (a replica busy with a full batch is healthy), or its answer of the last
        `max_age_s`, which those that waited for the question in flight take too (a flood of
        health probes cost a controller call each: QA). Raises what asking raises (the
        controller unreachable or slow)."""
        from ray import serve

        async with self._asking:
            asked_at, running = self._running
            if time.monotonic() - asked_at > max_age_s:
                async with asyncio.timeout(STATUS_TIMEOUT_S):
                    status = await asyncio.to_thread(serve.status)
                app = status.applications.get(self._replica.app_name)
                states = app.deployments.get(self._replica.deployment_name) if app is not None else None
                if states is not None:
                    running = any(states.replica_states.get(state) for state in SERVING_STATES)
                else:  # none listed: a redeploy that replaces the application has not listed its
                    # new ones yet, or a deploy whose build failed (the version before it serves
                    # on, unlisted): what this process's router can send to tells
                    running = bool(routable_replicas(self._replica.app_name))
                if running and self._config.model_identity is not None:  # (a new router may list none yet)
                    running = not routable_replicas(self._replica.app_name) or \
                        bool(routable_replicas(self._replica.app_name, self._config.model_identity))
                self._running = (time.monotonic(), running)
            return running

    async def answered(self, call: Any) -> Any:
        """What `call` (to an engine replica) returns, or ApiError(503) once Serve's controller
        has counted no Replica running for `replica_loss_retry_s`: a call waits in Serve's
        router as long as none runs, and with every start failing (an engine that cannot load
        its model) Serve tries on until a good deploy."""
        task = asyncio.ensure_future(call)
        none_since = None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=REPLICA_POLL_S)
                if done:
                    return task.result()
                try:
                    running = await self.engine_running(max_age_s=REPLICA_POLL_S / 2)
                except Exception:  # noqa: BLE001 - the controller cannot say: keep waiting
                    running = True
                if running:
                    none_since = None
                elif none_since is None:
                    none_since = time.monotonic()
                elif time.monotonic() - none_since >= self._config.replica_loss_retry_s:
                    raise no_engine_replica()
        finally:
            if not task.done():  # given up (a 503, or the client gone): its end is read, never logged
                task.cancel()    # as "Task exception was never retrieved" (found by QA)
                task.add_done_callback(_read_outcome)

    async def tokenizer(self, model_identity: str | None) -> Any:
        """The tokenizer of a Replica serving `model_identity`, asked again (Serve's router may
        pick another) for up to `replica_loss_retry_s` while Replicas of another model answer."""
        deadline = time.monotonic() + self._config.replica_loss_retry_s
        for attempt in itertools.count(1):
            try:
                tokenizer = await self.answered(self._replica.tokenizer.remote(model_identity))
            except ApiError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise server_error(exc) from exc
            if tokenizer is not None:
                return tokenizer
            if time.monotonic() >= deadline:
                raise another_model_serving()
            self._count_retry("another_model")
            await asyncio.sleep(_backoff_s(attempt))

    async def open(self, request: GenerationRequest, routing: asyncio.Lock):
        """Start the replica stream and wait for its first item (errors are still HTTP statuses).

        Nothing has reached the client yet, so a request whose replica dies here, or that a
        Replica of another model refuses, is sent again (the router picks a live replica of its
        model, or waits for Serve to start one) for up to `replica_loss_retry_s`: the client
        sees only latency. Held under `routing`, the HTTP
        request's lock: one of its choices routed at a time (see `Ingress.handle`).
        """
        async with routing:
            deadline = time.monotonic() + self._config.replica_loss_retry_s
            for attempt in itertools.count(1):
                stream = None
                try:
                    stream = self._streams.generate.remote(request)  # may raise BackPressureError here
                    # no idle timeout yet: a request waiting for a batch slot is not idle, and a
                    # replica whose engine stalls fails its health check and is replaced
                    first = await self.answered(stream.__anext__())
                    if isinstance(first, RequestRejected) and first.another_model:
                        raise _AnotherModel(first.message)
                    break
                except BaseException as exc:
                    if stream is not None:
                        cancel(stream)
                    if isinstance(exc, ApiError):
                        raise
                    if isinstance(exc, StopAsyncIteration):
                        raise ApiError(500, "the engine stream ended before any output") from None
                    another_model = isinstance(exc, _AnotherModel)
                    if (another_model or replica_lost(exc)) and time.monotonic() < deadline:
                        logger.warning("request %s %s; sending it again", request.request_id, exc if another_model
                                       else f"lost its replica before any output ({type(exc).__name__})")
                        self._count_retry("another_model" if another_model
                                          else "resume" if request.resume is not None else "retry")
                        await asyncio.sleep(_backoff_s(attempt))
                        continue
                    if another_model:
                        raise another_model_serving() from None
                    if isinstance(exc, Exception):
                        raise server_error(exc) from exc
                    raise
        if isinstance(first, RequestRejected):
            raise ApiError(400, first.message, first.param)
        waited_s = first_output_s() if request.resume is None else None
        if waited_s is not None:
            if self._ttft is None:
                from ray.serve import metrics

                self._ttft = metrics.Histogram(METRIC_INGRESS_TTFT, "time to first token from the request's arrival "
                                               "at the Ingress (tokenizing, queues, gate holds, prefill)",
                                               boundaries=TTFT_BOUNDARIES_S)
            self._ttft.observe(waited_s)
        return stream, first

    def _count_retry(self, kind: str) -> None:
        """kind: "retry" (sent again whole, nothing had reached the client), "resume", or
        "another_model" (a Replica of another model refused it)."""
        if self._retries is None:
            from ray.serve import metrics

            self._retries = metrics.Counter(METRIC_RETRIES, "requests sent again after their replica died, each "
                                            "send: whole (kind=retry) or as a continuation mid-stream (kind=resume); "
                                            "or after a Replica of another model refused it (kind=another_model)",
                                            tag_keys=("kind",))
        self._retries.inc(tags={"kind": kind})

    async def _following(self, request: GenerationRequest, stream, acc: fmt.Accumulated, routing: asyncio.Lock,
                         idle_timeout: bool = True):
        """(stream, its next delta), within `stream_idle_timeout_s` if `idle_timeout`. When the
        replica died mid-stream, the request is sent again as a continuation of what the client
        already has (`Resume`): the rest of the stream comes from the new replica, exactly what
        the dead one would have produced."""
        try:
            # not asyncio.wait_for: Python 3.11's returns a delta that came as its task was cancelled
            # (the client gone), and the stream then ran on to its end for nobody
            async with asyncio.timeout(self._config.stream_idle_timeout_s if idle_timeout else None):
                return stream, await stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            if not replica_lost(exc) or self._config.replica_loss_retry_s <= 0:
                raise
            cancel(stream)
            logger.warning("request %s lost its replica after %d tokens (%s); resuming it",
                           request.request_id, len(acc.token_ids), type(exc).__name__)
            self._count_retry("resume")
            # an id of its own: a replica that only seemed lost may still run the first attempt
            resumed = dataclasses.replace(request, request_id=f"{request.request_id}-at{len(acc.token_ids)}",
                                          resume=Resume(tuple(acc.token_ids), len(acc.text)))
            try:
                return await self.open(resumed, routing)
            except ApiError as refused:
                if refused.status != 400:
                    raise
                # the engine cannot continue it (TensorRT-LLM's cannot yet): the replica was lost,
                # as without a retry, not a fault of the client's request (was a 400 naming resume)
                logger.warning("request %s could not be resumed: %s", request.request_id, refused.message)
                raise server_error(exc) from exc

    async def deltas(self, request: GenerationRequest, stream, delta: GenerationDelta, acc: fmt.Accumulated,
                      routing: asyncio.Lock) -> AsyncIterator[GenerationDelta]:
        """The request's deltas from `delta` on, each added to `acc` before it is yielded, the
        stream resumed where its replica died (`_following`). An engine error or abort, or a
        stream that ends without a finish reason, raises ApiError(500). Unless it ran to its
        last delta (an error, or the consumer stopped), the replica stream is cancelled, which
        stops the request in the engine."""
        done = False
        try:
            while True:
                if delta.finish_reason == "error" and delta.error_param is not None:  # the request's fault
                    raise ApiError(400, delta.error or "", delta.error_param)
                if delta.finish_reason in ("error", "abort"):
                    raise ApiError(500, f"generation failed: {delta.error or delta.finish_reason}")
                waiting = delta.waiting  # back in the engine's queue: not idle, as before its first token
                if not waiting:
                    delta = acc.add(delta)
                    done = delta.finish_reason is not None
                    yield delta
                    if done:
                        return
                try:
                    stream, delta = await self._following(request, stream, acc, routing, idle_timeout=not waiting)
                except StopAsyncIteration:
                    raise ApiError(500, "the engine stream ended without a finish reason") from None
        finally:
            if not done:
                cancel(stream)

    async def collect(self, request: GenerationRequest, stream, delta: GenerationDelta,
                       routing: asyncio.Lock, prompt_only: bool = False) -> fmt.Accumulated:
        acc = fmt.Accumulated.of(request, prompt_only)
        try:
            async with contextlib.aclosing(self.deltas(request, stream, delta, acc, routing)) as deltas:
                async for _ in deltas:
                    pass
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise server_error(exc) from exc
        return acc
