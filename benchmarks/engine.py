"""Embedded-engine benchmark: speculation off / SA / MTP / hybrid vs llama.cpp and transformers.

One run, same prompts, same thread count: decode and end-to-end tokens/s, TTFT and mean
accepted tokens per verify step (MAT) on code edits (answer start prefilled, see DESIGN.md)
and open chat, at batch 1 and 8; MTP acceptance by draft position; hybrid against speculation
disabled in alternating runs (one request with the gate shut, batches of 4 and 8 under and
over the shipped gate: the batch's tokens/s and its mean request's time; 4 clients sending
request after request: tokens/s while all 4 are under way); llama.cpp's
server on the same GGUF through `xllamacpp` (plain, `ngram_mod`, `ngram_map_k`; run in the
bench venv by benchmarks/llamacpp_peer.py); and transformers' `generate`, plain and with
prompt lookup (10 tokens). Hybrid with the measured draft rule (`adaptive_drafts`, the
default) also runs against hybrid drafting all its rules allow (`hybrid_fixed`), at batch 1
and at batch 8 with the gate open. Every request
decodes exactly `--max-tokens` (EOS ignored, as for llama.cpp). Writes
benchmarks/results/engine.json, engine.png and engine.md (the side-by-side tables).

    .venv/bin/python benchmarks/engine.py [--prompts 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_peers import bench_llamacpp, bench_transformers_apart, llamacpp_figures  # noqa: E402
from benchmarks.llamacpp_peer import MODES as LLAMACPP_MODES  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig  # noqa: E402
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402
from training.corpora import EDIT_PREFILL, SPEC_BENCH, code_edits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The server settings each of our rows runs with. "hybrid_fixed" is hybrid drafting all the
# rules allow (`adaptive_drafts` off, as before the measured draft rule); it runs beside
# hybrid in a comparison of its own (ADAPTIVE_MODES), each of the two first on half the prompts.
MODE_SETTINGS = {"off": {"mode": "off"}, "sa": {"mode": "sa"}, "mtp": {"mode": "mtp"}, "hybrid": {"mode": "hybrid"},
                 "hybrid_fixed": {"mode": "hybrid", "adaptive_drafts": False}}
MODES = ("off", "sa", "mtp", "hybrid")
# The alternating runs' clients: as many as the shipped gate lets speculate, each sending
# CLIENT_ROUNDS requests one after another.
CLIENTS, CLIENT_ROUNDS = 4, 3
ADAPTIVE_MODES = ("hybrid", "hybrid_fixed")
WORKLOADS = ("code_edit", "chat")


def workloads(tokenizer, count: int) -> dict[str, list[str]]:
    """Code-edit prompts (real edits, answer start prefilled) and open chat questions."""
    def chat(user: str, prefill: str = "") -> str:
        messages = [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill

    edits = []
    for row in code_edits():
        if 1200 <= len(row["before"]) <= 2600:
            edits.append(chat(f"{row['instruction']}\n\n```python\n{row['before']}```\n"
                              "Apply the change and output the whole updated file.", EDIT_PREFILL))
    questions = []
    for line in SPEC_BENCH.open():
        row = json.loads(line)
        if row["category"] in ("writing", "roleplay", "stem", "humanities", "qa", "reasoning"):
            questions.append(chat(row["turns"][0]))
    step_e, step_q = max(1, len(edits) // count), max(1, len(questions) // count)
    return {"code_edit": edits[::step_e][:count], "chat": questions[::step_q][:count]}


async def run_request(engine: TorchEngine, name: str, prompt: str, max_tokens: int,
                      arrivals: list[tuple[float, int]] | None = None, prediction: tuple[int, ...] = ()) -> dict:
    """One request of exactly `max_tokens` tokens (with the client's `prediction` of its output,
    if any): its tokens, submission, first and last token times, speculation usage; (time,
    tokens) of each delta appended to `arrivals`."""
    req = GenerationRequest(f"{name}-{time.monotonic_ns()}", prompt,
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True), RequestSpeculation(mode="auto"),
                            prediction=prediction)
    tokens, first, last, submitted = [], None, None, time.perf_counter()
    async for delta in engine.generate(req):
        now = time.perf_counter()
        first = first or now
        tokens += delta.token_ids
        last = delta
        if arrivals is not None:
            arrivals.append((now, len(delta.token_ids)))
    return {"tokens": tokens, "submit_s": submitted, "first_s": first, "end_s": now, "spec": last.speculation}


async def run_batch(engine: TorchEngine, prompts: list[str], mode: str, max_tokens: int) -> list[dict]:
    """Run prompts concurrently; per request: tokens, decode time (first token to last), spec usage."""
    return await asyncio.gather(*(run_request(engine, f"{mode}-{i}", p, max_tokens) for i, p in enumerate(prompts)))


async def run_clients(engine: TorchEngine, prompts: list[str], mode: str, max_tokens: int, clients: int,
                      rounds: int) -> dict:
    """`clients` clients, each sending its next request as soon as its last one ends (the load a
    server sees at that concurrency), `rounds` each; client c's k-th prompt is prompts[(c + k) %
    len]. Tokens/s while every client had a request under way (from the last client's first
    token to the first client's last: no batch running down at the end), and the mean
    request's time from submission."""
    arrivals, done, outputs = [], [], {}

    async def client(c: int) -> None:
        for k in range(rounds):
            run = await run_request(engine, f"{mode}-{c}-{k}", prompts[(c + k) % len(prompts)], max_tokens, arrivals)
            done.append((k, run))
            outputs[c, k] = run["tokens"]

    await asyncio.gather(*(client(c) for c in range(clients)))
    start = max(run["first_s"] for k, run in done if k == 0)
    end = min(run["end_s"] for k, run in done if k == rounds - 1)
    return {"steady_tokens_per_s": sum(n for t, n in arrivals if start < t <= end) / (end - start),
            "mean_request_s": statistics.mean(run["end_s"] - run["submit_s"] for _, run in done),
            "outputs": [outputs[key] for key in sorted(outputs)]}


@contextlib.contextmanager
def mtp_by_position(core, drafted: list[int], accepted: list[int]):
    """Count MTP drafts and acceptances by draft position (0-based) while the block runs.

    The engine records every verify step once, in `core.totals.record(source, num_draft,
    num_accepted)`; wrapping that call here keeps per-position counters out of the engine.
    Position k is drafted when a draft has more than k tokens, accepted when k < num_accepted.
    """
    totals = core.totals
    record_step = totals.record

    def record(source: str, num_draft: int, num_accepted: int) -> None:
        record_step(source, num_draft, num_accepted)
        if source == "mtp":
            for k in range(num_draft):
                if k == len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[k] += 1
                accepted[k] += k < num_accepted

    totals.record = record
    try:
        yield
    finally:
        del totals.record  # the class's own method again


def summarize(results: list[dict], wall_s: float, e2e_wall_s: float) -> dict:
    """Decode tokens/s (first token to last), end-to-end tokens/s (submission to last token,
    prefill included), median TTFT, MAT (tokens per verify step, bonus included)."""
    decode_tokens = sum(len(r["tokens"]) - 1 for r in results)
    steps = sum(r["spec"]["steps"] for r in results)
    accepted = sum(r["spec"]["accepted_tokens"] for r in results)
    return {
        "tokens_per_s": decode_tokens / wall_s,
        "e2e_tokens_per_s": sum(len(r["tokens"]) for r in results) / e2e_wall_s,
        "ttft_ms": statistics.median((r["first_s"] - r["submit_s"]) * 1e3 for r in results),
        "mat": (accepted + steps) / steps if steps else 1.0,
        "draft_tokens": sum(r["spec"]["draft_tokens"] for r in results),
        "accepted_tokens": accepted,
        "completion_tokens": sum(len(r["tokens"]) for r in results),
    }


def bench_modes(engine: TorchEngine, loop, prompts: dict[str, list[str]], max_tokens: int) -> dict:
    """Every mode at batch 1 and 8 (the shipped gate, then held open); then hybrid with the
    measured draft rule against hybrid drafting all its rules allow, at batch 1 and 8 (gate
    held open); and the costs the rule measured meanwhile, in plain steps."""
    out = {"batch1": bench_engine(engine, loop, prompts, max_tokens, batch=1),
           "batch8": bench_engine(engine, loop, prompts, max_tokens, batch=8),
           "batch8_gate_open": bench_engine(engine, loop, prompts, max_tokens, batch=8, open_gate=True)}
    print("hybrid, measured draft rule against every draft its rules allow:")
    out["adaptive"] = {
        "batch1": bench_engine(engine, loop, prompts, max_tokens, batch=1, modes=ADAPTIVE_MODES),
        "batch8_gate_open": bench_engine(engine, loop, prompts, max_tokens, batch=8, open_gate=True,
                                         modes=ADAPTIVE_MODES)}
    costs = engine.core.drafts.costs
    out["measured_costs"] = {f"batch{b}": {"row": costs.row(b), "ask": costs.ask(b), "position": costs.catch_up(b, 1)}
                             for b in (1, 8)}
    return out


def bench_engine(engine: TorchEngine, loop, prompts: dict[str, list[str]], max_tokens: int, batch: int,
                 open_gate: bool = False, modes: tuple[str, ...] = MODES) -> dict:
    """Every mode on every workload; `open_gate` lifts the batch gate to `batch` (speculation
    in every step, to see what it would cost), else the shipped gate decides per step.

    Modes alternate per prompt group (off, sa, mtp, hybrid; then sa, mtp, hybrid, off ...),
    so a slow spell of this shared machine and whatever running after another mode costs
    fall on every mode alike rather than on whichever ran then (the engine has no prefix
    cache here: every run prefills cold, as llama.cpp's). Greedy outputs are checked against
    the first mode's.
    """
    out, outputs = {}, {}
    base = engine.config.speculation
    gate = max(batch, base.batch_gate) if open_gate else base.batch_gate
    core = engine.core
    for workload, texts in prompts.items():
        # Batch 1 alternates over the prompts; a batch of 8 holds them all, so it runs once per
        # mode, each mode first once (in the two rounds it ran before, two modes never ran first).
        groups = ([texts[i:i + batch] for i in range(0, len(texts), batch)] if batch == 1
                  else [(texts * batch)[:batch]] * len(modes))
        walls, e2e_walls = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0)
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        mtp_counts = {mode: ([], []) for mode in modes}  # (drafted, accepted) by draft position
        for k, group in enumerate(groups):
            for mode in modes[k % len(modes):] + modes[:k % len(modes)]:  # each mode first in turn
                engine.configure(dataclasses.replace(base, batch_gate=gate, **MODE_SETTINGS[mode]))
                with mtp_by_position(core, *mtp_counts[mode]):
                    res = loop.run_until_complete(run_batch(engine, group, mode, max_tokens))
                # decode time of the group: first token of any request to the last token of all
                walls[mode] += max(r["end_s"] for r in res) - min(r["first_s"] for r in res)
                e2e_walls[mode] += max(r["end_s"] for r in res) - min(r["submit_s"] for r in res)
                results[mode] += res
        for mode in modes:
            summary = summarize(results[mode], walls[mode], e2e_walls[mode])
            drafted, accepted = mtp_counts[mode]
            summary["mtp_accept_by_position"] = [round(a / d, 4) for a, d in zip(accepted, drafted) if d][:8]
            out[f"{workload}/{mode}"] = summary
            outputs[f"{workload}/{mode}"] = [r["tokens"] for r in results[mode]]
            print(f"  batch {batch}{' gate open' if open_gate else ''} {workload:9s} {mode:12s} "
                  f"{summary['tokens_per_s']:7.2f} tok/s decode, {summary['e2e_tokens_per_s']:7.2f} end-to-end  "
                  f"MAT {summary['mat']:.2f}", flush=True)
    engine.configure(base)
    for workload in prompts:  # speculation must never change greedy output
        ref = outputs[f"{workload}/{modes[0]}"]
        out[f"{workload}/identical_to_{modes[0]}"] = all(outputs[f"{workload}/{m}"] == ref for m in modes)
    return out


