"""GPU check: `serve run deploy-gpu.yaml` on one GPU, proved by its own outputs and /metrics.

For a person with one H100 (80 GB) and the pinned TensorRT-LLM container (docs/trtllm.md,
"Checking the GPU path"). It starts the application in deploy-gpu.yaml on a local Ray
cluster, then:

1. sends greedy completions with speculation on (the server's user_config) and with the
   request narrowed off (`"speculation": {"mode": "off"}`; the TensorRT-LLM engine ignores
   a request's narrowing, so the check does not rely on it), then redeploys with
   `user_config.mode: off` (a fresh engine: TensorRT-LLM builds speculation in) and sends
   the same requests: every output must be identical;
2. reads drafted / accepted tokens and the acceptance length from Prometheus (`/metrics` of
   the Ray node, the `ray_spec_*` series);
3. runs a burst of concurrent requests past the configured batch gate (the router's gate
   hold is turned off for the check, so they all reach the engine), sampling /metrics, and
   checks the gate the replica reports against what the engine does: a replica that
   reports a gate must stop drafting above it, one that reports NOT_GATED (0) keeps drafting.

Prints a table, writes JSON (benchmarks/results/gpu_check.json) and exits 1 on any mismatch.
Standard library, PyYAML and Ray only (what the container has after `pip install ray[serve]`);
importing this module imports neither Ray nor TensorRT-LLM.

    PYTHONPATH=. RAY_AUTH_MODE=disabled python3 benchmarks/gpu_check.py [--config deploy-gpu.yaml]
        [--max-tokens 128] [--burst 24] [--burst-max-tokens 512] [--skip-off-deployment]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import free_port  # noqa: E402 - standard library only
from replicas.stats import (  # noqa: E402 - standard library only
    METRIC_ACCEPTED_TOKENS, METRIC_BATCH_SIZE, METRIC_DRAFT_TOKENS, METRIC_EMITTED_TOKENS, METRIC_GATE_OPEN,
    METRIC_VERIFY_STEPS, NOT_GATED,
)

APP = "specserve"
CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n" for i in range(12))
PROMPTS = {  # greedy completions: an edit the suffix automaton can copy, then open prose
    "code-edit": "Rewrite this file, renaming every `x` to `value`:\n\n" + CODE + "\nHere is the whole file:\n",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "list": "List the planets of the solar system with one fact about each.",
}


# -- pure parts (tests/test_gpu_check.py) -------------------------------------------------------
KEPT_LABELS = ("source", "kind")  # the draft source; the Ingress's retry or resume


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over its label sets}, and for each label in
    KEPT_LABELS, {name{label=value}: the sum over the sets carrying that value}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)  # comments never match
        if not match:
            continue
        name, labels, value = match.groups()
        totals[name] = totals.get(name, 0.0) + float(value)
        for label in KEPT_LABELS:
            found = re.search(rf'\b{label}="(\w+)"', labels or "")
            if found:
                key = f"{name}{{{label}={found.group(1)}}}"
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def ray_name(metric: str) -> str:
    """Ray prefixes every application metric with `ray_`."""
    return f"ray_{metric}"


def speculation_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Drafted and accepted tokens between two snapshots, and the acceptance length over them
    (tokens emitted per verify step, from their counters)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta(ray_name(METRIC_VERIFY_STEPS))
    return {
        "draft_tokens": delta(ray_name(METRIC_DRAFT_TOKENS)),
        "accepted_tokens": delta(ray_name(METRIC_ACCEPTED_TOKENS)),
        "verify_steps": steps,
        "acceptance_length": delta(ray_name(METRIC_EMITTED_TOKENS)) / steps if steps else 0.0,
    }


def gate_sample(snapshot: dict[str, float]) -> dict[str, float]:
    """What the gate check reads from one /metrics snapshot."""
    return {"batch_size": snapshot.get(ray_name(METRIC_BATCH_SIZE), 0.0),
            "gate_open": snapshot.get(ray_name(METRIC_GATE_OPEN), 0.0),
            "draft_tokens": snapshot.get(ray_name(METRIC_DRAFT_TOKENS), 0.0)}


def drafted_above(samples: list[dict[str, float]], batch_gate: int, min_run: int = 3) -> Optional[bool]:
    """Did draft tokens grow while the batch stayed above `batch_gate`? None: it never stayed
    there for `min_run` samples. Each run's first sample is skipped: metrics lag a report."""
    verdicts = []
    run: list[dict[str, float]] = []
    for sample in [*samples, {"batch_size": 0.0}]:
        if sample["batch_size"] > batch_gate:
            run.append(sample)
            continue
        if len(run) >= min_run:
            verdicts.append(run[-1]["draft_tokens"] > run[1]["draft_tokens"])
        run = []
    return any(verdicts) if verdicts else None


