"""Fake `tensorrt_llm.LLM` / `SamplingParams`: the pinned call surface on a toy model.

Surface mirrored (tensorrt_llm/llmapi/llm.py, executor/result.py, sampling_params.py):
  LLM(**kwargs) rejects keywords TorchLlmArgs lacks (upstream raises ValueError);
  generate_async(inputs, sampling_params, streaming=True) -> a result that is async-iterable,
    yields itself with .outputs[0].{text, token_ids, finish_reason, request_perf_metrics},
    has .finished, .abort() (final output then has finish_reason 'cancelled') and
    .cached_tokens (executor/result.py GenerationResultBase: the reused prompt prefix);
  stop strings are matched on token ids and trimmed from the final output only;
  get_stats_async(timeout) -> async iterable of iteration rows, ending after `timeout` idle,
    empty until a request was submitted; shutdown(); _check_health(); .tokenizer.

Construction mirrors where upstream's executor comes from (tensorrt_llm/executor/executor.py
GenerationExecutor.create): outside mpirun, with no Ray orchestrator, the worker is spawned
through an MPI pool session (executor/proxy.py, MpiPoolSession(n_workers=world size)), which
from a plain Python process such as a Serve replica is reported to die with MPI_ERR_SPAWN
(or hang). The fake refuses that case outright, unless TP=1 and TLLM_WORKER_USE_SINGLE_PROCESS=1
(llmapi/utils.py), which keeps the worker in the calling process. Building the SA pool checks
its size against max_batch_size as SuffixAutomatonManager (_torch/speculative/suffix_automaton.py)
does.

Block reuse (KvCacheConfig.enable_block_reuse, on by default): a prefilled prompt's whole
blocks of tokens_per_block are remembered, and a later request reuses its longest remembered
prefix of whole blocks, so its result reports that many `cached_tokens` from its first output
on. Only the first len - 1 prompt tokens count, as in upstream's BlockManager
(cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp: "only (length - 1) tokens of the sequence
have their kv-state recorded"); requests scheduled in one iteration do not reuse each other's
blocks, which are stored after the step. `generate_async(cache_salt=...)` limits reuse to the
requests with the same salt (upstream: get_cache_salt_id, folded into the first block's hash).
Not modelled: partial-block reuse and eviction.

The toy model repeats its prompt (token t+1 = prompt[len(output) % len(prompt)]), so the
output does not depend on speculation. Each step drafts `runtime_draft_len(batch)` tokens per
request (llmapi.py: a schedule only where the mode follows one, floored; otherwise always
max_draft_len); SA drafts are accepted in full once the output is `threshold` long, learned
drafts accepted half.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Union

from tests.trtllm.fake_tensorrt_llm.llmapi import KvCacheConfig, SADecodingConfig, TorchLlmArgs

SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


def spawn_refusal(args: TorchLlmArgs) -> Optional[str]:
    """Why creating this LLM's executor from a plain process fails (None: it does not).

    UNVERIFIED beyond the report: that every MPI spawn from a Serve replica fails, and
    what a process launched by mpirun (where upstream reuses the world) would do.
    """
    if args.orchestrator_type == "ray":
        return None
    if args.tensor_parallel_size == 1 and os.environ.get(SINGLE_PROCESS_ENV) == "1":
        return None
    return (f"MPI_ERR_SPAWN: spawning {args.tensor_parallel_size} MPI worker(s) from a process not "
            f"launched by mpirun (set {SINGLE_PROCESS_ENV}=1 at TP=1, orchestrator_type='ray' for TP>1)")


def sa_pool_refusal(args: TorchLlmArgs) -> Optional[str]:
    """SuffixAutomatonManager's check: one SA slot per running request at least."""
    spec = args.speculative_config
    if not isinstance(spec, SADecodingConfig) or args.max_batch_size is None:
        return None
    pool = spec.effective_pool_size(args.max_batch_size)
    if pool < args.max_batch_size:
        return f"global_pool_size ({pool}) must be >= max_batch_size ({args.max_batch_size})"
    return None


@dataclass(kw_only=True)
class GuidedDecodingParams:
    """tensorrt_llm.sampling_params.GuidedDecodingParams: one guide per request. The fake only
    records it (it cannot constrain its toy model)."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None

    def __post_init__(self) -> None:
        if sum(bool(v) for v in (self.json, self.regex, self.grammar, self.json_object, self.structural_tag)) > 1:
            raise ValueError("Only one guide can be used for a request")


@dataclass(kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: Optional[int] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logprobs: Optional[int] = None
    guided_decoding: Optional[GuidedDecodingParams] = None
    return_perf_metrics: bool = False
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True


class FakeTokenizer:
    """A stand-in HF tokenizer: one token per character; id 0 is EOS."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)


