"""Shared by the tests that run a real Serve cluster or walk a Serve config document."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A one-module Ray cluster with Serve's HTTP proxy on 127.0.0.1; yields its base URL.

    `extra_env` reaches the raylet (through this process's environment) and every worker.
    """
    env = {"RAY_AUTH_MODE": "disabled", **(extra_env or {})}
    os.environ.update(env)
    import ray
    from ray import serve

    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy_config(document: dict, app: str, timeout_s: float) -> None:
    """Deploy a Serve config document the way `serve deploy` does; wait until it runs."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(document), _blocking=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(status.message)
        time.sleep(0.5)
    raise TimeoutError(f"{app} did not become RUNNING in {timeout_s:.0f} s")


def dict_paths(node, path=()):
    """Every mapping in a document, as a path of keys and list indices."""
    if isinstance(node, dict):
        yield path
        for key, value in node.items():
            yield from dict_paths(value, path + (key,))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from dict_paths(item, path + (i,))
