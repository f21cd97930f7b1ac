"""Replica memory: what one Replica of the default deploy.yaml holds, idle and under load.

Deploys deploy.yaml as it is (one Replica: its autoscaling is taken off, so the figures are
one engine's) on a local Ray cluster, and samples the Replica process's resident set
(/proc/PID/status VmRSS) every 0.2 s through three phases:
  started      deployed, no request yet;
  chat x8      8 chat questions at once (deploy.yaml's default max_tokens), as a chat client
               sends them;
  full x8      two waves of 8 distinct raw prompts of `--context-tokens` tokens each plus
               `--max-tokens` new ones: every KV slot near its whole context window, and the
               prefix cache filled to its budget by the first wave's blocks.
Beside it, llama.cpp's server (xllamacpp, the bench venv) on the same GGUF with the same
slots (8 x max_seq_len, fp16 KV, its default) serves the same full-context prompts and
reports its own peak. The JSON also gives what the configuration reserves: weights, KV
capacity (slots x window), the KV pages the slots and the prefix cache share, the prefix
cache's budget.

    make bench-memory        # writes benchmarks/results/memory.{json,png}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine import workloads  # noqa: E402
from benchmarks.llamacpp_peer import peer_available, run_peer  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from replicas.torch_engine.loader import packaged_gguf_path, resolve_model_dir  # noqa: E402
from replicas.torch_engine.model_config import ModelConfig  # noqa: E402
from tests.serve_support import APP, DEPLOY_YAML, deploy_config, live_actors, local_serve  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "smollm2-135m-instruct"  # deploy.yaml's engine.model
KV_BYTES = 2  # fp16 K and V, the native forward's cache


def single_replica_document() -> dict:
    """deploy.yaml's document, one Replica (no autoscaling), HTTP left to the local cluster."""
    doc = yaml.safe_load(DEPLOY_YAML.read_text())
    doc.pop("http_options"), doc.pop("proxy_location")
    app = doc["applications"][0]
    app["args"]["replica"]["num_replicas"] = 1
    for deployment in app["deployments"]:
        deployment.pop("autoscaling_config", None)
    return doc


