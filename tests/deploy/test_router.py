"""The speculation-gate router adapter (no Ray cluster); its pure ranking rule is tested in
tests/speculation/test_ranking.py."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from replicas.engine import GenerationRequest, SamplingParams
from replicas.speculation.affinity import preferred_replica, prefix_key
from replicas.speculation.ranking import ReplicaLoad, all_above_gate, hold_at_gate

REPO = Path(__file__).resolve().parents[2]


def test_names_shared_with_the_replica_agree():
    from deploy.router import GENERATE_METHOD, SPECULATE_KWARG, TOKENIZER_METHOD
    from replicas.replica import Replica

    assert SPECULATE_KWARG in inspect.signature(Replica.generate).parameters
    assert callable(getattr(Replica, GENERATE_METHOD)) and callable(getattr(Replica, TOKENIZER_METHOD))


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


def _built(cls, app: str, replicas: int):
    """A router of class `cls` as Serve builds one for `app` (what its machinery sets, by hand)."""
    router = cls.__new__(cls)
    router._deployment_id = SimpleNamespace(app_name=app, name="Replica")
    router._replicas = dict.fromkeys(range(replicas))
    router.initialize_state()
    return router


@pytest.mark.parametrize("name", ["SpeculationGateRouter", "PowerOfTwoRouter"])
def test_the_routers_built_here_say_how_many_replicas_they_can_send_to(name):
    """What the Ingress reads where Serve's status lists no deployment (a deploy whose build
    failed): this process's routers, `gate_router: false`'s too."""
    from deploy import router as module

    cls = getattr(module, name)
    assert module.routable_replicas("app-one") is None
    routers = [_built(cls, "app-one", 0), _built(cls, "app-two", 3)]
    assert (module.routable_replicas("app-one"), module.routable_replicas("app-two")) == (0, 3)
    routers.append(_built(cls, "app-one", 2))
    assert module.routable_replicas("app-one") == 2


def _plain_router(local_replicas=()):
    """A PowerOfTwoRouter as Serve builds one, its locality pass off (Serve's default), the
    replicas it holds `local_replicas`."""
    from deploy.router import PowerOfTwoRouter

    router = _built(PowerOfTwoRouter, "plain", 0)
    router._prefer_local_node_routing = router._prefer_local_az_routing = False
    router._replica_id_set = {r.replica_id for r in local_replicas}
    return router


def test_the_plain_router_offers_two_replicas_at_random_and_backs_off_as_serves_does():
    replicas = [SimpleNamespace(replica_id=_ReplicaId(str(i)), routing_stats={}) for i in range(5)]
    router = _plain_router(replicas[:3])
    offered = [asyncio.run(router.choose_replicas(replicas)) for _ in range(50)]
    assert all(len(ranks) == 1 and len(ranks[0]) == len({id(r) for r in ranks[0]}) == 2 for ranks in offered)
    assert all(r in replicas for ranks in offered for r in ranks[0])
    assert len({r.replica_id for ranks in offered for r in ranks[0]}) == 5
    assert asyncio.run(router.choose_replicas(replicas[:1])) == [replicas[:1]]
    assert asyncio.run(router.choose_replicas([])) == []
    # routing a request: Serve's locality pass (off here), which asks Serve to back off between
    # attempts (without it, a saturated deployment was probed in a busy loop: found in review)
    pending = _pending()
    (rank,) = asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.routing_context.should_backoff and {r.replica_id.unique_id for r in rank} <= {"0", "1", "2"}


def _for_model(method: str, model: str):
    """A pending call made for `model`: a request tokenized for it, or a tokenizer asked of it."""
    pending = _pending(method)
    pending.args = [GenerationRequest("r", "hi", SamplingParams(), model_identity=model) if method == "generate"
                    else model]
    return pending


@pytest.mark.parametrize("method", ["generate", "tokenizer"])
@pytest.mark.parametrize("name", ["SpeculationGateRouter", "PowerOfTwoRouter"])
def test_a_call_goes_to_a_replica_of_the_model_it_was_made_for(name, method):
    """A deploy changing the model runs Replicas of both for a while. The old one, idle (it
    refuses the new Ingress's calls) with the acceptance of its earlier traffic, ranked first
    every time, so the Ingress's retries never left it and ended in 503s (found in review).
    Where no Replica of the model runs, the call goes anywhere, to be refused and asked again
    until the Ingress's deadline."""
    router, replicas = _router_with_replicas({
        "old": {"batch_size": 0, "batch_gate": 4, "acceptance_length": 3.0, "model_identity": "/m/a"},
        "new": {"batch_size": 1, "batch_gate": 4, "acceptance_length": 1.0, "model_identity": "/m/b"},
        "starting": {},  # no routing stats reported yet: may be of either
    })
    if name == "PowerOfTwoRouter":
        router = _plain_router(replicas)

    def offered(candidates, pending) -> set[str]:
        ranks = asyncio.run(router.choose_replicas(candidates, pending))
        return {r.replica_id.unique_id for rank in ranks for r in rank}

    for _ in range(10):
        assert offered(replicas, _for_model(method, "/m/b")) <= {"new", "starting"}
        assert offered(replicas[:1], _for_model(method, "/m/b")) == {"old"}
        assert offered(replicas, _for_model(method, "/m/a")) <= {"old", "starting"}  # an old Ingress's


@pytest.mark.parametrize("name", ["SpeculationGateRouter", "PowerOfTwoRouter"])
def test_a_router_whose_class_serve_shipped_by_value_is_counted_too(name):
    """Serve ships the router class to the Ingress by value (cloudpickle): its methods read a
    copy of the module's globals, and a router registered there was one the Ingress never saw
    (found when the failed-build test did not pass). Loaded in a fresh process, as there."""
    from ray import cloudpickle

    from deploy import router as module

    cloudpickle.register_pickle_by_value(module)
    try:
        shipped = cloudpickle.dumps(getattr(module, name))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    script = (
        "import sys; from ray import cloudpickle; from deploy import router; "
        "from tests.deploy.test_router import _built; "
        f"cls = cloudpickle.loads(sys.stdin.buffer.read()); assert cls is not router.{name}; "
        "kept = _built(cls, 'shipped', 3); print(router.routable_replicas('shipped'))")
    done = subprocess.run([sys.executable, "-c", script], input=shipped, capture_output=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.decode().split() == ["3"], done.stderr.decode()[-2000:]


def _pending(method="generate", age_s=0.0, prompt="hi"):
    # Serve's PendingRequest: the call's positional args (Replica.generate's GenerationRequest) and kwargs
    request = GenerationRequest(request_id="r", prompt=prompt, sampling=SamplingParams())
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=[request], kwargs={},
                           created_at=time.time() - age_s, routing_context=SimpleNamespace(should_backoff=False))


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


# A replica whose engine does not gate by batch size reports batch_gate 0 (stats.NOT_GATED):
# the TensorRT-LLM modes that keep drafting at every batch size (speculating 1) and speculation
# off (speculating 0). The ranking rule's other tables are in tests/speculation/test_ranking.py.
NOT_GATED_ROUTING = [
    # (name, stats by replica, expected order, request marked non-speculative)
    ("a gated replica with room beats an idle ungated one",
     {"ungated": {"batch_size": 0, "batch_gate": 0, "speculating": 1, "acceptance_length": 4.0},
      "gated": {"batch_size": 3, "batch_gate": 4, "speculating": 1, "acceptance_length": 2.0}},
     ["gated", "ungated"], False),
    ("ungated replicas rank by load, like those over their gate",
     {"over": {"batch_size": 6, "batch_gate": 4, "speculating": 0},
      "ungated": {"batch_size": 5, "batch_gate": 0, "speculating": 1}},
     ["ungated", "over"], False),
    ("an ungated replica that speculates keeps requests speculative",
     {"ungated": {"batch_size": 40, "batch_gate": 0, "speculating": 1}}, ["ungated"], False),
    ("an ungated replica that does not speculate is no reason to keep them",
     {"off": {"batch_size": 1, "batch_gate": 0, "speculating": 0},
      "over": {"batch_size": 4, "batch_gate": 4, "speculating": 0}}, ["off", "over"], True),
]


@pytest.mark.parametrize("name,stats,order,marked", NOT_GATED_ROUTING, ids=[row[0] for row in NOT_GATED_ROUTING])
def test_a_replica_that_does_not_gate_is_never_under_its_gate(name, stats, order, marked):
    router, replicas = _router_with_replicas(stats)
    router.initialize_state(gate_hold_s=5.0, gate_hold_min_acceptance=1.0)
    pending = _pending()
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert [rank[0].replica_id.unique_id for rank in ranks] == order
    assert pending.kwargs == ({"speculate": False} if marked else {})


def test_no_request_waits_for_a_gate_nobody_has():
    loads = [ReplicaLoad.from_stats("off", {"batch_size": 9, "batch_gate": 0, "speculating": 0,
                                            "acceptance_length": 3.0})]
    assert all_above_gate(loads) and not hold_at_gate(loads, waited_s=0.1, hold_s=5.0, min_acceptance=1.0)


def test_prompts_that_start_alike_go_to_one_replica_while_it_has_room():
    stats = {rid: {"batch_size": 1, "batch_gate": 4, "acceptance_length": 2.0} for rid in ("a", "b", "c")}
    router, replicas = _router_with_replicas(stats)
    router.initialize_state(prefix_affinity_chars=64)
    # a prefix whose replica is not the first: the gate rule alone (ties in input order) picks "a"
    turn1 = next(text for text in (f"system {i}: you edit code. " * 4 + "user: rename x" for i in range(50))
                 if preferred_replica(prefix_key(text, 64), ["a", "b", "c"]) != "a")
    turn2 = turn1 + " assistant: done. user: now rename y"
    home = preferred_replica(prefix_key(turn1, 64), ["a", "b", "c"])
    for prompt in (turn1, turn2):
        ranks = asyncio.run(router.choose_replicas(replicas, _pending(prompt=prompt)))
        assert ranks[0][0].replica_id.unique_id == home

    busy = {**stats, home: {"batch_size": 4, "batch_gate": 4, "acceptance_length": 2.0}}  # at its gate
    router, replicas = _router_with_replicas(busy)
    router.initialize_state(prefix_affinity_chars=64)
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(prompt=turn2)))
    assert ranks[0][0].replica_id.unique_id != home

    router, replicas = _router_with_replicas(stats)
    router.initialize_state(prefix_affinity_chars=0)  # off: the gate rule alone (ties keep input order)
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(prompt=turn2)))
    assert [r[0].replica_id.unique_id for r in ranks] == ["a", "b", "c"]


def test_a_chats_turns_go_where_their_conversation_key_prefers():
    stats = {rid: {"batch_size": 1, "batch_gate": 4, "acceptance_length": 2.0} for rid in ("a", "b", "c")}
    router, replicas = _router_with_replicas(stats)
    router.initialize_state(prefix_affinity_chars=64)
    homes = set()
    for key in (b"chat:one", b"chat:two", b"chat:three"):
        home = preferred_replica(key, ["a", "b", "c"])
        homes.add(home)
        for prompt in ("hi", "hi there, a longer second turn " * 4):  # short, and past the prefix key
            pending = _pending(prompt=prompt)
            pending.args[0] = dataclasses.replace(pending.args[0], affinity_key=key)
            assert asyncio.run(router.choose_replicas(replicas, pending))[0][0].replica_id.unique_id == home
    assert len(homes) > 1


def test_importing_the_router_does_not_import_torch():
    code = ("import sys, deploy.router; "
            "bad = [m for m in ('torch', 'transformers', 'replicas.speculation._sa_native') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
