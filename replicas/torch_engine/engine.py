"""TorchEngine: the embedded engine behind the `Engine` protocol.

An asyncio face over `EngineCore`. Steps run back to back in one worker thread so the event
loop stays free for HTTP, each step's deltas handed to the loop as they come; requests join,
leave and reconfigure only while no step runs, applied by the loop task itself, so the core
needs no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

import torch

from replicas.engine import DEFAULT_MODEL, GenerationDelta, GenerationRequest, RequestError, SpeculationConfig
from replicas.stats import EngineStats
from replicas.torch_engine.core import EngineCore
from replicas.torch_engine.gguf_weights import GgufWeights
from replicas.torch_engine.loader import gguf_file, load_tokenizer, model_config, resolve_model_dir
from replicas.torch_engine.mtp import DEFAULT_MTP_WEIGHTS, MTPDrafter, setting_problems, weights_dir
from replicas.torch_engine.sequence import Detokenizer, Sequence
from replicas.torch_engine.sizes import kv_pages, size_problems, whole_pages
from replicas.torch_engine.suffix_drafts import prediction_prefix, suffix_drafts

if TYPE_CHECKING:
    from replicas.speculation.grammar import Constraint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchEngineConfig:
    model: str = DEFAULT_MODEL  # the embedded default, a Llama .gguf file or an HF Llama checkpoint directory
    max_batch_size: int = 8  # KV cache slots: requests decoding at once
    max_seq_len: int = 4096  # context window per request (prompt + output + drafts)
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int = 0  # native forward threads (on CUDA: torch's); 0 = native_model.DEFAULT_THREADS
    mtp_weights: str | None = DEFAULT_MTP_WEIGHTS  # None disables MTP drafting
    # MTP drafts stop at the first token the head is less sure of than this. Its confidence
    # is calibrated (acceptance ~ confidence, mtp.json). On the native forward an extra verify
    # row costs about a quarter of a decode step (compute, not bytes), so only confident
    # tokens pay: a sweep of 0.3 / 0.5 / 0.7 / 0.85 on 2 Zen 4 cores was fastest at 0.5-0.7 on
    # chat and code edits, and 0.3 was slower than no speculation on chat.
    mtp_min_confidence: float = 0.7
    sa_global_pool_tokens: int = 1 << 20  # cross-request suffix pool; 0 disables it
    # KV blocks kept for reuse by later prompts with the same start (prefix_cache.py); 0
    # turns the cache off. Must hold one whole context window (the default model needs
    # about 0.8 MB per 32 tokens: 104 MB at max_seq_len 4096); 256 MiB is ~10k tokens.
    prefix_cache_bytes: int = 256 << 20
    # On CPU, the KV pages every running request and the prefix cache's blocks share (about
    # 0.7 MB per 32 tokens for the default model); 0 = every slot's whole window. Must hold one
    # context window. When running requests need more, the prefix cache gives back blocks
    # nobody uses, then the newest requests wait in the queue and resume, exactly, later.
    kv_cache_bytes: int = 0
    # Context positions one engine step prefills: a longer prompt, and the requests behind it,
    # go in over the next steps, so running requests keep decoding while long prompts go in
    # (a 4,000-token prompt held their tokens back 4.4 s in one step on a 2-core Xeon; a
    # largest gap of 2.8 s at 2,048 a step, 0.8 s at 512; its own first token no later).
    max_prefill_tokens: int = 512
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if not 0 <= self.mtp_min_confidence <= 1:
            raise ValueError(f"mtp_min_confidence: must be in [0, 1], got {self.mtp_min_confidence}")
        for name in ("num_threads", "sa_global_pool_tokens", "prefix_cache_bytes", "kv_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


class TorchEngine:
    """PyTorch engine with hybrid SA + MTP speculative decoding (CPU, or CUDA when present)."""

    def __init__(self, config: TorchEngineConfig | None = None) -> None:
        self.config = config or TorchEngineConfig()
        self.tokenizer = None
        self._core: EngineCore | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._queues: dict[str, asyncio.Queue[GenerationDelta]] = {}
        self._pending_add: list[Sequence] = []
        self._pending_abort: list[str] = []
        self._pending_config: SpeculationConfig | None = None
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stopping = False  # read by the worker thread between steps
        self._sa_ids = itertools.count()
        self._eos_ids: frozenset[int] = frozenset()
        self._grammars = None  # GrammarCompiler, built with the core

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop_task is not None:
            return
        self._core = await asyncio.get_running_loop().run_in_executor(self._executor, self._build_core)
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name="torch-engine-loop")

    def _build_core(self) -> EngineCore:
        from replicas.speculation.grammar import GrammarCompiler

        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: cuda, but torch {torch.__version__} finds no CUDA device on this host "
                             f"(auto uses one where there is one)")
        device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu")
        # the sizes and the MTP head against the model's config, before its weights load or a
        # GGUF is converted (as config_check does); a GGUF's header is read once (gguf-py takes
        # seconds over a tokenizer's fields: 2.4 s for the default's 49,152 tokens)
        gguf = gguf_file(cfg.model)
        source = GgufWeights(gguf) if gguf is not None else None
        target_cfg = source.config if source is not None else model_config(cfg.model)
        # a GGUF's weights are read from it on CPU: its converted copy's are for CUDA alone
        model_dir = resolve_model_dir(cfg.model, weights=device.type == "cuda")
        memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        problems = size_problems(cfg.max_seq_len, cfg.kv_cache_bytes, cfg.prefix_cache_bytes,
                                 cfg.mtp_weights is not None, target_cfg, cuda=device.type == "cuda",
                                 max_batch_size=cfg.max_batch_size, memory_bytes=memory)
        problems += setting_problems(cfg.mtp_weights, target_cfg)
        if problems:
            raise ValueError("; ".join(problems))
        self.tokenizer = load_tokenizer(model_dir)
        if not self.tokenizer.chat_template:
            logger.warning("model %s has no chat template: chat requests are refused (400), completions served",
                           model_dir)
        if len(self.tokenizer) > target_cfg.vocab_size:  # its last ids would index past the embedding
            raise ValueError(f"model: its tokenizer has {len(self.tokenizer)} tokens, more than the model's "
                             f"vocab_size ({target_cfg.vocab_size}): not the model's tokenizer")
        if device.type == "cpu":
            from replicas.torch_engine.native_model import NativeLlamaModel

            # A GGUF's weights (the default's too) come straight from its blocks; a checkpoint
            # directory is quantised to Q8_0 at load.
            model = NativeLlamaModel.load(source or model_dir, num_threads=cfg.num_threads,
                                          max_positions=whole_pages(cfg.max_seq_len))
            logger.info("native CPU forward: %s kernels, %d threads, %.0f MB of weights", model.isa,
                        model.num_threads, model.weight_bytes / 1e6)
            # What torch still does between native steps (sampling, masks, KV copies) is small:
            # run it on this thread. An OpenMP team would spin on after each op, for longer
            # than a step, on the cores the native pool needs (~10% of a hybrid step).
            torch.set_num_threads(1)
        else:
            from replicas.torch_engine.cuda_model import CudaLlamaModel

            model = CudaLlamaModel.from_pretrained(model_dir, device=device, cfg=target_cfg)
            logger.info("CUDA forward on %s (%s)", device, torch.cuda.get_device_name(device))
        self._eos_ids = frozenset(_eos_token_ids(model_dir, self.tokenizer)).union(
            source.end_of_generation_ids() if source is not None else ())
        self._grammars = GrammarCompiler(self.tokenizer, model.cfg.vocab_size, self._eos_ids)
        if device.type == "cpu":
            pages = kv_pages(cfg.max_seq_len, cfg.kv_cache_bytes, model.cfg)
            cache = model.make_cache(cfg.max_batch_size, cfg.max_seq_len, pages)
        else:  # whole blocks of 32, as the native cache's (the prefix cache copies whole blocks)
            cache = model.make_cache(cfg.max_batch_size, whole_pages(cfg.max_seq_len))
        prefix = None
        if cfg.prefix_cache_bytes:
            from replicas.torch_engine.prefix_cache import PrefixCache

            prefix = PrefixCache(cache, model.cfg.hidden_size if cfg.mtp_weights is not None else 0,
                                 cfg.prefix_cache_bytes)
        suffix = suffix_drafts(device, cfg.max_batch_size, cfg.max_seq_len, cfg.sa_global_pool_tokens)
        mtp = None
        if cfg.mtp_weights is not None:
            mtp = MTPDrafter.load(model, cfg.max_batch_size, cfg.max_seq_len, weights_dir(cfg.mtp_weights))
        return EngineCore(model, cache, suffix, mtp, Detokenizer.for_tokenizer(self.tokenizer), cfg.speculation,
                          cfg.mtp_min_confidence, prefix, cfg.max_prefill_tokens, tokens=len(self.tokenizer))

    async def shutdown(self) -> None:
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._executor.shutdown(wait=True)

    async def check_health(self) -> None:
        if self._loop_task is None:
            raise RuntimeError("engine not started")
        if self._loop_task.done():
            raise RuntimeError(f"engine loop stopped: {self._loop_task.exception()!r}")

    # -- requests ---------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Validate now (RequestError naming the field), stream once iterated."""
        seq = self._make_sequence(request)
        return self._stream(seq)

    def _make_sequence(self, request: GenerationRequest) -> Sequence:
        if self._core is None:
            raise RuntimeError("engine not started")
        if request.request_id in self._queues:
            raise RequestError("request_id", f"{request.request_id!r} is already running")
        vocab = self._core.model.cfg.vocab_size
        if isinstance(request.prompt, str):
            prompt_ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        else:
            prompt_ids = [int(t) for t in request.prompt]
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        if not prompt_ids:
            raise RequestError("prompt", "must not be empty")
        window = self.config.max_seq_len
        if len(prompt_ids) >= window:
            raise RequestError("prompt", f"{len(prompt_ids)} tokens exceed the context window of {window}")
        sampling = request.sampling
        if len(prompt_ids) + sampling.max_tokens > window:
            raise RequestError("max_tokens", f"{sampling.max_tokens} + {len(prompt_ids)} prompt tokens exceed "
                                             f"the context window of {window}")
        resumed = [int(t) for t in request.resume.token_ids] if request.resume is not None else []
        if any(not 0 <= t < vocab for t in resumed) or len(resumed) >= sampling.max_tokens:
            raise RequestError("resume", f"needs fewer than max_tokens ({sampling.max_tokens}) token ids in the vocabulary")
        prediction = [int(t) for t in request.prediction]
        for name, ids in (("prediction", prediction), ("logit_bias", [t for t, _ in sampling.logit_bias])):
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(name, f"token ids must be in [0, {vocab})")
        constraint = self._constraint(request)
        if constraint is not None:
            try:
                constraint.advance(resumed)
            except RequestError as exc:
                raise RequestError("resume", f"the grammar refuses the resumed tokens: {exc}") from None
        return Sequence(
            request_id=request.request_id,
            sa_id=next(self._sa_ids),
            prompt_ids=prompt_ids,
            sampling=sampling,
            speculation=request.speculation,
            over_gate=request.over_gate,
            probe=request.probe,
            cache_salt=request.cache_salt,
            seed=None if sampling.temperature == 0 else
            sampling.seed if sampling.seed is not None else random.getrandbits(63),
            eos_ids=self._eos_ids,
            constraint=constraint,
            sa_prefix=prediction_prefix(prompt_ids, prediction, window - len(prompt_ids) - sampling.max_tokens),
            output_ids=resumed,
            resumed_tokens=len(resumed),
            num_sent_tokens=len(resumed),
            num_sent_chars=request.resume.text_chars if request.resume is not None else 0,
        )

    def _constraint(self, request: GenerationRequest) -> Constraint | None:
        """The request's compiled grammar; an optional one that does not compile is dropped."""
        if request.grammar is None:
            return None
        try:
            return self._grammars.compile(request.grammar)
        except RequestError as exc:
            if not request.grammar.optional:
                raise
            logger.warning("request %s runs unconstrained: its optional grammar (%s) did not compile: %s",
                           request.request_id, exc.param, exc)
            return None

    async def _stream(self, seq: Sequence) -> AsyncIterator[GenerationDelta]:
        if seq.request_id in self._queues:  # generate() checked, but its twin may have started since
            yield GenerationDelta(seq.request_id, (), "", "error", f"request_id {seq.request_id!r} is already running")
            return
        queue: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self._queues[seq.request_id] = queue
        self._pending_add.append(seq)
        self._wake.set()
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if self._queues.get(seq.request_id) is not queue:
                pass  # finished: its last delta took the queue out
            elif seq.finish_reason is None:
                # The consumer went away (client disconnect): free the request's resources. Its
                # id stays taken until then: a twin let in before would take the abort meant for
                # this one, and this one's deltas.
                self._pending_abort.append(seq.request_id)
                self._wake.set()
            else:
                del self._queues[seq.request_id]

    async def abort(self, request_id: str) -> None:
        if request_id in self._queues:
            self._pending_abort.append(request_id)
            self._wake.set()

    def configure(self, speculation: SpeculationConfig) -> None:
        self._pending_config = speculation
        if self._wake is not None:
            self._wake.set()

    @property
    def speculation(self) -> SpeculationConfig:
        """The settings in force from the next step on."""
        if self._pending_config is not None:
            return self._pending_config
        return self._core.speculation if self._core is not None else self.config.speculation

    def stats(self) -> EngineStats:
        return self._core.stats() if self._core is not None else EngineStats()

    @property
    def core(self) -> EngineCore:
        """The synchronous core (for inspection: cache slots, SA pool, running requests)."""
        return self._core

    @property
    def num_live_requests(self) -> int:
        core = self._core
        return len(self._pending_add) + (len(core.running) + len(core.waiting) if core else 0)

    # -- the loop ---------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        core = self._core
        if self._pending_config is not None:
            core.speculation, self._pending_config = self._pending_config, None
        for seq in self._pending_add:
            core.add(seq)
        self._pending_add.clear()
        for request_id in self._pending_abort:
            seq = core.abort(request_id)
            queue = self._queues.pop(request_id, None)
            if seq is not None and queue is not None:
                queue.put_nowait(GenerationDelta(request_id, (), "", "abort", None, len(seq.prompt_ids),
                                                 len(seq.output_ids), seq.counters.usage()))
        self._pending_abort.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._apply_pending()
                if not self._core.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await loop.run_in_executor(self._executor, self._steps, loop)
            except Exception as exc:  # noqa: BLE001 - a bug in a step must not hang clients
                logger.exception("engine step failed")
                self._fail_all(exc)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """Steps back to back in the worker thread until a request joins or leaves, the
        settings change, the work runs out or the engine stops. Each step's deltas go to the
        loop as they come: the next step does not wait for the loop to take them."""
        core = self._core
        while True:
            loop.call_soon_threadsafe(self._publish, core.step())
            if (self._stopping or self._pending_add or self._pending_abort or self._pending_config is not None
                    or not core.has_work):
                return

    def _publish(self, deltas: list[GenerationDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    self._queues.pop(delta.request_id, None)
                    if delta.request_id in self._pending_abort:  # its consumer had gone: the id is free
                        # now, and a twin let in before the next step must not take this abort
                        self._pending_abort = [r for r in self._pending_abort if r != delta.request_id]

    def _fail_all(self, exc: Exception) -> None:
        """Finish every live request with an error; never raises, so the loop lives on."""
        for seq in list(self._core.running) + list(self._core.waiting):
            try:
                self._core.abort(seq.request_id)
            except Exception:  # noqa: BLE001 - its resources may leak; its client must not hang
                logger.exception("freeing request %s failed", seq.request_id)
            queue = self._queues.pop(seq.request_id, None)
            if queue is not None:
                queue.put_nowait(GenerationDelta(seq.request_id, (), "", "error", f"{type(exc).__name__}: {exc}"))


def _eos_token_ids(model_dir, tokenizer) -> list[int]:
    """The tokenizer's EOS and the model's: generation_config.json's, or without one config.json's
    (as transformers' GenerationConfig.from_model_config takes them: a list of several was
    missed, and generation ran past its second id: QA)."""
    import json

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            break
    return sorted(ids)
