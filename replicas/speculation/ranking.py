"""Where a request should go, as pure functions over plain data (no Ray, no torch).

Speculation pays below a replica's batch gate, so a request first goes where adding it
keeps the batch at or under the gate; among those, where speculation accepts most (its
drafts are worth the most there), then the shortest queue. Replicas already above their
gate only differ in load, so they are ordered by queue first. When no candidate would
speculate, the request waits a moment for a slot under a gate (`hold_at_gate`), then is
marked non-speculative and goes over one. A replica whose engine does not gate by batch
size (it reports `stats.NOT_GATED`: TensorRT-LLM modes that cannot stop drafting, or
speculation off) has no room under a gate to offer: a request there changes nothing about
speculation, so it ranks with the over-gate replicas, by load; it speculates a request or
not as its last step did, which is what "every candidate is over its gate" asks. Standard
library + gate.py only: the KubeRay dashboard imports the router on a CPU-only head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from replicas.speculation.gate import gates_by_batch, speculate_this_step
from replicas.stats import ACCEPTANCE_LENGTH, BATCH_GATE, BATCH_SIZE, SPECULATING, WAITING

UNKNOWN_GATE = 1 << 30  # a replica that has not reported yet: assume speculation is on
ACCEPTANCE_RESOLUTION = 0.25  # acceptance lengths closer than this count as equal (EWMA noise)
GATE_HOLD_S = 5.0  # longest a request waits for a slot under a gate (0: never wait)
GATE_HOLD_MIN_ACCEPTANCE = 2.5  # ... while the replicas' acceptance is at least this


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it: its last stats plus the live queue length."""

    replica_id: str
    batch_size: int = 0  # running in the engine at the last stats report
    waiting: int = 0  # queued in the engine at the last stats report
    batch_gate: int = UNKNOWN_GATE
    acceptance_length: float = 0.0
    queue_len: Optional[int] = None  # Serve's live count of ongoing requests, when cached
    speculating: Optional[bool] = None  # its last step speculated (None: not reported)
    sole_router: bool = False  # the router that sees it is the only one sending to it (one Ingress)

    @property
    def load(self) -> int:
        """Requests the replica holds now. The stats are a period stale; the queue count is live
        (this router's sends and ends since Serve last asked the replica), and where this router
        alone sends it is the whole count: then it stands alone. (With the stats' count too,
        a request that had ended held its place for a period: at 4 clients and the gate at 4,
        each next request waited in the gate hold, TTFT 1.1-1.2 s against 0.4-0.6 s now, found
        by `benchmarks/serve.py`.) Otherwise the larger: the stats count other routers' requests."""
        if self.sole_router and self.queue_len is not None:
            return self.queue_len
        return max(self.batch_size + self.waiting, self.queue_len or 0)

    @property
    def under_gate(self) -> bool:
        """Does the replica's engine gate by batch size, with room under its gate for one more?"""
        return gates_by_batch(self.batch_gate) and speculate_this_step(self.load + 1, self.batch_gate)

    @property
    def speculates_next(self) -> bool:
        """Would a request added now run in a speculating step? Under the gate where the
        engine gates; where it does not, as its last step did (unreported: no claim, False)."""
        return self.under_gate if gates_by_batch(self.batch_gate) else bool(self.speculating)

    @classmethod
    def from_stats(cls, replica_id: str, stats: Mapping[str, float], queue_len: Optional[int] = None,
                   sole_router: bool = False) -> "ReplicaLoad":
        return cls(
            replica_id=replica_id,
            batch_size=int(stats.get(BATCH_SIZE, 0)),
            waiting=int(stats.get(WAITING, 0)),
            batch_gate=int(stats.get(BATCH_GATE, UNKNOWN_GATE)),
            acceptance_length=float(stats.get(ACCEPTANCE_LENGTH, 0.0)),
            queue_len=queue_len,
            speculating=bool(stats[SPECULATING]) if SPECULATING in stats else None,
            sole_router=sole_router,
        )


def _acceptance_bucket(load: ReplicaLoad) -> int:
    return int(load.acceptance_length / ACCEPTANCE_RESOLUTION)


def rank_replicas(loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """Best first: below the gate (higher acceptance, then shorter queue), then the rest,
    above the gate or not gated (shorter queue, then higher acceptance). Ties keep the
    input order."""
    below = [r for r in loads if r.under_gate]
    above = [r for r in loads if not r.under_gate]
    below.sort(key=lambda r: (-_acceptance_bucket(r), r.load))
    above.sort(key=lambda r: (r.load, -_acceptance_bucket(r)))
    return below + above


def all_above_gate(loads: Sequence[ReplicaLoad]) -> bool:
    """True when no candidate would speculate a new request (False for no candidates): every
    one is over its gate, or does not gate and is not speculating."""
    return bool(loads) and not any(r.speculates_next for r in loads)


def hold_at_gate(loads: Sequence[ReplicaLoad], waited_s: float, hold_s: float = GATE_HOLD_S,
                 min_acceptance: float = GATE_HOLD_MIN_ACCEPTANCE) -> bool:
    """Should a request wait in the handle queue rather than go to a replica over its gate?

    One request over the gate turns speculation off for the whole batch: a replica at gate g
    verifying drafts at acceptance a emits about g * a tokens per step, one step later g + 1,
    so tipping it over slows its whole batch several-fold, while the newcomer would wait only
    for the next of g requests to finish (1/g of a request's decode time). So while every
    candidate is at its gate and the replicas that report an acceptance length average at
    least `min_acceptance`, hold the request, for at most `hold_s` after it arrived: a
    sustained overload still gets served (over the gate, as before) while the autoscaler,
    which counts held requests, adds replicas. Below `min_acceptance` the gate costs little
    and nothing is held.
    """
    if hold_s <= 0 or waited_s >= hold_s or not all_above_gate(loads):
        return False
    if not any(gates_by_batch(r.batch_gate) for r in loads):  # no gate anywhere: no slot will open
        return False
    return acceptance_reaches((r.acceptance_length for r in loads), min_acceptance)


def acceptance_reaches(acceptance_lengths: Iterable[float], min_acceptance: float) -> bool:
    """Do the measured acceptance lengths (>= 1; 0 = no verify step yet) average at least
    `min_acceptance`? False when none is measured. The simulator's hold applies it too."""
    measured = [a for a in acceptance_lengths if a >= 1.0]
    return bool(measured) and sum(measured) / len(measured) >= min_acceptance
