"""The replay protocol every drafter goes through (Arctic's simulator protocol).

Teacher-forced with exact-match acceptance: from the prompt, ask for a K-token draft,
accept its longest prefix equal to the true next tokens, advance by accepted + 1 (the bonus
token is the true one), repeat. `replay_mat` measures mean accepted tokens per step over a
dataset; `time_steps` the cost of one step at a given context size and batch.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from benchmarks.datasets import TokenPair
from benchmarks.peers.drafter import Drafter


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    make: Callable[[int, int], Drafter]  # (max_slots, max_seq_len) -> a fresh drafter
    cross_request: bool                  # keeps finished responses for later requests
    timed: bool = True                   # ablations share a timed drafter's cost: MAT only


def accepted_prefix(draft: np.ndarray, truth: np.ndarray) -> int:
    """Length of the longest prefix of `draft` equal to `truth` (-1 padding never matches)."""
    m = min(len(draft), len(truth))
    same = draft[:m] == truth[:m]
    return m if same.all() else int(np.argmin(same))


def replay_mat(spec: DrafterSpec, pairs: list[TokenPair], draft_len: int) -> dict:
    """Teacher-forced replay of every pair in order, batch 1; MAT over all verify steps."""
    max_len = max(len(p.prompt) + len(p.response) for p in pairs) + draft_len + 2
    drafter = spec.make(1, max_len)
    ids = np.zeros(1, dtype=np.int64)
    accepted = np.zeros((1, draft_len + 1), dtype=np.int32)
    lens = np.zeros(1, dtype=np.int32)
    steps = emitted = accepted_total = drafted = 0
    for request_id, pair in enumerate(pairs):
        ids[0] = request_id
        drafter.start(request_id, pair.prompt)
        lens[0] = 0
        draft = drafter.step(ids, accepted, lens)[0]
        response, pos = pair.response, 0
        while pos < len(response):
            hit = accepted_prefix(draft, response[pos: pos + draft_len])
            n = min(hit + 1, len(response) - pos)  # no bonus past the end of the response
            steps, emitted, accepted_total = steps + 1, emitted + n, accepted_total + hit
            drafted += int((draft >= 0).sum())
            accepted[0, :n] = response[pos: pos + n]
            lens[0] = n
            pos += n
            # The last call only feeds the tail, so the whole response reaches the cache.
            draft = drafter.step(ids, accepted, lens)[0]
        drafter.stop(request_id)
    return {"mat": emitted / steps, "steps": steps, "tokens": emitted,
            "drafted_per_step": drafted / steps,
            "acceptance_rate": accepted_total / drafted if drafted else 0.0}


def time_steps(spec: DrafterSpec, stream: np.ndarray, context: int, max_context: int,
               batch: int, steps: int, warmup: int, draft_len: int, rounds: int,
               feed_tokens: int | None = None) -> dict:
    """µs of one step for `batch` requests holding `context` tokens each.

    Steps feed accepted + 1 tokens (teacher-forced), or exactly `feed_tokens` true tokens
    whatever was drafted: more history means longer matches and so more tokens per step,
    and a fixed feed separates the cost of context from the cost of acceptance.

    Request b's context is the `context` tokens before a fixed point of the stream, the
    same point at every context size, so every size replays the same continuation and
    feeds about as many tokens per step: only the history behind it grows.
    Each step is timed alone (wall clock); the figure is the median step of a round, and
    the smallest of `rounds` such medians, because on a shared machine other processes
    only ever add time. The rounds continue one replay (a few hundred tokens more context).
    """
    tail = (rounds * steps + warmup + 1) * (draft_len + 1)
    room = len(stream) - max_context - tail
    if feed_tokens is not None and not 0 < feed_tokens <= draft_len + 1:
        raise ValueError(f"feed_tokens must be in [1, {draft_len + 1}], got {feed_tokens}")
    if room < 0 or context > max_context:
        raise ValueError(f"token stream of {len(stream)} is too short for context {max_context}")
    pos = [max_context + b * room // batch for b in range(batch)]
    built = time.perf_counter()
    drafter = spec.make(batch, context + tail + 1)
    for b, end in enumerate(pos):
        drafter.start(b, stream[end - context: end])
    built = time.perf_counter() - built
    ids = np.arange(batch, dtype=np.int64)
    accepted = np.zeros((batch, draft_len + 1), dtype=np.int32)
    lens = np.zeros(batch, dtype=np.int32)
    drafts = drafter.step(ids, accepted, lens)
    times_ns, fed = [], []
    gc.disable()
    try:
        for s in range(warmup + rounds * steps):
            for b in range(batch):
                n = feed_tokens or accepted_prefix(drafts[b], stream[pos[b]: pos[b] + draft_len]) + 1
                accepted[b, :n] = stream[pos[b]: pos[b] + n]
                lens[b] = n
                pos[b] += n
            start = time.perf_counter_ns()
            drafts = drafter.step(ids, accepted, lens)
            elapsed = time.perf_counter_ns() - start
            if s >= warmup:
                times_ns.append(elapsed)
                fed.append(int(lens.sum()))
    finally:
        gc.enable()
    del drafter
    gc.collect()
    medians_us = [statistics.median(times_ns[r * steps: (r + 1) * steps]) / 1e3 for r in range(rounds)]
    best_us = min(medians_us)
    return {"us_per_step": best_us, "us_per_request": best_us / batch,
            "us_per_fed_token": best_us * len(fed) / sum(fed),
            "round_medians_us": medians_us,
            "tokens_fed_per_step": statistics.mean(fed), "build_s": built,
            "steps": steps, "rounds": rounds}
