"""A real Serve application on CPU scales 1 -> 2 replicas under load and back to 1 after.

deploy.yaml's document goes through Serve's own config path (`deploy_apps`, so the
Replica's `autoscaling_config` override with our policy is applied exactly as `serve deploy`
applies it), with two changes for a test: the fake engine (tests/deploy/fakes.py, a token
every 50 ms for "SLOW" prompts, acceptance length 2.0) in place of the model, and delays
of seconds instead of minutes, and a spreading threshold under the fake's acceptance.
The replicas' autoscaling metrics are pushed every 0.5 s.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from tests.polling import wait_until
from tests.serve_support import deploy_config, local_serve

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.ray  # a local Ray cluster with Serve (fake engine, not the model)

REPO = Path(__file__).resolve().parents[2]
APP = "specserve"
PUSH_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
            "RAY_AUTH_MODE": "disabled"}
# Two gates' worth (user_config batch_gate 4): spreading wants 2 replicas. Serve's default
# policy (and ours without the replicas' metrics) wants ceil(8 / target_ongoing_requests 8)
# = 1, so reaching 2 shows the policy ran on the replicas' acceptance and gate reports.
CONCURRENCY = 8


def scaled_document() -> dict:
    doc = yaml.safe_load((REPO / "deploy.yaml").read_text())
    doc.pop("http_options"), doc.pop("proxy_location")
    app = doc["applications"][0]
    app["import_path"] = "tests.autoscaling.serve_app:build_fake_app"
    app["args"]["replica"].update(num_cpus=0.5, health_check_period_s=5)
    replica = next(d for d in app["deployments"] if d["name"] == "Replica")
    auto = replica["autoscaling_config"]
    assert auto["policy"]["policy_function"] == "autoscaling.policy:AcceptanceAwarePolicy"
    auto.update(look_back_period_s=2, upscale_delay_s=1, downscale_delay_s=3, max_replicas=2, min_replicas=1)
    # The fake engine reports acceptance 2.0: below the policy's default threshold, so lower it.
    auto["policy"]["policy_kwargs"] = {"min_acceptance_length": 1.5}
    assert auto["target_ongoing_requests"] >= CONCURRENCY  # the default policy would stay at 1
    assert replica["user_config"]["batch_gate"] * 2 == CONCURRENCY
    return doc


@pytest.fixture(scope="module")
def serve_url():
    with local_serve(PUSH_ENV) as url:
        yield url


def _deploy(doc: dict) -> None:
    deploy_config(doc, APP, timeout_s=120)


def _running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["Replica"]
    return status.replica_states.get("RUNNING", 0)


class Load:
    """CONCURRENCY clients, each sending slow completions back to back until stopped."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.completed, self.errors = 0, []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CONCURRENCY)]

    def _client(self) -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(200):  # bounded: at most 200 requests per client
                if self.stop.is_set():
                    return
                try:
                    r = client.post(f"{self.url}/v1/completions",
                                    json={"model": self.model, "prompt": "SLOW load", "max_tokens": 40})
                    r.raise_for_status()
                    self.completed += 1
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(exc))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_scales_out_under_load_and_back_in(serve_url):
    doc = scaled_document()
    _deploy(doc)
    assert _running_replicas() == 1
    model = doc["applications"][0]["args"]["engine"]["model"]
    with Load(serve_url, model) as load:
        assert wait_until(lambda: _running_replicas() >= 2, 60, interval_s=0.5), \
            f"no second replica under load; running replicas: {_running_replicas()}"
    assert load.completed > 0 and not load.errors, load.errors[:3]
    assert wait_until(lambda: _running_replicas() == 1, 60, interval_s=0.5), \
        f"no scale-in after the load; running replicas: {_running_replicas()}"
