"""Plan autoscaling at scale: a fixed-increment discrete-event simulation of a Serve fleet.

    .venv/bin/python -m autoscaling.simulate [--scales 10 100 1000] [--seeds 4] [--quick]

Arrivals are Poisson with bursts (or a JSONL trace: {"t": s, "class": name,
"output_tokens": n} per line; prompt length and acceptance come from the class; `arrivals.py`); requests are
routed as the project's router does (least loaded below the gate, held briefly when every
replica is at it) to replicas that decode in fluid steps (`fleet.py`) on a step-time profile
(`profiles.py`); every control period the policy under test sees what Serve would show it
(ongoing requests averaged over the look-back window, each replica's acceptance EWMA once it
has pushed metrics) and Serve's delays and bounds are applied (`serve_rules.py`). Compared:
this package's acceptance-aware policy, Serve's default at the same `target_ongoing_requests`,
and Serve's default with the target set to the gate (always spread, acceptance-blind).
`scale` N sizes the load so that Serve's default wants about N replicas at the peak. Each
case runs on `--seeds` seeds (the same arrivals for every policy per seed), in `--workers`
processes; the table gives medians over the seeds. Writes benchmarks/results/autoscaling.json
and autoscaling.png, prints the table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import os
import random
import time
from collections import deque
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Optional, Sequence

from autoscaling.arrivals import RequestSampler, base_level, poisson_arrivals, trace_arrivals
from autoscaling.decision import PolicyConfig, ReplicaSignals, Signals, decide, spread_pays
from autoscaling.fleet import DRAINING, READY, STARTING, STOPPED, Lane, Records, Replica
from autoscaling.profiles import RESULTS, mixes, profiles
from autoscaling.scenario import Scenario
from autoscaling.serve_rules import DelayState, apply_delays, queue_length_replicas
from replicas.speculation.ranking import acceptance_reaches

POLICIES = ("acceptance_aware", "serve_default", "serve_default_at_gate")


class Simulation:
    """One scenario, run once. `run()` returns the summary dict."""

    def __init__(self, sc: Scenario) -> None:
        self.sc, self.p = sc, sc.profile
        self.rng = random.Random(sc.seed)
        self.arrival_rng = random.Random(sc.seed + 1)  # same arrivals for every policy
        lanes: list[Lane] = []
        self.lane_of: list[list[int]] = []  # class index -> its lanes
        for cls in sc.mix.classes:
            self.lane_of.append([len(lanes) + i for i in range(len(cls.acceptance_levels))])
            lanes += [Lane(min(a, cls.draft_len + 1.0), cls.draft_len + 1) for a in cls.acceptance_levels]
        self.lanes = tuple(lanes)
        self.prefill_s = [self.p.step.prefill_ms(c.prompt_tokens) / 1e3 for c in sc.mix.classes]
        self.measure_from_s = 0.0 if sc.trace else sc.warmup_s
        self.end_s = self.measure_from_s + sc.duration_s
        self.records = Records(self.p.tpot_slo_ms / 1e3, self.p.ttft_slo_s, self.measure_from_s)
        # spread from the break-even at the mix's own draft length (weighted over its classes)
        # and at the fill the policy spreads to, plus the hysteresis band: spreading then stops
        # where it would start to cost replica-hours, not a band below
        draft_len = round(sum(c.weight * c.draft_len for c in sc.mix.classes) / sum(c.weight for c in sc.mix.classes))
        band = PolicyConfig.acceptance_band
        self.policy_config = PolicyConfig(
            batch_gate=self.p.batch_gate, target_ongoing_requests=self.p.pack_target, gate_fill=self.p.gate_fill,
            min_acceptance_length=round(self.p.break_even_acceptance(draft_len, self.p.gate_fill) + band, 2))
        if sc.policy_overrides:
            self.policy_config = replace(self.policy_config, **sc.policy_overrides)
        initial = max(1, math.ceil(sc.scale * base_level(sc, 0.0)))
        self.min_replicas, self.max_replicas = 1, max(4, 3 * sc.scale)
        self.replicas = [Replica(self.lanes, 0.0, READY) for _ in range(initial)]
        self.target = initial
        self.delay = DelayState()
        self.spreading = False
        self.window: deque = deque()
        self.queue: deque = deque()  # (arrival_s, lane, output tokens, prefill_s)
        self.seq = itertools.count()  # heap tie-breaker
        self.replica_s = 0.0
        self.timeline: list[tuple[float, int, float]] = []  # (t, replicas billed, load)

    # -- routing ---------------------------------------------------------------------------
    def _routable(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == READY]

    def _admit(self, r: Replica, item: tuple, now_s: float) -> None:
        arrival_s, lane, tokens, prefill_s = item
        r.admit(lane, tokens, arrival_s, now_s, prefill_s, next(self.seq))

    def _route(self, items, now_s: float, routable: list[Replica]) -> None:
        """Queued requests first (FIFO), then `items`; a request no replica can take waits."""
        if self.sc.router == "power_of_two":
            self._route_power_of_two(items, now_s, routable)
            return
        if not (self.sc.gate_hold_s > 0 and self._gate_hold_pays(routable)):
            self._fill(items, now_s, routable, self.p.max_ongoing)
            return
        # The router's gate hold: nobody goes over a gate, except requests that have waited
        # `gate_hold_s` already (the queue is in arrival order, so they are at its front).
        self._fill(items, now_s, routable, self.p.batch_gate)
        held_long: deque = deque()
        while self.queue and now_s - self.queue[0][0] >= self.sc.gate_hold_s:
            held_long.append(self.queue.popleft())
        if held_long:
            rest, self.queue = self.queue, deque()
            self._fill(held_long, now_s, routable, self.p.max_ongoing)
            self.queue.extend(rest)

    def _gate_hold_pays(self, routable: list[Replica]) -> bool:
        """`hold_at_gate`'s acceptance test, at the policy's own threshold."""
        return acceptance_reaches((r.acceptance for r in routable), self.policy_config.min_acceptance_length)

    def _fill(self, items, now_s: float, routable: list[Replica], cap: int) -> None:
        """Route the queue, then `items`, to replicas holding fewer than `cap`; the rest queue."""
        # The project's router (replicas/speculation/ranking.py) ranks every replica: below the
        # gate first, then by load. With the fleet's acceptance alike, that is
        # join-the-shortest-queue: replicas bucketed by ongoing count, the lowest bucket served first.
        buckets: list[list[Replica]] = [[] for _ in range(cap)]
        for r in routable:
            if r.ongoing < cap:
                buckets[r.ongoing].append(r)
        low = 0
        for source in (self.queue, items):
            while source:
                while low < cap and not buckets[low]:
                    low += 1
                if low == cap:  # every replica full: the rest wait in the handle queue
                    self.queue.extend(items)
                    return
                r = buckets[low].pop()
                self._admit(r, source.popleft(), now_s)
                if r.ongoing < cap:
                    buckets[r.ongoing].append(r)

    def _route_power_of_two(self, items, now_s: float, routable: list[Replica]) -> None:
        """Serve's default router: the less loaded of two random replicas, a few retries."""
        cap, rand, n = self.p.max_ongoing, self.rng.random, len(routable)
        free = [r for r in routable if r.ongoing < cap]
        while self.queue and free:
            r = min(free, key=lambda x: x.ongoing)
            self._admit(r, self.queue.popleft(), now_s)
            free = [x for x in free if x.ongoing < cap] if r.ongoing >= cap else free
        for item in items:
            if self.queue or not n:
                self.queue.append(item)
                continue
            for _ in range(3):
                a, b = routable[int(rand() * n)], routable[int(rand() * n)]
                r = a if a.ongoing <= b.ongoing else b
                if r.ongoing < cap:
                    self._admit(r, item, now_s)
                    break
            else:
                self.queue.append(item)

    def _expire_queue(self, now_s: float) -> None:
        while self.queue and now_s - self.queue[0][0] > self.p.queue_timeout_s:
            self.records.drop(self.queue.popleft()[0])

    # -- control ---------------------------------------------------------------------------
    def _control(self, now_s: float) -> None:
        running = self._routable()
        total = sum(r.ongoing for r in running) + len(self.queue)
        self.window.append((now_s, total))
        while self.window[0][0] < now_s - self.sc.look_back_s:
            self.window.popleft()
        load = sum(v for _, v in self.window) / len(self.window)
        policy = self.sc.policy
        if policy == "acceptance_aware":
            push = self.sc.metrics_push_s
            signals = Signals(
                total_requests=load, min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                spreading=self.spreading,
                replicas=tuple(ReplicaSignals(batch_size=r.ongoing, speculating=float(r.ongoing <= self.p.batch_gate),
                                              acceptance_length=r.acceptance)
                               if now_s - r.ready_s >= push else ReplicaSignals() for r in running))
            desired = decide(signals, len(running), self.policy_config)
            spread = spread_pays(signals, self.policy_config)
            self.spreading = self.spreading if spread is None else spread  # as the Serve adapter keeps it
        else:
            target = self.p.pack_target if policy == "serve_default" else self.p.batch_gate
            desired = queue_length_replicas(load, target)
        desired = max(self.min_replicas, min(self.max_replicas, desired))
        self.target = apply_delays(desired, self.target, now_s, self.delay,
                                   self.sc.upscale_delay_s, self.sc.downscale_delay_s)
        self._reconcile(now_s)

    def _reconcile(self, now_s: float) -> None:
        live = [r for r in self.replicas if r.state in (STARTING, READY)]
        if self.target > len(live):
            self.replicas += [Replica(self.lanes, now_s + self.p.startup_s)
                              for _ in range(self.target - len(live))]
        elif self.target < len(live):
            excess = len(live) - self.target
            order = sorted(live, key=lambda r: (r.state != STARTING, r.ongoing))
            for r in order[:excess]:
                r.state, r.stop_by_s = (STOPPED if r.state == STARTING else DRAINING), now_s + self.p.graceful_shutdown_s

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> dict:
        sc, p, rec = self.sc, self.p, self.records
        tick = p.tick_s
        sample = RequestSampler(sc.mix, self.lane_of, self.prefill_s, self.arrival_rng)
        source = trace_arrivals(sc, sample) if sc.trace else poisson_arrivals(sc, sample, self.arrival_rng)
        pending = next(source, None)
        now, next_control, step_ms = 0.0, 0.0, p.step.compiled()
        started, started_cpu = time.perf_counter(), time.process_time()
        in_flight = 0
        while True:
            end = now + tick
            billed, stopped, routable = 0, False, []
            for r in self.replicas:  # one pass: decode, then state changes at the tick's end
                state = r.state
                if state == READY or state == DRAINING:
                    r.advance(now, tick, p.batch_gate, step_ms, rec)
                if state == STARTING and r.ready_s <= end:
                    r.state = state = READY
                elif state == DRAINING and (r.ongoing == 0 or end >= r.stop_by_s):
                    r.drop_all(rec)
                    r.state = state = STOPPED
                if state == STOPPED:
                    stopped = True
                    continue
                billed += 1
                if state == READY:
                    routable.append(r)
            if stopped:
                self.replicas = [r for r in self.replicas if r.state != STOPPED]
            now = end
            if self.measure_from_s < now <= self.end_s:
                self.replica_s += billed * tick
            self._expire_queue(now)
            arrived: deque = deque()
            while pending is not None and pending[0] < now:
                arrived.append(pending)
                pending = next(source, None)
            rec.arrivals += len(arrived)
            self._route(arrived, now, routable)
            if now >= next_control:
                self._control(now)
                next_control += sc.control_period_s
                self.timeline.append((round(now, 3), billed, round(self.window[-1][1], 1)))
            if pending is None and now >= self.end_s:
                in_flight = sum(r.ongoing for r in self.replicas) + len(self.queue)
                if in_flight == 0 or now >= self.end_s + sc.drain_limit_s:
                    break
        return self._summary(in_flight, time.perf_counter() - started, time.process_time() - started_cpu)

    def _summary(self, unfinished: int, wall_s: float, cpu_s: float) -> dict:
        rec = self.records
        # conservation: every arrival is completed, dropped, or still in flight at the end
        assert rec.arrivals == rec.completed + rec.dropped + unfinished, (rec.arrivals, rec.completed, rec.dropped)
        assert all(r.ongoing == sum(r.count) >= 0 for r in self.replicas)
        tpot = sorted(rec.tpot_s)
        ttft = sorted(rec.ttft_s)
        return {
            "profile": self.p.name, "mix": self.sc.mix.name, "scale": self.sc.scale, "policy": self.sc.policy,
            "seed": self.sc.seed, "arrivals": rec.arrivals, "completed": rec.completed, "dropped": rec.dropped,
            "unfinished": unfinished, "measured": rec.measured, "measured_dropped": rec.measured_dropped,
            "replica_hours": round(self.replica_s / 3600, 3),
            "tpot_p50_ms": round(_quantile(tpot, 0.50) * 1e3, 2), "tpot_p99_ms": round(_quantile(tpot, 0.99) * 1e3, 2),
            "ttft_p99_s": round(_quantile(ttft, 0.99), 2), "slo_misses": rec.slo_misses,
            "slo_miss_pct": round(100 * rec.slo_misses / max(1, rec.measured), 2),
            "output_tokens": rec.output_tokens, "wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2),
            "speculating_pct": round(100 * rec.spec_ticks / max(1, rec.busy_ticks), 1),
            "min_acceptance_length": self.policy_config.min_acceptance_length,
        }


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_scenario(sc: Scenario, with_timeline: bool = False) -> dict:
    sim = Simulation(sc)
    out = sim.run()
    if with_timeline:
        out["timeline"] = sim.timeline
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    from autoscaling.report import print_table, summarize, target_check, write_png

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--profiles", nargs="+", default=None, help="default: all")
    parser.add_argument("--seeds", type=int, default=4, help="runs per case (medians are reported)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    parser.add_argument("--duration-s", type=float, default=900.0)
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--shape", choices=("diurnal", "flat"), default="diurnal")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--burst-factor", type=float, default=1.3)
    parser.add_argument("--quick", action="store_true", help="scales 10 100, 300 s, one seed: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS / "autoscaling.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.scales, args.duration_s, args.seeds = [10, 100], 300.0, 1
    all_profiles = profiles()
    all_mixes, acceptance_source = mixes()
    jobs = [(Scenario(all_profiles[name], mix, scale, policy, seed=seed, duration_s=args.duration_s,
                      trace=args.trace, shape=args.shape, bursts=args.bursts, burst_factor=args.burst_factor),
             scale == args.scales[0] and seed == args.first_seed)
            for name in args.profiles or list(all_profiles) for scale in args.scales for mix in all_mixes.values()
            for policy in POLICIES for seed in range(args.first_seed, args.first_seed + args.seeds)]
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].scale)  # the longest first, for balance
    rows: list[Optional[dict]] = [None] * len(jobs)
    with concurrent.futures.ProcessPoolExecutor(max(1, args.workers)) as pool:
        futures = {pool.submit(run_scenario, *jobs[i]): i for i in order}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            row = rows[futures[future]] = future.result()
            print(f"  [{done:3d}/{len(jobs)}] {row['profile']:17s} {row['scale']:5d} {row['mix']:15s} "
                  f"{row['policy']:22s} seed {row['seed']}  {row['cpu_s']:6.1f} s CPU", flush=True)
    result = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "scenario_defaults": {f.name: f.default for f in fields(Scenario)
                              if f.name not in ("profile", "mix", "scale", "policy", "trace", "duration_s",
                                                "shape", "bursts", "burst_factor", "seed")},
        "profiles": {n: asdict(p) for n, p in all_profiles.items()},
        "break_even_acceptance": {n: {f"K={k}": round(p.break_even_acceptance(k), 3) for k in (3, 8)}
                                  | {f"K=8 at fill {p.gate_fill}": round(p.break_even_acceptance(8, p.gate_fill), 3)}
                                  for n, p in all_profiles.items()},
        "mixes": {n: asdict(m) | {"mean_acceptance": round(m.mean_acceptance(), 3)} for n, m in all_mixes.items()},
        "acceptance_source": acceptance_source,
        "summary": summarize(rows),
        "rows": rows,
    }
    result["target"] = target_check(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    write_png(result, args.out.with_suffix(".png"))
    print_table(result)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
