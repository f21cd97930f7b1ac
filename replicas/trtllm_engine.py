"""TrtllmEngine: TensorRT-LLM's `LLM` behind the `Engine` protocol (the production GPU engine).

TensorRT-LLM does the drafting (EAGLE-3 or MTP), its own GPU suffix automaton and the
verification; this adapter adds what it lacks: the batch gate it really applies as a stat
the router can read (`replicas/trtllm/gate.py`: often none), live acceptance figures for
autoscaling, per-request usage, prefix-cache hits (upstream's KV block reuse), and our
deltas. It stays thin: settings are translated by the pure functions in
`replicas/trtllm/translate.py`.

`tensorrt_llm` is imported when the engine is constructed, never at module import; without
it the constructor raises TensorRTLLMUnavailable naming the install route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from replicas.engine import GenerationDelta, GenerationRequest, RequestError, SpeculationConfig
from replicas.stats import EngineStats
from replicas.token_bytes import token_bytes
from replicas.trtllm.api import TensorRTLLMUnavailable, TrtllmApi, load_api
from replicas.trtllm.config import TrtllmEngineConfig
from replicas.trtllm.iteration_stats import IterationStatsFolder
from replicas.trtllm.outputs import OutputTracker, cached_prompt_tokens, prefilled, request_usage
from replicas.trtllm.translate import (
    SpecPlan, guided_decoding_kwargs, guided_decoding_refusal, kv_cache_kwargs, llm_kwargs, plan_speculation,
    sampling_kwargs, worker_env,
)

__all__ = ["TrtllmEngine", "TrtllmEngineConfig", "TensorRTLLMUnavailable"]

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    """One request in flight: upstream's result handle, our tracker, the delta queue."""

    tracker: OutputTracker
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: Any = None  # tensorrt_llm RequestOutput (async iterable, .abort())
    pump: asyncio.Task | None = None
    prefilled: bool = False  # counted in the prefix-cache totals
    probe: bool = False  # a health probe (GenerationRequest.probe): never counted


