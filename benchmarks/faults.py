"""Failures under load: what a replica's or a node's loss costs the clients, with the real engine.

A three-worker Ray cluster on this machine (`ray.cluster_utils.Cluster`, as in
tests/deploy/test_faults.py), the embedded model in two 1-CPU Replicas on two workers (the
third spare for Serve's replacement), the Ingress on the head (`ingress_placement: head`), and
a streaming load of greedy completions. First an undisturbed run gives each prompt's
reference text; then, for each scenario, the same load is started and, once every stream has
its first tokens, a Replica's process is killed, its worker node is killed, or its node is
drained through Ray's drain API (what KubeRay's autoscaler calls); 0.5 s later two more
requests arrive, while the router may still list the lost Replica. Reported per scenario:
requests in flight, lost (no whole answer), sent again before their first token (retried) and
resumed mid-stream (the Ingress's `ray_request_retries_total{kind}`), whether every answer
equals its reference, the longest extra wait for a token (a stream's longest wait between two
tokens beyond its median one: a resume's cost), and the time from the fault until two Replicas serve again.

    make bench-faults            # writes benchmarks/results/faults.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import metrics, ray_name  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from deploy.app import compose_app  # noqa: E402
from deploy.config import AppArgs  # noqa: E402
from deploy.engine_factory import engine_factory  # noqa: E402
from replicas.stats import METRIC_RETRIES  # noqa: E402
from tests.polling import wait_until  # noqa: E402
from tests.serve_support import drain_node, local_cluster, replica_and_node, replicas_serving  # noqa: E402
from tests.stream_load import StreamLoad, StreamRecord  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
APP = "faults"
MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step and at length, how a compiler turns source code into machine code.",
    "Describe a walk through a busy market in a city you love, in great detail.",
    "Write a detailed guide to planting and caring for a vegetable garden.",
]
SCENARIOS = ("replica process killed", "worker node killed", "worker node drained")


def _retries(metrics_url: str) -> dict[str, float]:
    """The Ingress's counter by kind (retry / resume), as its node exports it."""
    totals = metrics(metrics_url)
    return {kind: totals.get(f"{ray_name(METRIC_RETRIES)}{{kind={kind}}}", 0.0) for kind in ("retry", "resume")}


def _settled_retries(metrics_url: str, quiet_s: float = 6.0, timeout_s: float = 40.0) -> dict[str, float]:
    """The counter once it stopped moving (Ray exports application metrics every few seconds)."""
    last, since, deadline = _retries(metrics_url), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _retries(metrics_url)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def _extra_latency_s(record: StreamRecord) -> float:
    """The longest wait between two tokens beyond the stream's median one (a resumed stream's
    extra latency; in an undisturbed stream, other requests' prefills)."""
    times = record.token_times_s
    gaps = [b - a for a, b in zip(times, times[1:])]
    return max(gaps) - statistics.median(gaps) if len(gaps) > 1 else 0.0


