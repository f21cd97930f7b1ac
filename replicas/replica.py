"""The Serve deployment that owns one engine.

A plain class: `deploy/app.py` turns it into a deployment with `serve.deployment(Replica)`,
so it has no import-time Serve side effects. The engine comes from an injected factory,
so the Serve parts run with any `Engine`. Speculation settings arrive only as `user_config`
through `reconfigure`: Serve calls it once before the first request, which builds and
starts the engine with them (an engine such as TensorRT-LLM fixes them at build), and
again on every change. Stats, the settings in force included, are read from the engine
(the batch gate as the engine applies it: `EngineStats.batch_gate`, NOT_GATED where no
batch size switches its speculation off) and go to the router (`record_routing_stats`),
the autoscaling policy (`record_autoscaling_stats`) and Prometheus (`ray.serve.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from replicas.engine import (
    MAX_DRAFT_LEN, Engine, GenerationDelta, GenerationRequest, RequestError, RequestRejected,
    RequestSpeculation, SamplingParams, SpeculationConfig,
)
from replicas.speculation.gate import gate_open
from replicas.stats import (
    METRIC_ACCEPTANCE_LENGTH, METRIC_ACCEPTED_TOKENS, METRIC_BATCH_SIZE, METRIC_DRAFT_ROW_COST, METRIC_DRAFT_TOKENS,
    METRIC_EMITTED_TOKENS, METRIC_GATE_OPEN, METRIC_KV_PREEMPTIONS, METRIC_KV_USAGE, METRIC_MTP_ACCEPTED_PER_ASK,
    METRIC_MTP_ASK_COST, METRIC_PREFIX_BLOCKS, METRIC_PREFIX_EVICTIONS, METRIC_PREFIX_HIT_TOKENS,
    METRIC_PREFIX_PROMPT_TOKENS, METRIC_SA_ACCEPTANCE, METRIC_SA_POOL_TOKENS, METRIC_TPOT, METRIC_TTFT,
    METRIC_USER_CONFIG_REFUSED, METRIC_VERIFY_STEPS, METRIC_WAITING, MODEL_IDENTITY, SOURCES, TTFT_BOUNDARIES_S,
    EngineStats,
)

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0  # how often counters and gauges are refreshed from engine stats
CONTROLLER_TIMEOUT_S = 10.0  # a stopping replica's question to Serve's controller
DEPLOYMENT_NAME = "Replica"  # what deploy/app.py names this deployment
STALLED_CHECKS = 3  # health checks in a row with live requests and no new token or step = unhealthy


def log_through_serve(package: str) -> None:
    """In a Serve replica, `package`'s loggers write INFO and above through Serve's own handlers
    (the replica's log file and the driver's console, in Serve's format). Serve configures only
    `ray.serve`: our INFO lines (the engine's kernels and threads, a preemption, a
    reconfiguration) went nowhere and warnings went out bare. Outside a replica: nothing."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return
    ours = logging.getLogger(package)
    ours.setLevel(logging.INFO)
    ours.handlers = list(logging.getLogger("ray.serve").handlers)
    ours.propagate = False


def _follow(counter, total: int, last: int, tags: dict[str, str] | None = None) -> int:
    """Advance a Prometheus counter by what an engine's monotonic `total` grew since `last`;
    returns `total`, the next call's `last`."""
    if total > last:
        counter.inc(total - last, tags=tags)
    return total


class _Metrics:
    """The DESIGN.md Prometheus metrics; counters follow the engine's monotonic totals."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.draft = metrics.Counter(METRIC_DRAFT_TOKENS, "draft tokens proposed", tag_keys=("source",))
        self.accepted = metrics.Counter(METRIC_ACCEPTED_TOKENS, "draft tokens accepted", tag_keys=("source",))
        self.acceptance = metrics.Histogram(
            METRIC_ACCEPTANCE_LENGTH, "tokens emitted per verify step (bonus included), at each request's mean",
            boundaries=[1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 17, 33, MAX_DRAFT_LEN + 1])
        self.verify_steps = metrics.Counter(METRIC_VERIFY_STEPS, "verify steps of finished requests")
        self.emitted = metrics.Counter(METRIC_EMITTED_TOKENS, "tokens the verify steps of finished requests emitted "
                                       "(bonus included): / verify steps = the acceptance length")
        self.gate_open = metrics.Gauge(METRIC_GATE_OPEN, "1 if a new request would be speculated")
        self.batch = metrics.Gauge(METRIC_BATCH_SIZE, "requests decoding in the engine")
        self.waiting = metrics.Gauge(METRIC_WAITING, "requests queued in the engine for a batch slot or KV pages")
        self.kv_usage = metrics.Gauge(METRIC_KV_USAGE, "share of the KV cache the requests hold (0 to 1)")
        self.user_config_refused = metrics.Gauge(METRIC_USER_CONFIG_REFUSED, "1 while the last user_config is "
                                                 "refused (the settings before it stay in force)")
        self.ttft = metrics.Histogram(METRIC_TTFT, "time to first token from the engine's taking the request",
                                      boundaries=list(TTFT_BOUNDARIES_S))
        self.tpot = metrics.Histogram(METRIC_TPOT, "time per output token after the first",
                                      boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2])
        self._last = {source: (0, 0) for source in SOURCES}
        # engine totals -> counters (the prefix cache's hit rate = hit / prompt tokens); blocks held
        self.totals = {
            "prefix_hit_tokens": metrics.Counter(METRIC_PREFIX_HIT_TOKENS, "prompt tokens served from the prefix cache"),
            "prefix_prompt_tokens": metrics.Counter(METRIC_PREFIX_PROMPT_TOKENS, "prompt tokens admitted"),
            "prefix_evicted_blocks": metrics.Counter(METRIC_PREFIX_EVICTIONS, "prefix cache blocks evicted"),
            "kv_preemptions": metrics.Counter(METRIC_KV_PREEMPTIONS, "requests sent back to the queue for KV pages"),
        }
        self._last_totals = dict.fromkeys(self.totals, 0)
        self.prefix_blocks = metrics.Gauge(METRIC_PREFIX_BLOCKS, "blocks held by the prefix cache")
        self.sa_pool_tokens = metrics.Gauge(METRIC_SA_POOL_TOKENS, "tokens the suffix automata's cross-request "
                                            "pool holds (it fills to sa_global_pool_tokens)")
        # what the measured draft rule weighs: the costs, and what drafts have yielded
        self.draft_rule = {
            "draft_row_cost": metrics.Gauge(METRIC_DRAFT_ROW_COST, "an extra verify row, in plain steps (measured)"),
            "mtp_ask_cost": metrics.Gauge(METRIC_MTP_ASK_COST, "an ask of the MTP head, in plain steps (measured)"),
            "mtp_accepted_per_ask": metrics.Gauge(METRIC_MTP_ACCEPTED_PER_ASK,
                                                  "draft tokens accepted per ask of the MTP head (measured)"),
        }
        self.sa_acceptance = metrics.Gauge(METRIC_SA_ACCEPTANCE, "chance an SA draft token is accepted, by match length "
                                           "(measured)", tag_keys=("match_len",))

    def refresh(self, stats: EngineStats, user_config_refused: bool) -> None:
        self.user_config_refused.set(float(user_config_refused))
        for source in SOURCES:
            tags = {"source": source}
            last_draft, last_accepted = self._last[source]
            self._last[source] = (_follow(self.draft, stats.draft_tokens.get(source, 0), last_draft, tags),
                                  _follow(self.accepted, stats.accepted_tokens.get(source, 0), last_accepted, tags))
        for name, counter in self.totals.items():
            self._last_totals[name] = _follow(counter, getattr(stats, name), self._last_totals[name])
        self.prefix_blocks.set(stats.prefix_cached_blocks)
        self.sa_pool_tokens.set(stats.sa_pool_tokens)
        for name, gauge in self.draft_rule.items():
            gauge.set(getattr(stats, name))
        for match_len, rate in stats.sa_acceptance.items():
            self.sa_acceptance.set(rate, tags={"match_len": match_len})
        self.batch.set(stats.batch_size)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        # the engine's own gate, for a request joining behind those waiting: one it cannot apply
        # (NOT_GATED) never reads as closed or open by batch
        self.gate_open.set(1.0 if gate_open(stats.batch_size + stats.waiting, stats.batch_gate, stats.speculating)
                           else 0.0)

    def finished(self, usage: dict[str, float], ttft_s: float | None, tpot_s: float | None) -> None:
        # The acceptance length as counters (rate(emitted) / rate(steps)): Ray 2.60 records a
        # histogram's _sum at each bucket's midpoint (QA: 6 steps at 4.83 added 27, not 29).
        # The histogram takes one observation per verify step at the request's mean (the
        # engine reports no per-step figure), for its quantiles.
        steps = int(usage.get("steps", 0))
        if steps:
            self.verify_steps.inc(steps)
            self.emitted.inc(int(usage["accepted_tokens"]) + steps)
        for _ in range(steps):
            self.acceptance.observe(usage["acceptance_length"])
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)


class LastSettings:
    """The last `user_config` a replica of this deployment took, kept in Ray's internal KV store
    (the GCS: it outlives every replica). A replica that starts while a refused user_config is
    deployed (a restart, a scale-out) starts with it, as the running ones keep it, instead of
    failing to start until a good deploy. They go with the application (`serve delete`, `serve
    shutdown`): a later one of the same name starts from its own. Outside a Serve replica:
    nothing is kept."""

    def __init__(self, deployment: str | None = None) -> None:
        """Those of `deployment` of the application of the Serve replica making this (default:
        the replica's own deployment)."""
        from ray import serve
        from ray.serve.exceptions import RayServeException

        self._stopping = False
        try:
            context = serve.get_replica_context()
        except RayServeException:
            self._app, self._key = None, None
        else:
            self._app = context.app_name
            self._key = f"specserve/user_config/{context.app_name}/{deployment or context.deployment}".encode()

    def get(self) -> Any:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(self._key) if self._key is not None else None
        return None if value is None else json.loads(value)

    def put(self, user_config: Any) -> None:
        from ray.experimental import internal_kv

        if self._key is not None:
            internal_kv._internal_kv_put(self._key, json.dumps(user_config).encode(), overwrite=True)

    def on_stop(self) -> Awaitable[None] | None:
        """What a deployment's `__del__` returns, once: Serve's graceful stop awaits it
        (`forget_if_deleted`); Python's own finalizer call later gets nothing to await."""
        if self._key is None or self._stopping:
            return None
        self._stopping = True
        return self.forget_if_deleted()

    async def forget_if_deleted(self) -> None:
        """Forget them where the application is being deleted (or is gone): asked of Serve's
        controller as a replica stops. A replica stopped for a redeploy or a scale-in keeps them.
        The Replica's own stop may never come to it (killed at the end of its graceful timeout
        with a long stream still running, or never started): the ResponseStore asks too."""
        from ray import serve
        from ray.experimental import internal_kv

        try:
            async with asyncio.timeout(CONTROLLER_TIMEOUT_S):
                status = await asyncio.to_thread(serve.status)
        except Exception as exc:  # kept: a later refused start falls back on them, and says so
            logger.warning("could not ask Serve whether application %r is being deleted: %r", self._app, exc)
            return
        app = status.applications.get(self._app)
        if app is None or app.status == "DELETING":
            internal_kv._internal_kv_del(self._key)


class Replica:
    """Owns one engine: builds it with the first `user_config`, streams requests through it
    and reports its stats."""

    def __init__(self, engine_factory: Callable[[SpeculationConfig], Engine], metrics: bool = True,
                 last_settings: LastSettings | None = None, model_identity: str | None = None) -> None:
        """`model_identity`: the model this replica's engine serves (EngineArgs.identity); a
        request tokenized for another is refused (None: every request is taken)."""
        log_through_serve("replicas")
        self._engine_factory = engine_factory
        self._model_identity = model_identity
        self._last_settings = last_settings or LastSettings()
        self._engine: Engine | None = None  # built by the first reconfigure
        self._user_config_refused = False  # the last user_config was refused
        self._metrics = _Metrics() if metrics else None
        self._stats_task: asyncio.Task | None = None
        self._tokens_out = 0  # deltas with tokens forwarded: the health check's progress, with steps
        self._stalled_checks = 0
        self._last_progress = (0, 0)  # (tokens forwarded, engine steps) at the last health check

    def __del__(self):
        """Serve's graceful stop awaits what this returns: the settings this deployment's
        replicas took go if the application is being deleted (`LastSettings.on_stop`)."""
        settings = getattr(self, "_last_settings", None)  # (an __init__ that raised)
        return settings.on_stop() if settings is not None else None

    # -- configuration and stats ------------------------------------------------------------
    async def reconfigure(self, user_config: Any) -> None:
        """Serve's `user_config` hook: the first call builds and starts the engine with these
        settings; later calls change them (gate, threshold, draft length, mode) live. Settings
        refused are logged, naming the key, and `user_config_refused` is 1 in the stats and
        metrics: a running replica keeps the settings in force, a starting one takes those its
        deployment's replicas last took (LastSettings), and with none taken yet it fails to
        start."""
        if self._engine is not None:
            try:
                config = SpeculationConfig.from_user_config(user_config)
                self._engine.configure(config)
            except ValueError as exc:
                # Raising would make Serve stop this replica and start new ones that fail on the
                # same settings: with one replica, an outage until a good deploy.
                self._user_config_refused = True
                logger.error("user_config refused, the settings in force are kept (%s): %s",
                             self._engine.speculation, exc)
                return
            self._user_config_refused = False
            self._last_settings.put(user_config or {})
            logger.info("speculation reconfigured: %s (in force: %s)", config, self._engine.speculation)
            return
        user_config = user_config or {}
        try:
            config = SpeculationConfig.from_user_config(user_config)
            engine = self._engine_factory(config)  # an engine may refuse settings as it is built
        except ValueError as exc:
            last = self._last_settings.get()
            if last is None or last == user_config:  # none taken before: it does not start
                raise
            config = SpeculationConfig.from_user_config(last)
            engine = self._engine_factory(config)
            self._user_config_refused = True
            logger.error("user_config refused, starting with the settings last taken (%s): %s", config, exc)
        await engine.start()
        if not self._user_config_refused:  # taken: what a replica starting later falls back on
            self._last_settings.put(user_config)
        self._engine = engine
        self._stats_task = asyncio.create_task(self._refresh_metrics_forever())

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine is not built yet: the replica has received no user_config")
        return self._engine

    async def stats(self) -> dict[str, float]:
        """`EngineStats.as_metrics()` (the gate the engine really applies included: one source,
        never the configured or staged setting) plus the settings in force and the live
        request count."""
        engine = self.engine
        flat = engine.stats().as_metrics()
        speculation = engine.speculation
        flat["max_draft_len"] = float(speculation.max_draft_len)
        flat["sa_threshold"] = float(speculation.sa_threshold)
        flat["live_requests"] = float(engine.num_live_requests)
        flat["user_config_refused"] = float(self._user_config_refused)
        return flat

    async def record_routing_stats(self) -> dict[str, Any]:
        """`stats()`, and the model this replica serves (the routers send a request to one of
        the model it was tokenized for)."""
        stats: dict[str, Any] = await self.stats()
        if self._model_identity is not None:
            stats[MODEL_IDENTITY] = self._model_identity
        return stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """`stats()`, or nothing while the engine is being built: Serve asks from the replica's
        start, and a replica that reports nothing counts as not reporting (policy.py)."""
        return await self.stats() if self._engine is not None else {}

    async def pid(self) -> int:
        """The replica's process id (tells a live reconfigure from a restart)."""
        return os.getpid()

    async def tokenizer(self, model_identity: str | None = None) -> Any:
        """The engine's HF tokenizer (pickled to the ingress, which renders chats and counts);
        None if `model_identity` is given and this replica serves another model."""
        if not self._serves(model_identity):
            return None
        return self.engine.tokenizer

    def _serves(self, model_identity: str | None) -> bool:
        return model_identity is None or self._model_identity is None or model_identity == self._model_identity

    async def _refresh_metrics_forever(self) -> None:
        while self._metrics is not None:
            try:
                self._metrics.refresh(self.engine.stats(), self._user_config_refused)
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("metrics refresh failed")
            await asyncio.sleep(STATS_PERIOD_S)

    # -- requests -----------------------------------------------------------------------------
    async def generate(
        self, request: GenerationRequest, speculate: bool = True,
    ) -> AsyncIterator[GenerationDelta | RequestRejected]:
        """Stream one request. `speculate=False` (set by the router when every replica is
        above its gate) marks it `over_gate`. Cancelling the stream (the client went away)
        closes the engine stream, which aborts the request there."""
        if not self._serves(request.model_identity):
            yield RequestRejected(f"this replica serves {self._model_identity!r}, the request was tokenized for "
                                  f"{request.model_identity!r}", another_model=True)
            return
        if not speculate:
            request = dataclasses.replace(request, over_gate=True)
        started = time.monotonic()
        try:
            stream = self.engine.generate(request)
        except RequestError as exc:
            yield RequestRejected.from_error(exc)
            return
        first_token_at = None
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if delta.token_ids:
                    self._tokens_out += 1
                    first_token_at = first_token_at or time.monotonic()
                yield delta
                if delta.finish_reason is not None:
                    self._observe(delta, started, first_token_at)

    def _observe(self, last: GenerationDelta, started: float, first_token_at: float | None) -> None:
        if self._metrics is None:
            return
        ttft = tpot = None
        if first_token_at is not None:
            ttft = first_token_at - started
            if last.completion_tokens > 1:
                tpot = (time.monotonic() - first_token_at) / (last.completion_tokens - 1)
        self._metrics.finished(last.speculation, ttft, tpot)

    async def check_health(self) -> None:
        """Raise unless the engine serves: live requests must make progress (a token out, or a
        step run while long prompts go in); an idle engine must answer a one-token probe."""
        engine = self.engine
        await engine.check_health()
        if engine.num_live_requests:
            progress = (self._tokens_out, engine.stats().steps)  # a step: long prompts going in
            progressed = progress != self._last_progress
            self._last_progress = progress
            self._stalled_checks = 0 if progressed else self._stalled_checks + 1
            if self._stalled_checks >= STALLED_CHECKS:
                raise RuntimeError(f"engine made no progress over {STALLED_CHECKS} health checks")
            return
        probe = GenerationRequest(
            request_id=f"health-{uuid.uuid4().hex}", prompt="ok",
            sampling=SamplingParams(max_tokens=1), speculation=RequestSpeculation(mode="off"), probe=True,
        )
        async for delta in engine.generate(probe):
            if delta.finish_reason == "error":
                raise RuntimeError(f"health probe failed: {delta.error}")
