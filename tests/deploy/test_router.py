"""The speculation-gate router adapter (no Ray cluster); its pure ranking rule is tested in
tests/speculation/test_ranking.py."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def test_names_shared_with_the_replica_agree():
    from deploy.router import SPECULATE_KWARG
    from replicas.replica import Replica

    assert SPECULATE_KWARG in inspect.signature(Replica.generate).parameters


@dataclass(frozen=True)
class _ReplicaId:
    unique_id: str


def _router_with_replicas(stats_by_id, queue_by_id=None):
    # The cache behind the public `replica_queue_len_cache` property has no public import.
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from deploy.router import SpeculationGateRouter

    router = SpeculationGateRouter.__new__(SpeculationGateRouter)  # no Serve machinery needed
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    replicas = []
    for rid, stats in stats_by_id.items():
        replica = SimpleNamespace(replica_id=_ReplicaId(rid), routing_stats=stats)
        replicas.append(replica)
        if queue_by_id and rid in queue_by_id:
            router._replica_queue_len_cache.update(replica.replica_id, queue_by_id[rid])
    return router, replicas


def _pending(method="generate", age_s=0.0):
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), kwargs={}, created_at=time.time() - age_s,
                           routing_context=SimpleNamespace(should_backoff=False))


def test_router_adapter_ranks_and_marks():
    router, replicas = _router_with_replicas({
        "busy": {"batch_size": 4, "batch_gate": 4, "acceptance_length": 3.0},
        "idle": {"batch_size": 1, "batch_gate": 4, "acceptance_length": 2.0},
    })
    pending = _pending()
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["idle"], ["busy"]]
    assert "speculate" not in pending.kwargs

    router, replicas = _router_with_replicas({"a": {"batch_size": 4, "batch_gate": 4}}, {"a": 6})
    pending = _pending()
    asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.kwargs == {"speculate": False}

    other = _pending("tokenizer")  # only generate calls carry the flag
    asyncio.run(router.choose_replicas(replicas, other))
    assert other.kwargs == {}


def test_router_holds_a_request_at_the_gate_then_lets_it_over():
    router, replicas = _router_with_replicas({"a": {"batch_size": 4, "batch_gate": 4, "acceptance_length": 3.0}})
    router.initialize_state(gate_hold_s=5.0, gate_hold_min_acceptance=2.5)
    fresh = _pending(age_s=1.0)
    assert asyncio.run(router.choose_replicas(replicas, fresh)) == []  # held: Serve asks again
    assert fresh.routing_context.should_backoff and fresh.kwargs == {}  # ... after a back-off

    late = _pending(age_s=6.0)  # held long enough: over the gate, not speculating
    ranks = asyncio.run(router.choose_replicas(replicas, late))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["a"]]
    assert late.kwargs == {"speculate": False}

    other = _pending("tokenizer", age_s=1.0)  # only generate calls wait
    assert asyncio.run(router.choose_replicas(replicas, other)) != []

    router.initialize_state(gate_hold_s=0.0)
    assert asyncio.run(router.choose_replicas(replicas, _pending(age_s=1.0))) != []


def test_retried_request_loses_a_stale_mark():
    router, replicas = _router_with_replicas({"a": {"batch_size": 0, "batch_gate": 4}})
    pending = _pending()
    pending.kwargs["speculate"] = False
    asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.kwargs == {}


def test_importing_the_router_does_not_import_torch():
    code = ("import sys, deploy.router; "
            "bad = [m for m in ('torch', 'transformers', 'replicas.speculation._sa_native') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
