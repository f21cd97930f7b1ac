"""The simulator's mirror of Serve's rules agrees with Ray's own functions."""

import math
import random

import pytest

from autoscaling.serve_rules import DelayState, apply_delays, queue_length_replicas

pytest.importorskip("ray.serve")
# The rules mirrored here are Serve internals: no public API exposes them or their state keys.
from ray.serve._private.constants import (  # noqa: E402
    SERVE_AUTOSCALING_DECISION_COUNTERS_KEY,
    SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY,
)
from ray.serve.autoscaling_policy import _apply_delay_logic  # noqa: E402
from ray.serve.config import AutoscalingConfig  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_delay_mirror_matches_serve(seed):
    rng = random.Random(seed)
    config = AutoscalingConfig(min_replicas=1, max_replicas=50, upscale_delay_s=3.0, downscale_delay_s=7.0)
    ray_state, ours = {}, DelayState()
    ray_target = our_target = 5
    for tick in range(300):
        now = tick * 0.5
        desired = max(1, our_target + rng.choice([-3, -1, 0, 0, 1, 2]))
        ray_target, ray_state = _apply_delay_logic(desired, ray_target, config, ray_state, _now=now)
        our_target = apply_delays(desired, our_target, now, ours, 3.0, 7.0)
        assert our_target == ray_target, tick
        assert ours.direction == ray_state[SERVE_AUTOSCALING_DECISION_COUNTERS_KEY]
        assert ours.since_s == ray_state[SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY]


@pytest.mark.parametrize("load,target,expected", [(0, 2, 0), (1, 2, 1), (16, 8, 2), (16.5, 8, 3), (-1, 8, 0)])
def test_queue_length_rule(load, target, expected):
    assert queue_length_replicas(load, target) == expected == max(0, math.ceil(load / target))
