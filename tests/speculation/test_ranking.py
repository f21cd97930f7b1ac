"""The router's pure ranking rule as tables of plain data (no Ray, no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replicas.speculation.ranking import UNKNOWN_GATE, ReplicaLoad, all_above_gate, hold_at_gate, rank_replicas

REPO = Path(__file__).resolve().parents[2]


def R(rid, batch=0, waiting=0, gate=4, acc=0.0, queue=None):
    return ReplicaLoad(rid, batch, waiting, gate, acc, queue)


RANKING = [
    # (name, replicas, expected order)
    ("below the gate first", [R("a", batch=4), R("b", batch=1)], ["b", "a"]),
    ("then higher acceptance", [R("a", batch=1, acc=1.5), R("b", batch=2, acc=3.0)], ["b", "a"]),
    ("then shorter queue", [R("a", batch=3, acc=2.0), R("b", batch=1, acc=2.0)], ["b", "a"]),
    ("acceptance noise is a tie", [R("a", batch=3, acc=2.05), R("b", batch=1, acc=2.0)], ["b", "a"]),
    ("waiting counts as load", [R("a", batch=1, waiting=3), R("b", batch=2)], ["b", "a"]),
    ("live queue beats stale stats", [R("a", batch=0, queue=4), R("b", batch=2)], ["b", "a"]),
    ("stale stats beat a short queue", [R("a", batch=4, queue=1), R("b", batch=2, queue=2)], ["b", "a"]),
    # the sole router's live count is the whole count: the stats' requests have ended since
    ("a sole router's queue beats stale stats", [ReplicaLoad("a", 4, 0, 4, 0.0, 1, sole_router=True),
                                                  ReplicaLoad("b", 2, 0, 4, 0.0, 2, sole_router=True)], ["a", "b"]),
    ("a sole router without a count reads the stats", [ReplicaLoad("a", 4, 0, 4, 0.0, None, sole_router=True),
                                                       R("b", batch=2)], ["b", "a"]),
    ("above the gate: shorter queue first", [R("a", batch=9, acc=3.0), R("b", batch=6, acc=1.0)], ["b", "a"]),
    ("the gate is per replica", [R("a", batch=5, gate=8), R("b", batch=2, gate=2)], ["a", "b"]),
    ("gate 0 never speculates", [R("a", gate=0), R("b", batch=3)], ["b", "a"]),
    ("unreported replica is assumed open", [ReplicaLoad("new"), R("b", batch=4)], ["new", "b"]),
    ("ties keep input order", [R("a", batch=1), R("b", batch=1), R("c", batch=1)], ["a", "b", "c"]),
    ("empty", [], []),
]


@pytest.mark.parametrize("name,replicas,expected", RANKING, ids=[row[0] for row in RANKING])
def test_rank_replicas(name, replicas, expected):
    assert [r.replica_id for r in rank_replicas(replicas)] == expected


ABOVE_GATE = [
    ("all full", [R("a", batch=4), R("b", batch=7)], True),
    ("one has room", [R("a", batch=4), R("b", batch=3)], False),
    ("room by the live queue only", [R("a", batch=4, queue=2)], True),
    ("exactly at the gate after adding", [R("a", batch=3, gate=4)], False),
    ("gate 0 everywhere", [R("a", gate=0), R("b", gate=0)], True),
    ("unreported replica", [ReplicaLoad("new"), R("b", batch=9)], False),
    ("no candidates", [], False),
]


@pytest.mark.parametrize("name,replicas,expected", ABOVE_GATE, ids=[row[0] for row in ABOVE_GATE])
def test_all_above_gate(name, replicas, expected):
    assert all_above_gate(replicas) is expected


HOLD = [
    # (name, replicas, waited_s, hold_s, expected); min acceptance 2.5
    ("all at the gate, acceptance high", [R("a", batch=4, acc=3.0), R("b", batch=4, acc=4.0)], 0.5, 5.0, True),
    ("one has room", [R("a", batch=4, acc=3.0), R("b", batch=2, acc=3.0)], 0.5, 5.0, False),
    ("waited long enough", [R("a", batch=4, acc=3.0)], 5.0, 5.0, False),
    ("hold off", [R("a", batch=4, acc=3.0)], 0.0, 0.0, False),
    ("acceptance too low to matter", [R("a", batch=4, acc=2.0), R("b", batch=4, acc=2.9)], 0.5, 5.0, False),
    ("the mean counts, not the best", [R("a", batch=4, acc=1.5), R("b", batch=4, acc=3.4)], 0.5, 5.0, False),
    ("unmeasured replicas do not dilute", [R("a", batch=4, acc=3.0), R("b", batch=4, acc=0.0)], 0.5, 5.0, True),
    ("nobody measured yet", [R("a", batch=4), R("b", batch=4)], 0.5, 5.0, False),
    ("full by the live queue", [R("a", batch=1, acc=3.0, queue=4)], 0.5, 5.0, True),
    ("gate 0 everywhere: no slot will open", [R("a", gate=0, acc=3.0)], 0.5, 5.0, False),
    ("no candidates", [], 0.5, 5.0, False),
]


@pytest.mark.parametrize("name,replicas,waited_s,hold_s,expected", HOLD, ids=[row[0] for row in HOLD])
def test_hold_at_gate(name, replicas, waited_s, hold_s, expected):
    assert hold_at_gate(replicas, waited_s, hold_s, min_acceptance=2.5) is expected


def test_from_stats_reads_the_replica_keys():
    stats = {"batch_size": 3.0, "waiting": 1.0, "batch_gate": 6.0, "acceptance_length": 2.5, "step_ms": 9.0}
    assert ReplicaLoad.from_stats("x", stats, 2) == ReplicaLoad("x", 3, 1, 6, 2.5, 2)
    assert ReplicaLoad.from_stats("x", stats, 2, sole_router=True).load == 2
    assert ReplicaLoad.from_stats("x", {}) == ReplicaLoad("x", 0, 0, UNKNOWN_GATE, 0.0, None)


def test_importing_the_ranking_does_not_import_torch():
    code = ("import sys, replicas.speculation.ranking; "
            "bad = [m for m in ('torch', 'transformers', 'replicas.speculation._sa_native') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
