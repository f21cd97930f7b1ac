"""Shared by the tests that run a real Serve cluster or walk a Serve config document."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

from benchmarks.machine import free_port
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[1]
DEPLOY_YAML = REPO / "deploy.yaml"
APP = "specserve"  # deploy.yaml's application


def _worker_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for Ray's workers, with this checkout importable."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def local_serve(extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A one-module Ray cluster with Serve's HTTP proxy on 127.0.0.1; yields its base URL.

    `extra_env` reaches the raylet (through this process's environment, restored when the
    cluster is torn down, so one module's settings never leak into the next cluster) and
    every worker. Its Prometheus metrics are at `metrics_url()`, reported every second.
    """
    env = {"RAY_AUTH_MODE": "disabled", **(extra_env or {})}
    with mock.patch.dict(os.environ, env):
        import ray
        from ray import serve

        ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": _worker_env(env)},
                 log_to_driver=False, _metrics_export_port=free_port(),
                 _system_config={"metrics_report_interval_ms": 1000})
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


def metrics_url() -> str:
    """The Prometheus endpoint of the running cluster's head node."""
    import ray

    head = next(node for node in ray.nodes() if node["Alive"] and node.get("MetricsExportPort"))
    return f"http://127.0.0.1:{head['MetricsExportPort']}/metrics"


@contextlib.contextmanager
def local_cluster(num_workers: int, worker_cpus: int = 1,
                  extra_env: dict[str, str] | None = None) -> Iterator[tuple[Any, str]]:
    """A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per
    node) with Serve's proxy on the head at 127.0.0.1; yields (cluster, base URL).

    The head has no CPU, so every CPU-reserving actor (a Replica) lands on a worker node, one
    per worker at `worker_cpus: 1`. Build it from the main thread: Ray adds and removes nodes
    only there.
    """
    env = {"RAY_AUTH_MODE": "disabled", **(extra_env or {})}
    with mock.patch.dict(os.environ, env):
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        try:
            for _ in range(num_workers):
                cluster.add_node(num_cpus=worker_cpus)
            ray.init(address=cluster.address, runtime_env={"env_vars": _worker_env(env)}, log_to_driver=False)
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
            yield cluster, f"http://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


def live_actors(class_suffix: str) -> list[dict]:
    """Ray's records of the alive actors whose class name ends with `class_suffix` (e.g.
    ":Replica"), on nodes Ray still counts alive (a killed node does until its heartbeats
    time out): ActorID, Pid, Address.NodeID."""
    import ray

    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return [a for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_suffix) and a["Address"]["NodeID"] in alive]


def replica_and_node(cluster: Any) -> tuple[dict, Any]:
    """A live Replica actor's record and the `cluster` worker node holding it."""
    replica = live_actors(":Replica")[0]
    return replica, next(n for n in cluster.worker_nodes if n.node_id == replica["Address"]["NodeID"])


def drain_node(cluster: Any, node: Any, deadline_s: float, why: str) -> None:
    """Ask Ray to drain `node` as KubeRay's autoscaler does before taking a preemptible pod:
    reason PREEMPTION, the node going `deadline_s` from now."""
    import ray
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, refusal = ray._raylet.GcsClient(address=cluster.address).drain_node(
        node.node_id, reason, why, int((time.time() + deadline_s) * 1000))
    if not accepted:
        raise RuntimeError(f"drain refused: {refusal}")


def replicas_serving(app: str, count: int, lost_actor: str = "") -> bool:
    """`count` Replicas of `app` run, none of them the actor `lost_actor` (a lost one Ray
    has not noticed yet)."""
    from ray import serve

    states = serve.status().applications[app].deployments["Replica"].replica_states
    live = [a for a in live_actors(":Replica") if a["ActorID"] != lost_actor]
    return states.get("RUNNING", 0) == count and sum(states.values()) == count and len(live) == count


def deploy_config(document: dict, app: str, timeout_s: float) -> None:
    """Deploy a Serve config document the way `serve deploy` does; wait until it runs."""
    from ray import serve
    # No public Python API deploys a config document (`serve deploy` goes through the dashboard).
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(document), _blocking=False)

    def running() -> bool:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(status.message)
        return status is not None and status.status == "RUNNING"

    if not wait_until(running, timeout_s, interval_s=0.5):
        raise TimeoutError(f"{app} did not become RUNNING in {timeout_s:.0f} s")


def embedded_config(batch_gate: int = 4, **engine) -> dict:
    """deploy.yaml's document with one replica, sized for a 2-core test machine; `engine`
    overrides its engine settings."""
    import yaml

    doc = yaml.safe_load(DEPLOY_YAML.read_text())
    doc.pop("http_options"), doc.pop("proxy_location")  # the fixture's cluster owns HTTP
    args = doc["applications"][0]["args"]
    args["engine"].update({"max_batch_size": 8, "max_seq_len": 1024, "num_threads": 1, "mtp_weights": None, **engine})
    replica = next(d for d in doc["applications"][0]["deployments"] if d["name"] == "Replica")
    replica["user_config"]["batch_gate"] = batch_gate
    replica.pop("autoscaling_config", None)  # one replica: these tests are about one engine
    args["replica"].update(num_cpus=1, health_check_period_s=5)
    return doc


def dict_paths(node, path=()):
    """Every mapping in a document, as a path of keys and list indices."""
    if isinstance(node, dict):
        yield path
        for key, value in node.items():
            yield from dict_paths(value, path + (key,))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from dict_paths(item, path + (i,))
