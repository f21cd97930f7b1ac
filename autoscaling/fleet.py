"""The simulated fleet: replicas that decode in fluid steps, and the records they leave.

Time advances in fixed ticks (`Profile.tick_s`). Within a tick a replica's batch is fixed,
so each request gains tokens at a constant rate: `acceptance / step_s` while the batch is at
or under the gate (`speculate_this_step`), `1 / step_s` above it. Requests of one *lane* (a
request class at one acceptance level) share a virtual token clock, so a replica keeps one
heap per lane keyed by the clock value at which each request finishes, and a finish time
inside a tick is exact. Prefill stalls the replica (no chunking): it is carried as `debt_s`.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

from replicas.speculation.gate import speculate_this_step

STARTING, READY, DRAINING, STOPPED = range(4)


@dataclass(frozen=True)
class Lane:
    acceptance: float  # tokens per verify step, bonus included
    verify_tokens: int  # 1 + draft length: tokens each sequence puts through a verify step


class Records:
    """Every arrival ends here exactly once: completed, dropped or (at the end) unfinished.

    Latency figures and SLO misses count only requests that arrived at or after
    `measure_from_s` (the end of the warm-up); the conservation counts cover all of them.
    """

    def __init__(self, tpot_slo_s: float, ttft_slo_s: float, measure_from_s: float = 0.0) -> None:
        self.tpot_slo_s, self.ttft_slo_s, self.measure_from_s = tpot_slo_s, ttft_slo_s, measure_from_s
        self.arrivals = self.completed = self.dropped = 0
        self.measured = self.measured_dropped = self.slo_misses = 0
        self.tpot_s = array("d")
        self.ttft_s = array("d")
        self.output_tokens = 0
        self.busy_ticks = self.spec_ticks = 0  # replica-ticks with a batch, and with speculation on

    def complete(self, request: tuple, finish_s: float) -> None:
        arrival_s, first_token_s, num_tokens = request
        self.completed += 1
        if arrival_s < self.measure_from_s:
            return
        self.measured += 1
        ttft = first_token_s - arrival_s
        tpot = (finish_s - first_token_s) / (num_tokens - 1) if num_tokens > 1 else 0.0
        self.output_tokens += num_tokens
        self.ttft_s.append(ttft)
        if num_tokens > 1:
            self.tpot_s.append(tpot)
        if ttft > self.ttft_slo_s or tpot > self.tpot_slo_s:
            self.slo_misses += 1

    def drop(self, arrival_s: float) -> None:
        self.dropped += 1
        if arrival_s >= self.measure_from_s:
            self.measured += 1
            self.measured_dropped += 1
            self.slo_misses += 1


class Replica:
    """One replica. `lanes` is shared by all replicas; per-lane state is kept in lists, and the
    batch's verify tokens and acceptance sum are kept incrementally (this is the hot loop)."""

    __slots__ = ("state", "ready_s", "ongoing", "count", "clock", "heaps", "debt_s", "acceptance", "stop_by_s",
                 "lanes", "verify_tokens", "acceptance_sum")

    def __init__(self, lanes: tuple[Lane, ...], ready_s: float, state: int = STARTING) -> None:
        self.state = state
        self.ready_s = ready_s
        self.lanes = lanes
        self.ongoing = 0
        self.count = [0] * len(lanes)
        self.clock = [0.0] * len(lanes)
        self.heaps: list[list] = [[] for _ in lanes]
        self.verify_tokens = 0  # sum over the batch of 1 + draft length
        self.acceptance_sum = 0.0  # sum over the batch of acceptance lengths
        self.debt_s = 0.0
        self.acceptance = 0.0  # EWMA like the engine's; 0.0 until the first verify step
        self.stop_by_s = 0.0

    def admit(self, lane: int, request_tokens: int, arrival_s: float, now_s: float, prefill_s: float,
              seq: int) -> None:
        self.debt_s += prefill_s
        first_token_s = now_s + self.debt_s
        self.count[lane] += 1
        self.ongoing += 1
        self.verify_tokens += self.lanes[lane].verify_tokens
        self.acceptance_sum += self.lanes[lane].acceptance
        heapq.heappush(self.heaps[lane], (self.clock[lane] + request_tokens - 1, seq,
                                          (arrival_s, first_token_s, request_tokens)))

    def advance(self, start_s: float, tick_s: float, gate: int, step_ms, records: Records) -> None:
        """Decode over [start_s, start_s + tick_s) with the batch as it stands at start_s."""
        if self.debt_s >= tick_s:
            self.debt_s -= tick_s
            return
        available_s = tick_s - self.debt_s
        t0 = start_s + self.debt_s
        self.debt_s = 0.0
        batch = self.ongoing
        if batch == 0:
            return
        spec = speculate_this_step(batch, gate)
        step_s = step_ms(batch, self.verify_tokens if spec else batch) / 1e3
        records.busy_ticks += 1
        if spec:
            records.spec_ticks += 1
            sample = self.acceptance_sum / batch
            self.acceptance = sample if self.acceptance == 0.0 else 0.5 * (self.acceptance + sample)
        count, clocks, heaps, lanes = self.count, self.clock, self.heaps, self.lanes
        heappop = heapq.heappop
        for i, n in enumerate(count):
            if not n:
                continue
            lane = lanes[i]
            rate = (lane.acceptance if spec else 1.0) / step_s  # tokens/s for each request of the lane
            clock = clocks[i]
            new_clock = clock + rate * available_s
            heap = heaps[i]
            done = 0
            while heap and heap[0][0] <= new_clock:
                key, _, request = heappop(heap)
                records.complete(request, t0 + (key - clock) / rate)
                done += 1
            if done:
                count[i] = n - done
                self.ongoing -= done
                self.verify_tokens -= done * lane.verify_tokens
                self.acceptance_sum -= done * lane.acceptance
            clocks[i] = new_clock

    def drop_all(self, records: Records) -> None:
        for heap in self.heaps:
            for _, _, (arrival_s, _, _) in heap:
                records.drop(arrival_s)
        self.ongoing = self.verify_tokens = 0
        self.acceptance_sum = 0.0
        self.count = [0] * len(self.count)
        self.heaps = [[] for _ in self.heaps]
