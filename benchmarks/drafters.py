"""Drafters side by side: our suffix automaton pool vs Arctic suffix decoding vs vLLM n-gram.

Every drafter drafts K tokens and is replayed teacher-forced with exact-match acceptance
(Arctic's simulator protocol): from the prompt, ask for a draft, accept its longest prefix
that equals the true next response tokens, advance by accepted + 1 (the bonus token is the
true one), repeat to the end of the response. Two measurements:

- cost: µs per step (feed the accepted tokens, get the next draft) at 2k/16k/128k tokens
  of context, batch 1 and 64 (the median step, least-disturbed of 3 rounds). Contexts are
  real token streams (code edits, prompt + response, concatenated). Ours makes one batched
  call per step; Arctic's API is per request, so its step loops over the batch in Python
  (as vLLM's proposer does); the n-gram step is vLLM's own batched numba kernel.
- MAT: mean accepted tokens per step, bonus included (tokens emitted per verify step),
  per dataset. "+ global" variants process the requests in order and keep finished
  responses in a cross-request cache.

Writes benchmarks/results/drafters.json and drafters.png and prints the tables. Run with
`make bench-drafters` (sets up .venv-bench with the peers), or directly:

    PYTHONPATH=. .venv-bench/bin/python benchmarks/drafters.py [--pairs 60] [--steps 40]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import datasets  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from benchmarks.peers.replay import DrafterSpec, replay_mat, time_steps  # noqa: E402

OURS, OURS_GLOBAL = "ours SA", "ours SA + global"
OURS_GLOBAL_BIAS4 = "ours SA + global, bias 4"
ARCTIC, ARCTIC_GLOBAL = "Arctic suffix", "Arctic suffix + global"
NGRAM_5, NGRAM_14 = "vLLM n-gram [5,5]", "vLLM n-gram [1,4]"


def drafter_specs(draft_len: int, global_pool_tokens: int, ablations: bool) -> tuple[list[DrafterSpec], dict]:
    """Every drafter that imports here, and why the others were left out."""
    from benchmarks.peers.arctic import ArcticSuffixDrafter
    from benchmarks.peers.ours import SuffixAutomatonDrafter
    from benchmarks.peers.sa_policies import SuffixPolicyDrafter
    from benchmarks.peers.vllm_ngram import VllmNgramDrafter

    k = draft_len
    candidates = [
        DrafterSpec(OURS, lambda s, n: SuffixAutomatonDrafter(s, n, k), False),
        DrafterSpec(OURS_GLOBAL, lambda s, n: SuffixAutomatonDrafter(s, n, k, global_pool_tokens), True),
        # The pool's default global_bias (0) against SAM-Decoding's cautious margin.
        DrafterSpec(OURS_GLOBAL_BIAS4, lambda s, n: SuffixAutomatonDrafter(s, n, k, global_pool_tokens, 4),
                    True, timed=False),
        DrafterSpec(ARCTIC, lambda s, n: ArcticSuffixDrafter(s, n, k, global_cache=False), False),
        DrafterSpec(ARCTIC_GLOBAL, lambda s, n: ArcticSuffixDrafter(s, n, k, global_cache=True), True),
        DrafterSpec(NGRAM_5, lambda s, n: VllmNgramDrafter(s, n, k, 5, 5), False),
        DrafterSpec(NGRAM_14, lambda s, n: VllmNgramDrafter(s, n, k, 1, 4), False),
    ]
    if ablations:
        candidates += [DrafterSpec(f"SA ablation: {p} occurrence",
                                   lambda s, n, p=p: SuffixPolicyDrafter(s, n, k, p), False, timed=False)
                       for p in ("first", "recent", "frequent")]
    specs, skipped = [], {}
    for spec in candidates:
        try:
            spec.make(1, 64)  # also compiles the n-gram kernel once, outside any timing
            specs.append(spec)
        except ImportError as err:
            skipped[spec.name] = f"not importable: {err}"
    return specs, skipped


def load_workloads(n_pairs: int, tokenizer) -> tuple[dict[str, list], dict]:
    loaders = {"code_edits": datasets.code_edit_pairs, "sharegpt": datasets.sharegpt_pairs,
               "humaneval": datasets.humaneval_pairs}
    workloads = {name: datasets.tokenize_pairs(tokenizer, load(n_pairs)) for name, load in loaders.items()}
    notes = {"spec_bench": "skipped: Spec-Bench ships questions only, no reference responses "
                           "to replay against (question.jsonl has no answers)"}
    return workloads, notes


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_description(),
           "processor_count": os.cpu_count(),
           # Other processes inflate wall-clock timings; this says how busy the machine was.
           "load_average_1m_at_start": os.getloadavg()[0]}
    native = sorted((ROOT / "replicas" / "speculation").glob("_sa_native*.so"))
    out["sa_native_sha256"] = hashlib.sha256(native[0].read_bytes()).hexdigest() if native else None
    for dist in ("numpy", "numba", "arctic-inference", "vllm", "tokenizers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["specserve_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["specserve_commit"] = None
    return out


def checks(cost: dict, mat: dict) -> dict:
    """The targets, as measured ratios (reported, not asserted)."""
    def us(name: str, context: int, batch: int) -> float | None:
        row = cost.get(name, {}).get(f"{context}/{batch}")
        return row["us_per_step"] if row else None

    out: dict = {"cost": {}, "mat": {}}
    contexts = sorted({int(key.split("/")[0]) for rows in cost.values() for key in rows})
    batches = sorted({int(key.split("/")[1]) for rows in cost.values() for key in rows})
    for batch in batches:
        first, last = us(OURS, contexts[0], batch), us(OURS, contexts[-1], batch)
        if first and last:
            out["cost"][f"ours {contexts[-1]}/{contexts[0]} tokens, batch {batch} (flat = ~1)"] = last / first
            per_token = [cost[OURS][f"{c}/{batch}"]["us_per_fed_token"] for c in (contexts[-1], contexts[0])]
            out["cost"][f"ours per fed token {contexts[-1]}/{contexts[0]} tokens, batch {batch}"] = \
                per_token[0] / per_token[1]
        for context in contexts:
            ours = us(OURS, context, batch)
            for peer in (ARCTIC, NGRAM_5, NGRAM_14):
                theirs = us(peer, context, batch)
                if ours and theirs:
                    out["cost"][f"{peer} / ours at {context} tokens, batch {batch}"] = theirs / ours
    for dataset, rows in mat.items():
        peers = {n: rows[n]["mat"] for n in (ARCTIC, ARCTIC_GLOBAL, NGRAM_5, NGRAM_14) if n in rows}
        ours = {n: rows[n]["mat"] for n in (OURS, OURS_GLOBAL) if n in rows}
        if peers and ours:
            best_peer = max(peers, key=peers.get)
            best_ours = max(ours, key=ours.get)
            out["mat"][dataset] = {"best_ours": best_ours, "best_ours_mat": ours[best_ours],
                                   "best_peer": best_peer, "best_peer_mat": peers[best_peer],
                                   "ours_minus_best_peer": ours[best_ours] - peers[best_peer]}
    return out


def _grid(title: str, rows: dict, keys: list[str], cell: Callable[[str, dict], str]) -> None:
    print(f"\n{title}\n{'drafter':34}" + "".join(f"{k:>13}" for k in keys))
    for name, row in rows.items():
        print(f"{name:34}" + "".join(cell(k, row[k]) if k in row else f"{'-':>13}" for k in keys))


def print_tables(result: dict) -> None:
    cost, mat, feed = result["cost"], result["mat"], result["settings"]["fixed_feed"]
    keys = sorted({k for rows in cost.values() for k in rows},
                  key=lambda k: (int(k.split("/")[1]), int(k.split("/")[0])))
    per_request = {name: {_label(k): r for k, r in rows.items()} for name, rows in cost.items()}
    labels = [_label(k) for k in keys]
    _grid("µs per step, teacher-forced (min over rounds of the median step; whole batch)",
          per_request, labels, lambda k, r: f"{r['us_per_step']:13.1f}")
    _grid("tokens fed per request per step, teacher-forced (accepted + bonus)", per_request, labels,
          lambda k, r: f"{r['tokens_fed_per_step'] / int(k.split('B')[1]):13.2f}")
    fixed = {name: {_label(k): r for k, r in rows.items()} for name, rows in result["cost_fixed_feed"].items()}
    _grid(f"µs per step, fixed feed of {feed} tokens per request", fixed, labels,
          lambda k, r: f"{r['us_per_step']:13.1f}")
    names = list(dict.fromkeys(n for rows in mat.values() for n in rows))
    by_name = {n: {d: mat[d][n] for d in mat if n in mat[d]} for n in names}
    _grid(f"MAT, mean accepted tokens per step incl. bonus (K={result['settings']['draft_len']})",
          by_name, list(mat), lambda k, r: f"{r['mat']:13.2f}")
    for mode, found in result["checks"].items():
        print(f"\nchecks ({mode})")
        for key, value in found["cost"].items():
            print(f"  {key}: {value:.1f}x")
        for dataset, row in found["mat"].items():
            print(f"  MAT {dataset}: best of ours, {row['best_ours']}, {row['best_ours_mat']:.2f} vs best "
                  f"peer, {row['best_peer']}, {row['best_peer_mat']:.2f} ({row['ours_minus_best_peer']:+.2f})")


def _label(key: str) -> str:
    context, batch = (int(v) for v in key.split("/"))
    return f"{context // 1024}k/B{batch}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6))
    names = list(dict.fromkeys([*result["cost"], *(n for rows in result["mat"].values() for n in rows)]))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    for name, rows in result["cost"].items():
        for batch, style in ((1, "-o"), (64, "--s")):
            points = sorted((int(k.split("/")[0]), r["us_per_step"]) for k, r in rows.items()
                            if int(k.split("/")[1]) == batch)
            if points:
                left.plot(*zip(*points), style, color=colors[name], label=f"{name}, batch {batch}")
    left.set(xscale="log", yscale="log", xlabel="context tokens per request",
             ylabel="µs per step (median step, whole batch)", title="Cost of one step: feed accepted + draft")
    contexts = sorted({int(k.split("/")[0]) for rows in result["cost"].values() for k in rows})
    left.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
    left.legend(fontsize=7, ncol=2)
    left.grid(True, which="both", alpha=0.3)

    mat = result["mat"]
    names = list(dict.fromkeys(n for rows in mat.values() for n in rows))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j, d in enumerate(mat) if name in mat[d]]
        ys = [mat[d][name]["mat"] for d in mat if name in mat[d]]
        bars = right.bar(xs, ys, width, label=name, color=colors[name])
        right.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    right.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(mat))], list(mat))
    right.set(ylabel="mean accepted tokens per step (bonus incl.)",
              title=f"MAT, K={result['settings']['draft_len']}, teacher-forced exact match")
    right.legend(fontsize=7)
    right.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=164, help="(prompt, response) pairs per dataset")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration (min of medians)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--draft-len", type=int, default=8)
    parser.add_argument("--fixed-feed", type=int, default=4,
                        help="tokens fed per step in the fixed-feed cost run")
    parser.add_argument("--global-pool-tokens", type=int, default=1 << 20)
    parser.add_argument("--ablations", action="store_true",
                        help="also replay first/recent/frequent-occurrence SA drafts (slow, MAT only)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "drafters.json")
    args = parser.parse_args()

    began = time.perf_counter()
    specs, skipped = drafter_specs(args.draft_len, args.global_pool_tokens, args.ablations)
    tokenizer = datasets.load_tokenizer()
    workloads, notes = load_workloads(args.pairs, tokenizer)
    # The cost stream: every code edit, prompt then response, end to end (~1.3M tokens).
    stream = np.concatenate([np.concatenate([p.prompt, p.response]) for p in
                             datasets.tokenize_pairs(tokenizer, datasets.code_edit_pairs(10**6))])

    mat: dict[str, dict] = {}
    for dataset, pairs in workloads.items():
        mat[dataset] = {}
        for spec in specs:
            mat[dataset][spec.name] = replay_mat(spec, pairs, args.draft_len)
            print(f"MAT {dataset:11} {spec.name:26} {mat[dataset][spec.name]['mat']:.2f}", flush=True)

    # Teacher-forced cost, then the same with a fixed feed (see time_steps).
    cost: dict[str, dict] = {}
    cost_fixed: dict[str, dict] = {}
    for spec in (s for s in specs if s.timed):
        for table, feed in ((cost, None), (cost_fixed, args.fixed_feed)):
            table[spec.name] = {}
            for batch in args.batches:
                for context in args.contexts:
                    row = time_steps(spec, stream, context, max(args.contexts), batch, args.steps,
                                     args.warmup, args.draft_len, args.rounds, feed)
                    table[spec.name][f"{context}/{batch}"] = row
                    print(f"cost {spec.name:26} {context:>7} tokens batch {batch:>3} feed "
                          f"{feed or 'accepted+1'}: {row['us_per_step']:10.1f} µs/step", flush=True)

    result = {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "acceptance": "teacher-forced exact match, advance by accepted + 1",
                     "cost_stream_tokens": int(len(stream)),
                     "batching": {OURS: "one batched extend call per step",
                                  OURS_GLOBAL: "one batched extend call per step",
                                  ARCTIC: "Python loop per request (per-request API, as vLLM does)",
                                  ARCTIC_GLOBAL: "Python loop per request (per-request API, as vLLM does)",
                                  NGRAM_5: "vLLM's batch_propose_numba, one numba thread",
                                  NGRAM_14: "vLLM's batch_propose_numba, one numba thread"},
                     "arctic": {"tree_depth": 24, "spec_factor": 1.0, "min_token_prob": 0.1,
                                "max_cached_requests (global)": 10000},
                     "datasets": {name: {"pairs": len(p),
                                         "mean_prompt_tokens": float(np.mean([len(x.prompt) for x in p])),
                                         "mean_response_tokens": float(np.mean([len(x.response) for x in p]))}
                                  for name, p in workloads.items()}},
        "versions": versions(),
        "skipped": {**skipped, **notes},
        "cost": cost,
        "cost_fixed_feed": cost_fixed,
        "mat": mat,
    }
    result["checks"] = {"teacher_forced": checks(cost, mat),
                        f"fixed_feed_{args.fixed_feed}": checks(cost_fixed, {})}
    result["wall_s"] = time.perf_counter() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    plot(result, args.out.with_suffix(".png"))
    print_tables(result)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
