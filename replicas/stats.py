"""Stat and metric names, and the counters engines keep. Standard library only.

The router and the autoscaling policy import this module inside KubeRay's dashboard on a
CPU-only head, so it must never import torch, numpy or the native module.

Definitions, in one place:
- a *verify step* is one target forward pass in which a request had a draft checked;
- *acceptance length* = tokens emitted per verify step, the bonus/correction token
  included, so a step that accepts 3 of 5 drafts emits 4 and a step with no draft is not
  a verify step. Engines export monotonic counters; rates are derived here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SOURCES = ("sa", "mtp", "grammar")  # draft sources: suffix automaton, MTP heads, grammar-forced tokens

# Keys of record_routing_stats() / record_autoscaling_stats() (flat floats).
BATCH_SIZE = "batch_size"
WAITING = "waiting"
SPECULATING = "speculating"
ACCEPTANCE_LENGTH = "acceptance_length"
STEP_MS = "step_ms"
TOKENS_PER_S = "tokens_per_s"
BATCH_GATE = "batch_gate"  # EngineStats.batch_gate: the gate the engine's steps obey
MODEL_IDENTITY = "model_identity"  # routing stats only, a string: the model the Replica serves (EngineArgs.identity)
PREFIX_HIT_TOKENS = "prefix_hit_tokens"  # prompt tokens served from the prefix cache (total)
PREFIX_PROMPT_TOKENS = "prefix_prompt_tokens"  # prompt tokens admitted (total)
PREFIX_HIT_RATE = "prefix_hit_rate"  # derived: prefix_hit_rate()

# EngineStats.batch_gate when the engine does not switch speculation off by batch size: it
# speculates at every batch size, or at none (`speculating` says which). The same number as
# SpeculationConfig.batch_gate 0 ("never speculate"), which is one such engine.
NOT_GATED = 0

# Prometheus metric names (Ray prefixes them with `ray_`).
METRIC_DRAFT_TOKENS = "spec_draft_tokens_total"
METRIC_ACCEPTED_TOKENS = "spec_accepted_tokens_total"
METRIC_ACCEPTANCE_LENGTH = "spec_acceptance_length"  # histogram: its quantiles (Ray records its _sum at bucket midpoints)
METRIC_VERIFY_STEPS = "spec_verify_steps_total"  # the acceptance length = emitted / verify steps, exactly
METRIC_EMITTED_TOKENS = "spec_emitted_tokens_total"  # tokens verify steps emitted, bonus tokens included
METRIC_GATE_OPEN = "spec_gate_open"
METRIC_BATCH_SIZE = "engine_batch_size"
METRIC_TTFT = "request_ttft_seconds"  # the Replica's: from its engine's taking the request
METRIC_INGRESS_TTFT = "ingress_ttft_seconds"  # the client's: from the request's arrival at the Ingress
TTFT_BOUNDARIES_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)  # both TTFT histograms' buckets
METRIC_TPOT = "request_tpot_seconds"
METRIC_RETRIES = "request_retries_total"  # the ingress: requests sent again after losing their replica
METRIC_PREFIX_HIT_TOKENS = "prefix_cache_hit_tokens_total"
METRIC_PREFIX_PROMPT_TOKENS = "prefix_cache_prompt_tokens_total"
METRIC_PREFIX_BLOCKS = "prefix_cache_blocks"  # gauge: blocks held
METRIC_PREFIX_EVICTIONS = "prefix_cache_evicted_blocks_total"
METRIC_KV_PREEMPTIONS = "engine_kv_preemptions_total"
METRIC_WAITING = "engine_waiting_requests"  # gauge: queued in the engine for a batch slot or KV pages
METRIC_KV_USAGE = "engine_kv_cache_usage"  # gauge: EngineStats.kv_cache_usage
METRIC_USER_CONFIG_REFUSED = "replica_user_config_refused"  # gauge: 1 while the last user_config is refused
# gauges: what the measured draft rule (speculation.draft_length) weighs drafts against
METRIC_DRAFT_ROW_COST = "spec_draft_row_cost"
METRIC_MTP_ASK_COST = "spec_mtp_ask_cost"
# gauges: what it has measured drafts to yield
METRIC_SA_ACCEPTANCE = "spec_sa_acceptance"  # by match_len
METRIC_MTP_ACCEPTED_PER_ASK = "spec_mtp_accepted_per_ask"
METRIC_SA_POOL_TOKENS = "spec_sa_pool_tokens"  # gauge: EngineStats.sa_pool_tokens


def acceptance_length(emitted_tokens: int, verify_steps: int) -> float:
    """Tokens emitted per verify step (bonus included); 0.0 before the first step."""
    return emitted_tokens / verify_steps if verify_steps else 0.0


def prefix_hit_rate(hit_tokens: int, prompt_tokens: int) -> float:
    """The share of admitted prompt tokens whose KV came from the prefix cache; 0.0 before any."""
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass
class SpecCounters:
    """Monotonic speculation counters for one request or one engine, by draft source."""

    draft_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    verify_steps: int = 0
    emitted_tokens: int = 0  # on verify steps only, bonus tokens included

    def record(self, source: str, num_draft: int, num_accepted: int) -> None:
        """One verify step: `num_draft` tokens proposed by `source`, `num_accepted` kept."""
        self.draft_tokens[source] += num_draft
        self.accepted_tokens[source] += num_accepted
        self.verify_steps += 1
        self.emitted_tokens += num_accepted + 1

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.emitted_tokens, self.verify_steps)

    def usage(self) -> dict[str, float]:
        """The `usage.speculation` object of an HTTP response."""
        return {
            "draft_tokens": sum(self.draft_tokens.values()),
            "accepted_tokens": sum(self.accepted_tokens.values()),
            "acceptance_length": round(self.acceptance_length, 4),
            "steps": self.verify_steps,
        }


class Ewma:
    """Exponentially weighted moving average; `value` is 0.0 until the first sample."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.value = 0.0
        self._seen = False

    def update(self, sample: float) -> float:
        self.value = sample if not self._seen else self.alpha * sample + (1 - self.alpha) * self.value
        self._seen = True
        return self.value