class TrtllmEngine:
    """One TensorRT-LLM LLM per replica; see docs/trtllm.md for what needs a restart."""

    def __init__(self, config: TrtllmEngineConfig, api: TrtllmApi | None = None,
                 load: Callable[[], TrtllmApi] = load_api) -> None:
        self.config = config
        self.api = api or load()
        self._plan = self._make_plan(config.speculation)  # fails fast on unsupported settings
        self._pending: SpeculationConfig | None = None
        self._llm: Any = None
        self.tokenizer: Any = None
        self._raw = None  # its tokens' bytes (replicas/token_bytes.py), once started
        self._live: dict[str, _Live] = {}
        self._stats = IterationStatsFolder(self._plan.source)
        self._stats_task: asyncio.Task | None = None
        self._submitted = False
        # Prefix-cache totals, kept across restart(): the replica exports their increase.
        self._prefix_hit_tokens = 0
        self._prefix_prompt_tokens = 0

    def _make_plan(self, spec: SpeculationConfig) -> SpecPlan:
        plan = plan_speculation(self.config, spec, self.api.spec_fields())
        for note in plan.notes:
            logger.warning(note)
        return plan

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._llm is not None:
            return
        # Built off the event loop: loading takes minutes, and upstream's RayExecutor only
        # creates its workers synchronously when the constructing thread has no running loop
        # (tensorrt_llm/executor/ray_executor.py).
        self._llm = await asyncio.to_thread(self._build_llm)
        # The raw HF tokenizer under upstream's TransformersTokenizer wrapper
        # (tensorrt_llm/tokenizer/tokenizer.py): it pickles to an ingress without TensorRT-LLM.
        self.tokenizer = getattr(self._llm.tokenizer, "tokenizer", self._llm.tokenizer)
        self._raw = token_bytes(self.tokenizer)
        self._stats_task = asyncio.create_task(self._poll_stats(), name="trtllm-stats")

    def _build_llm(self) -> Any:
        api, cfg, plan = self.api, self.config, self._plan
        # Before the executor exists: upstream reads it once, when the LLM creates its worker.
        os.environ.update(worker_env(cfg))
        kwargs = llm_kwargs(cfg, api.llm_fields)
        kwargs["kv_cache_config"] = api.kv_cache_config_cls(**kv_cache_kwargs(cfg, api.kv_cache_fields))
        if cfg.cuda_graphs and api.cuda_graph_config_cls is not None:
            kwargs["cuda_graph_config"] = api.cuda_graph_config_cls(max_batch_size=cfg.max_batch_size, enable_padding=True)
        if plan.config_class is not None:
            spec_kwargs = dict(plan.kwargs)
            if plan.sa_enhancer is not None:
                spec_kwargs["sa_config"] = api.classes["SAEnhancerConfig"](**plan.sa_enhancer)
            kwargs["speculative_config"] = api.classes[plan.config_class](**spec_kwargs)
        logger.info("building TensorRT-LLM %s LLM: %s", api.version, kwargs)
        return api.llm_cls(**kwargs)

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            # bounded: a stats read that swallows the cancellation must not block shutdown
            await asyncio.wait({self._stats_task}, timeout=self.config.stats_timeout_s + 1.0)
            self._stats_task = None
        for request_id in list(self._live):
            await self.abort(request_id)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    async def check_health(self) -> None:
        if self._llm is None:
            raise RuntimeError("engine not started")
        if self._stats_task is not None and self._stats_task.done() and not self._stats_task.cancelled():
            raise RuntimeError(f"stats poller stopped: {self._stats_task.exception()!r}")
        probe = getattr(self._llm, "_check_health", None)  # what trtllm-serve's /health calls
        if callable(probe) and not probe():
            raise RuntimeError("TensorRT-LLM executor reports a fatal error")

    # -- requests ---------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Validate now (RequestError naming the field), submit and stream once iterated.

        A request's `speculation` narrowing (and its `over_gate` mark) is not forwarded:
        TensorRT-LLM has no per-request draft control, and speculation never changes the output, only its speed.
        """
        if self._llm is None:
            raise RuntimeError("engine not started")
        if request.request_id in self._live:
            raise RequestError("request_id", f"{request.request_id!r} is already running")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(request.sampling, name) is not None:
                raise RequestError(name, "not returned by the TensorRT-LLM engine yet")
        if request.sampling.logit_bias:
            raise RequestError("logit_bias", "not mapped to the TensorRT-LLM engine yet")
        if request.resume is not None:  # refused, never rerun from the start (the client has the start)
            raise RequestError("resume", "the TensorRT-LLM engine cannot continue an interrupted request yet")
        prompt_ids = self._prompt_ids(request)
        kwargs = sampling_kwargs(request.sampling, self.api.sampling_fields)
        kept = request.sampling.stop_after  # matched by our tracker in unconstrained output only
        if request.grammar is not None:  # constrained, or refused (an optional grammar: unconstrained)
            refusal = guided_decoding_refusal(self.config, self.speculation, self.api.guided_decoding_cls is not None,
                                              request.grammar)
            if refusal and not request.grammar.optional:
                raise RequestError(request.grammar.param, refusal)
            if not refusal:
                kwargs["guided_decoding"] = self.api.guided_decoding_cls(**guided_decoding_kwargs(request.grammar))
                kept = ()  # the grammar ends the text itself
        try:
            sampling = self.api.sampling_params_cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RequestError("sampling", str(exc)) from exc
        tracker = OutputTracker(request.request_id, len(prompt_ids), request.sampling.stop, kept, self._raw)
        return self._stream(tracker, prompt_ids, sampling, request.probe, request.cache_salt or None)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if isinstance(request.prompt, str):
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=False))
        else:
            ids = [int(t) for t in request.prompt]
            if any(t < 0 for t in ids):
                raise RequestError("prompt", "token ids must be >= 0")
        if not ids:
            raise RequestError("prompt", "must not be empty")
        window = self.config.max_seq_len
        if len(ids) + request.sampling.max_tokens > window:
            raise RequestError("max_tokens", f"{request.sampling.max_tokens} + {len(ids)} prompt tokens exceed "
                                             f"the context window of {window}")
        return ids

    async def _stream(self, tracker: OutputTracker, prompt_ids: list[int], sampling: Any, probe: bool,
                      cache_salt: str | None):
        live = _Live(tracker, probe=probe)
        self._live[tracker.request_id] = live
        try:
            try:
                live.result = self._llm.generate_async(prompt_ids, sampling_params=sampling, streaming=True,
                                                       cache_salt=cache_salt)
            except Exception as exc:  # noqa: BLE001 - e.g. a dead executor: an error delta, not a trace
                logger.exception("submitting request %s failed", tracker.request_id)
                yield tracker.finish("error", f"{type(exc).__name__}: {exc}")
                return
            self._submitted = True
            live.pump = asyncio.create_task(self._pump(live))
            while True:
                delta = await live.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._live.pop(tracker.request_id, None)
            if live.pump is not None:
                live.pump.cancel()
            if not tracker.done:  # the consumer went away (client disconnect)
                tracker.finish("abort")
                self._abort_upstream(live)

    async def _pump(self, live: _Live) -> None:
        """Upstream snapshots -> deltas on the request's queue."""
        tracker = live.tracker
        try:
            async for output in live.result:
                out = output.outputs[0]
                if not live.prefilled and prefilled(out.token_ids, out.finish_reason):
                    self._count_prefill(live, getattr(output, "cached_tokens", 0))
                usage = request_usage(getattr(out, "request_perf_metrics", None),
                                      int(getattr(output, "decoding_iter", 0) or 0), len(out.token_ids))
                delta = tracker.update(out.text, out.token_ids, out.finish_reason, usage,
                                       getattr(out, "stop_reason", None))
                if delta is None:
                    continue
                live.queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    if out.finish_reason is None:  # we cut a stop string upstream did not match
                        self._abort_upstream(live)
                    return
            delta = tracker.finish("error", "upstream stream ended without a finish reason")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure must not hang the client
            logger.exception("TensorRT-LLM request %s failed", tracker.request_id)
            delta = tracker.finish("error", f"{type(exc).__name__}: {exc}")
        if delta is not None:
            live.queue.put_nowait(delta)

    def _count_prefill(self, live: _Live, reported_cached: Any) -> None:
        """Once per request, when upstream has run its prefill (the reused prefix is known by then)."""
        tracker = live.tracker
        tracker.cached_tokens = cached_prompt_tokens(reported_cached, tracker.prompt_tokens)
        if not live.probe:
            self._prefix_hit_tokens += tracker.cached_tokens
            self._prefix_prompt_tokens += tracker.prompt_tokens
        live.prefilled = True

    def _abort_upstream(self, live: _Live) -> None:
        result = live.result
        if result is None or getattr(result, "finished", False):
            return
        try:
            result.abort()
        except Exception:  # noqa: BLE001 - best effort: the request is already over for us
            logger.warning("aborting request %s upstream failed", live.tracker.request_id, exc_info=True)

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.tracker.done:
            return
        if live.pump is not None:
            live.pump.cancel()
        self._abort_upstream(live)
        live.queue.put_nowait(live.tracker.finish("abort"))

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    # -- settings and stats -----------------------------------------------------------------
    def configure(self, speculation: SpeculationConfig) -> None:
        """Validate and stage new settings. TensorRT-LLM fixes speculative_config (drafter,
        K, SA threshold, gate) when the LLM is built, so every field here needs
        `await restart()`; until then the engine and its stats (its gate included) keep the
        built settings."""
        if speculation == self.config.speculation:
            self._pending = None
            return
        self._make_plan(speculation)  # raise now, not at restart
        self._pending = speculation
        logger.warning("TensorRT-LLM speculation is fixed at build: %s take effect after restart()",
                       ", ".join(self.restart_required))

    @property
    def speculation(self) -> SpeculationConfig:
        """The settings the running LLM was built with (staged changes apply at restart)."""
        return self.config.speculation

    @property
    def restart_required(self) -> tuple[str, ...]:
        """Fields staged by configure() that the running LLM does not have yet."""
        if self._pending is None:
            return ()
        built = self.config.speculation
        return tuple(f.name for f in dataclasses.fields(built)
                     if getattr(built, f.name) != getattr(self._pending, f.name))

    async def restart(self) -> None:
        """Rebuild the LLM with the staged settings; in-flight requests end with `abort`."""
        if self._pending is None:
            return
        await self.shutdown()
        self.config = dataclasses.replace(self.config, speculation=self._pending)
        self._plan, self._pending = self._make_plan(self.config.speculation), None
        self._stats = IterationStatsFolder(self._plan.source)
        self._submitted = False
        await self.start()

    def stats(self) -> EngineStats:
        """Live figures, with the gate the built engine applies (NOT_GATED where the mode cannot
        stop drafting by batch size: then `speculating` is 1 whenever speculation is built).

        Prefix cache: hit and prompt token totals from each request's `cached_tokens`; the
        block figures stay 0, since upstream's iteration rows (`kvCacheStats`) count blocks in
        use and blocks reused at allocation, not the reusable blocks it holds or evicts.
        """
        live = len(self._live)  # our own count: immediate, where upstream rows lag a poll
        batch = min(live, self.config.max_batch_size)
        plan, s = self._plan, self._stats
        return EngineStats(
            batch_size=batch, waiting=live - batch, speculating=int(plan.speculates_at(batch)),
            batch_gate=plan.batch_gate,
            acceptance_length=s.acceptance_length.value,
            draft_tokens=dict(s.draft_tokens), accepted_tokens=dict(s.accepted_tokens),
            step_ms=s.step_ms.value, tokens_per_s=s.tokens_per_s.value,
            prefix_hit_tokens=self._prefix_hit_tokens, prefix_prompt_tokens=self._prefix_prompt_tokens,
        )

    async def _poll_stats(self) -> None:
        """Drain iteration stats rows. A read ends after stats_timeout_s without a row."""
        while True:
            # Before the first request upstream has no stats queue and warns on every read.
            if self._submitted:
                try:
                    async for row in self._llm.get_stats_async(timeout=self.config.stats_timeout_s):
                        self._fold(row)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - stats are advisory; keep serving
                    logger.warning("reading TensorRT-LLM iteration stats failed", exc_info=True)
            await asyncio.sleep(self.config.stats_poll_interval_s)

    def _fold(self, row: Any) -> None:
        try:
            self._stats.fold(row)
        except (TypeError, ValueError, AttributeError):  # one malformed row must not stop the poller
            logger.warning("skipping a malformed iteration stats row: %.200r", row)