def bench_alternating(engine: TorchEngine, loop, prompts: dict[str, list[str]], max_tokens: int, repeats: int) -> dict:
    """Hybrid against speculation disabled in alternating runs (medians of `repeats`: a single
    run of each moves more than what is measured): one chat request with the gate shut (a
    gated-off step), batches of 4 (under the shipped gate) and 8 (over it), and CLIENTS
    clients sending request after request (`run_clients`), on each workload; `bench_engine`
    runs a batch once per mode. A batch's tokens/s runs to its last token: one that holds its
    requests to the end is as fast as its slowest, while a server's users each wait for their
    own (the time its mean request took from the batch's first token) and a server's slots
    fill again as requests end (the clients' tokens/s while all of them had one under way)."""
    base = engine.config.speculation
    hybrid = dataclasses.replace(base, mode="hybrid")

    def batch(group: list[str]):
        def run(mode: str) -> tuple[float, float, list]:
            res = loop.run_until_complete(run_batch(engine, group, mode, max_tokens))
            first = min(r["first_s"] for r in res)
            return (sum(len(r["tokens"]) - 1 for r in res) / (max(r["end_s"] for r in res) - first),
                    statistics.mean(r["end_s"] - first for r in res), [r["tokens"] for r in res])
        return run

    def clients(texts: list[str]):
        def run(mode: str) -> tuple[float, float, list]:
            res = loop.run_until_complete(run_clients(engine, texts, mode, max_tokens, CLIENTS, CLIENT_ROUNDS))
            return res["steady_tokens_per_s"], res["mean_request_s"], res["outputs"]
        return run

    cases = {"batch1/chat, gate shut": (batch(prompts["chat"][:1]), dataclasses.replace(hybrid, batch_gate=0))}
    for size in (4, 8):
        for workload, texts in prompts.items():
            cases[f"batch{size}/{workload}"] = (batch((texts * size)[:size]), hybrid)
    for workload, texts in prompts.items():
        cases[f"{CLIENTS} clients/{workload}"] = (clients(texts), hybrid)
    out = {}
    for case, (run, hybrid_cfg) in cases.items():
        rates, waits, outputs = {"off": [], "hybrid": []}, {"off": [], "hybrid": []}, []
        pair = (("off", dataclasses.replace(base, mode="off")), ("hybrid", hybrid_cfg))
        for rep in range(repeats):
            for mode, cfg in pair[rep % 2:] + pair[:rep % 2]:  # each first in turn
                engine.configure(cfg)
                rate, wait, tokens = run(mode)
                rates[mode].append(rate)
                waits[mode].append(wait)
                outputs.append(tokens)
        off, hybrid_rate = statistics.median(rates["off"]), statistics.median(rates["hybrid"])
        off_wait, hybrid_wait = statistics.median(waits["off"]), statistics.median(waits["hybrid"])
        out[case] = {"off_tokens_per_s": off, "hybrid_tokens_per_s": hybrid_rate, "hybrid_vs_off": hybrid_rate / off,
                     "off_mean_request_s": off_wait, "hybrid_mean_request_s": hybrid_wait,
                     "mean_request_off_over_hybrid": off_wait / hybrid_wait,
                     # every run's greedy tokens, hybrid's and off's, the same
                     "identical_to_off": all(tokens == outputs[0] for tokens in outputs)}
        print(f"  {case:22s} hybrid {hybrid_rate:7.2f} tok/s against off {off:7.2f}: {hybrid_rate / off:.3f}x; "
              f"mean request {off_wait / hybrid_wait:.3f}x sooner", flush=True)
    engine.configure(base)
    return out


