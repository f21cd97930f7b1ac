"""Serve's own scaling rules, mirrored in plain Python for the simulator.

The simulator runs Serve's default policy and ours under the same wrapper Serve applies to
any policy (ray 2.60 `serve/autoscaling_policy.py`): the queue-length rule, then the
upscale/downscale delays, then the bounds. Mirrored rather than imported so a planning run
needs no Ray; `tests/autoscaling/test_serve_rules.py` checks the mirror against Ray's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

_EPS_S = 1e-6  # Serve's tolerance on elapsed-delay comparisons


def queue_length_replicas(total_requests: float, target_ongoing_requests: float) -> int:
    """Serve's default policy: replicas = ceil(ongoing requests / target per replica)."""
    return math.ceil(max(0.0, total_requests) / target_ongoing_requests)


@dataclass
class DelayState:
    """Serve's delay bookkeeping: >0 counts up-decisions, <0 down; since when, in seconds."""

    direction: int = 0
    since_s: Optional[float] = None


def apply_delays(desired: int, current_target: int, now_s: float, state: DelayState,
                 upscale_delay_s: float, downscale_delay_s: float) -> int:
    """Serve's `_apply_delay_logic`: move to `desired` only after the wish has held for the
    delay in its direction; mutates `state`. (Scale-to-zero delay not modelled: min >= 1.)"""
    if desired > current_target:
        if state.direction < 0:
            state.direction, state.since_s = 0, None
        state.direction += 1
        state.since_s = now_s if state.since_s is None else state.since_s
        if now_s - state.since_s + _EPS_S >= upscale_delay_s:
            state.direction, state.since_s = 0, None
            return desired
    elif desired < current_target:
        if state.direction > 0:
            state.direction, state.since_s = 0, None
        state.direction -= 1
        state.since_s = now_s if state.since_s is None else state.since_s
        if now_s - state.since_s + _EPS_S >= downscale_delay_s:
            state.direction, state.since_s = 0, None
            return max(1, desired)
    else:
        state.direction, state.since_s = 0, None
    return current_target
