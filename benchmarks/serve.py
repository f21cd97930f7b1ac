"""Serve benchmark: HTTP load against deploy.yaml's application, three speculation settings.

For each setting -- the gate at deploy.yaml's value, the same without the router's gate hold
(`replica.gate_hold_s: 0`), the gate disabled (always speculate) and speculation off -- and
each concurrency level, closed-loop clients stream chat requests (half code edits with the
answer start prefilled, half open questions; `--workload code`: code edits only) and
record tokens/s, TTFT and TPOT p50/p99, errors and acceptance length. Each setting (the
Replica's user_config) gets a fresh replica and each level prompts of its own, so the
cross-request suffix pool never replays an earlier answer. A short request alternates
between the engine called directly (in this process) and the server, so the time Ray adds
per request (HTTP, proxy, ingress, router, replica hops) is the median paired difference.
Writes benchmarks/results/serve.json and serve.png.

    PYTHONPATH=. .venv/bin/python benchmarks/serve.py [--concurrency 1 4 16 64] [--max-tokens 32]
        [--settings gate no-hold always off] [--workload mixed|code]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import cpu_description, free_port  # noqa: E402
from replicas.stats import NOT_GATED  # noqa: E402
from training.corpora import CODE_EDITS, EDIT_PREFILL, SPEC_BENCH  # noqa: E402

APP = "specserve"
ALWAYS = 1 << 20  # a batch gate no batch reaches
# --settings key: (results name, Replica user_config change, args.replica change)
SETTINGS = {
    "gate": ("gate={gate}", {}, {}),
    "no-hold": ("gate={gate}, no hold", {}, {"gate_hold_s": 0}),
    "always": ("always", {"batch_gate": ALWAYS}, {}),
    "off": ("off", {"mode": "off"}, {}),
}


def workload(count: int, max_edit_chars: int = 1500, code_only: bool = False) -> list[list[dict]]:
    """Chat message lists: code edits (prefilled answers) and open questions, interleaved
    (`code_only`: edits only)."""
    edits, questions = [], []
    path = CODE_EDITS
    if path.exists():  # real edits; long files cut at a line end to keep CPU prefill modest
        for line in path.open():
            row = json.loads(line)
            before = row["before"][:max_edit_chars]
            edits.append((row["instruction"], before[:before.rfind("\n") + 1] or before))
    if not edits:  # no shared data: edit this repository's own files
        edits = [("Add type hints.", p.read_text()[:max_edit_chars]) for p in sorted((ROOT / "deploy").glob("*.py"))]
    path = SPEC_BENCH
    if path.exists():
        questions = [json.loads(line)["turns"][0] for line in path.open()]
    questions = questions or ["Explain how a hash map works.", "Write a short poem about the sea."]
    chats = []
    for i in range(count):
        if code_only or i % 2 == 0:
            instruction, before = edits[(i if code_only else i // 2) % len(edits)]
            chats.append([{"role": "user", "content": f"{instruction}\n\n```python\n{before}```\n"
                                                      "Apply the change and output the whole updated file."},
                          {"role": "assistant", "content": EDIT_PREFILL}])
        else:
            chats.append([{"role": "user", "content": questions[(i // 2) % len(questions)]}])
    return chats


def body(messages: list[dict], max_tokens: int) -> dict:
    prefilled = messages[-1]["role"] == "assistant"
    return {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "continue_final_message": prefilled, "add_generation_prompt": not prefilled}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# -- what Ray adds -----------------------------------------------------------------------------
OVERHEAD_CHAT = [{"role": "user", "content": "Say hello."}]


def ray_overhead(url: str, engine_config: dict, user_config: dict, pairs: int, max_tokens: int) -> dict:
    """Median of (HTTP latency - engine latency) over alternating pairs of the same request.

    The engine runs in this process while the replica idles, one request at a time; the
    two measurements alternate so drifting machine load cancels out of each pair.
    """
    from deploy.config import EngineArgs
    from deploy.engine_factory import build_engine
    from replicas.engine import GenerationRequest, SamplingParams, SpeculationConfig

    async def run() -> dict:
        engine = build_engine(EngineArgs.model_validate(engine_config), SpeculationConfig.from_user_config(user_config))
        await engine.start()
        prompt = engine.tokenizer.apply_chat_template(OVERHEAD_CHAT, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        direct, http = [], []
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            for i in range(pairs + 1):  # the first pair warms both paths up
                started = time.perf_counter()
                async for _ in engine.generate(GenerationRequest(f"direct-{i}", ids, SamplingParams(max_tokens=max_tokens))):
                    pass
                direct_s = time.perf_counter() - started
                result = await one_request(client, body(OVERHEAD_CHAT, max_tokens))
                if i and not result.get("error"):
                    direct.append(direct_s)
                    http.append(result["latency_s"])
        await engine.shutdown()
        diffs = sorted(h - d for h, d in zip(http, direct))
        return {"median_ms": 1000 * statistics.median(diffs), "p25_ms": 1000 * percentile(diffs, 25),
                "p75_ms": 1000 * percentile(diffs, 75), "direct_latency_median_s": statistics.median(direct),
                "pairs": len(diffs), "max_tokens": max_tokens}

    return asyncio.run(run())


# -- over HTTP --------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, payload: dict) -> dict:
    started = time.perf_counter()
    first = last = None
    usage, error, text = None, None, ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}", "latency_s": time.perf_counter() - started}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text += chunk["choices"][0]["delta"]["content"]
    except httpx.HTTPError as exc:
        error = repr(exc)
    done = time.perf_counter()
    if error or usage is None:
        return {"error": error or "no usage", "latency_s": done - started}
    tokens = usage["completion_tokens"]
    return {"latency_s": done - started, "ttft_s": (first or done) - started, "tokens": tokens,
            "tpot_s": (last - first) / (tokens - 1) if first and last and tokens > 1 else None,
            "acceptance_length": usage["speculation"]["acceptance_length"], "error": None, "text": text}


async def load(url: str, payloads: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Closed loop: `concurrency` clients, each sending its next request when one finishes."""
    queue = list(enumerate(payloads))
    results: list[dict] = [{} for _ in payloads]

    async def worker(client):
        while queue:
            i, payload = queue.pop(0)
            results[i] = await one_request(client, payload)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        return results, time.perf_counter() - started


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if not r.get("error")]
    accept = [r["acceptance_length"] for r in ok if r["acceptance_length"] > 0]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall_s,
        "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 50),
        "ttft_p99_s": percentile([r["ttft_s"] for r in ok], 99),
        "tpot_p50_ms": 1000 * percentile([r["tpot_s"] for r in ok if r["tpot_s"]], 50),
        "tpot_p99_ms": 1000 * percentile([r["tpot_s"] for r in ok if r["tpot_s"]], 99),
        "acceptance_length_mean": statistics.fmean(accept) if accept else 0.0,
    }


