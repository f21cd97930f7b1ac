"""The speculation-gate request router: a thin Serve adapter over `replicas/speculation/ranking.py`.

Configured on the Replica deployment as
`request_router_config: {request_router_class: "deploy.router:SpeculationGateRouter"}`.
Each routing attempt reads every candidate's last `record_routing_stats()` (one period
stale) and Serve's live queue-length cache, ranks them with `rank_replicas`, and returns
one replica per rank so Serve tries them best first (skipping full ones). While every
candidate is at its gate and speculation pays, a `generate` call is held (no candidates:
Serve backs off and asks again) for up to `gate_hold_s`; one routed over a gate after
that gets `speculate=False`. A `generate` call's prompt also names a preferred replica, the
one most likely to hold its prefix in cache (`replicas/speculation/affinity.py`), which
goes first unless it is over its gate or busier than the others. `request_router_kwargs`
(`initialize_state`): `gate_hold_s`, `gate_hold_min_acceptance`, `prefix_affinity_chars`,
`prefix_affinity_max_extra_load` (deploy.yaml's `replica:` section sets them).
`PowerOfTwoRouter` is what `gate_router: false` routes with: Serve's default rule (same node,
then same zone, first; two replicas at random, the less busy one), counted by
`routable_replicas` as the gate router is. Both send a request to Replicas of the model it
was tokenized for where any runs (`of_the_requested_model`: a deploy changing the model runs
both for a while).

Imports Ray's router API, the ranking and affinity rules and the stats names only: never torch.
"""

from __future__ import annotations

import random
import time
import weakref
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from replicas.speculation.affinity import AFFINITY_MAX_EXTRA_LOAD, AFFINITY_PREFIX_CHARS, prefix_key, rank_with_affinity
from replicas.speculation.ranking import (
    GATE_HOLD_MIN_ACCEPTANCE,
    GATE_HOLD_S,
    ReplicaLoad,
    all_above_gate,
    hold_at_gate,
)
from replicas.stats import MODEL_IDENTITY

GENERATE_METHOD = "generate"  # Replica.generate
TOKENIZER_METHOD = "tokenizer"  # Replica.tokenizer, given the model identity it must serve
SPECULATE_KWARG = "speculate"  # Replica.generate's keyword that narrows a request to no speculation

_ROUTERS: "weakref.WeakSet[CountedRouter]" = weakref.WeakSet()  # this process's, as built


def routable_replicas(app_name: str, model: Optional[str] = None) -> Optional[int]:
    """How many Replicas of `app_name` this process's routers can send to: those Serve's
    controller tells them run, whatever the application's status lists (a deploy whose build
    failed lists none while the version before it serves on); of them, with `model`, those
    that serve it or have not said yet. None: none of ours built here (no call made yet)."""
    counts = [sum(_serves(r, model) for r in list(router.curr_replicas.values()))
              for router in list(_ROUTERS) if router.app_name == app_name]
    return max(counts) if counts else None


def _serves(replica: RunningReplica, model: Optional[str]) -> bool:
    return model is None or (replica.routing_stats or {}).get(MODEL_IDENTITY, model) == model


