"""One simulated case: the fleet's profile and workload, the policy and router under test,
and Serve's timings. Read by `arrivals.py` (the workload) and `simulate.py` (the run)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from autoscaling.profiles import Mix, Profile
from replicas.speculation.ranking import GATE_HOLD_S


@dataclass(frozen=True)
class Scenario:
    profile: Profile
    mix: Mix
    scale: int
    policy: str
    seed: int = 0
    duration_s: float = 900.0  # measured time, after the warm-up
    warmup_s: float = 600.0  # at the starting rate, not measured (a trace measures all): longer
    # than the downscale delay, so each policy has settled into its own layout by then
    shape: str = "diurnal"  # "diurnal": base rate 50 % -> 100 % -> 50 %; "flat": 100 %
    burst_factor: float = 1.3  # rate multiplier inside a burst
    bursts: int = 3
    burst_s: float = 60.0
    control_period_s: float = 1.0
    look_back_s: float = 10.0
    metrics_push_s: float = 2.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 300.0  # shorter makes Serve's default oscillate (queue-driven)
    drain_limit_s: float = 1800.0
    router: str = "gate_aware"  # the project's router; "power_of_two": Serve's default router
    policy_overrides: Optional[dict] = None  # PolicyConfig fields for the acceptance-aware policy
    trace: Optional[Path] = None
    # the router's hold (replicas/speculation/ranking.py `hold_at_gate`): while every replica
    # is at its gate and their acceptance is at least the policy's min_acceptance_length, a
    # request waits in the handle queue up to this long for a slot under a gate before it
    # tips a replica over
    gate_hold_s: float = GATE_HOLD_S
