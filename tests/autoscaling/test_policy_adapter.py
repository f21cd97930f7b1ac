"""The Serve adapter fed real `AutoscalingContext`s, called the way Serve 2.60 calls it."""

import math

import pytest

pytest.importorskip("ray.serve")

# No public API builds a policy the way the controller does, nor exports these two types.
from ray.serve._private.autoscaling_state import _resolve_policy_callable  # noqa: E402
from ray.serve._private.common import DeploymentID, TimeStampedValue  # noqa: E402
from ray.serve.autoscaling_policy import (  # noqa: E402
    _apply_autoscaling_config,
    replica_queue_length_autoscaling_policy,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy  # noqa: E402
from ray.serve.request_router import ReplicaID  # noqa: E402

from autoscaling.policy import STATE_DECISION, STATE_SPREADING, AcceptanceAwarePolicy  # noqa: E402

DEP = DeploymentID(name="Replica", app_name="default")
NOW = 1_000.0


def serve_config(**policy_kwargs) -> AutoscalingConfig:
    return AutoscalingConfig(
        min_replicas=1, max_replicas=20, target_ongoing_requests=8, upscale_delay_s=0, downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function="autoscaling.policy:AcceptanceAwarePolicy",
                                 policy_kwargs={"batch_gate": 4, "gate_fill": 1.0, "min_acceptance_length": 2.0,
                                                **policy_kwargs}),
    )


def context(config, total_requests, per_replica, policy_state=None, reported_at=NOW - 1.0):
    """per_replica: one dict of record_autoscaling_stats() figures per running replica (None: silent)."""
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(len(per_replica))]
    aggregated, raw = {}, {}
    for rid, stats in zip(replicas, per_replica):
        for name, value in (stats or {}).items():
            aggregated.setdefault(name, {})[rid] = value
            raw.setdefault(name, {})[rid] = [TimeStampedValue(reported_at - 1.0, value),
                                             TimeStampedValue(reported_at, value)]
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=len(replicas), target_num_replicas=len(replicas), running_replicas=replicas,
        total_num_requests=lambda: total_requests, total_queued_requests=0.0,
        aggregated_metrics=lambda: aggregated, raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=dict(policy_state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=NOW, config=config,
    )


def stats(acceptance, batch=4.0):
    """A replica's record_autoscaling_stats() dict (EngineStats.as_metrics() keys)."""
    return {"batch_size": batch, "waiting": 0.0, "speculating": 1.0, "acceptance_length": acceptance,
            "step_ms": 100.0, "tokens_per_s": 30.0, "draft_tokens_sa": 10.0, "accepted_tokens_sa": 5.0}


def serve_policy(config):
    """What Serve's controller builds: the class instantiated with policy_kwargs, then wrapped
    with the delays, factors and bounds."""
    return _apply_autoscaling_config(_resolve_policy_callable(config.policy))


def test_serve_instantiates_the_class_with_policy_kwargs():
    instance = _resolve_policy_callable(serve_config(min_acceptance_length=2.75).policy)
    assert isinstance(instance, AcceptanceAwarePolicy)
    assert instance.config.min_acceptance_length == 2.75 and instance.config.batch_gate == 4


def test_spreads_when_acceptance_pays():
    config = serve_config()
    replicas, state = serve_policy(config)(context(config, 18, [stats(3.1), stats(2.9), None]))
    assert replicas == 5
    assert state[STATE_SPREADING] is True and state[STATE_DECISION] == "spread"


def test_packs_when_it_does_not():
    config = serve_config()
    replicas, state = serve_policy(config)(context(config, 40, [stats(1.3), stats(1.2)]))
    assert replicas == 5  # ceil(40 / 8)
    assert state[STATE_DECISION] == "pack"


def test_mode_hysteresis_rides_in_policy_state():
    config = serve_config()
    policy = serve_policy(config)
    _, state = policy(context(config, 16, [stats(3.0)] * 4))
    replicas, state = policy(context(config, 16, [stats(1.9)] * 4, policy_state=state))
    assert replicas == 4 and state[STATE_SPREADING] is True  # 1.9 is inside the band


@pytest.mark.parametrize("per_replica", [[None, None, None], [{"batch_size": 4.0}] * 3, [stats(0.0)] * 3])
def test_missing_metrics_match_serves_default(per_replica):
    config = serve_config()
    ctx = context(config, 18, per_replica)
    ours, state = serve_policy(config)(ctx)
    default, _ = replica_queue_length_autoscaling_policy(context(config, 18, per_replica))
    assert ours == math.ceil(default) == 3
    assert state[STATE_DECISION] == "queue_length"


def test_stale_reports_count_as_missing():
    config = serve_config()
    ctx = context(config, 18, [stats(3.0)] * 3, reported_at=NOW - 120.0)
    replicas, state = serve_policy(config)(ctx)
    assert replicas == 3 and state[STATE_DECISION] == "queue_length"


