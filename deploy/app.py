"""`build_app(args)`: the Serve application `serve run deploy.yaml` imports.

Three deployments: `Ingress` (HTTP, OpenAI API, tokenization, limits) -> `Replica` (one
engine each, routed by the speculation-gate router), and `ResponseStore` (the responses
`/v1/responses` keeps, one replica on the head node). The speculation settings are the
Replica's `user_config` (deploy.yaml's `deployments: - name: Replica`; the defaults when the
file sets none): the replica builds its engine with them, and changing them in deploy.yaml
(or through the Serve REST API) reconfigures live replicas without a restart.

No `from __future__ import annotations` here: Serve validates `args` into `AppArgs` by
reading the builder's annotation, which must be the class itself, not a string.
"""

import dataclasses
from typing import Callable

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deploy.config import AppArgs, IngressConfig
from deploy.engine_factory import engine_factory
from deploy.routes import HttpIngress
from deploy.response_store import ResponseStore
from replicas.engine import Engine, SpeculationConfig
from replicas.replica import DEPLOYMENT_NAME, Replica

ROUTER_CLASS = "deploy.router:SpeculationGateRouter"
PLAIN_ROUTER_CLASS = "deploy.router:PowerOfTwoRouter"  # `gate_router: false`
INGRESS_MAX_ONGOING_REQUESTS = 1000  # the ingress only waits on replicas; it must not throttle
# Ray's resource on the head node alone (ray._common.constants.HEAD_NODE_RESOURCE_NAME): a
# sliver of it pins an actor there.
ON_HEAD_NODE = {"node:__internal_head__": 0.001}


def replica_deployment(args: AppArgs, speculation: SpeculationConfig = SpeculationConfig()):
    """The Replica deployment with its Serve options (sizing, router, health checks);
    `speculation` is its default `user_config`, which a config file's replaces."""
    opts = args.replica
    router = RequestRouterConfig(request_router_class=PLAIN_ROUTER_CLASS,
                                 request_routing_stats_period_s=opts.routing_stats_period_s)
    if opts.gate_router:
        router = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                     request_router_kwargs={
                                         "gate_hold_s": opts.gate_hold_s,
                                         "gate_hold_min_acceptance": opts.gate_hold_min_acceptance,
                                         "prefix_affinity_chars": opts.prefix_affinity_chars,
                                         "prefix_affinity_max_extra_load": opts.prefix_affinity_max_extra_load,
                                         "sole_router": args.ingress_replicas == 1},
                                     request_routing_stats_period_s=opts.routing_stats_period_s)
    return serve.deployment(Replica).options(
        name=DEPLOYMENT_NAME,
        num_replicas=opts.num_replicas,
        # The engine batches: admit a full batch plus a batch waiting, queue the rest in
        # Serve (bounded by max_queued_requests, then 503 + Retry-After).
        max_ongoing_requests=opts.max_ongoing_requests or 2 * args.engine.max_batch_size,
        max_queued_requests=opts.max_queued_requests,
        user_config=dataclasses.asdict(speculation),
        ray_actor_options={"num_cpus": opts.num_cpus, "num_gpus": opts.num_gpus},
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=opts.health_check_timeout_s,
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s,
        request_router_config=router,
    )


def ingress_deployment(args: AppArgs):
    """The HTTP deployment. A stream's client connection is held by a proxy and its replica
    work by the Ingress the proxy picked: on the head (`ingress_placement: head`) that Ingress
    dies only with the head, whose proxy and controller the cluster cannot lose anyway."""
    placement = {"resources": ON_HEAD_NODE} if args.ingress_placement == "head" else {}
    return serve.deployment(serve.ingress()(HttpIngress)).options(
        name="Ingress",
        num_replicas=args.ingress_replicas,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0, **placement},
    )


def response_store_deployment():
    """The kept responses: one replica, on the head node, which a cluster that loses its head
    loses whole anyway (what it keeps is state the Ingress replicas share)."""
    return serve.deployment(ResponseStore).options(
        name="ResponseStore",
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0, "resources": ON_HEAD_NODE},
    )


def compose_app(args: AppArgs, factory: Callable[[SpeculationConfig], Engine],
                speculation: SpeculationConfig = SpeculationConfig()) -> Application:
    """Ingress.bind(Replica.bind(factory), ResponseStore.bind(...)): the application around any engine."""
    replica = replica_deployment(args, speculation).bind(factory, model_identity=args.engine.identity)
    store = response_store_deployment().bind(args.limits.stored_responses)
    return ingress_deployment(args).bind(replica, store, IngressConfig.from_args(args))


def build_app(args: AppArgs) -> Application:
    """The application `deploy.yaml` names; `args` is its `args:` (validated strictly)."""
    if not isinstance(args, AppArgs):  # called directly with a dict
        args = AppArgs.model_validate(args)
    return compose_app(args, engine_factory(args.engine))