def requested_model(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The model identity a `generate` call's request was tokenized for, or a `tokenizer` call
    asks for; None: any model."""
    if pending_request is None or not pending_request.args:
        return None
    method, first = pending_request.metadata.call_method, pending_request.args[0]
    if method == GENERATE_METHOD:
        return getattr(first, "model_identity", None)
    return first if method == TOKENIZER_METHOD and isinstance(first, str) else None


def of_the_requested_model(candidates: List[RunningReplica],
                           pending_request: Optional[PendingRequest]) -> List[RunningReplica]:
    """The candidates serving the model the call asks for, or not saying yet (no routing stats
    reported); all of them where none does: each refuses it, and the Ingress asks again until
    its deadline (a model that cannot load must not hold requests without end)."""
    model = requested_model(pending_request)
    if model is None:
        return candidates
    kept = [r for r in candidates if _serves(r, model)]
    return kept or candidates


class CountedRouter(RequestRouter):
    """A router `routable_replicas` counts."""

    def initialize_state(self, **kwargs) -> None:
        # Serve ships the class to the Ingress by value (cloudpickle): its methods read a copy
        # of this module's globals, so the registry is the one of the module imported here
        from deploy import router

        router._ROUTERS.add(self)


class PowerOfTwoRouter(FIFOMixin, LocalityMixin, CountedRouter):
    """Serve's default rule: the same node, then the same zone, first (where Serve's settings
    say so), then two replicas at random; Serve sends to the less busy one."""

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:  # also asks Serve to back off once every replica was offered
            local = self.apply_locality_routing(pending_request)
            candidate_replicas = [r for r in candidate_replicas if r.replica_id in local]
        candidates = of_the_requested_model(candidate_replicas, pending_request)
        return [random.sample(candidates, min(2, len(candidates)))] if candidates else []


class SpeculationGateRouter(CountedRouter):
    """Requests go where speculation is still on; when it is on nowhere, they say so.

    No FIFOMixin on purpose: Serve then hands the chosen replica to exactly the request
    being routed, so the `speculate` flag set here travels with the right request.
    """

    gate_hold_s: float = GATE_HOLD_S
    gate_hold_min_acceptance: float = GATE_HOLD_MIN_ACCEPTANCE
    prefix_affinity_chars: int = AFFINITY_PREFIX_CHARS
    prefix_affinity_max_extra_load: int = AFFINITY_MAX_EXTRA_LOAD
    sole_router: bool = False

    def initialize_state(self, gate_hold_s: float = GATE_HOLD_S,
                         gate_hold_min_acceptance: float = GATE_HOLD_MIN_ACCEPTANCE,
                         prefix_affinity_chars: int = AFFINITY_PREFIX_CHARS,
                         prefix_affinity_max_extra_load: int = AFFINITY_MAX_EXTRA_LOAD,
                         sole_router: bool = False) -> None:
        """`sole_router`: the application's one Ingress holds the only router of its Replicas,
        so Serve's live count of a Replica's requests is the whole count (`ReplicaLoad.load`)."""
        super().initialize_state()
        self.gate_hold_s = float(gate_hold_s)
        self.gate_hold_min_acceptance = float(gate_hold_min_acceptance)
        self.prefix_affinity_chars = int(prefix_affinity_chars)
        self.prefix_affinity_max_extra_load = int(prefix_affinity_max_extra_load)
        self.sole_router = bool(sole_router)

    def affinity_key(self, pending_request: PendingRequest) -> Optional[bytes]:
        """The key of a `generate` call's request: its conversation's (a chat's), else its
        prompt's prefix (None: no affinity)."""
        request = pending_request.args[0] if pending_request.args else None
        prompt = getattr(request, "prompt", None)
        if not self.prefix_affinity_chars or not prompt:
            return None
        return getattr(request, "affinity_key", None) or prefix_key(prompt, self.prefix_affinity_chars)

    def replica_loads(self, candidates: List[RunningReplica]) -> List[ReplicaLoad]:
        cache = self.replica_queue_len_cache
        return [
            ReplicaLoad.from_stats(r.replica_id.unique_id, r.routing_stats or {}, cache.get(r.replica_id),
                                   self.sole_router)
            for r in candidates
        ]

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        candidate_replicas = of_the_requested_model(candidate_replicas, pending_request)
        if not candidate_replicas:
            return []
        loads = self.replica_loads(candidate_replicas)
        key = None
        if pending_request is not None:
            # No locality pass here: every answer is the full set, so Serve must back off
            # between attempts (its default, False, means "retry at once": a busy loop).
            pending_request.routing_context.should_backoff = True
        if pending_request is not None and pending_request.metadata.call_method == GENERATE_METHOD:
            waited_s = time.time() - pending_request.created_at
            if hold_at_gate(loads, waited_s, self.gate_hold_s, self.gate_hold_min_acceptance):
                return []
            if all_above_gate(loads):
                pending_request.kwargs[SPECULATE_KWARG] = False
            else:  # a retried request may have been marked on an earlier attempt
                pending_request.kwargs.pop(SPECULATE_KWARG, None)
            key = self.affinity_key(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = rank_with_affinity(loads, key, self.prefix_affinity_max_extra_load)
        return [[by_id[load.replica_id]] for load in ranked]
