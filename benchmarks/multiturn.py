"""Multi-turn benchmark: agent-style conversations over code files, with and without the prefix cache.

Each conversation starts from a real code edit (../shared/data/code_edits; this repository's
own files without it) and goes on for `--turns` turns of follow-up requests about the same
file; every turn sends the whole conversation so far, rendered with the model's chat
template into one raw prompt (`/v1/completions`, greedy, exactly `--max-tokens` new tokens),
and the answer joins the history. All conversations run at once, each turn after the last.
Configurations, each a fresh deployment of the embedded model (1-CPU Replicas, one native
thread each): 1 and 2 Replicas, prefix cache off and on, and with 2 Replicas the cache with
and without the router's prefix affinity. Reported per configuration: TTFT p50/p99 per turn,
the median conversation's total time, the prefix hit rate (cached / prompt tokens, from each
response's `usage.prompt_tokens_details.cached_tokens`), and whether every answer equals the
first configuration's (the cache must never change a token). Side by side: llama.cpp's
server (xllamacpp, the bench venv) with `cache_prompt` on the same turn prompts, one slot per
conversation, 2 threads.

    make bench-multiturn        # writes benchmarks/results/multiturn.{json,png}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.llamacpp_peer import peer_available, run_peer  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from benchmarks.serve import percentile  # noqa: E402
from deploy.app import compose_app  # noqa: E402
from deploy.config import AppArgs  # noqa: E402
from deploy.engine_factory import engine_factory  # noqa: E402
from replicas.torch_engine.loader import packaged_gguf_path, resolve_model_dir  # noqa: E402
from tests.polling import wait_until  # noqa: E402
from tests.serve_support import local_serve, replicas_serving  # noqa: E402
from training.corpora import CODE_EDITS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
APP = "multiturn"
MODEL = "smollm2-135m-instruct"
FOLLOW_UPS = [
    "Now add type hints to the functions you changed.",
    "Add a one-line docstring to each function.",
    "Write one pytest test for the main function.",
    "List the changes you made, one line each.",
    "Check the file once more for bugs and name the worst one.",
]
# (name, Replicas, engine overrides, replica overrides)
CONFIGS = [
    ("1 replica, no cache", 1, {"prefix_cache_bytes": 0}, {"prefix_affinity_chars": 0}),
    ("1 replica, cache", 1, {}, {}),
    ("2 replicas, no cache", 2, {"prefix_cache_bytes": 0}, {"prefix_affinity_chars": 0}),
    ("2 replicas, cache, no affinity", 2, {}, {"prefix_affinity_chars": 0}),
    ("2 replicas, cache + affinity", 2, {}, {}),
]


def first_turns(count: int, max_chars: int) -> list[str]:
    """The opening user message of each conversation: an edit request over a whole file."""
    edits = []
    if CODE_EDITS.exists():
        for line in CODE_EDITS.open():
            row = json.loads(line)
            before = row["before"][:max_chars]
            edits.append((row["instruction"], before[:before.rfind("\n") + 1] or before))
    if not edits:
        edits = [("Add type hints.", p.read_text()[:max_chars]) for p in sorted((ROOT / "deploy").glob("*.py"))]
    return [f"{instruction}\n\n```python\n{before}```\nApply the change and output the whole updated file."
            for instruction, before in edits[:count]]


async def turn(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: text, TTFT, wall time and usage."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage = None, "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
                text += chunk["choices"][0]["text"]
    done = time.perf_counter()
    return {"text": text, "ttft_s": (first or done) - started, "wall_s": done - started,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def conversation(client: httpx.AsyncClient, tokenizer, opening: str, turns: int, max_tokens: int) -> list[dict]:
    history, rows = [], []
    for i in range(turns):
        history.append({"role": "user", "content": opening if i == 0 else FOLLOW_UPS[(i - 1) % len(FOLLOW_UPS)]})
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        row = await turn(client, prompt, max_tokens)
        rows.append({**row, "prompt": prompt})
        history.append({"role": "assistant", "content": row["text"]})
    return rows


async def run_conversations(url: str, tokenizer, openings: list[str], turns: int, max_tokens: int) -> list[list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        return list(await asyncio.gather(*(conversation(client, tokenizer, o, turns, max_tokens) for o in openings)))


def summarize(conversations: list[list[dict]]) -> dict[str, Any]:
    turns = len(conversations[0])
    per_turn = []
    for t in range(turns):
        ttfts = [c[t]["ttft_s"] for c in conversations]
        per_turn.append({"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 99),
                         "prompt_tokens": statistics.median(c[t]["prompt_tokens"] for c in conversations),
                         "cached_tokens": statistics.median(c[t]["cached_tokens"] for c in conversations)})
    prompt = sum(r["prompt_tokens"] for c in conversations for r in c)
    cached = sum(r["cached_tokens"] for c in conversations for r in c)
    return {"turns": per_turn, "hit_rate": cached / prompt,
            "conversation_s_median": statistics.median(sum(r["wall_s"] for r in c) for c in conversations)}


def deploy(replicas: int, engine: dict, replica: dict, max_seq_len: int) -> None:
    from ray import serve

    config = AppArgs(engine={"max_batch_size": 8, "max_seq_len": max_seq_len, "num_threads": 1, **engine},
                     replica={"num_cpus": 1, "num_replicas": replicas, **replica})
    serve.run(compose_app(config, engine_factory(config.engine)), name=APP, route_prefix="/")
    if not wait_until(lambda: replicas_serving(APP, replicas), 300, interval_s=0.5):
        raise RuntimeError(f"{replicas} Replicas did not start")
    time.sleep(2.5)  # the router's copy of the replicas' stats is one period stale


def bench_llamacpp(conversations: list[list[str]], max_tokens: int, threads: int) -> dict | None:
    if not peer_available("bench-multiturn"):
        return None
    run = run_peer(str(packaged_gguf_path()), "--conversations-json", conversations, "--max-tokens", str(max_tokens),
                   "--threads", str(threads))
    rows = run.pop("conversations")
    for c in rows:
        for r in c:
            r["cached_tokens"] = r["cache_n"]
    return {**run, **summarize(rows)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir())
    openings = first_turns(args.conversations, args.max_file_chars)
    results: dict[str, Any] = {"cpu": cpu_description(), "conversations": len(openings), "turns": args.turns,
                               "max_tokens": args.max_tokens, "configs": {}}
    reference = None
    with local_serve() as url:
        for name, replicas, engine, replica in CONFIGS:
            deploy(replicas, engine, replica, args.max_seq_len)
            started = time.perf_counter()
            conversations = asyncio.run(run_conversations(url, tokenizer, openings, args.turns, args.max_tokens))
            entry = {**summarize(conversations), "wall_s": time.perf_counter() - started}
            texts = [[r["text"] for r in c] for c in conversations]
            reference = reference or (texts, [[r["prompt"] for r in c] for c in conversations])
            entry["identical_to_first"] = texts == reference[0]
            results["configs"][name] = entry
            print(f"{name}: turn TTFT p50 {[round(t['ttft_p50_s'], 2) for t in entry['turns']]} s, "
                  f"hit rate {entry['hit_rate']:.2f}, conversation {entry['conversation_s_median']:.1f} s, "
                  f"identical {entry['identical_to_first']}", flush=True)
    results["llamacpp"] = bench_llamacpp(reference[1], args.max_tokens, args.llamacpp_threads)
    if results["llamacpp"]:
        peer = results["llamacpp"]
        print(f"llama.cpp cache_prompt: turn TTFT p50 {[round(t['ttft_p50_s'], 2) for t in peer['turns']]} s, "
              f"hit rate {peer['hit_rate']:.2f}", flush=True)
    configs = results["configs"]
    cold, warm = configs["1 replica, no cache"], configs["1 replica, cache"]
    third = min(3, args.turns)  # turn 3, or the last of fewer
    results["ratios"] = {
        f"turn{third}_ttft_cache_vs_cold": warm["turns"][third - 1]["ttft_p50_s"] / cold["turns"][third - 1]["ttft_p50_s"],
        "conversation_time_cache_vs_cold": warm["conversation_s_median"] / cold["conversation_s_median"],
        "conversation_time_2_replicas_affinity_vs_cold": (configs["2 replicas, cache + affinity"]["conversation_s_median"]
                                                          / configs["2 replicas, no cache"]["conversation_s_median"]),
    }
    return results


def table(results: dict[str, Any]) -> str:
    turns = results["turns"]
    rows = [*results["configs"].items()]
    if results.get("llamacpp"):
        rows.append((f"llama.cpp server, cache_prompt ({results['llamacpp']['threads']} threads)", results["llamacpp"]))
    head = " | ".join(f"turn {t + 1} TTFT p50 / p99" for t in range(turns))
    lines = [f"| configuration | {head} | conversation (median) | hit rate | same answers |",
             "|---|" + "---:|" * (turns + 3)]
    for name, entry in rows:
        cells = " | ".join(f"{t['ttft_p50_s']:.2f} / {t['ttft_p99_s']:.2f} s" for t in entry["turns"])
        same = {True: "yes", False: "NO"}.get(entry.get("identical_to_first"), "-")
        lines.append(f"| {name} | {cells} | {entry['conversation_s_median']:.1f} s | {entry['hit_rate']:.0%} | {same} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = dict(results["configs"])
    if results.get("llamacpp"):
        series["llama.cpp, cache_prompt"] = results["llamacpp"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, entry in series.items():
        ax.plot(range(1, results["turns"] + 1), [t["ttft_p50_s"] for t in entry["turns"]], marker="o", label=name)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_xticks(range(1, results["turns"] + 1))
    ax.legend(fontsize=7)
    names = list(series)
    bx.barh(names, [series[n]["conversation_s_median"] for n in names])
    for i, n in enumerate(names):
        bx.text(series[n]["conversation_s_median"], i, f" hit {series[n]['hit_rate']:.0%}", va="center", fontsize=8)
    bx.set_xlabel(f"median conversation time (s), {results['turns']} turns")
    bx.invert_yaxis()
    fig.suptitle(f"{results['conversations']} conversations at once, {results['max_tokens']} tokens per answer; "
                 f"{results['cpu']['model']} ({results['cpu']['cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-file-chars", type=int, default=1200)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--llamacpp-threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "multiturn.json", help="the JSON; the PNG beside it")
    args = parser.parse_args()
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    print(json.dumps(results["ratios"], indent=1))
    if differing := [name for name, entry in results["configs"].items() if entry.get("identical_to_first") is False]:
        raise SystemExit(f"the prefix cache or routing changed an answer: {', '.join(differing)}")


if __name__ == "__main__":
    main()
