"""The simulator's workload: arrival-rate curves, bursts, request sampling, traces.

Every function reads its settings from a `scenario.Scenario`; all randomness comes from the
generator passed in, so a seed fixes the arrivals (the same for every policy).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Iterator, Optional

from autoscaling.profiles import Mix, Profile
from autoscaling.scenario import Scenario

SEGMENT_S = 10.0  # arrival-rate curve resolution


def mean_request_s(profile: Profile, mix: Mix) -> float:
    """Mean request duration on a replica packed at the target without speculation."""
    pack = int(round(profile.pack_target))
    step_s = profile.step.step_ms(pack, pack) / 1e3
    total = sum(c.weight for c in mix.classes)
    return sum(c.weight * (c.output_tokens * math.exp(c.output_sigma ** 2 / 2) * step_s
                           + profile.step.prefill_ms(c.prompt_tokens) / 1e3) for c in mix.classes) / total


def peak_rate_per_s(sc: Scenario) -> float:
    return sc.scale * sc.profile.pack_target / mean_request_s(sc.profile, sc.mix)


def burst_windows(sc: Scenario, rng: random.Random) -> list[tuple[float, float]]:
    """One burst at a random time in each of `bursts` equal slots of the run."""
    slot = sc.duration_s / max(1, sc.bursts)
    return [(start, start + sc.burst_s) for k in range(sc.bursts)
            for start in [k * slot + rng.uniform(0.15, 0.85) * max(0.0, slot - sc.burst_s)]]


def base_level(sc: Scenario, t: float) -> float:
    """Fraction of the peak base rate at time t: flat, or one slow 'day' from 50 % to 100 %
    and back, which a reactive autoscaler can follow."""
    if sc.shape == "flat":
        return 1.0
    return 0.5 + 0.5 * math.sin(math.pi * t / sc.duration_s)


def rate_segments(sc: Scenario, rng: random.Random) -> list[tuple[float, float, float]]:
    """(start_s, end_s, arrivals per second), piecewise constant over SEGMENT_S slices:
    the base curve, times `burst_factor` inside bursts. Scale N: Serve's default wants about
    N replicas at the base peak (bursts ask for burst_factor x N)."""
    peak_base = peak_rate_per_s(sc)
    windows = burst_windows(sc, rng)
    cuts = sorted({0.0, sc.duration_s, *(min(sc.duration_s, x) for w in windows for x in w),
                   *(k * SEGMENT_S for k in range(1, int(sc.duration_s // SEGMENT_S) + 1))})
    segments = [(0.0, sc.warmup_s, peak_base * base_level(sc, 0.0))] if sc.warmup_s > 0 else []
    for start, end in zip(cuts, cuts[1:]):
        if end <= start:
            continue
        mid = (start + end) / 2
        burst = any(a <= mid < b for a, b in windows)
        rate = peak_base * base_level(sc, mid) * (sc.burst_factor if burst else 1.0)
        segments.append((sc.warmup_s + start, sc.warmup_s + end, rate))
    return segments


class RequestSampler:
    """Class by weight, then one of the class's acceptance lanes uniformly, then a lognormal
    output length. Rows: (cumulative weight, class, its lanes, how many, log median output,
    sigma, prefill seconds)."""

    def __init__(self, mix: Mix, lane_of: list[list[int]], prefill_s: list[float], rng: random.Random) -> None:
        total = sum(c.weight for c in mix.classes)
        cumulative = list(itertools.accumulate(c.weight / total for c in mix.classes))
        cumulative[-1] = 2.0  # past any random() draw
        self.rng = rng
        self.table = [(edge, k, lane_of[k], len(lane_of[k]), math.log(c.output_tokens), c.output_sigma, prefill_s[k])
                      for k, (edge, c) in enumerate(zip(cumulative, mix.classes))]

    def __call__(self, k: Optional[int] = None) -> tuple:
        """(lane, output tokens, prefill seconds) of one request (of class k, if given)."""
        rng = self.rng
        if k is None:
            u = rng.random()
            for row in self.table:
                if u < row[0]:
                    break
        else:
            row = self.table[k]
        _, _, lanes, num_lanes, log_median, sigma, prefill_s = row
        tokens = max(1, int(math.exp(log_median + sigma * rng.gauss(0.0, 1.0))))
        return lanes[int(rng.random() * num_lanes)], tokens, prefill_s


def poisson_arrivals(sc: Scenario, sample: RequestSampler, rng: random.Random) -> Iterator[tuple]:
    """(time_s, lane, output tokens, prefill seconds), exact exponential gaps per rate segment."""
    expovariate = rng.expovariate
    for start, end, rate in rate_segments(sc, rng):
        t = start
        while True:
            t += expovariate(rate)
            if t >= end:  # memoryless: the next segment starts its own draw
                break
            yield (t, *sample())


def trace_arrivals(sc: Scenario, sample: RequestSampler) -> Iterator[tuple]:
    names = [c.name for c in sc.mix.classes]
    for line in sc.trace.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["t"] < sc.duration_s:
                lane, _, prefill_s = sample(names.index(row["class"]))
                yield float(row["t"]), lane, int(row["output_tokens"]), prefill_s
