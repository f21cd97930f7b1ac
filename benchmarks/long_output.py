"""Long outputs: does the embedded engine keep its speed as a request's output grows?

Requests decode `--max-tokens` each (EOS ignored), 1 and 8 at once, speculation off and
hybrid. Per quarter of the output: decode tokens/s over all requests, and per step the
engine's wall time beside the compiled forward's own (forward + logits) inside it, so what the
engine adds per step (Python bookkeeping: text, drafts, prefix cache) is measured, not
guessed; plus the gap between one step's end and the next step's start (the hand-off to the
event loop). The native forward's time grows with the context (attention); the engine's part
should not. Writes benchmarks/results/long_output.json and .png.

    .venv/bin/python benchmarks/long_output.py [--max-tokens 2048] [--batches 1,8] [--modes off,hybrid]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import workloads  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig  # noqa: E402
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUARTERS = 4


class StepClock:
    """Wall time of every engine step and of the native forward's calls inside it."""

    def __init__(self, core) -> None:
        self.steps: list[tuple[float, float, float]] = []  # (start, wall, native) seconds
        self._native = 0.0
        step, native = core.step, core.model._forward  # the compiled forward (NativeLlamaModel)
        clock = self

        class Timed:  # the compiled module's methods, timed; everything else passed through
            def __getattr__(self, name):
                fn = getattr(native, name)
                if name not in ("forward", "logits"):
                    return fn

                def call(*args):
                    start = time.perf_counter()
                    try:
                        return fn(*args)
                    finally:
                        clock._native += time.perf_counter() - start
                return call

        core.model._forward = Timed()

        def timed_step():
            self._native, start = 0.0, time.perf_counter()
            deltas = step()
            self.steps.append((start, time.perf_counter() - start, self._native))
            return deltas

        core.step = timed_step


async def run_requests(engine: TorchEngine, prompts: list[str], mode: str,
                       max_tokens: int) -> list[tuple[list[float], list[int]]]:
    """Every request's per-token arrival times and its tokens."""
    async def one(i: int, prompt: str) -> tuple[list[float], list[int]]:
        req = GenerationRequest(f"long-{mode}-{i}-{time.monotonic_ns()}", prompt,
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True), RequestSpeculation(mode="auto"))
        stamps: list[float] = []
        tokens: list[int] = []
        async for delta in engine.generate(req):
            stamps += [time.perf_counter()] * len(delta.token_ids)
            tokens += delta.token_ids
        return stamps, tokens
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def by_quarter(stamps: list[list[float]], steps: list[tuple[float, float, float]], max_tokens: int) -> list[dict]:
    """Output positions [q * n/4, (q + 1) * n/4) of every request; the steps that ran while
    the requests were in that quarter (between its first and last token)."""
    size, out = max_tokens // QUARTERS, []
    for q in range(QUARTERS):
        lo, hi = max(q * size, 1), (q + 1) * size - 1  # the first token is the prefill's
        t0, t1 = min(s[lo - 1] for s in stamps), max(s[hi] for s in stamps)
        inside = [(start, wall, native) for start, wall, native in steps if t0 <= start and start + wall <= t1]
        gaps = [b[0] - (a[0] + a[1]) for a, b in zip(inside, inside[1:])]
        out.append({
            "tokens_per_s": len(stamps) * (hi - lo + 1) / (t1 - t0),
            "step_ms": statistics.median(w for _, w, _ in inside) * 1e3,
            "native_ms": statistics.median(n for _, _, n in inside) * 1e3,
            "engine_ms": statistics.median(w - n for _, w, n in inside) * 1e3,
            "gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "steps": len(inside),
        })
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, cost) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = [f"q{q + 1}" for q in range(QUARTERS)]
    for key, quarters in result["runs"].items():
        rate.plot(x, [q["tokens_per_s"] for q in quarters], marker="o", label=key)
        line, = cost.plot(x, [q["native_ms"] for q in quarters], marker="o", label=f"{key}: native forward")
        cost.plot(x, [q["engine_ms"] for q in quarters], marker="s", ls="--", color=line.get_color(),
                  label=f"{key}: engine beyond it")
    rate.set_ylabel("decode tokens/s (all requests)")
    rate.set_title(f"quarters of a {result['max_tokens']}-token output")
    cost.set_ylabel("ms per step (median)")
    cost.set_title("per step: the native forward vs what the engine adds")
    for ax in (rate, cost):
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['machine']['model']}, {result['kernel_path']} kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="off,hybrid")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_output.json")
    args = parser.parse_args()
    if args.max_tokens < 4 * QUARTERS:
        parser.error(f"--max-tokens: at least {4 * QUARTERS}")

    loop = asyncio.new_event_loop()
    # No cross-request SA pool and no prefix cache: each mode replays the same prompts, and the
    # pool drafted hybrid's answers from off's run word for word (16 tokens a step on open chat)
    engine = TorchEngine(TorchEngineConfig(max_batch_size=8, max_seq_len=4096, sa_global_pool_tokens=0,
                                           prefix_cache_bytes=0, speculation=SpeculationConfig()))
    loop.run_until_complete(engine.start())
    clock = StepClock(engine.core)
    chat = workloads(engine.tokenizer, 8)["chat"]
    base = engine.config.speculation
    result = {"machine": cpu_description(), "kernel_path": getattr(engine.core.model, "isa", "torch"),
              "max_tokens": args.max_tokens, "runs": {}, "identical_to_first_mode": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        first_tokens = None
        for mode in args.modes.split(","):
            engine.configure(dataclasses.replace(base, mode=mode))
            clock.steps.clear()
            ran = loop.run_until_complete(run_requests(engine, chat[:batch], mode, args.max_tokens))
            stamps, tokens = [r[0] for r in ran], [r[1] for r in ran]
            if first_tokens is None:
                first_tokens = tokens
            else:
                result["identical_to_first_mode"][f"batch {batch}, {mode}"] = tokens == first_tokens
            quarters = by_quarter(stamps, clock.steps, args.max_tokens)
            result["runs"][f"batch {batch}, {mode}"] = quarters
            for q, row in enumerate(quarters):
                gap = f"{row['gap_ms']:.3f}" if row["gap_ms"] is not None else "-"
                print(f"batch {batch} {mode:6s} q{q + 1}: {row['tokens_per_s']:7.1f} tok/s, step {row['step_ms']:6.2f} ms "
                      f"= native {row['native_ms']:6.2f} + engine {row['engine_ms']:5.2f}; gap {gap} ms", flush=True)
    loop.run_until_complete(engine.shutdown())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its .png")
    differing = sorted(where for where, same in result["identical_to_first_mode"].items() if not same)
    if differing:
        raise SystemExit(f"speculation changed the output: {', '.join(differing)}")


if __name__ == "__main__":
    main()
