"""Prefix affinity's pure rule as tables (no Ray, no torch): which replica a prompt prefers,
and when that preference yields to the speculation gate or to load."""

from __future__ import annotations

import collections

import pytest

from replicas.speculation.affinity import affinity_holds, preferred_replica, prefix_key, rank_with_affinity
from replicas.speculation.ranking import ReplicaLoad, rank_replicas

IDS = ["r0", "r1", "r2"]
KEY = prefix_key("x" * 600)
HOME = preferred_replica(KEY, IDS)
OTHERS = [i for i in IDS if i != HOME]


def test_prefix_key_is_the_start_of_the_prompt():
    conversation = "system: be brief. " * 40
    assert prefix_key(conversation, 64) == prefix_key(conversation + "user: next turn", 64)
    assert prefix_key(conversation, 64) != prefix_key("other " + conversation, 64)
    assert prefix_key("short", 64) is None  # shorter than the key: no affinity
    assert prefix_key(list(range(16)), 64) == prefix_key(list(range(16)) + [99], 64)  # 64 // 4 ids
    assert prefix_key(list(range(15)), 64) is None


def test_rendezvous_spreads_keys_and_moves_only_the_lost_replicas_keys():
    keys = [prefix_key(f"conversation {i} " * 40) for i in range(300)]
    homes = {k: preferred_replica(k, IDS) for k in keys}
    counts = collections.Counter(homes.values())
    assert set(counts) == set(IDS) and min(counts.values()) > 60  # about 100 each
    survivors = IDS[:2]
    for k in keys:  # r2 leaves: its keys move, every other key stays where it was
        if homes[k] != "r2":
            assert preferred_replica(k, survivors) == homes[k]
    assert preferred_replica(KEY, []) is None


def L(role, batch=0, gate=4, acc=2.0, queue=None):
    rid = {"home": HOME, "x": OTHERS[0], "y": OTHERS[1]}[role]
    return ReplicaLoad(rid, batch, 0, gate, acc, queue)


AFFINITY = [
    # (name, loads, expected first role, or None: the ranking alone decides)
    ("idle cluster: home first", [L("x"), L("y"), L("home")], "home"),
    ("home a little busier: still home", [L("x", batch=1), L("home", batch=3)], "home"),
    ("home much busier: the ranking", [L("x", batch=0), L("home", batch=3, gate=8)], None),
    ("home at its gate, another under it: the ranking", [L("x", batch=2), L("home", batch=4)], None),
    ("every replica over its gate: home if not much busier", [L("x", batch=5), L("home", batch=6)], "home"),
    ("home over its gate by far: the ranking", [L("x", batch=5), L("home", batch=9)], None),
    ("home does not gate (nor speculate), another would: the ranking", [L("x", batch=1), L("home", batch=2, gate=0)], None),
    ("live queue counts as load", [L("x", batch=1), L("home", batch=1, queue=4)], None),
]


@pytest.mark.parametrize("name,loads,first", AFFINITY, ids=[row[0] for row in AFFINITY])
def test_rank_with_affinity(name, loads, first):
    ranked = rank_with_affinity(loads, KEY, max_extra_load=2)
    if first is None:
        assert ranked == rank_replicas(loads)
    else:
        assert ranked[0].replica_id == {"home": HOME}[first]
        assert ranked[1:] == [r for r in rank_replicas(loads) if r.replica_id != HOME]


def test_no_key_or_no_replicas_is_the_ranking_alone():
    loads = [L("home", batch=3), L("x", batch=0)]
    assert rank_with_affinity(loads, None) == rank_replicas(loads)
    assert rank_with_affinity([], KEY) == []


def test_affinity_holds_bounds_extra_load():
    home, idle = L("home", batch=2), L("x", batch=0)
    assert affinity_holds(home, [home, idle], max_extra_load=2)
    assert not affinity_holds(home, [home, idle], max_extra_load=1)