class TransformersTokenizer:
    """Upstream's wrapper: the HF tokenizer is its `.tokenizer`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return self.tokenizer.encode(text, *args, **kwargs)

    def decode(self, ids, *args, **kwargs) -> str:
        return self.tokenizer.decode(ids, *args, **kwargs)


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # upstream's: the stop string or token id that ended it
    request_perf_metrics: object = None


class FakeRequestOutput:
    def __init__(self, llm: "LLM", prompt: list[int], params: SamplingParams) -> None:
        self._llm, self.prompt_token_ids, self.params = llm, prompt, params
        self.outputs = [CompletionOutput()]
        self.finished = False
        self.aborted = False
        self.iterations = 0
        self.decoding_iter = 0  # upstream GenerationResultBase.decoding_iter
        self.cached_tokens = 0  # upstream GenerationResultBase.cached_tokens, set at scheduling
        self.cache_salt: Optional[str] = None  # generate_async's (upstream: the request's cache_salt_id)
        self.draft_total = self.accepted_total = 0
        self._ids: list[int] = []  # the engine's view of the output
        self._queue: asyncio.Queue = asyncio.Queue()

    def abort(self) -> None:
        self.aborted = True
        self._llm.abort_calls.append(self)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        snapshot, self.decoding_iter = await self._queue.get()
        self.outputs = [snapshot]
        return self


class LLM:
    def __init__(self, **kwargs) -> None:
        unknown = sorted(set(kwargs) - set(TorchLlmArgs.model_fields))
        if unknown:
            raise ValueError(f"Invalid argument(s): {unknown}")
        self.args = TorchLlmArgs(**kwargs)
        if refusal := spawn_refusal(self.args):
            raise RuntimeError(refusal)
        if refusal := sa_pool_refusal(self.args):
            raise ValueError(refusal)
        self.tokenizer = TransformersTokenizer(FakeTokenizer())
        self.kv_cache_config = self.args.kv_cache_config or KvCacheConfig()
        self.reusable_prefixes: set[tuple[Optional[str], tuple[int, ...]]] = set()  # (salt, whole-block prefix) held
        self.stats_as_json = False
        self.iteration_latency_ms = 10.0
        self.abort_calls: list[FakeRequestOutput] = []
        self.fatal = False
        self._active: list[FakeRequestOutput] = []
        self._rows: Optional[asyncio.Queue] = None
        self._loop_task: Optional[asyncio.Task] = None
        self.shut_down = False

    def generate_async(self, inputs, sampling_params=None, streaming=False, cache_salt=None) -> FakeRequestOutput:
        assert streaming and isinstance(inputs, list) and isinstance(inputs[0], int)
        # upstream's _check_arguments (llmapi/llm.py), PyTorch backend: without chunked prefill
        # a prompt goes in one iteration, so max_num_tokens bounds it
        limit = self.args.max_num_tokens
        if not self.args.enable_chunked_prefill and limit is not None and len(inputs) > limit:
            raise ValueError(f"The sum of prompt length ({len(inputs)}), query length (0) should not exceed "
                             f"max_num_tokens ({limit})")
        params = sampling_params or SamplingParams()
        spec = self.args.speculative_config
        # upstream's DecodingBaseConfig.enable_penalty: "While off, a request that asks for any
        # of these penalties is rejected at admission rather than silently decoded without them."
        if spec is not None and not spec.enable_penalty and (params.presence_penalty or params.frequency_penalty or (
                params.repetition_penalty not in (None, 1.0))):
            raise ValueError("penalties need the speculative config's enable_penalty=True")
        result = FakeRequestOutput(self, list(inputs), params)
        result.cache_salt = cache_salt
        if self._rows is None:
            self._rows = asyncio.Queue()
        self._active.append(result)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return result

    async def get_stats_async(self, timeout: float = 2):
        if self._rows is None:
            return
        while True:
            try:
                async with asyncio.timeout(timeout):
                    row = await self._rows.get()
            except TimeoutError:
                return
            yield json.dumps(row) if self.stats_as_json else row

    def shutdown(self) -> None:
        self.shut_down = True
        if self._loop_task is not None:
            self._loop_task.cancel()

    def _check_health(self) -> bool:
        return not self.fatal

    # -- the toy engine loop ----------------------------------------------------------------
    def _whole_block_prefixes(self, req: FakeRequestOutput) -> list[tuple[Optional[str], tuple[int, ...]]]:
        n, prompt = self.kv_cache_config.tokens_per_block, req.prompt_token_ids
        return [(req.cache_salt, tuple(prompt[:end])) for end in range(n, len(prompt), n)]  # within the first len - 1

    def _reused_tokens(self, req: FakeRequestOutput) -> int:
        if not self.kv_cache_config.enable_block_reuse:
            return 0
        reused = 0
        for prefix in self._whole_block_prefixes(req):
            if prefix not in self.reusable_prefixes:
                break
            reused = len(prefix[1])
        return reused

    def _store_blocks(self, req: FakeRequestOutput) -> None:
        if self.kv_cache_config.enable_block_reuse:
            self.reusable_prefixes.update(self._whole_block_prefixes(req))

    def _draft_len(self, batch: int) -> int:
        spec = self.args.speculative_config
        return 0 if spec is None else spec.runtime_draft_len(batch)

    def _accepted(self, req: FakeRequestOutput, k: int) -> int:
        spec = self.args.speculative_config
        sa = getattr(spec, "sa_config", None)
        sa_on = spec.decoding_type == "SA" or sa is not None
        if sa_on and len(req._ids) >= (sa.threshold if sa is not None else 4):
            return k
        return 0 if spec.decoding_type == "SA" else k // 2

    async def _run(self) -> None:
        while self._active:
            batch = self._active[: self.args.max_batch_size or len(self._active)]
            gen = [r for r in batch if r.iterations > 0 and not r.aborted]
            k = self._draft_len(len(batch))
            drafts = accepted = 0
            scheduled = [r for r in batch if r.iterations == 0 and not r.aborted]
            for req in scheduled:
                req.cached_tokens = self._reused_tokens(req)
            for req in batch:
                if req.aborted:
                    self._finish(req, "cancelled")
                    continue
                acc = self._accepted(req, k) if req.iterations and k else 0
                acc = max(0, min(acc, req.params.max_tokens - len(req._ids) - 1))  # no drafts past max_tokens
                if req.iterations and k:
                    drafts += k
                    accepted += acc
                    req.draft_total += k
                    req.accepted_total += acc
                self._emit(req, 1 + acc)
            for req in scheduled:
                self._store_blocks(req)
            with_drafts = len(gen) if k else 0
            self._rows.put_nowait({
                # the overlap scheduler's (upstream's default): iterLatencyMS spans about two loops,
                # hostStepTimeMS the loop itself (py_executor._process_iter_stats)
                "iter": 0, "iterLatencyMS": 2 * self.iteration_latency_ms, "hostStepTimeMS": self.iteration_latency_ms,
                "schedulerMode": "overlap",
                "numActiveRequests": len(batch), "numQueuedRequests": len(self._active) - len(batch),
                "inflightBatchingStats": {"numScheduledRequests": len(batch), "numContextRequests": len(batch) - len(gen),
                                          "numGenRequests": len(gen), "numPausedRequests": 0},
                "specDecodingStats": {"numDraftTokens": drafts, "numAcceptedTokens": accepted,
                                      "numRequestsWithDraftTokens": with_drafts,
                                      "acceptanceLength": (accepted + with_drafts) / with_drafts if with_drafts else 0.0,
                                      "iterLatencyMS": 1.0, "draftOverhead": 0.1},
            })
            await asyncio.sleep(0)

    def _emit(self, req: FakeRequestOutput, count: int) -> None:
        p = req.params
        ids = list(req._ids)
        stops = [p.stop] if isinstance(p.stop, str) else p.stop or []
        stop_words = [self.tokenizer.encode(s) for s in stops]
        reason = stop_reason = None
        for _ in range(count):
            ids.append(req.prompt_token_ids[len(ids) % len(req.prompt_token_ids)])
            if ids[-1] in (p.stop_token_ids or []):
                reason, stop_reason = "stop", ids[-1]
            elif any(ids[-len(w):] == w for w in stop_words):
                i = next(i for i, w in enumerate(stop_words) if ids[-len(w):] == w)
                ids, reason, stop_reason = ids[: len(ids) - len(stop_words[i])], "stop", stops[i]
            elif len(ids) >= p.max_tokens:
                reason = "length"
            if reason:
                break
        req.iterations += 1
        self._snapshot(req, ids, reason, stop_reason)

    def _finish(self, req: FakeRequestOutput, reason: str) -> None:
        self._snapshot(req, list(req._ids), reason)

    def _snapshot(self, req: FakeRequestOutput, ids: list, reason: Optional[str], stop_reason=None) -> None:
        perf = None
        if req.params.return_perf_metrics:
            perf = SimpleNamespace(speculative_decoding=SimpleNamespace(
                acceptance_rate=req.accepted_total / req.draft_total if req.draft_total else 0.0,
                total_accepted_draft_tokens=req.accepted_total, total_draft_tokens=req.draft_total))
        snapshot = CompletionOutput(text=self.tokenizer.decode(ids), token_ids=ids, finish_reason=reason,
                                    stop_reason=stop_reason, request_perf_metrics=perf)
        req._ids = ids
        req._queue.put_nowait((snapshot, req.iterations))
        if reason:
            req.finished = True
            self._active.remove(req)
