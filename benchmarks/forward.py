"""Forward-pass cost, side by side: Hugging Face (DynamicCache) vs our lean forward.

Each case is one forward of T new tokens per sequence on top of a `context`-token KV cache
(logits for every new token included, as a verify step needs them), timed repeatedly and
rolled back after each run. The two implementations alternate inside every repeat so that
load from other processes on this shared machine hits both alike. Reported per case: the
median wall time, its p10-p90 spread (how noisy the machine was), and the median process
CPU time (robust to other tenants when threads=1; with more threads it sums all threads,
including OpenMP spin-waiting).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.forward [--threads 1 2] [--repeats 15]

On a shared machine run with OMP_WAIT_POLICY=PASSIVE: with the default (spinning) policy,
2 threads on 2 busy cores measured 5-20x slower than 1 thread (see the report).

Writes benchmarks/results/forward.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from replicas.torch_engine.kv_cache import KVCache
from replicas.torch_engine.loader import resolve_model_dir
from replicas.torch_engine.model import LlamaModel, SeqSpan

CASES = ((1, 1), (1, 2), (1, 5), (1, 9), (1, 17), (8, 1), (8, 9))  # (batch, new tokens each)


@dataclass(frozen=True)
class Row:
    threads: int
    batch: int
    new_tokens: int
    hf_ms: float
    ours_ms: float
    hf_spread_ms: tuple[float, float]    # wall p10, p90
    ours_spread_ms: tuple[float, float]
    hf_cpu_ms: float                     # median process CPU time
    ours_cpu_ms: float


def _quantiles_ms(samples_s: list[float]) -> tuple[float, tuple[float, float]]:
    ms = sorted(s * 1e3 for s in samples_s)
    deciles = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return statistics.median(ms), (round(deciles[0], 1), round(deciles[-1], 1))


def _timed(fn) -> tuple[float, float]:
    """(wall s, process CPU s) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


class HfSide:
    """HF forward with a DynamicCache holding `context` tokens per row; crops back after a run."""

    def __init__(self, model_dir: Path, prompt_ids: torch.Tensor, batch: int) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.context = prompt_ids.shape[0]
        self.cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(prompt_ids[None].expand(batch, -1), past_key_values=self.cache, use_cache=True)

    def step(self, new_ids: torch.Tensor) -> None:  # new_ids [B, T]
        with torch.inference_mode():
            self.model(new_ids, past_key_values=self.cache, use_cache=True)
        self.cache.crop(-new_ids.shape[1])  # transformers 5: a negative count drops tokens


class OursSide:
    """Our forward over `batch` slots, each holding the same `context` tokens; truncates back."""

    def __init__(self, model: LlamaModel, prompt_ids: torch.Tensor, batch: int) -> None:
        self.model = model
        self.context = prompt_ids.shape[0]
        self.cache: KVCache = model.make_cache(max_slots=batch, max_seq_len=self.context + 32)
        self.slots = [self.cache.allocate() for _ in range(batch)]
        model(prompt_ids, [SeqSpan(self.slots[0], 0, self.context)], self.cache)
        for slot in self.slots[1:]:  # same prefix in every slot: copy instead of re-prefilling
            self.cache.k[:, slot] = self.cache.k[:, self.slots[0]]
            self.cache.v[:, slot] = self.cache.v[:, self.slots[0]]
            self.cache.lengths[slot] = self.context

    def step(self, new_ids: torch.Tensor) -> None:  # new_ids [B, T]
        t = new_ids.shape[1]
        spans = [SeqSpan(slot, self.context, t) for slot in self.slots]
        self.model.logits(self.model(new_ids.reshape(-1), spans, self.cache))
        for slot in self.slots:
            self.cache.truncate(slot, self.context)


def run(context: int, repeats: int, threads: list[int], warmup: int = 2) -> list[Row]:
    model_dir = resolve_model_dir()
    ours_model = LlamaModel.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(100, ours_model.cfg.vocab_size, (context,), generator=gen)
    rows = []
    for batch in sorted({b for b, _ in CASES}):
        hf, ours = HfSide(model_dir, prompt_ids, batch), OursSide(ours_model, prompt_ids, batch)
        for num_threads in threads:
            torch.set_num_threads(num_threads)
            for _, t in (c for c in CASES if c[0] == batch):
                new_ids = torch.randint(100, ours_model.cfg.vocab_size, (batch, t), generator=gen)
                hf_s, ours_s = [], []
                for i in range(warmup + repeats):
                    a, b = _timed(lambda: hf.step(new_ids)), _timed(lambda: ours.step(new_ids))
                    if i >= warmup:
                        hf_s.append(a)
                        ours_s.append(b)
                (hf_ms, hf_spread), (ours_ms, ours_spread) = (_quantiles_ms([w for w, _ in x]) for x in (hf_s, ours_s))
                hf_cpu, ours_cpu = (statistics.median(c for _, c in x) * 1e3 for x in (hf_s, ours_s))
                rows.append(Row(num_threads, batch, t, round(hf_ms, 1), round(ours_ms, 1), hf_spread, ours_spread,
                                round(hf_cpu, 1), round(ours_cpu, 1)))
                print(_format(rows[-1]), flush=True)
        del hf
    return rows


HEADER = (f"{'threads':>7} {'batch':>5} {'tokens':>6} | {'HF ms':>7} {'ours ms':>7} {'speedup':>7} | "
          f"{'HF p10-p90':>11} {'ours p10-p90':>12} | {'HF cpu':>7} {'ours cpu':>8}")


def _format(r: Row) -> str:
    return (f"{r.threads:>7} {r.batch:>5} {r.new_tokens:>6} | {r.hf_ms:>7.1f} {r.ours_ms:>7.1f} "
            f"{r.hf_ms / r.ours_ms:>6.2f}x | {r.hf_spread_ms[0]:>5.0f}-{r.hf_spread_ms[1]:<5.0f} "
            f"{r.ours_spread_ms[0]:>6.0f}-{r.ours_spread_ms[1]:<5.0f} | {r.hf_cpu_ms:>7.1f} {r.ours_cpu_ms:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "forward.json")
    args = parser.parse_args()
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "(default: active)")
    print(f"context {args.context} tokens, {args.repeats} repeats, OMP_WAIT_POLICY={wait_policy}; "
          f"wall medians, p10-p90 and CPU medians in ms")
    print(HEADER)
    rows = run(args.context, args.repeats, args.threads)
    for num_threads in args.threads:
        wall = {(r.batch, r.new_tokens): r.ours_ms for r in rows if r.threads == num_threads}
        cpu = {(r.batch, r.new_tokens): r.ours_cpu_ms for r in rows if r.threads == num_threads}
        print(f"threads {num_threads}: ours 9-token / 1-token = {wall[(1, 9)] / wall[(1, 1)]:.2f}x wall, "
              f"{cpu[(1, 9)] / cpu[(1, 1)]:.2f}x cpu; batch 8x9 / 8x1 = {wall[(8, 9)] / wall[(8, 1)]:.2f}x wall")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "context_tokens": args.context, "repeats": args.repeats, "torch": torch.__version__,
        "omp_wait_policy": wait_policy, "load_average_at_end": os.getloadavg(),
        "machine": platform.processor() or platform.machine(), "rows": [asdict(r) for r in rows],
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
