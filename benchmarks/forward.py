"""Forward-pass cost, side by side: the native quantized forward vs the fp32 torch forward.

Each case is one forward of T new tokens per sequence on top of a `context`-token KV cache
(logits for every new token included, as a verify step needs them), timed repeatedly and
rolled back after each run; the two forwards alternate inside every repeat so that load from
other processes hits both alike. Reported: median wall time and its p10-p90 spread, the cost
of a 1..17-row verify relative to one row, batch 8, the time to first token of a 1,000-token
prompt, decode tokens/s against the memory-bandwidth roofline (weights + KV read per token),
and the CPU model and the kernel path used. Beside them, llama.cpp's own step of the same row
counts on the same context and GGUF (`llamacpp_peer.run_step_costs`, in the bench venv): its
prompt path, which computes the last row's logits only, so it is a lower bound on its verify.

    .venv/bin/python -m benchmarks.forward [--threads 1 2] [--repeats 15] [--context 1024]

Writes benchmarks/results/forward.json and forward.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Set before torch loads OpenMP. By default (300,000 spins) its threads spin on for
# milliseconds after each torch op, on the cores the other side's step then needs: on a Xeon,
# 2 threads, a 1-row native step at 1,024 tokens measured 7.5 ms right after an fp32 step
# and 6.4 ms with 30,000 spins, while the fp32 steps kept their times (sleeping OpenMP threads
# at once instead slowed them by a third). The engine itself runs torch single-threaded beside
# the native forward (torch_engine/engine.py), so no spinning team meets its steps.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import torch  # noqa: E402

from benchmarks.llamacpp_peer import peer_available, run_peer  # noqa: E402
from benchmarks.machine import cpu_description, read_bandwidth_gbs  # noqa: E402
from replicas.torch_engine.kv_cache import PagedKVCache  # noqa: E402
from replicas.torch_engine.loader import packaged_gguf_path, resolve_model_dir  # noqa: E402
from replicas.torch_engine.model import LlamaModel, SeqSpan  # noqa: E402
from replicas.torch_engine.native_model import NativeLlamaModel  # noqa: E402

CASES = ((1, 1), (1, 2), (1, 3), (1, 5), (1, 8), (1, 9), (1, 13), (1, 17), (8, 1), (8, 9))  # (batch, new tokens)
PREFILL_TOKENS = 1000


@dataclass(frozen=True)
class Row:
    threads: int
    batch: int
    new_tokens: int
    ours_ms: float                       # the native forward (what the CPU engine runs)
    fp32_ms: float                       # the fp32 torch forward it replaced
    ours_spread_ms: tuple[float, float]  # wall p10, p90
    fp32_spread_ms: tuple[float, float]


def _quantiles_ms(samples_s: list[float]) -> tuple[float, tuple[float, float]]:
    ms = sorted(s * 1e3 for s in samples_s)
    deciles = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return round(statistics.median(ms), 2), (round(deciles[0], 2), round(deciles[-1], 2))


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def copy_slot(cache, src: int, dst: int, length: int) -> None:
    """`dst` holds a copy of `src`'s first `length` positions, in memory of its own."""
    if isinstance(cache, PagedKVCache):
        cache.reserve(dst, 0, length)
        for page, into in zip(cache.pages_of(src), cache.pages_of(dst)):
            cache.copy_page(page, into)
    else:
        cache.k[:, dst] = cache.k[:, src]
        cache.v[:, dst] = cache.v[:, src]
    cache.lengths[dst] = length