@dataclass(frozen=True)
class EngineStats:
    """A replica's live figures: what the router and the autoscaling policy read."""

    batch_size: int = 0
    waiting: int = 0
    speculating: int = 0  # 1 if the last step ran with the gate open (drafted or not)
    # The batch size above which the engine's steps really stop speculating, as built and
    # running (a setting staged for a restart is not in force); NOT_GATED where no batch
    # size does. The router and the autoscaler read this, never the configured setting.
    batch_gate: int = NOT_GATED
    acceptance_length: float = 0.0  # EWMA of tokens emitted per verify step
    draft_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    step_ms: float = 0.0  # EWMA
    tokens_per_s: float = 0.0  # EWMA over steps
    # Prefix cache (monotonic totals, and the blocks held now); all 0 where there is none.
    prefix_hit_tokens: int = 0
    prefix_prompt_tokens: int = 0
    prefix_cached_blocks: int = 0
    prefix_evicted_blocks: int = 0
    # Running requests sent back to the queue for want of KV pages (the paged cache; a total).
    kv_preemptions: int = 0
    # The share of the KV cache the requests hold now (0 to 1; blocks kept only for the prefix
    # cache count as free); 0 where the engine does not measure it.
    kv_cache_usage: float = 0.0
    # Steps run, a total (0 where the engine does not count them): progress while long prompts
    # go in over several steps and no token comes out.
    steps: int = 0
    # At the current batch size, as fractions of a plain step: an extra verify row, and an ask
    # of the MTP head (its catching up aside). 0 where the engine does not measure them.
    draft_row_cost: float = 0.0
    mtp_ask_cost: float = 0.0
    # What drafts have yielded: per SA draft token, the chance it is accepted (the ones before
    # it having been), by the match length the SA drafted at (draft_length.MATCH_LEN_BUCKETS);
    # per ask of the MTP head, the tokens accepted. Empty / 0 where the engine does not measure.
    sa_acceptance: dict[str, float] = field(default_factory=dict)
    mtp_accepted_per_ask: float = 0.0
    # Tokens the suffix automata's cross-request pool holds now (it fills to its bound,
    # `sa_global_pool_tokens`, then starts a new generation); 0 where there is none.
    sa_pool_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return prefix_hit_rate(self.prefix_hit_tokens, self.prefix_prompt_tokens)

    def as_metrics(self) -> dict[str, float]:
        """Flat float dict for record_routing_stats / record_autoscaling_stats."""
        flat = {
            k: float(v)
            for k, v in dataclasses.asdict(self).items()
            if not isinstance(v, dict)
        }
        flat[PREFIX_HIT_RATE] = self.prefix_hit_rate
        for source in SOURCES:
            flat[f"draft_tokens_{source}"] = float(self.draft_tokens.get(source, 0))
            flat[f"accepted_tokens_{source}"] = float(self.accepted_tokens.get(source, 0))
        for match_len, rate in self.sa_acceptance.items():
            flat[f"sa_acceptance_{match_len}"] = rate
        return flat
