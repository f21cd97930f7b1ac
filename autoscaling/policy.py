"""Serve adapter for the acceptance-aware autoscaling policy (Ray Serve 2.56-2.60 API).

deploy.yaml, on the replica deployment:

    autoscaling_config:
      target_ongoing_requests: 8        # the pack target (and the queue-length fallback's)
      upscale_delay_s: 10
      downscale_delay_s: 60
      policy:
        policy_function: autoscaling.policy:AcceptanceAwarePolicy
        policy_kwargs: {batch_gate: 4, min_acceptance_length: 2.0}

How Serve drives it (checked against ray 2.60's `serve/_private/autoscaling_state.py` and
`serve/autoscaling_policy.py`): the class is instantiated once per deployment with
`policy_kwargs`, then called with an `AutoscalingContext` on every control-loop tick; it
returns `(replicas, policy_state)`. Serve then applies upscaling/downscaling factors, the
upscale/downscale delays and the replica bounds, and skips the policy when scaling from
zero. The replica's `record_autoscaling_stats()` dict arrives per metric name and replica as
`ctx.aggregated_metrics[name][replica_id]` (time-weighted over `look_back_period_s`), the raw
samples as `ctx.raw_metrics[name][replica_id]`. The replicas push them every
RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S (10 s unless set).

Import-pure on purpose: no Ray, torch or native module at import time (the type names
below are for checkers only), because KubeRay's dashboard imports this on a CPU-only head.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional

from autoscaling.decision import (
    PolicyConfig,
    ReplicaSignals,
    Signals,
    decide,
    fleet_acceptance,
    spread_pays,
)
from replicas.speculation.gate import gates_by_batch
from replicas.stats import ACCEPTANCE_LENGTH, BATCH_GATE, BATCH_SIZE, SPECULATING, TOKENS_PER_S

if TYPE_CHECKING:  # pragma: no cover
    from ray.serve.config import AutoscalingContext

__all__ = ["AcceptanceAwarePolicy", "PolicyConfig", "Signals", "ReplicaSignals", "decide",
           "signals_from_context"]

# Keys this policy keeps in Serve's policy_state (Serve adds its own delay bookkeeping).
STATE_SPREADING = "acceptance_aware/spreading"
STATE_ACCEPTANCE = "acceptance_aware/fleet_acceptance"
STATE_DECISION = "acceptance_aware/decision"


def _last_timestamp(series: Any) -> Optional[float]:
    try:
        return max(point.timestamp for point in series) if series else None
    except (TypeError, AttributeError):
        return None


def signals_from_context(ctx: "AutoscalingContext", spreading: bool, metrics_stale_s: float) -> Signals:
    """Read one `AutoscalingContext` into plain `Signals`.

    A replica with no report, or whose newest raw sample is older than `metrics_stale_s`,
    contributes a `ReplicaSignals()` of Nones: `decide` then counts it as not reporting.
    """
    aggregated: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
    raw: Mapping[str, Mapping[Any, Any]] = ctx.raw_metrics or {}
    now = ctx.current_time
    replicas = []
    for replica_id in ctx.running_replicas:
        newest = _last_timestamp(raw.get(ACCEPTANCE_LENGTH, {}).get(replica_id))
        if now is not None and newest is not None and now - newest > metrics_stale_s:
            replicas.append(ReplicaSignals())
            continue

        def value(name: str) -> Optional[float]:
            v = aggregated.get(name, {}).get(replica_id)
            return float(v) if v is not None else None

        replicas.append(ReplicaSignals(
            batch_size=value(BATCH_SIZE),
            acceptance_length=value(ACCEPTANCE_LENGTH),
            speculating=value(SPECULATING),
            tokens_per_s=value(TOKENS_PER_S),
            batch_gate=value(BATCH_GATE),
        ))
    return Signals(
        total_requests=float(ctx.total_num_requests or 0.0),
        replicas=tuple(replicas),
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        spreading=spreading,
    )


class AcceptanceAwarePolicy:
    """Class-form Serve autoscaling policy; all thinking is in `decide`.

    `policy_kwargs` are `PolicyConfig` fields. `target_ongoing_requests` left unset is taken
    from the deployment's `autoscaling_config`, so the pack target and the queue-length
    fallback are the same number Serve's default policy would use; `batch_gate` left unset
    is read from the replicas' stats (until they report, `PolicyConfig`'s default).
    """

    def __init__(self, **policy_kwargs: Any) -> None:
        # An explicit batch_gate pins the gate; otherwise the replicas' reported one is used.
        self.gate_from_replicas = BATCH_GATE not in policy_kwargs
        self.config = PolicyConfig.from_kwargs(policy_kwargs)

    def resolved_config(self, ctx: "AutoscalingContext", signals: Signals) -> PolicyConfig:
        """Fill what `policy_kwargs` left to Serve and the replicas: the pack target from the
        deployment's autoscaling_config, the gate from the replicas' own reports (the
        smallest of those that gate by batch size, so a hot `user_config` change is followed
        without redeploying the policy; a NOT_GATED replica has no gate to offer, and a
        replica silent past `metrics_stale_s` none either: Serve keeps its last report)."""
        config = self.config
        if config.target_ongoing_requests is None:
            serve_target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else None
            config = dataclasses.replace(config, target_ongoing_requests=float(serve_target or 2.0))
        # each a mean over Serve's look-back window: rounded before it is judged, or a gate
        # turned on from 0 (off) read 0.6, passed as 1 and failed PolicyConfig as 0
        reported = [round(r.batch_gate) for r in signals.replicas if r.batch_gate is not None]
        reported = [g for g in reported if gates_by_batch(g)]
        if reported and self.gate_from_replicas:
            config = dataclasses.replace(config, batch_gate=min(reported))
        return config

    def __call__(self, ctx: "AutoscalingContext") -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        signals = signals_from_context(ctx, bool(state.get(STATE_SPREADING, False)), self.config.metrics_stale_s)
        config = self.resolved_config(ctx, signals)
        replicas = decide(signals, ctx.current_num_replicas, config)
        spread = spread_pays(signals, config)
        # a tick without enough metrics (new replicas not yet reporting) chose no mode: keep the last
        state[STATE_SPREADING] = signals.spreading if spread is None else spread
        state[STATE_ACCEPTANCE] = fleet_acceptance(signals, config)
        state[STATE_DECISION] = {None: "queue_length", True: "spread", False: "pack"}[spread]
        return replicas, state