class RssSampler:
    """A process's VmRSS every `interval_s`, each sample tagged with the phase running then."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s, self.phase = pid, interval_s, "started"
        self.samples: list[tuple[float, float, str]] = []  # (seconds since start, MB, phase)
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def status_mb(self, field: str) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise KeyError(field)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append((time.monotonic() - self._start, self.status_mb("VmRSS"), self.phase))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, dict[str, float]]:
        phases: dict[str, list[float]] = {}
        for _, mb, phase in self.samples:
            phases.setdefault(phase, []).append(mb)
        return {phase: {"end_mb": round(v[-1], 1), "peak_mb": round(max(v), 1)} for phase, v in phases.items()}


def full_context_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` distinct raw prompts of about `tokens` tokens each: windows of this repository's
    own Python sources (always present), each starting at a different place."""
    text = "\n".join(p.read_text() for p in sorted(ROOT.glob("[a-z]*/**/*.py")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stride = (len(ids) - tokens) // count
    if stride <= 0:
        raise RuntimeError(f"the sources hold {len(ids)} tokens, fewer than {count} prompts of {tokens}")
    return [tokenizer.decode(ids[i * stride:i * stride + tokens]) for i in range(count)]


def openai_client(url: str):
    """The official client on the local deployment; no retries (a failure is a finding)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)


async def chat_batch(url: str, questions: list[str]) -> int:
    """Completion tokens of the chat `questions` sent at once."""
    async with openai_client(url) as client:
        async def one(question: str) -> int:
            reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                         temperature=0)  # the same answers in every run
            return reply.usage.completion_tokens
        return sum(await asyncio.gather(*(one(q) for q in questions)))


async def raw_batch(url: str, prompts: list[str], max_tokens: int) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of `prompts` sent at once."""
    async with openai_client(url) as client:
        async def one(prompt: str) -> tuple[int, int]:
            reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
            return reply.usage.prompt_tokens, reply.usage.completion_tokens
        counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(p for p, _ in counts), sum(c for _, c in counts)


def reserved(doc: dict) -> dict[str, Any]:
    """What the configuration reserves (pages are resident once written, not before)."""
    engine = doc["applications"][0]["args"]["engine"]
    cfg = ModelConfig.from_hf_dir(resolve_model_dir())
    per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * KV_BYTES
    window = -(-engine["max_seq_len"] // 32) * 32
    return {"max_batch_size": engine["max_batch_size"], "max_seq_len": engine["max_seq_len"],
            "weights_file_mb": round(packaged_gguf_path().stat().st_size / 2**20, 1),
            "kv_bytes_per_token": per_token,
            "kv_capacity_mb": round(engine["max_batch_size"] * window * per_token / 2**20, 1),
            "kv_pool_mb": round((engine.get("kv_cache_bytes") or engine["max_batch_size"] * window * per_token)
                                / 2**20, 1),
            "prefix_cache_budget_mb": round(engine["prefix_cache_bytes"] / 2**20, 1)}


def bench_llamacpp(prompts: list[str], max_tokens: int, slots: int, slot_ctx: int) -> dict | None:
    if not peer_available("bench-memory"):
        return None
    run = run_peer(str(packaged_gguf_path()), "--prompts-json", {"full": prompts}, "--max-tokens", str(max_tokens),
                   "--batch", str(slots), "--modes", "plain", "--slot-ctx", str(slot_ctx))
    full = run["modes"]["plain"]["workloads"]["full"]
    return {"llamacpp_version": run["llamacpp_version"], "slot_ctx": run["slot_ctx"], "slots": slots,
            "peak_rss_mb": run["peak_rss_mb"], "wall_s": round(full["wall_s"], 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir())
    doc = single_replica_document()
    config = reserved(doc)
    if args.context_tokens + args.max_tokens > config["max_seq_len"] - 64:
        raise SystemExit(f"--context-tokens + --max-tokens must leave 64 tokens of the {config['max_seq_len']} window")
    slots = config["max_batch_size"]
    waves = [full_context_prompts(tokenizer, 2 * slots, args.context_tokens)[w::2] for w in range(2)]
    questions = (workloads(tokenizer, slots)["chat"] * slots)[:slots]
    result: dict[str, Any] = {"cpu": cpu_description(), "config": config, "context_tokens": args.context_tokens,
                              "max_tokens": args.max_tokens}
    # llama.cpp first: the peer is this process's only child while it runs.
    print("llama.cpp, same GGUF and slots, full-context prompts ...", flush=True)
    result["llamacpp"] = bench_llamacpp(waves[0], args.max_tokens, slots, config["max_seq_len"])
    with local_serve() as url:
        deploy_config(doc, APP, timeout_s=300)
        (replica,) = live_actors(":Replica")
        sampler = RssSampler(replica["Pid"])
        phases = []
        try:
            time.sleep(args.idle_s)  # samples of the idle replica
            sampler.phase = "chat x8"
            started = time.monotonic()
            completion = asyncio.run(chat_batch(url, questions))
            phases.append({"phase": sampler.phase, "completion_tokens": completion,
                           "wall_s": round(time.monotonic() - started, 1)})
            for w, prompts in enumerate(waves):
                sampler.phase = f"full x8, wave {w + 1}"
                started = time.monotonic()
                prompt, completion = asyncio.run(raw_batch(url, prompts, args.max_tokens))
                phases.append({"phase": sampler.phase, "prompt_tokens": prompt, "completion_tokens": completion,
                               "wall_s": round(time.monotonic() - started, 1)})
                print(f"  {sampler.phase}: {prompt} prompt + {completion} new tokens in {phases[-1]['wall_s']} s, "
                      f"RSS {sampler.samples[-1][1]:.0f} MB", flush=True)
            peak_mb = sampler.status_mb("VmHWM")
        finally:
            sampler.stop()
    summary = sampler.summary()
    for entry in phases:
        entry.update(summary[entry["phase"]])
    result["replica"] = {"phases": [{"phase": "started", **summary["started"]}, *phases],
                         "peak_rss_mb": round(peak_mb, 1),
                         "samples": [(round(t, 2), round(mb, 1), phase) for t, mb, phase in sampler.samples]}
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    samples = result["replica"]["samples"]
    ax.plot([t for t, _, _ in samples], [mb for _, mb, _ in samples], color="#4a7", label="our Replica (VmRSS)")
    for entry in result["replica"]["phases"]:
        times = [t for t, _, phase in samples if phase == entry["phase"]]
        if "wave" in entry["phase"]:
            ax.axvspan(times[0], times[-1], alpha=0.06, color="#4a7")
        ax.annotate(entry["phase"], (times[0], entry["peak_mb"]), fontsize=8, xytext=(2, 6), textcoords="offset points")
    if result["llamacpp"]:
        ax.axhline(result["llamacpp"]["peak_rss_mb"], color="#57b", ls="--",
                   label=f"llama.cpp server peak, same GGUF and slots ({result['llamacpp']['slots']} x "
                         f"{result['llamacpp']['slot_ctx']})")
    cfg = result["config"]
    ax.set_xlabel("seconds since the Replica was deployed")
    ax.set_ylabel("resident MB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"default deploy.yaml: {cfg['max_batch_size']} slots x {cfg['max_seq_len']} tokens "
                 f"(KV pages {cfg['kv_pool_mb']:.0f} of {cfg['kv_capacity_mb']:.0f} MB), prefix cache {cfg['prefix_cache_budget_mb']:.0f} MB; "
                 f"{result['cpu']['model']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=3584, help="prompt tokens of a full-context request")
    parser.add_argument("--max-tokens", type=int, default=384, help="new tokens of a full-context request")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds of samples before the first request")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    for entry in result["replica"]["phases"]:
        print(f"{entry['phase']:18s} RSS at end {entry['end_mb']:7.1f} MB, peak {entry['peak_mb']:7.1f} MB")
    print(f"Replica peak (VmHWM) {result['replica']['peak_rss_mb']:.1f} MB; reserved: {result['config']}")
    if result["llamacpp"]:
        print(f"llama.cpp server peak {result['llamacpp']['peak_rss_mb']:.1f} MB")
    print(f"wrote {args.out} and its .png")


if __name__ == "__main__":
    main()