class Side:
    """One model over `batch` slots, each holding the same `context` tokens; truncates back."""

    def __init__(self, model, prompt_ids: torch.Tensor, batch: int) -> None:
        self.model = model
        self.context = prompt_ids.shape[0]
        self.cache = model.make_cache(batch, self.context + 32)
        self.slots = [self.cache.allocate() for _ in range(batch)]
        with torch.inference_mode():
            model(prompt_ids, [SeqSpan(self.slots[0], 0, self.context)], self.cache)
        for slot in self.slots[1:]:  # same prefix in every slot: copied (not shared) instead of re-prefilled
            copy_slot(self.cache, self.slots[0], slot, self.context)

    def step(self, new_ids: torch.Tensor) -> None:  # new_ids [B, T]
        spans = [SeqSpan(slot, self.context, new_ids.shape[1]) for slot in self.slots]
        with torch.inference_mode():
            self.model.logits(self.model(new_ids.reshape(-1), spans, self.cache))
        for slot in self.slots:
            self.cache.truncate(slot, self.context)


def time_to_first_token_ms(model, prompt_ids: torch.Tensor, repeats: int) -> float:
    cache = model.make_cache(1, prompt_ids.shape[0])
    slot = cache.allocate()

    def prefill() -> None:
        with torch.inference_mode():
            model.logits(model(prompt_ids, [SeqSpan(slot, 0, prompt_ids.shape[0])], cache)[-1:])

    return round(statistics.median(_timed(prefill) for _ in range(repeats)) * 1e3, 1)


def run(context: int, repeats: int, threads: list[int], llamacpp: bool, warmup: int = 2) -> tuple[list[Row], dict]:
    fp32 = LlamaModel.from_pretrained(resolve_model_dir())
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(100, fp32.cfg.vocab_size, (context,), generator=gen)
    long_prompt = torch.randint(100, fp32.cfg.vocab_size, (PREFILL_TOKENS,), generator=gen)
    rows, per_threads = [], {}
    for num_threads in threads:
        torch.set_num_threads(num_threads)
        native = NativeLlamaModel.load(packaged_gguf_path(), num_threads=num_threads)
        per_threads[num_threads] = {
            "kernel_path": native.isa, "weight_bytes": native.weight_bytes,
            # one decode step reads every layer's K and V of the context, fp16
            "kv_bytes_per_token": 2 * 2 * native.cfg.num_layers * native.cfg.num_kv_heads * native.cfg.head_dim * context,
            "ttft_ms": {"ours": time_to_first_token_ms(native, long_prompt, 3),
                        "fp32": time_to_first_token_ms(fp32, long_prompt, 3)},
            "llamacpp": run_peer(str(packaged_gguf_path()), "--step-costs-json",
                                 {"context": prompt_ids.tolist(), "rows": [t for b, t in CASES if b == 1],
                                  "repeats": repeats}, "--threads", str(num_threads)) if llamacpp else None,
        }
        for batch in sorted({b for b, _ in CASES}):
            sides = Side(native, prompt_ids, batch), Side(fp32, prompt_ids, batch)
            for _, t in (c for c in CASES if c[0] == batch):
                new_ids = torch.randint(100, fp32.cfg.vocab_size, (batch, t), generator=gen)
                samples: tuple[list[float], list[float]] = ([], [])
                for i in range(warmup + repeats):
                    for side, out in zip(sides, samples):
                        elapsed = _timed(lambda: side.step(new_ids))
                        if i >= warmup:
                            out.append(elapsed)
                (ours, ours_spread), (ref, ref_spread) = (_quantiles_ms(s) for s in samples)
                rows.append(Row(num_threads, batch, t, ours, ref, ours_spread, ref_spread))
                print(_format(rows[-1]), flush=True)
    return rows, per_threads


HEADER = f"{'threads':>7} {'batch':>5} {'tokens':>6} | {'ours ms':>8} {'fp32 ms':>8} {'speedup':>7} | {'ours p10-p90':>13}"


def _format(r: Row) -> str:
    return (f"{r.threads:>7} {r.batch:>5} {r.new_tokens:>6} | {r.ours_ms:>8.2f} {r.fp32_ms:>8.1f} "
            f"{r.fp32_ms / r.ours_ms:>6.2f}x | {r.ours_spread_ms[0]:>6.1f}-{r.ours_spread_ms[1]:<6.1f}")