# -- the Serve cluster ----------------------------------------------------------------------
def app_document(args) -> dict:
    doc = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    doc.pop("http_options"), doc.pop("proxy_location")
    engine = doc["applications"][0]["args"]["engine"]
    if not args.autoscaling:  # one replica, so the settings compare on the same hardware
        for deployment in doc["applications"][0].get("deployments", []):
            deployment.pop("autoscaling_config", None)
    if args.mtp_weights is not None:
        engine["mtp_weights"] = None if args.mtp_weights == "none" else args.mtp_weights
    if args.gate_hold_s is not None:
        doc["applications"][0]["args"]["replica"]["gate_hold_s"] = args.gate_hold_s
    return doc


def replica_config(doc: dict) -> dict:
    return next(d for d in doc["applications"][0]["deployments"] if d["name"] == "Replica")["user_config"]


def apply(doc: dict, timeout_s: float = 300) -> None:
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(doc))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            handle = serve.get_deployment_handle("Replica", APP)
            settings = replica_config(doc)  # the gate as the engine applies it: none when it never drafts
            if handle.stats.remote().result()["batch_gate"] == (NOT_GATED if settings["mode"] == "off"
                                                                else settings["batch_gate"]):
                time.sleep(2.5)  # let the router's copy of the stats catch up (one period stale)
                return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(status.message)
        time.sleep(0.5)
    raise TimeoutError("application not running")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-requests", type=int, default=8, help="requests per level: max(this, concurrency)")
    parser.add_argument("--autoscaling", action="store_true", help="keep deploy.yaml's autoscaling (default: 1 replica)")
    parser.add_argument("--overhead-pairs", type=int, default=8, help="direct/HTTP pairs for Ray's overhead (0: none)")
    parser.add_argument("--edit-chars", type=int, default=1500, help="longest code-edit file, in characters")
    parser.add_argument("--mtp-weights", default=None, help="override deploy.yaml's (path, default or none)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--workload", choices=("mixed", "code"), default="mixed")
    parser.add_argument("--gate-hold-s", type=float, default=None, help="override deploy.yaml's replica.gate_hold_s")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve.json")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray runs workers at nice 15 by default; the direct engine here runs at 0. On a shared
    # machine that alone skews the comparison, so replicas run at this process's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM still shuts Ray down

    doc = app_document(args)
    app_args = doc["applications"][0]["args"]
    gate = replica_config(doc)["batch_gate"]
    counts = [max(c, args.min_requests) for c in args.concurrency]
    chats = workload(sum(counts) + 1, args.edit_chars, args.workload == "code")  # each level its own prompts
    # Ray gives a replica as many torch threads as CPUs it reserves: the direct engine gets as many
    threads = app_args["engine"].get("num_threads") or int(app_args["replica"].get("num_cpus", 1)) or 1

    import ray
    from ray import serve

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    replica_args = dict(app_args["replica"])
    results, overhead, applied, texts = {}, {}, {}, {}
    try:
        for key in args.settings:
            name, change, replica_change = SETTINGS[key]
            name = name.format(gate=gate)
            # a fresh replica per setting: the cross-request suffix pool must not carry the
            # previous setting's answers to the same prompts
            if APP in serve.status().applications:
                serve.delete(APP)
            replica_config(doc).update({"mode": "hybrid", "batch_gate": gate, **change})
            app_args["replica"] = {**replica_args, **replica_change}
            applied[name] = {"user_config": dict(replica_config(doc)), "replica": dict(app_args["replica"])}
            apply(doc)
            asyncio.run(load(url, [body(chats[-1], 4)], 1))  # warm up the path
            results[name], texts[name], offset = {}, [], 0
            for concurrency, count in zip(args.concurrency, counts):
                payloads = [body(m, args.max_tokens) for m in chats[offset:offset + count]]
                offset += count
                out, wall_s = asyncio.run(load(url, payloads, concurrency))
                results[name][concurrency] = summarize(out, wall_s)
                texts[name] += [r.get("text") for r in out]  # every setting answers the same prompts, greedy
                print(name, concurrency, json.dumps(results[name][concurrency]), flush=True)
            if key == "gate" and args.overhead_pairs > 0:
                print("Ray overhead: alternating direct / HTTP requests", flush=True)
                overhead = ray_overhead(url, {**app_args["engine"], "num_threads": threads}, replica_config(doc),
                                        args.overhead_pairs, max_tokens=8)
    finally:
        serve.shutdown()
        ray.shutdown()

    machine = {**cpu_description(), "platform": platform.platform()}  # kernel_path among them
    first = next(iter(texts.values()), [])
    report = {"machine": machine,
              "max_tokens": args.max_tokens, "workload": args.workload, "settings": applied,
              "engine": app_args["engine"], "results": results,
              "identical_to_first_setting": {name: answers == first for name, answers in texts.items()},
              "ray_overhead_per_request": overhead}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(table(report))
    differing = [name for name, same in report["identical_to_first_setting"].items() if not same]
    if differing:
        raise SystemExit(f"these settings answered differently from {next(iter(texts))}: {', '.join(differing)}")