def identical_flags(node, path: str = ""):
    """(where, flag) of every `identical_to_*` check in the result, however deep."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}/{key}" if path else str(key)
            if str(key).rsplit("/", 1)[-1].startswith("identical_to_"):  # e.g. "chat/identical_to_off"
                yield where, value
            else:
                yield from identical_flags(value, where)


def table_rows(result: dict, batch: str = "batch1") -> list[tuple[str, dict[str, tuple[float, float]]]]:
    """Rows of (name, {workload: (decode tok/s, end-to-end tok/s)}) for the side-by-side table."""
    rows = []
    for mode in MODES:
        rows.append((f"ours, {mode}", {w: (result[batch][f"{w}/{mode}"]["tokens_per_s"],
                                           result[batch][f"{w}/{mode}"]["e2e_tokens_per_s"]) for w in WORKLOADS}))
    if result.get("llamacpp"):
        for mode in LLAMACPP_MODES:
            rows.append((f"llama.cpp, {mode}", {w: llamacpp_figures(result, batch, w, mode) for w in WORKLOADS}))
    if batch == "batch1":
        for name in ("hf_plain", "hf_prompt_lookup"):
            rows.append((f"transformers, {name[3:]}", {w: (result["transformers"][f"{w}/{name}"]["tokens_per_s"], None)
                                                       for w in WORKLOADS}))
    return rows


def markdown_table(result: dict) -> str:
    cpu = result["machine"]
    lines = [f"{cpu['model']} (family {cpu['family']} model {cpu['model_number']}), {result['threads']} threads, "
             f"kernels {result['kernel_path']}, greedy, {result['settings']['max_tokens']} tokens per request", ""]
    for batch in ("batch1", "batch8"):
        lines += [f"| {batch}, tokens/s | edit decode | edit end-to-end | chat decode | chat end-to-end |",
                  "|---|---:|---:|---:|---:|"]
        for name, figures in table_rows(result, batch):
            cells = [f"{v:.1f}" if v is not None else "-" for w in WORKLOADS for v in figures[w]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["| hybrid, tokens/s (decode / end-to-end) | edits | chat |", "|---|---:|---:|"]
    for batch, runs in result["adaptive"].items():
        for mode, name in (("hybrid", "measured draft rule"), ("hybrid_fixed", "every draft its rules allow")):
            cells = [f"{runs[f'{w}/{mode}']['tokens_per_s']:.1f} / {runs[f'{w}/{mode}']['e2e_tokens_per_s']:.1f}"
                     for w in WORKLOADS]
            lines.append(f"| {batch}, {name} | " + " | ".join(cells) + " |")
    lines += ["", f"| alternating runs, decode tokens/s (median of {result['settings']['repeats']}) "
                  "| off | hybrid | hybrid / off | mean request, off / hybrid time |", "|---|---:|---:|---:|---:|"]
    for case, run in result["alternating"].items():
        lines.append(f"| {case} | {run['off_tokens_per_s']:.1f} | {run['hybrid_tokens_per_s']:.1f} "
                     f"| {run['hybrid_vs_off']:.3f} | {run['mean_request_off_over_hybrid']:.3f} |")
    lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 8))
    for row, batch in enumerate(("batch1", "batch8")):
        rows = table_rows(result, batch)
        for ax, workload in zip(axes[row], WORKLOADS):
            x = range(len(rows))
            decode = [figures[workload][0] or 0.0 for _, figures in rows]
            e2e = [figures[workload][1] or 0.0 for _, figures in rows]
            colors = ["#4a7" if name.startswith("ours") else "#57b" if "llama" in name else "#c66" for name, _ in rows]
            ax.bar([i - 0.2 for i in x], decode, width=0.4, color=colors, label="decode")
            ax.bar([i + 0.2 for i in x], e2e, width=0.4, color=colors, alpha=0.5, label="end-to-end")
            ax.set_xticks(list(x), [name.replace(", ", "\n") for name, _ in rows], fontsize=7)
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{workload}, {batch} (solid: decode, pale: end-to-end)")
    fig.suptitle(f"{result['machine']['model']}, {result['threads']} threads, kernels {result['kernel_path']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compute_ratios(result: dict) -> dict[str, float]:
    ratios = {}
    for workload in WORKLOADS:
        for batch in ("batch1", "batch8", "batch8_gate_open"):
            off = result[batch][f"{workload}/off"]
            for mode in MODES[1:]:
                ours = result[batch][f"{workload}/{mode}"]
                ratios[f"{batch}/{workload}/{mode}_vs_off"] = ours["tokens_per_s"] / off["tokens_per_s"]
                ratios[f"{batch}/{workload}/{mode}_vs_off_e2e"] = ours["e2e_tokens_per_s"] / off["e2e_tokens_per_s"]
        for batch, runs in result["adaptive"].items():
            adaptive, fixed = runs[f"{workload}/hybrid"], runs[f"{workload}/hybrid_fixed"]
            ratios[f"{batch}/{workload}/hybrid_vs_hybrid_fixed"] = adaptive["tokens_per_s"] / fixed["tokens_per_s"]
            ratios[f"{batch}/{workload}/hybrid_vs_hybrid_fixed_e2e"] = (
                adaptive["e2e_tokens_per_s"] / fixed["e2e_tokens_per_s"])
        for mode, peer in (("hybrid", "hf_prompt_lookup"), ("off", "hf_plain")):
            if (theirs := result["transformers"][f"{workload}/{peer}"]["tokens_per_s"]) is not None:
                ratios[f"batch1/{workload}/{mode}_vs_{peer}"] = result["batch1"][f"{workload}/{mode}"]["tokens_per_s"] / theirs
        if result.get("llamacpp"):
            for batch in ("batch1", "batch8"):
                plain_decode, _ = llamacpp_figures(result, batch, workload, "plain")
                best_e2e = max(llamacpp_figures(result, batch, workload, m)[1] for m in LLAMACPP_MODES[1:])
                ours = result[batch]
                ratios[f"{batch}/{workload}/off_vs_llamacpp_plain"] = ours[f"{workload}/off"]["tokens_per_s"] / plain_decode
                ratios[f"{batch}/{workload}/hybrid_e2e_vs_llamacpp_best_ngram_e2e"] = (
                    ours[f"{workload}/hybrid"]["e2e_tokens_per_s"] / best_e2e)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each hybrid-against-off case")
    parser.add_argument("--mtp-weights", default="default", help="'none' runs without MTP heads")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine.json")
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    mtp_weights = None if args.mtp_weights == "none" else args.mtp_weights
    # No cross-request SA pool: every mode replays the same prompts, and a pool would
    # draft each answer from its earlier run (benchmarks/drafters.py measures the pool).
    # No prefix cache either: each prompt recurs across modes and batches, and a later run would
    # skip its prefill, while llama.cpp's server prefills every request (cache_prompt off).
    engine = TorchEngine(TorchEngineConfig(max_batch_size=8, max_seq_len=4096, mtp_weights=mtp_weights,
                                           sa_global_pool_tokens=0, prefix_cache_bytes=0,
                                           speculation=SpeculationConfig()))
    loop.run_until_complete(engine.start())
    prompts = workloads(engine.tokenizer, args.prompts)
    result = {"settings": vars(args) | {"out": str(args.out)}, "machine": cpu_description(),
              "kernel_path": getattr(engine.core.model, "isa", "torch"), "threads": engine.core.model.num_threads,
              "speculation": dataclasses.asdict(engine.config.speculation)}
    print(f"our engine ({result['kernel_path']} kernels, {result['threads']} threads):")
    result |= bench_modes(engine, loop, prompts, args.max_tokens)
    print("hybrid against off, alternating:")
    result["alternating"] = bench_alternating(engine, loop, prompts, args.max_tokens, args.repeats)
    loop.run_until_complete(engine.shutdown())
    print("transformers:")
    result["transformers"] = bench_transformers_apart(prompts, args.max_tokens, result["threads"])
    print("llama.cpp:")
    result["llamacpp"] = None if args.no_llamacpp else bench_llamacpp(prompts, args.max_tokens, result["threads"])

    result["ratios"] = compute_ratios(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    table = markdown_table(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print("ratios:")
    for key, value in result["ratios"].items():
        print(f"  {key:55s} {value:5.2f}x")
    print(f"wrote {args.out} and its .png and .md")
    differing = sorted(where for where, same in identical_flags(result) if not same)
    if differing:
        raise SystemExit(f"speculation changed greedy output: {', '.join(differing)}")


if __name__ == "__main__":
    main()
