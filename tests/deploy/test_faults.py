"""Replicas and nodes dying under a streaming load, on a real multi-node Ray cluster.

One `ray.cluster_utils.Cluster` for the module: a head with no CPU (Serve's controller, the
proxy on 127.0.0.1, the Ingress pinned there by `ingress_placement: head`) and three 1-CPU
worker nodes, two of them holding one Replica each and the third spare for Serve's
replacements. Each test streams 8 requests (4 per Replica: `max_ongoing_requests: 4`), kills
or drains what holds half of them mid-stream, and checks that every client got its whole
answer: status 200, no error event, `[DONE]`, every token once and in order. The fake engine's
tokens depend only on their position, so a lost, repeated or reordered token changes the text.
Afterwards the cluster is brought back to two Replicas on live nodes for the next test.
"""

from __future__ import annotations

import os
import signal

import pytest

from deploy.app import compose_app
from deploy.config import AppArgs
from tests.deploy.fakes import ALPHABET, FakeEngine
from tests.polling import wait_until
from tests.serve_support import drain_node, live_actors, local_cluster, replica_and_node, replicas_serving
from tests.stream_load import StreamLoad

pytestmark = pytest.mark.ray

APP = "faults"
STREAMS, PER_REPLICA = 8, 4
TOKENS = 100  # 5 s at the fake's 50 ms a token ("SLOW")
DRAIN_DEADLINE_S = 10


@pytest.fixture(scope="module")
def cluster_url():
    from ray import serve

    with local_cluster(num_workers=3) as (cluster, url):
        args = AppArgs(engine={"max_seq_len": 256}, served_model_name="fake", limits={"max_tokens": TOKENS},
                       replica={"num_cpus": 1, "num_replicas": 2, "max_ongoing_requests": PER_REPLICA,
                                "graceful_shutdown_timeout_s": 1, "health_check_period_s": 1})
        serve.run(compose_app(args, FakeEngine), name=APP, route_prefix="/")
        yield cluster, url


def _node_alive(node_id: str) -> bool:
    import ray

    return any(node["Alive"] for node in ray.nodes() if node["NodeID"] == node_id)


@pytest.fixture
def load(cluster_url):
    """The streams, started and each past its first tokens; afterwards, two Replicas again."""
    cluster, url = cluster_url
    assert wait_until(lambda: replicas_serving(APP, 2), 60), "the app did not (re)reach two running Replicas"
    streams = _streams(url, STREAMS)
    assert streams.wait_tokens(3, 30), "the streams did not start"
    yield streams
    if len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=1)


def _streams(url: str, count: int) -> StreamLoad:
    return StreamLoad(url, [{"model": "fake", "prompt": "SLOW", "max_tokens": TOKENS}] * count).start()


def _assert_nothing_lost(streams: StreamLoad) -> None:
    expected = [ALPHABET[i % len(ALPHABET)] for i in range(TOKENS)]
    records = streams.join(120)
    lost = [(r.status, r.error, r.done) for r in records if r.lost]
    assert not lost, f"{len(lost)} of {len(records)} streams lost: {lost}"
    for record in records:
        assert record.tokens == expected and record.text == "".join(expected)


def test_the_ingress_lives_on_the_head(cluster_url):
    """Every proxy reaches the Ingress on the head, so no worker's death can hold a stream."""
    cluster, _ = cluster_url
    ingresses = live_actors(":Ingress")
    assert ingresses and {a["Address"]["NodeID"] for a in ingresses} == {cluster.head_node.node_id}


def test_a_replica_process_killed(cluster_url, load):
    replica, _ = replica_and_node(cluster_url[0])
    os.kill(replica["Pid"], signal.SIGKILL)
    _assert_nothing_lost(load)


def test_a_replica_killed_under_streams_of_two_choices(cluster_url):
    """Each stream's two choices run as two engine requests; those on the killed Replica are
    resumed at once, each (routed one at a time) where the other left it."""
    cluster, url = cluster_url
    assert wait_until(lambda: replicas_serving(APP, 2), 60), "the app did not (re)reach two running Replicas"
    load = StreamLoad(url, [{"model": "fake", "prompt": "SLOW", "max_tokens": TOKENS, "n": 2}] * (STREAMS // 2)).start()
    assert load.wait_tokens(6, 30), "the streams did not start"
    replica, _ = replica_and_node(cluster)
    os.kill(replica["Pid"], signal.SIGKILL)
    expected = [ALPHABET[i % len(ALPHABET)] for i in range(TOKENS)]
    records = load.join(120)
    assert not [(r.status, r.error, r.done) for r in records if r.lost]
    assert all(record.choice_tokens == {0: expected, 1: expected} for record in records)


def test_a_worker_node_killed(cluster_url, load):
    """Also requests sent just after the node went, while the router still lists its Replica:
    sent to it, they are sent again before their first token."""
    cluster, url = cluster_url
    _, node = replica_and_node(cluster)
    cluster.remove_node(node, allow_graceful=False)
    late = _streams(url, STREAMS)
    _assert_nothing_lost(load)
    _assert_nothing_lost(late)
    assert wait_until(lambda: not _node_alive(node.node_id), 60), "Ray never noticed the node's death"


def test_a_worker_node_drained(cluster_url, load):
    """Ray's drain API, as KubeRay's autoscaler calls it before a pod goes: Serve starts a
    replacement on the spare node and stops the drained Replica; what that Replica cannot
    finish within its graceful_shutdown_timeout_s (1 s here, the streams need 5) is resumed
    elsewhere. At the deadline the node goes, as the cloud would take it."""
    cluster = cluster_url[0]
    _, node = replica_and_node(cluster)
    drain_node(cluster, node, DRAIN_DEADLINE_S, "test drain")
    _assert_nothing_lost(load)
    if not wait_until(lambda: not _node_alive(node.node_id), DRAIN_DEADLINE_S):
        cluster.remove_node(node)