def gate_verdict(samples: list[dict[str, float]], reported_gate: int, configured_gate: int) -> dict[str, Any]:
    """Does the engine do what the gate it reports says? `ok` False only on a contradiction."""
    gated = reported_gate != NOT_GATED
    threshold = reported_gate if gated else configured_gate
    drafted = drafted_above(samples, threshold)
    if drafted is None:
        return {"ok": True, "verdict": f"not exercised: the batch never stayed above {threshold}"}
    if gated and drafted:
        return {"ok": False, "verdict": f"reports gate {reported_gate} but drafted above it"}
    if gated:
        return {"ok": True, "verdict": f"gated at {reported_gate}: no drafts above it"}
    note = "drafts" if drafted else "stopped drafting"
    return {"ok": drafted, "verdict": f"not gated: {note} above the configured {configured_gate}"}


def compare_outputs(runs: dict[str, dict[str, str]]) -> dict[str, bool]:
    """{prompt: every run's text identical} for runs {run name: {prompt: text}}."""
    names = list(runs)
    return {prompt: all(runs[n].get(prompt) == runs[names[0]][prompt] for n in names) for prompt in runs[names[0]]}


def passed(report: dict[str, Any]) -> bool:
    """Identical outputs, some drafting with speculation on, and a truthful gate."""
    return (all(report["identical"].values()) and report["speculation"]["draft_tokens"] > 0
            and report["gate"]["ok"])


def table(report: dict[str, Any]) -> str:
    runs = list(report["outputs"])
    lines = ["| prompt | " + " | ".join(runs) + " | identical |", "|---|" + "---|" * (len(runs) + 1)]
    for prompt, same in report["identical"].items():
        lengths = " | ".join(f"{len(report['outputs'][r][prompt])} chars" for r in runs)
        lines.append(f"| {prompt} | {lengths} | {'yes' if same else '**NO**'} |")
    spec, gate = report["speculation"], report["gate"]
    lines += ["", f"speculation on: {spec['draft_tokens']:.0f} drafted, {spec['accepted_tokens']:.0f} accepted, "
                  f"acceptance length {spec['acceptance_length']:.2f} over {spec['verify_steps']:.0f} verify steps",
              f"gate: configured {gate['configured']}, reported {gate['reported']} "
              f"({'NOT_GATED' if gate['reported'] == NOT_GATED else 'gated'}); {gate['verdict']}",
              f"result: {'PASS' if passed(report) else 'FAIL'}"]
    return "\n".join(lines)


# -- the cluster and the requests ----------------------------------------------------------------
def replica_user_config(doc: dict) -> dict:
    return next(d for d in doc["applications"][0]["deployments"] if d["name"] == "Replica")["user_config"]