def table(report: dict) -> str:
    m = report["machine"]
    lines = [f"{m['model']} (family {m.get('family')} model {m.get('model_number')}), {m['cpus']} CPUs, "
             f"kernels {m.get('kernel_path')}, {report['max_tokens']} tokens per request", "",
             "| setting | conc | tok/s | TTFT p50/p99 s | TPOT p50/p99 ms | accept len | errors |",
             "|---|---|---|---|---|---|---|"]
    for name, levels in report["results"].items():
        for c, r in levels.items():
            lines.append(f"| {name} | {c} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                         f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | {r['acceptance_length_mean']:.2f} | "
                         f"{r['errors']} |")
    o = report["ray_overhead_per_request"]
    if o:
        lines.append(f"\nRay adds {o['median_ms']:.0f} ms per request (median of {o['pairs']} alternating pairs, "
                     f"IQR {o['p25_ms']:.0f}..{o['p75_ms']:.0f} ms; the engine alone takes "
                     f"{o['direct_latency_median_s']:.2f} s for {o['max_tokens']} tokens)")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, levels in report["results"].items():
        conc = [int(c) for c in levels]
        left.plot(conc, [levels[c]["tokens_per_s"] for c in levels], marker="o", label=name)
        right.plot(conc, [levels[c]["tpot_p50_ms"] for c in levels], marker="o", label=name)
    for ax, title in ((left, "throughput (tokens/s)"), (right, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    machine = report["machine"]
    fig.suptitle(f"Serve, deploy.yaml, {report.get('workload', 'mixed')} workload, {report['max_tokens']} tokens "
                 f"per request, {machine.get('model', 'CPU')} ({machine['cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