def test_serve_delays_still_apply():
    config = serve_config()
    config.upscale_delay_s = 30.0
    replicas, state = serve_policy(config)(context(config, 18, [stats(3.0)] * 3))
    assert replicas == 3  # wanted 5, but the upscale delay has not elapsed
    assert state[STATE_SPREADING] is True


def test_target_from_policy_kwargs_overrides_serve():
    config = serve_config(target_ongoing_requests=4)
    replicas, _ = serve_policy(config)(context(config, 18, [None] * 3))
    assert replicas == 5  # ceil(18 / 4)


def test_unknown_policy_kwargs_fail_at_instantiation():
    with pytest.raises(ValueError, match="unknown keys"):
        _resolve_policy_callable(serve_config(gate=3).policy)


def test_gate_comes_from_the_replicas_unless_pinned():
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=20, target_ongoing_requests=8, upscale_delay_s=0, downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function="autoscaling.policy:AcceptanceAwarePolicy",
                                 policy_kwargs={"gate_fill": 1.0}))
    per_replica = [stats(3.0) | {"batch_gate": 2.0}] * 3
    replicas, _ = serve_policy(config)(context(config, 18, per_replica))
    assert replicas == 9  # ceil(18 / 2): the replicas' gate, not PolicyConfig's default 4
    pinned = serve_config()  # batch_gate: 4 in policy_kwargs
    replicas, _ = serve_policy(pinned)(context(pinned, 18, per_replica))
    assert replicas == 5


def test_a_silent_replicas_last_gate_is_not_the_fleets():
    """Serve keeps a silent replica's last report while it runs: its signals counted as
    missing, but its gate (2, from before a hot change to 8) still set the fleet's, and
    the decision sized for batches of 2 (12 replicas, not 3)."""
    config = serve_config()
    config.policy.policy_kwargs.pop("batch_gate")  # read from the replicas
    fresh = stats(3.0, batch=6.0) | {"batch_gate": 8.0}
    ctx = context(config, 24, [fresh, fresh, stats(3.0, batch=6.0) | {"batch_gate": 2.0}])
    silent = ctx.running_replicas[2]
    for series in ctx.raw_metrics.values():
        if silent in series:
            series[silent] = [TimeStampedValue(NOW - 121.0, 0.0), TimeStampedValue(NOW - 120.0, 0.0)]
    assert serve_policy(config)(ctx)[0] == 3 == serve_policy(config)(context(config, 24, [fresh, fresh, None]))[0]


def test_a_gate_just_turned_on_reads_as_its_rounded_window_mean():
    """A replica's gate is a mean over Serve's look-back window: turned on from 0 (off), it reads
    0.6 for a while, which passed as a gate and failed the policy (Serve then skipped the
    application's update, every tick of it)."""
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=20, target_ongoing_requests=8, upscale_delay_s=0, downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function="autoscaling.policy:AcceptanceAwarePolicy",
                                 policy_kwargs={"gate_fill": 1.0}))
    for mean, replicas in ((0.4, 3), (0.6, 18), (0.9, 18), (1.4, 18), (2.6, 6)):
        per_replica = [stats(3.0) | {"batch_gate": mean}] * 3
        assert serve_policy(config)(context(config, 18, per_replica))[0] == replicas, mean


def test_replicas_that_do_not_gate_neither_set_the_gate_nor_make_it_spread():
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=20, target_ongoing_requests=8, upscale_delay_s=0, downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function="autoscaling.policy:AcceptanceAwarePolicy",
                                 policy_kwargs={"gate_fill": 1.0}))
    mixed = [stats(3.0) | {"batch_gate": 0.0}, stats(3.0) | {"batch_gate": 2.0}, stats(3.0) | {"batch_gate": 0.0}]
    replicas, state = serve_policy(config)(context(config, 18, mixed))
    assert replicas == 9 and state[STATE_DECISION] == "spread"  # the one real gate, 2: ceil(18 / 2)
    ungated = [stats(3.0) | {"batch_gate": 0.0}] * 3
    replicas, state = serve_policy(config)(context(config, 18, ungated))
    assert replicas == 3 and state[STATE_DECISION] == "pack"  # ceil(18 / 8): Serve's rule


def test_a_tick_without_metrics_keeps_the_mode_hysteresis():
    """Scaling out leaves the new replicas silent for a push period: that tick falls back to
    the queue-length rule, and it also forgot it was spreading, so a fleet inside the band
    (1.9, min 2.0 - band 0.25) packed once the new replicas reported."""
    config = serve_config()
    policy = serve_policy(config)
    _, state = policy(context(config, 16, [stats(3.0)] * 2))
    _, state = policy(context(config, 16, [stats(1.9)] * 2 + [None] * 3, policy_state=state))
    assert state[STATE_DECISION] == "queue_length"
    replicas, state = policy(context(config, 16, [stats(1.9)] * 5, policy_state=state))
    assert replicas == 5 and state[STATE_DECISION] == "spread"  # held in the dead band, not packed to 2