def post(url: str, body: dict, timeout_s: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def metrics(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        return parse_metrics(response.read().decode())


def complete(url: str, model: str, prompt: str, max_tokens: int, **fields: Any) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    return post(f"{url}/v1/completions", body)


def texts(url: str, model: str, max_tokens: int, **fields: Any) -> dict[str, str]:
    return {name: complete(url, model, p, max_tokens, **fields)["choices"][0]["text"] for name, p in PROMPTS.items()}


def deploy(doc: dict, timeout_s: float) -> None:
    """Deploy a config document as `serve deploy` does (no public API takes one); wait for it."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    if APP in serve.status().applications:
        serve.delete(APP)
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(doc))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.message}")
        time.sleep(2)
    raise TimeoutError(f"{APP} not running after {timeout_s} s (downloads and the engine build take minutes)")


def replica_stats() -> dict[str, float]:
    from ray import serve

    return serve.get_deployment_handle("Replica", APP).stats.remote().result()


def burst(url: str, model: str, metrics_url: str, count: int, max_tokens: int) -> list[dict[str, float]]:
    """`count` concurrent requests of `max_tokens` each (no early EOS, so they overlap);
    /metrics sampled every 0.5 s until they are all done."""
    prompts = [f"{PROMPTS['prose']} Chapter {i}." for i in range(count)]
    samples = []
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(complete, url, model, p, max_tokens, ignore_eos=True) for p in prompts]
        while not all(f.done() for f in futures):
            samples.append(gate_sample(metrics(metrics_url)))
            time.sleep(0.5)
        for f in futures:
            f.result()  # a failed request fails the check loudly
    return samples


def device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def check(doc: dict, args: argparse.Namespace, url: str, metrics_url: str) -> dict[str, Any]:
    engine = doc["applications"][0]["args"]["engine"]
    model = doc["applications"][0]["args"].get("served_model_name") or engine["model"]
    user_config = dict(replica_user_config(doc))
    deploy(doc, args.deploy_timeout_s)
    complete(url, model, "Hello", 8)  # warm-up: the first request starts the stats poller
    before = metrics(metrics_url)
    outputs = {"speculation on": texts(url, model, args.max_tokens)}
    time.sleep(args.metrics_settle_s)  # counters reach /metrics one report later
    spec = speculation_delta(before, metrics(metrics_url))
    outputs["request off"] = texts(url, model, args.max_tokens, speculation={"mode": "off"})
    reported = int(replica_stats()["batch_gate"])
    samples = burst(url, model, metrics_url, args.burst or user_config["batch_gate"] + 8, args.burst_max_tokens)
    gate = {"configured": user_config["batch_gate"], "reported": reported, "samples": samples,
            **gate_verdict(samples, reported, user_config["batch_gate"])}
    if not args.skip_off_deployment:
        replica_user_config(doc)["mode"] = "off"
        deploy(doc, args.deploy_timeout_s)
        outputs["deployment off"] = texts(url, model, args.max_tokens)
    return {"device": device(), "config": str(args.config), "engine": engine, "user_config": user_config,
            "max_tokens": args.max_tokens, "outputs": outputs, "identical": compare_outputs(outputs),
            "speculation": spec, "gate": gate}


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "deploy-gpu.yaml")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=0, help="concurrent requests past the gate (0: gate + 8)")
    parser.add_argument("--burst-max-tokens", type=int, default=512)
    parser.add_argument("--skip-off-deployment", action="store_true",
                        help="compare with the request-level off only (TensorRT-LLM ignores it: weaker)")
    parser.add_argument("--deploy-timeout-s", type=float, default=3600)
    parser.add_argument("--metrics-settle-s", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    args = parser.parse_args(list(argv) if argv is not None else None)
    doc = yaml.safe_load(args.config.read_text())
    doc.pop("http_options", None), doc.pop("proxy_location", None)
    # The check's one change to the application: the router sends the burst over the gate
    # at once instead of holding it (gate_hold_s), so the engine's gate is what is measured.
    doc["applications"][0]["args"]["replica"]["gate_hold_s"] = 0

    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    metrics_port = free_port()
    ray.init(address="local", include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        report = check(doc, args, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**report, "passed": passed(report)}, indent=2))
    print(table(report))
    print(f"wrote {args.out}")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
