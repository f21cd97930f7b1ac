"""The synchronous heart of the embedded engine: admit, step, finish.

One `step()` is one iteration of continuous batching: prefill the requests that joined,
then one decode pass over every running request in which each request feeds
`[last token] + draft` and the target verifies all drafts in a single packed forward.
Requests join and leave only between steps. Nothing here knows about asyncio.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from replicas.engine import GenerationDelta, RequestError, SpeculationConfig
from replicas.speculation.gate import speculate_this_step
from replicas.speculation.hybrid import NO_DRAFT, drafts_with_mtp
from replicas.speculation.sampling import token_logprobs
from replicas.speculation.verify import Verdict
from replicas.stats import NOT_GATED, EngineStats, Ewma, SpecCounters
from replicas.torch_engine.draft_policy import DraftPolicy
from replicas.torch_engine.kv_cache import KVCache, KVCacheFull, PagedKVCache
from replicas.torch_engine.model import SeqSpan
from replicas.torch_engine.prefix_cache import BLOCK_TOKENS
from replicas.torch_engine.request_step import verify_rows
from replicas.torch_engine.sequence import Detokenizer, Sequence, release_text
from replicas.torch_engine.step_drafts import Planned, request_mode, shadow_drafts, shadow_kept, step_drafts

if TYPE_CHECKING:
    from replicas.torch_engine.model import LlamaModel
    from replicas.torch_engine.native_model import NativeLlamaModel
    from replicas.torch_engine.prefix_cache import PrefixCache
    from replicas.torch_engine.suffix_drafts import DeviceSuffixDrafts, HostSuffixDrafts

logger = logging.getLogger(__name__)
PROMPT_LOGIT_ROWS = 128  # a prompt is scored this many rows at a time: [128, V] fp32 logits, 25 MB at V = 49k


class EngineCore:
    """Owns the model, the KV cache, the suffix automata and the MTP drafter; not thread-safe."""

    def __init__(self, model: LlamaModel | NativeLlamaModel, cache: KVCache | PagedKVCache, suffix: HostSuffixDrafts | DeviceSuffixDrafts,
                 mtp, detokenizer: Detokenizer, speculation: SpeculationConfig, mtp_min_confidence: float = 0.0,
                 prefix: PrefixCache | None = None, max_prefill_tokens: int = 2048, tokens: int | None = None):
        self.model = model
        # ids from `tokens` on (a checkpoint's vocabulary padded past its tokenizer's, as
        # Qwen2.5's 151,936 over 151,665) have no text: never sampled, never a logprob
        self.tokens = tokens
        self.cache = cache
        self.prefix = prefix  # KV blocks shared by prefix across requests, or None
        self.suffix = suffix  # the requests' suffix automata, fed once per step
        self.mtp = mtp  # MTPDrafter or None
        self.mtp_min_confidence = mtp_min_confidence
        self.detokenizer = detokenizer  # output token ids -> text
        self.speculation = speculation
        self.max_prefill_tokens = max_prefill_tokens  # context positions a step prefills
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.totals = SpecCounters()
        self.drafts = DraftPolicy(mtp)  # the measured draft rules (`adaptive_drafts`)
        self.acceptance_ewma = Ewma()
        self.step_ms = Ewma()
        self.tokens_per_s = Ewma()
        self.last_speculated = False
        self.preemptions = 0  # running requests sent back to the queue for want of KV pages
        self.steps = 0  # steps run (the health check's progress while prompts go in and no token out)
        # False from a preemption until a request ends: the queue waits for pages an ending
        # request gives back (those of the one sent back would only send it back again).
        self._room_freed = True
        self._step_tokens = 0  # tokens emitted in the current step
        self._to_feed: list[tuple[Sequence, list[int]]] = []  # the step's tokens, for the automata
        self._paused: list[GenerationDelta] = []  # the step's preempted requests' `waiting` deltas

    # -- membership (called between steps) ------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finish_reason = "abort"
                    self._release(seq)
                    return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        """Free every per-request resource: KV slot, SA slot, MTP slot, prefix blocks held."""
        if self.prefix is not None:
            if seq.finish_reason in ("stop", "length") and seq.slot >= 0 and not seq.probe:
                try:  # its last, partial block, where the next turn starts: worth keeping, not failing for
                    self._store_prefix(seq, finished=True)
                except Exception:  # noqa: BLE001 - the answer is whole; the next turn prefills that block
                    logger.exception("keeping request %s's last block failed", seq.request_id)
            self.prefix.release(seq.prefix_blocks)
            seq.prefix_hidden = []
        if seq.slot >= 0:
            self.cache.free(seq.slot)
            self._room_freed = True
            if self.mtp is not None:
                self.mtp.remove(seq.slot)
            seq.slot = -1
        if self.suffix.has(seq.sa_id):
            self.suffix.remove(seq.sa_id)

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerationDelta]:
        """One forward for every running request; the deltas it produced."""
        started = time.perf_counter()
        self._step_tokens = 0
        self._to_feed = []  # not what a step that raised left: its requests were failed and removed
        self._paused = []
        prefilled = self._admit()
        decoding = [s for s in self.running if s not in prefilled and not s.prefilling and s.finish_reason is None]
        if decoding:
            self._decode(decoding)
        self.suffix.feed(self._to_feed, self.speculation.max_draft_len)
        deltas = self._collect()
        self.steps += 1
        elapsed_s = time.perf_counter() - started
        if decoding:
            self.step_ms.update(elapsed_s * 1e3)
            self.tokens_per_s.update(self._step_tokens / elapsed_s)
        return deltas

    def _admit(self) -> list[Sequence]:
        """Prefill at most the step's `max_prefill_tokens` positions: first of the prompts under
        way, then of waiting requests while KV slots are free, each what the budget has left; a
        longer prompt goes on in the next steps. The budget keeps a step short: between two
        steps requests finish, join and leave, and the running ones' tokens go out (a 4,000-token
        prompt in one step held them back 4-5 s on a 2-core Xeon; 8 long prompts in one step, a
        minute, long enough to fail health checks). Each request alone, so one bad prompt fails
        only itself. A request the paged KV cache has no pages for waits, first in line, until a
        running request ends and gives some back. Returns the requests prefilled this step."""
        prefilled, budget = [], self.max_prefill_tokens
        for seq in [s for s in self.running if s.prefilling and s.finish_reason is None]:
            if budget <= 0:
                break
            prefilled.append(seq)
            try:
                budget -= self._prefill(seq, budget)
            except Exception as exc:  # noqa: BLE001 - finish this request, keep the others
                self._fail(seq, exc)
        while budget > 0 and self.waiting and self.cache.num_free > 0 and (self._room_freed or not self.running):
            seq = self.waiting.pop(0)
            self.running.append(seq)
            prefilled.append(seq)
            try:
                budget -= self._prefill(seq, budget, self._start(seq))
            except KVCacheFull as exc:
                if len(self.running) == 1:  # nobody else holds pages: it can never fit
                    self._fail(seq, exc)
                else:
                    prefilled.remove(seq)
                    self._preempt(seq, admitting=True)
                    break
            except Exception as exc:  # noqa: BLE001
                self._fail(seq, exc)
        return prefilled

    def _preempt(self, seq: Sequence, admitting: bool = False) -> None:
        """Take a running request's KV pages (and every per-request resource) back; it waits
        first in line and resumes where it was, as a `Resume` does: its output goes back in with
        the prompt (from the prefix cache where its blocks are still there), and it produces
        exactly what it would have without the pause. One `admitting` found no pages before its
        first step: it goes back to wait, no preemption."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = seq.prefix_offered = 0
        seq.prefilling = False
        seq.prompt_logprobs = []  # not sent yet: scored again from the start
        self.waiting.insert(0, seq)
        self._room_freed = False
        if admitting:
            return
        self.preemptions += 1
        self._paused.append(GenerationDelta(seq.request_id, (), "", waiting=True))
        logger.info("request %s back in the queue until KV pages free up (%d output tokens kept)",
                    seq.request_id, len(seq.output_ids))

    def _start(self, seq: Sequence) -> torch.Tensor | None:
        """A request's KV slot (and the head's), the longest cached prefix of its context and pages
        for the rest; the prefix's hidden states where the prefix cache keeps them. A resumed
        request (`Resume`, or preempted) already has output: everything but its last token goes
        in with the prompt, and it goes on from there as if it had produced that output itself."""
        seq.slot = self.cache.allocate()
        if self.mtp is not None:
            self.mtp.add(seq.slot)  # with the KV slot, so releasing one always releases both
        # Only a request that may draft with the head feeds it (a queue of every position's hidden
        # state otherwise grows for nothing, 2.3 KB a position). One admitted without stays so,
        # should the server's mode change under it; a resumed one is admitted afresh.
        seq.mtp_fed = (self.mtp is not None and not seq.over_gate
                       and drafts_with_mtp(request_mode(self.speculation, seq)))
        context = seq.context
        reused, reused_hidden = 0, None
        # the longest cached prefix goes into the slot: prefill the rest (all of a prompt to score,
        # unless the cache keeps the prefix's hidden states: the lm_head scores those)
        if self.prefix is not None and (not self._scores_prompt(seq) or self.prefix.keeps_hidden):
            seq.prefix_blocks, reused_hidden = self.prefix.admit(context, seq.slot, seq.cache_salt)
            reused = self.cache.lengths[seq.slot]
        # Pages for the context and one block more: room to decode before the next page is due.
        if not self.cache.reserve(seq.slot, reused, min(len(context) + BLOCK_TOKENS, self.cache.max_seq_len)):
            raise KVCacheFull(f"KV cache: no pages for a {len(context)}-token context")
        if self.prefix is not None and not seq.admitted:  # a readmission finds its own blocks: not a hit
            seq.cached_tokens = min(reused, len(seq.prompt_ids))
            if not seq.probe:
                self.prefix.count(len(seq.prompt_ids), seq.cached_tokens)
        seq.admitted = True
        seq.num_cached, seq.prefilling = reused, True
        return reused_hidden

    def _prefill(self, seq: Sequence, budget: int, reused_hidden: torch.Tensor | None = None) -> int:
        """Up to `budget` more of the request's context into the cache (`reused_hidden`: its first
        chunk's prefix from the prefix cache); after the last, its first token. The positions
        prefilled."""
        resumed = list(seq.output_ids)
        context = seq.context
        start = seq.num_cached
        end = min(len(context), start + budget)
        hidden = self.model(torch.tensor(context[start:end], dtype=torch.long),
                            [SeqSpan(seq.slot, start, end - start)], self.cache)  # [end - start, d]
        if reused_hidden is not None:  # the MTP head needs every position's
            hidden = torch.cat((reused_hidden, hidden))
        first = end - len(hidden)  # hidden's first position
        if self._scores_prompt(seq):  # from the first position `hidden` holds: a cached prefix's too
            self._score_prompt(seq, hidden, first)
        seq.num_cached = end
        # (without an MTP head no hidden state is stored: the offset is moot)
        self._store_prefix(seq, hidden[max(0, len(seq.prefix_blocks) * BLOCK_TOKENS - first):])
        if end < len(context):
            if seq.mtp_fed:
                self.mtp.observe_rows([seq.slot], [hidden], [context[first + 1:end + 1]])
            return end - start
        seq.prefilling = False
        logits = None if resumed else self._logits(hidden[-1:])  # [1, V]
        new = resumed or [verify_rows(seq, [], logits).tokens[0]]
        self.suffix.add(seq.sa_id, seq.sa_prefix + seq.prompt_ids)
        if seq.mtp_fed:
            self.mtp.observe_rows([seq.slot], [hidden], [context[first + 1:] + new[-1:]])
        if resumed:
            self._to_feed.append((seq, resumed))
        else:
            self._emit(seq, new, logits)
        return end - start

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(hidden)
        if self.tokens is not None and self.tokens < logits.shape[-1]:
            logits[:, self.tokens:] = float("-inf")
        return logits

    @staticmethod
    def _scores_prompt(seq: Sequence) -> bool:
        """Does the request want its prompt's logprobs from its prefill (not yet sent: a resumed
        or preempted request has output, so they went out with its first token)?"""
        return seq.sampling.prompt_logprobs is not None and not seq.output_ids

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """The prompt logprobs `hidden` (positions `start`..) gives: position p scores prompt
        token p + 1, through the lm_head a slice of rows at a time."""
        prompt = seq.prompt_ids
        rows = min(len(hidden), len(prompt) - 1 - start)
        for i in range(0, rows, PROMPT_LOGIT_ROWS):
            j = min(rows, i + PROMPT_LOGIT_ROWS)
            seq.prompt_logprobs += token_logprobs(self._logits(hidden[i:j]), prompt[start + i + 1:start + j + 1],
                                                  seq.sampling.prompt_logprobs)

    def _decode(self, seqs: list[Sequence]) -> None:
        self.suffix.settle()  # the last step's drafts
        # the gate's verdict, what the policy and the router read: not whether a request drafted
        # (a request of mode off, or one with nothing to copy, leaves a gate open; a grammar's
        # forced tokens, drafted at any batch size, leave it closed)
        gate_open = self.speculation.mode != "off" and speculate_this_step(len(seqs), self.speculation.batch_gate)
        shadowing = not gate_open and self.speculation.mode != "off"
        shadow_drafts(seqs, self.speculation, self.drafts, self.cache.max_seq_len, shadowing)
        plans = step_drafts(seqs, self.speculation, self.drafts, self.mtp, self.mtp_min_confidence,
                            self.cache.max_seq_len)
        seqs, plans = self._make_room(seqs, plans)
        if not seqs:
            return
        self.last_speculated = gate_open

        input_ids, spans = [], []
        for seq, (_, draft) in zip(seqs, plans):
            input_ids += [seq.last_token] + draft
            spans.append(SeqSpan(seq.slot, seq.num_cached, 1 + len(draft)))
        started = time.perf_counter()
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long), spans, self.cache)
        logits = self._logits(hidden)  # [N, V]

        row, verdicts = 0, []
        for seq, (plan, draft), span in zip(seqs, plans, spans):
            rows = slice(row, row + span.length)
            row += span.length
            try:
                verdict = verify_rows(seq, draft, logits[rows])
                kept = 1 + verdict.num_accepted  # positions whose KV stays valid
                self.drafts.observe_emitted(seq, verdict.tokens)
                seq.num_cached += kept
                self.cache.truncate(seq.slot, seq.num_cached)
                if draft:
                    if plan.source == "mtp":
                        self.drafts.mtp_outcome(seq, request_mode(self.speculation, seq), len(draft),
                                                verdict.num_accepted)
                    seq.counters.record(plan.source, len(draft), verdict.num_accepted)
                    self.totals.record(plan.source, len(draft), verdict.num_accepted)
                    if plan.source != "grammar":  # what speculation earns, which forced tokens are not
                        self.acceptance_ewma.update(kept)
                if shadowing and (would_keep := shadow_kept(seq, verdict.tokens)) is not None:
                    self.acceptance_ewma.update(would_keep)
                verdicts.append((seq, rows, verdict))
            except Exception as exc:  # noqa: BLE001
                self._fail(seq, exc)
        kept_hidden = self._kept_hidden(hidden, verdicts)
        fed = [(seq, kept, verdict.tokens) for (seq, _, verdict), kept in zip(verdicts, kept_hidden) if seq.mtp_fed]
        if fed:
            fed_seqs, fed_rows, fed_tokens = zip(*fed)
            try:
                self.mtp.observe_rows([seq.slot for seq in fed_seqs], fed_rows, fed_tokens)
            except Exception as exc:  # noqa: BLE001
                for seq in fed_seqs:
                    self._fail(seq, exc)
        for (seq, rows, verdict), kept in zip(verdicts, kept_hidden):
            if seq.finish_reason == "error":
                continue
            try:
                self._emit(seq, verdict.tokens, logits[rows])
                self._store_prefix(seq, kept)
            except Exception as exc:  # noqa: BLE001
                self._fail(seq, exc)
        self.drafts.costs.observe_step(len(seqs), len(input_ids), time.perf_counter() - started)

    def _kept_hidden(self, hidden: torch.Tensor, verdicts: list[tuple[Sequence, slice, Verdict]]
                     ) -> list[torch.Tensor | None]:
        """Each request's kept rows of the step's `hidden` (those whose KV stays), for the MTP
        head's queue and the prefix cache to keep: views of one gather (a copy each cost a
        batch of 8 about 2% of its step), or None where neither keeps them."""
        if not verdicts or self.mtp is None or (self.prefix is None and not any(seq.mtp_fed for seq, _, _ in verdicts)):
            return [None] * len(verdicts)  # (every request of the step failed: no index to gather by)
        counts = [len(verdict.tokens) for _, _, verdict in verdicts]
        index = torch.tensor([rows.start + i for (_, rows, _), n in zip(verdicts, counts) for i in range(n)],
                             device=hidden.device)
        return list(hidden.index_select(0, index).split(counts))

    def _make_room(self, seqs: list[Sequence], plans: list[Planned]) -> tuple[list[Sequence], list[Planned]]:
        """KV pages for every request's step, oldest request first. Short of pages, a request
        drops its draft, then the newest requests of the step are preempted until it fits
        (itself last)."""
        seqs, plans = list(seqs), list(plans)
        i = 0
        while i < len(seqs):
            seq, (_, draft) = seqs[i], plans[i]
            if self.cache.reserve(seq.slot, seq.num_cached, seq.num_cached + 1 + len(draft)):
                i += 1
            elif draft:
                plans[i] = (NO_DRAFT, [])
            else:
                plans.pop()
                self._preempt(seqs.pop())
        return seqs, plans

    def _store_prefix(self, seq: Sequence, hidden: torch.Tensor | None = None, finished: bool = False) -> None:
        """Offer the request's newly committed positions to the prefix cache; `hidden` holds
        their hidden states (the MTP head reruns over them when a later request reuses them),
        kept uncopied until the next whole block goes in: a view of the step's gather of kept
        rows (`_kept_hidden`) or of the prefill's. `finished`: the request is over; its last,
        partial block goes in too."""
        if self.prefix is None:
            return
        if self.mtp is not None and hidden is not None:
            seq.prefix_hidden.append(hidden)
        whole = seq.num_cached // BLOCK_TOKENS
        if not finished and whole <= max(len(seq.prefix_blocks), seq.prefix_offered):
            return  # no whole block since the last offer (a pool full of held blocks refuses)
        seq.prefix_offered = whole
        pending = torch.cat(seq.prefix_hidden) if seq.prefix_hidden else None
        tokens = seq.prompt_ids + seq.output_ids  # a stop may have cut accepted drafts off the output
        used = self.prefix.extend(seq.prefix_blocks, tokens, min(seq.num_cached, len(tokens)), seq.slot, pending,
                                  tail=finished, salt=seq.cache_salt)
        seq.prefix_hidden = [pending[used:]] if pending is not None else []

    def _emit(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> None:
        """Append tokens (cut at a stop), record their logprobs from `logits [len(tokens)+, V]`,
        and feed them to the grammar now and to the SA at the step's end, which then drafts anew."""
        before = len(seq.output_ids)
        seq.append(tokens)
        fed = seq.output_ids[before:]
        self._step_tokens += len(fed)
        if seq.sampling.logprobs is not None:
            shown = fed[:-1] if seq.finish_reason == "stop" and fed and seq.is_visible_stop(fed[-1]) else fed
            seq.logprobs += token_logprobs(logits, shown, seq.sampling.logprobs)
        if seq.constraint is not None:
            seq.constraint.advance(fed)
        if seq.finish_reason is None and fed:
            self._to_feed.append((seq, fed))

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        logger.exception("request %s failed", seq.request_id, exc_info=exc)
        seq.finish_reason = "error"
        seq.error = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        seq.error_param = exc.param if isinstance(exc, RequestError) else None

    def _collect(self) -> list[GenerationDelta]:
        deltas, self._paused = self._paused, []
        for seq in list(self.running):
            if seq.finish_reason != "error":
                try:
                    delta = release_text(seq, self.detokenizer)
                except Exception as exc:  # noqa: BLE001
                    self._fail(seq, exc)
                    delta = None
            else:
                delta = None
            if seq.finish_reason == "error":
                delta = GenerationDelta(seq.request_id, (), "", "error", seq.error,
                                        len(seq.prompt_ids), len(seq.output_ids), seq.counters.usage(),
                                        error_param=seq.error_param)
            if delta is not None:
                deltas.append(delta)
            if seq.finish_reason is not None:
                self.running.remove(seq)
                try:
                    self._release(seq)
                except Exception:  # noqa: BLE001 - its resources may leak; the step's deltas (its last) must go
                    logger.exception("freeing request %s failed", seq.request_id)
        return deltas

    def stats(self) -> EngineStats:
        return EngineStats(
            batch_size=len(self.running),
            waiting=len(self.waiting),
            speculating=int(self.last_speculated),
            # the gate this engine's steps obey (speculate_this_step); mode off obeys none
            batch_gate=NOT_GATED if self.speculation.mode == "off" else self.speculation.batch_gate,
            acceptance_length=self.acceptance_ewma.value,
            draft_tokens=dict(self.totals.draft_tokens),
            accepted_tokens=dict(self.totals.accepted_tokens),
            step_ms=self.step_ms.value,
            tokens_per_s=self.tokens_per_s.value,
            kv_preemptions=self.preemptions,
            kv_cache_usage=self.cache.usage(),
            steps=self.steps,
            draft_row_cost=self.drafts.costs.row(max(1, len(self.running))),
            mtp_ask_cost=self.drafts.costs.ask(max(1, len(self.running))) if self.mtp is not None else 0.0,
            sa_acceptance=self.drafts.sa_acceptance.rates(),
            mtp_accepted_per_ask=self.drafts.mtp_accepted_per_ask(),
            sa_pool_tokens=self.suffix.pool_tokens,
            **(self._prefix_stats() if self.prefix is not None else {}),
        )

    def _prefix_stats(self) -> dict[str, int]:
        stats = self.prefix.stats
        return dict(prefix_hit_tokens=stats.hit_tokens, prefix_prompt_tokens=stats.prompt_tokens,
                    prefix_cached_blocks=self.prefix.cached_blocks, prefix_evicted_blocks=stats.evicted_blocks)
