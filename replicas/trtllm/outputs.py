"""Upstream streaming outputs -> GenerationDelta, one tracker per request.

TensorRT-LLM streams snapshots (`outputs[0].text`, `.token_ids`, `.finish_reason`,
`.stop_reason`); a stop string is matched on token ids (and, in recent releases, in the
decoded text) and trimmed only from the final snapshot, so its first tokens may already sit
in earlier text. The tracker therefore releases text itself: it holds back any tail that
could still grow into a stop string and an incomplete UTF-8 character, and cuts a stop
string it sees even if upstream tokenized it differently; one upstream cut first is named by
its `stop_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from replicas.engine import FinishReason, GenerationDelta, find_stop, stop_prefix_end
from replicas.stats import acceptance_length
from replicas.token_bytes import TokenBytes, ends_inside_character

# CompletionOutput.finish_reason: 'stop' | 'length' | 'timeout' | 'cancelled'
# (tensorrt_llm/executor/result.py).
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "error"}


def releasable_text(text: str, sent_chars: int, stops: Sequence[str], finished: bool,
                    kept: Sequence[str] = (), cut: bool = False,
                    incomplete: Optional[bool] = None) -> tuple[str, int, str | None]:
    """(text ended at any stop string, how much of it may be sent, the stop string that hit);
    `kept` ones stay in the text (`SamplingParams.stop_after`). `cut`: max_tokens ended it.
    `incomplete`: whether the tokens' bytes end inside a character (its U+FFFD held back, still
    to come or cut off), where they tell; None: every trailing U+FFFD is taken for one."""
    found = find_stop(text, sent_chars, stops, kept)
    if found is not None:
        return text[: found[0]], found[0], found[1]
    end = len(text)
    if (not finished or cut) and text.endswith("\ufffd"):
        end = len(text.rstrip("\ufffd")) if incomplete is None else end - incomplete
    if not finished:  # a tail that may be the start of a stop string
        end = stop_prefix_end(text, end, stops)
    return text, end, None


def request_usage(perf_metrics: Any, decoding_iter: int, completion_tokens: int) -> dict[str, float]:
    """usage.speculation from `request_perf_metrics.speculative_decoding` (0s when absent).

    Upstream reports draft and accepted totals per request, not verify steps. The result's
    `decoding_iter` counts its iterations, the first being the prefill, so the generation
    steps are decoding_iter - 1; without it, every step after the first token emits its
    accepted drafts plus one: steps = (completion_tokens - 1) - accepted. Either way steps
    with no draft (gate closed) are counted too.
    """
    spec = getattr(perf_metrics, "speculative_decoding", None)
    draft = int(getattr(spec, "total_draft_tokens", 0) or 0)
    accepted = int(getattr(spec, "total_accepted_draft_tokens", 0) or 0)
    steps = 0
    if draft:
        steps = decoding_iter - 1 if decoding_iter > 1 else completion_tokens - 1 - accepted
        steps = max(0, steps)
    return {
        "draft_tokens": draft,
        "accepted_tokens": accepted,
        "acceptance_length": round(acceptance_length(accepted + steps, steps), 4),
        "steps": steps,
    }


def cached_prompt_tokens(reported: Any, prompt_tokens: int) -> int:
    """A result's `cached_tokens`, bounded by its prompt (0 when the release has none).

    Upstream sets `RequestOutput.cached_tokens` from each response (executor/result.py) to
    `LlmRequest.cached_tokens`, which latches the first value written: the KV positions its
    first context chunk did not compute, i.e. the reused prefix (_torch/pyexecutor/
    model_engine.py, llm_request.py), at most the prompt less its last token. Upstream has
    also reported a whole sequence length there (a disaggregated generation-only request whose
    first write came from a decode step), so the figure is clamped to the prompt: a hit rate
    never exceeds 1.
    """
    return max(0, min(int(reported or 0), prompt_tokens))


def prefilled(token_ids: Sequence[int], upstream_finish: str | None) -> bool:
    """Has upstream run the request's prefill? It has output tokens, or it ended for a reason
    other than cancellation (a stop string trimmed from the first token leaves none)."""
    return bool(token_ids) or upstream_finish in ("stop", "length")


@dataclass
class OutputTracker:
    request_id: str
    prompt_tokens: int
    stops: tuple[str, ...] = ()
    stop_after: tuple[str, ...] = ()  # matched here only: upstream has no per-string "keep it"
    raw: Optional[TokenBytes] = None  # a token's bytes, where the tokenizer tells them
    sent_chars: int = 0
    sent_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from upstream's prefix cache (block reuse)
    usage: dict[str, float] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, text: str, token_ids: Sequence[int], upstream_finish: str | None,
               usage: dict[str, float], stop_reason: Any = None) -> GenerationDelta | None:
        """The delta for one upstream snapshot (None: nothing new to send). `stop_reason`:
        upstream's CompletionOutput.stop_reason, the stop string (or token id) that ended it,
        which names the stop string where upstream already cut it from the text."""
        if self.done:
            return None
        finish = FINISH_REASONS.get(upstream_finish) if upstream_finish else None
        if upstream_finish and finish is None:
            finish = "error"
        ids = list(token_ids)
        incomplete = None if self.raw is None else ends_inside_character(self.raw, ids)
        text, end, self.stop_string = releasable_text(text, self.sent_chars, self.stops, finish is not None,
                                                      self.stop_after, finish == "length", incomplete)
        if self.stop_string is not None:
            finish = "stop"
        elif finish == "stop" and isinstance(stop_reason, str) and stop_reason in self.stops:
            self.stop_string = stop_reason
        new_ids = tuple(ids[self.sent_tokens :])  # empty once upstream trims a stop sequence
        new_text = text[self.sent_chars : end]
        self.sent_tokens = max(self.sent_tokens, len(ids))
        self.sent_chars = max(self.sent_chars, end)
        self.completion_tokens = len(ids)
        self.usage = usage
        if not new_text and not new_ids and finish is None:
            return None
        self.finish_reason = finish
        error = f"request ended upstream with {upstream_finish!r}" if finish == "error" else None
        return self._delta(new_ids, new_text, finish, error)

    def finish(self, reason: FinishReason, error: str | None = None) -> GenerationDelta | None:
        """End the request here (abort, failure); None if it already ended."""
        if self.done:
            return None
        self.finish_reason = reason
        return self._delta((), "", reason, error)

    def _delta(self, ids, text, finish, error) -> GenerationDelta:
        return GenerationDelta(
            request_id=self.request_id, token_ids=ids, text=text, finish_reason=finish, error=error,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens, speculation=dict(self.usage), stop_string=self.stop_string,
        )
