"""Fold TensorRT-LLM iteration stats rows (`LLM.get_stats_async`) into our counters.

A row is one engine iteration, a dict (or its JSON text), with the fields used here:
  iterLatencyMS, numActiveRequests, numQueuedRequests,
  inflightBatchingStats {numContextRequests, numGenRequests, ...},
  specDecodingStats {numDraftTokens, numAcceptedTokens, numRequestsWithDraftTokens, ...}
(cpp/include/tensorrt_llm/executor/types.h SpecDecodingStats; the LLM needs
enable_iter_perf_stats=True). Upstream does not split drafts by source: in hybrid mode the
SA's overrides are inside the learned drafter's numbers, so they are all counted under one
source, "sa" for standalone SA and "mtp" otherwise.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from replicas.stats import SOURCES, Ewma, acceptance_length


def _int(table: Mapping[str, Any], key: str) -> int:
    return int(table.get(key) or 0)


class IterationStatsFolder:
    """Monotonic draft/accepted totals plus EWMAs of acceptance length, step time, tokens/s."""

    def __init__(self, source: str, alpha: float = 0.1) -> None:
        if source and source not in SOURCES:
            raise ValueError(f"source: must be one of {SOURCES} or empty, got {source!r}")
        self.source = source
        self.draft_tokens = dict.fromkeys(SOURCES, 0)
        self.accepted_tokens = dict.fromkeys(SOURCES, 0)
        self.acceptance_length = Ewma(alpha)
        self.step_ms = Ewma(alpha)
        self.tokens_per_s = Ewma(alpha)
        self.iterations = 0

    def fold(self, row: Mapping[str, Any] | str | bytes) -> None:
        if isinstance(row, (str, bytes)):
            row = json.loads(row)
        spec = row.get("specDecodingStats") or {}
        batching = row.get("inflightBatchingStats") or {}
        num_draft = _int(spec, "numDraftTokens")
        num_accepted = _int(spec, "numAcceptedTokens")
        num_verified = _int(spec, "numRequestsWithDraftTokens")
        self.iterations += 1
        if num_draft and self.source:
            self.draft_tokens[self.source] += num_draft
            self.accepted_tokens[self.source] += num_accepted
        if num_draft and num_verified:
            # each request with a draft emits its accepted tokens plus the bonus token
            self.acceptance_length.update(acceptance_length(num_accepted + num_verified, num_verified))
        # the loop's own time: under the overlap scheduler a release that reports it has
        # iterLatencyMS span about two loops (py_executor._process_iter_stats)
        latency_ms = float(row.get("hostStepTimeMS") or row.get("iterLatencyMS") or 0.0)
        if latency_ms > 0:
            self.step_ms.update(latency_ms)
            # generation requests emit 1 + accepted each; a finished prefill emits its first token
            emitted = _int(batching, "numGenRequests") + _int(batching, "numContextRequests") + num_accepted
            self.tokens_per_s.update(emitted / (latency_ms / 1000.0))