def _fault(name: str, cluster: Any, drain_deadline_s: float) -> tuple[str, Callable[[], None]]:
    """(the Replica actor it hits, the action of one scenario on its process or node)."""
    replica, node = replica_and_node(cluster)
    if name == "replica process killed":
        return replica["ActorID"], lambda: os.kill(replica["Pid"], signal.SIGKILL)
    if name == "worker node killed":
        return replica["ActorID"], lambda: cluster.remove_node(node, allow_graceful=False)
    return replica["ActorID"], lambda: drain_node(cluster, node, drain_deadline_s, "benchmark drain")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    config = AppArgs(
        engine={"max_batch_size": 4, "max_seq_len": 1024, "num_threads": 1},
        limits={"max_tokens": args.max_tokens},
        replica={"num_cpus": 1, "num_replicas": 2, "max_ongoing_requests": len(PROMPTS) // 2,
                 "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s},
    )
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
              for p in PROMPTS]
    results: dict[str, Any] = {"cpu": cpu_description(), "streams": len(bodies), "max_tokens": args.max_tokens,
                               "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s, "scenarios": []}
    with local_cluster(num_workers=3) as (cluster, url):
        metrics_url = f"http://127.0.0.1:{cluster.head_node.metrics_export_port}/metrics"
        serve.run(compose_app(config, engine_factory(config.engine)), name=APP, route_prefix="/")
        reference = StreamLoad(url, bodies, timeout_s=600).start().join(600)
        if any(r.lost for r in reference):
            raise RuntimeError(f"the undisturbed run lost requests: {[r.error for r in reference if r.lost]}")
        texts = [r.text for r in reference]
        results["undisturbed"] = {"seconds": max(r.token_times_s[-1] - r.started_s for r in reference),
                                  "extra_latency_s": [round(_extra_latency_s(r), 3) for r in reference]}
        print(f"undisturbed: {results['undisturbed']['seconds']:.1f} s for {len(bodies)} streams", flush=True)
        for name in SCENARIOS:
            if not wait_until(lambda: replicas_serving(APP, 2), 180, interval_s=0.5):
                raise RuntimeError("the app did not come back to two Replicas")
            before = _settled_retries(metrics_url)
            victim, fault = _fault(name, cluster, args.drain_deadline_s)
            load = StreamLoad(url, bodies, timeout_s=600).start()
            if not load.wait_tokens(args.tokens_before_fault, 120):
                raise RuntimeError("the streams did not start")
            fault_at = time.monotonic()
            fault()
            time.sleep(args.late_after_s)  # requests that arrive while the router may still list the lost Replica
            late = StreamLoad(url, bodies[:args.late_streams], timeout_s=600).start()
            hit = load.join(600)
            records = hit + late.join(600)
            recovered = wait_until(lambda: replicas_serving(APP, 2, victim), 180, interval_s=0.2)
            capacity_s = time.monotonic() - fault_at if recovered else None
            after = _settled_retries(metrics_url)
            row = {
                "scenario": name,  # in flight: streams the fault found unfinished (a token after it, or lost)
                "in_flight": sum(r.lost or bool(r.token_times_s and r.token_times_s[-1] > fault_at) for r in hit),
                "streams": len(records), "late": args.late_streams,
                "lost": sum(r.lost for r in records),
                "retried": after["retry"] - before["retry"],
                "resumed": after["resume"] - before["resume"],
                "identical_to_undisturbed": sum(r.text == t for r, t in zip(records, texts + texts)),
                "extra_latency_s": [round(_extra_latency_s(r), 3) for r in records],
                "full_capacity_after_s": capacity_s,
                "timeline": [{"t_s": [round(t - fault_at, 3) for t in r.token_times_s], "lost": r.lost,
                              "error": r.error} for r in records],
            }
            results["scenarios"].append(row)
            if not row["in_flight"]:
                raise RuntimeError(f"{name}: every stream had ended before the fault: raise --max-tokens")
            if name == SCENARIOS[0] and not row["lost"] and not row["retried"] + row["resumed"]:
                # the killed Replica most likely held some of the streams: each lost, retried or resumed
                row["warning"] = (f"{ray_name(METRIC_RETRIES)} did not move and no stream was lost: the killed "
                                  f"Replica held none, or the counter is not exported where {metrics_url} reads")
                print(f"WARNING: {name}: {row['warning']}", flush=True)
            print(f"{name}: lost {row['lost']}/{len(records)}, retried {row['retried']:.0f}, "
                  f"resumed {row['resumed']:.0f}, identical {row['identical_to_undisturbed']}, "
                  f"extra latency {row['extra_latency_s']}, capacity after {capacity_s}", flush=True)
            while len(cluster.worker_nodes) < 3:
                cluster.add_node(num_cpus=1)
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| scenario | in flight + after | lost | retried | resumed | identical to undisturbed | "
             "longest extra wait for a token | full capacity after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             f"| none (reference) | {results['streams']} + 0 | 0 | 0 | 0 | - | "
             f"{max(results['undisturbed']['extra_latency_s']):.2f} s | - |"]
    for row in results["scenarios"]:
        extra = max(row["extra_latency_s"], default=0.0)
        capacity = row["full_capacity_after_s"]
        total = row.get("streams", row["in_flight"] + row["late"])  # (results written before "streams")
        lines.append(f"| {row['scenario']} | {row['in_flight']} + {row['late']} | {row['lost']} | {row['retried']:.0f} | "
                     f"{row['resumed']:.0f} | {row['identical_to_undisturbed']}/{total} | "
                     f"{extra:.2f} s | {'-' if capacity is None else f'{capacity:.1f} s'} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["scenarios"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), sharey=True)
    for ax, row in zip(axes, rows):
        for i, stream in enumerate(row["timeline"]):
            ax.plot(stream["t_s"], range(1, len(stream["t_s"]) + 1), label=f"stream {i}",
                    linestyle=":" if stream["lost"] else "-")
        ax.axvline(0, color="red", linewidth=1)
        capacity = row["full_capacity_after_s"]
        if capacity is not None:
            ax.axvline(capacity, color="green", linewidth=1, linestyle="--")
        ax.set_title(f"{row['scenario']}\nlost {row['lost']}, resumed {row['resumed']:.0f}")
        ax.set_xlabel("seconds since the fault (red); two Replicas again (green)")
    axes[0].set_ylabel("tokens the client received")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Faults under a streaming load, {results['cpu']['model']} ({results['cpu']['cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--tokens-before-fault", type=int, default=16)
    parser.add_argument("--late-streams", type=int, default=2, help="sent after the fault")
    parser.add_argument("--late-after-s", type=float, default=0.5)
    parser.add_argument("--graceful-shutdown-timeout-s", type=float, default=2.0)
    parser.add_argument("--drain-deadline-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = parser.parse_args()
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(table(results))


if __name__ == "__main__":
    main()
