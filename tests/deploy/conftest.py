"""One real Serve cluster per test module, on 127.0.0.1, HTTP included.

A module sets `SERVE_ENV = {...}` to give the cluster's workers extra environment
variables (e.g. API keys); the cluster is torn down at the end of the module.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(request):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "RAY_AUTH_MODE": "disabled", **getattr(request.module, "SERVE_ENV", {})}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