def summarize(rows: list[Row], per_threads: dict, bandwidth: dict[int, float]) -> dict:
    """Per thread count: verify cost over one row, decode tokens/s, and the roofline."""
    out = {}
    for num_threads, extra in per_threads.items():
        ms = {(r.batch, r.new_tokens): r for r in rows if r.threads == num_threads}
        one = ms[(1, 1)]
        peer_ms = {int(t): v for t, v in extra["llamacpp"]["step_ms"].items()} if extra["llamacpp"] else None
        bytes_per_token = extra["weight_bytes"] + extra["kv_bytes_per_token"]
        roofline = bandwidth[num_threads] * 1e9 / bytes_per_token
        decode = 1e3 / one.ours_ms
        out[str(num_threads)] = {
            **extra,
            "verify_cost_vs_one_row": {str(t): {"ours": round(ms[(1, t)].ours_ms / one.ours_ms, 2),
                                                "fp32": round(ms[(1, t)].fp32_ms / one.fp32_ms, 2),
                                                "llamacpp": round(peer_ms[t] / peer_ms[1], 2) if peer_ms else None}
                                       for b, t in CASES if b == 1},
            "batch8_verify9_vs_decode": round(ms[(8, 9)].ours_ms / ms[(8, 1)].ours_ms, 2),
            "decode_tok_s": {"ours": round(decode, 1), "fp32": round(1e3 / one.fp32_ms, 1)},
            "read_bandwidth_gb_s": round(bandwidth[num_threads], 1),
            "bytes_read_per_token_mb": round(bytes_per_token / 1e6, 1),
            "roofline_tok_s": round(roofline, 1),
            "decode_fraction_of_roofline": round(decode / roofline, 2),
        }
    return out


def plot(rows: list[Row], per_threads: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for num_threads in sorted({r.threads for r in rows}):
        own = sorted((r for r in rows if r.threads == num_threads and r.batch == 1), key=lambda r: r.new_tokens)
        for field, style in (("ours_ms", "-o"), ("fp32_ms", "--s")):
            base = getattr(own[0], field)
            label = f"{'native' if field == 'ours_ms' else 'fp32 torch'}, {num_threads} thread(s)"
            ax.plot([r.new_tokens for r in own], [getattr(r, field) / base for r in own], style, label=label)
        if per_threads[num_threads]["llamacpp"]:
            peer = {int(t): ms for t, ms in per_threads[num_threads]["llamacpp"]["step_ms"].items()}
            ax.plot(sorted(peer), [peer[t] / peer[1] for t in sorted(peer)], ":^",
                    label=f"llama.cpp (last row's logits only), {num_threads} thread(s)")
    ax.set_xlabel("rows in the step (1 = plain decode, K+1 = verify of K drafts)")
    ax.set_ylabel("step time / 1-row step")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[len(os.sched_getaffinity(0))])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "forward.json")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    args = parser.parse_args()
    llamacpp = not args.no_llamacpp and peer_available("bench-forward")
    cpu = cpu_description()
    print(f"{cpu['model']} (family {cpu['family']} model {cpu['model_number']}), features {cpu['features']}; "
          f"context {args.context} tokens, {args.repeats} repeats, medians in ms")
    print(HEADER)
    rows, per_threads = run(args.context, args.repeats, args.threads, llamacpp)
    bandwidth = {t: read_bandwidth_gbs(t) for t in args.threads}
    summary = summarize(rows, per_threads, bandwidth)
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu, "context_tokens": args.context, "repeats": args.repeats, "torch": torch.__version__,
              "load_average_at_end": os.getloadavg(), "summary": summary, "rows": [asdict(r) for r in rows]}
    args.out.write_text(json.dumps(result, indent=2))
    plot(rows, per_threads, args.out.with_suffix(".png"), f"verify cost, {cpu['model']} fam {cpu['family']} model "
                                             f"{cpu['model_number']}, {args.context}-token context")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
