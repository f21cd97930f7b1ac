"""Where a request should go, as pure functions over plain data (no Ray, no torch).

Speculation pays below a replica's batch gate, so a request first goes where adding it
keeps the batch at or under the gate; among those, where speculation accepts most (its
drafts are worth the most there), then the shortest queue. Replicas already above their
gate only differ in load, so they are ordered by queue first. When no candidate would
speculate, the request is marked non-speculative. Standard library + gate.py only: the
KubeRay dashboard imports the router on a CPU-only head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from replicas.speculation.gate import speculate_this_step
from replicas.stats import ACCEPTANCE_LENGTH, BATCH_GATE, BATCH_SIZE, WAITING

UNKNOWN_GATE = 1 << 30  # a replica that has not reported yet: assume speculation is on
ACCEPTANCE_RESOLUTION = 0.25  # acceptance lengths closer than this count as equal (EWMA noise)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it: its last stats plus the live queue length."""

    replica_id: str
    batch_size: int = 0  # running in the engine at the last stats report
    waiting: int = 0  # queued in the engine at the last stats report
    batch_gate: int = UNKNOWN_GATE
    acceptance_length: float = 0.0
    queue_len: Optional[int] = None  # Serve's live count of ongoing requests, when cached

    @property
    def load(self) -> int:
        """Requests the replica holds now: stats are a period stale, the queue count is not."""
        return max(self.batch_size + self.waiting, self.queue_len or 0)

    @property
    def speculates_next(self) -> bool:
        """Would a request added now run in a speculating step?"""
        return speculate_this_step(self.load + 1, self.batch_gate)

    @classmethod
    def from_stats(cls, replica_id: str, stats: Mapping[str, float], queue_len: Optional[int] = None) -> "ReplicaLoad":
        return cls(
            replica_id=replica_id,
            batch_size=int(stats.get(BATCH_SIZE, 0)),
            waiting=int(stats.get(WAITING, 0)),
            batch_gate=int(stats.get(BATCH_GATE, UNKNOWN_GATE)),
            acceptance_length=float(stats.get(ACCEPTANCE_LENGTH, 0.0)),
            queue_len=queue_len,
        )


def _acceptance_bucket(load: ReplicaLoad) -> int:
    return int(load.acceptance_length / ACCEPTANCE_RESOLUTION)


def rank_replicas(loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """Best first: below the gate (higher acceptance, then shorter queue), then above it
    (shorter queue, then higher acceptance). Ties keep the input order."""
    below = [r for r in loads if r.speculates_next]
    above = [r for r in loads if not r.speculates_next]
    below.sort(key=lambda r: (-_acceptance_bucket(r), r.load))
    above.sort(key=lambda r: (r.load, -_acceptance_bucket(r)))
    return below + above


def all_above_gate(loads: Sequence[ReplicaLoad]) -> bool:
    """True when no candidate would speculate a new request (False for no candidates)."""
    return bool(loads) and not any(r.speculates_next for r in loads)
