"""The embedded engine on a CUDA GPU: the suffix automata on the device vs the host, and
tokens/s with speculation off / SA / MTP / hybrid (SmolLM2-135M, the row-invariant torch forward).

1. SA update cost per step: every row feeds 4 tokens (3 accepted drafts + the bonus) to a
   request holding a ~1,000-token code-edit prompt, then reads its next 8-token draft. The
   device figure is feed to settle (upload, kernel, download, wait) on an idle stream, the
   most it can cost; in the engine the host detokenises while it runs.
2. The engine through `benchmarks/engine.py`'s harness (same prompts, modes alternating), at
   batch 1 and 8 (the shipped gate, then held open), no cross-request pool: decode and
   end-to-end tokens/s, acceptance, and whether every mode's tokens equal speculation off.
3. Hybrid with the measured draft rule (`adaptive_drafts`, the default) against hybrid drafting
   everything its rules allow, at batch 1 and at batch 8 with the gate held open.

Writes benchmarks/results/cuda_engine.json, .png and .md. Needs a CUDA GPU and `make native`
built with nvcc.

    python benchmarks/cuda_engine.py [--prompts 4] [--max-tokens 128]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import (  # noqa: E402
    ADAPTIVE_MODES, MODES, WORKLOADS, bench_engine, bench_modes, identical_flags, workloads,
)
from benchmarks.machine import cpu_description  # noqa: E402
from replicas.engine import SpeculationConfig  # noqa: E402
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402
from replicas.torch_engine.suffix_drafts import DeviceSuffixDrafts, HostSuffixDrafts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FED_PER_ROW, DRAFT_LEN = 4, 8
BATCHES = ("batch1", "batch8", "batch8_gate_open")


@dataclasses.dataclass
class _Request:  # what the automata read and write of an engine's Sequence
    sa_id: int
    text: list[int]
    sa_match_len: int = 0
    sa_draft: list[int] = dataclasses.field(default_factory=list)


def gpu_description() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda}


def bench_sa_update(tokenizer, prompt_texts: list[str], batches=(1, 8, 64), steps=300) -> dict:
    """Median ms per step of feed + settle, device automata vs host pool, by batch size."""
    prompts = [tokenizer(text)["input_ids"][:1000] for text in prompt_texts]
    out = {}
    for batch in batches:
        figures = {}
        for name, drafts in (("host", HostSuffixDrafts(batch, 4096, 0)),
                             ("device", DeviceSuffixDrafts(batch, 4096, torch.device("cuda")))):
            seqs = []
            for i in range(batch):
                prompt = prompts[i % len(prompts)]
                drafts.add(i, prompt)
                seqs.append(_Request(i, prompt))
            times, launch = [], []
            for step in range(steps):
                # each row replays its own prompt, so matches grow as in a code edit
                fed = [(s, s.text[(step * FED_PER_ROW) % 900:][:FED_PER_ROW]) for s in seqs]
                torch.cuda.synchronize()
                started = time.perf_counter()
                drafts.feed(fed, DRAFT_LEN)
                queued = time.perf_counter()
                drafts.settle()
                times.append((time.perf_counter() - started) * 1e3)
                launch.append((queued - started) * 1e3)
            figures[name] = {"step_ms": statistics.median(times[20:]), "host_blocked_ms": statistics.median(launch[20:])}
        figures["device_vs_host"] = figures["device"]["step_ms"] / figures["host"]["step_ms"]
        out[f"batch{batch}"] = figures
        print(f"  SA update, batch {batch:3d}: host {figures['host']['step_ms']:.3f} ms, device "
              f"{figures['device']['step_ms']:.3f} ms (feed returns after {figures['device']['host_blocked_ms']:.3f} ms)",
              flush=True)
    return out


def markdown(result: dict) -> str:
    gpu, cpu = result["gpu"], result["machine"]
    lines = [f"{gpu['name']} (torch {gpu['torch']}, CUDA {gpu['cuda']}), host {cpu['model']}; greedy, "
             f"{result['settings']['max_tokens']} tokens per request", "",
             "| SA update per step | host pool ms | device ms | device / host |", "|---|---:|---:|---:|"]
    for batch, f in result["sa_update"].items():
        lines.append(f"| {batch} | {f['host']['step_ms']:.3f} | {f['device']['step_ms']:.3f} | {f['device_vs_host']:.2f} |")
    lines += ["", "| measured draft costs, plain steps | a verify row | an ask of the MTP head | a queued position |",
              "|---|---:|---:|---:|"]
    lines += [f"| {batch} | {c['row']:.3f} | {c['ask']:.3f} | {c['position']:.4f} |" for batch, c in result["measured_costs"].items()]
    tables = [(batch, result[batch], MODES) for batch in BATCHES]
    tables += [(f"{batch}, hybrid", runs, ADAPTIVE_MODES) for batch, runs in result["adaptive"].items()]
    for title, runs, modes in tables:
        lines += ["", f"| {title}, tokens/s | edit decode | edit e2e | edit MAT | chat decode | chat e2e | chat MAT |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for mode in modes:
            cells = []
            for w in WORKLOADS:
                f = runs[f"{w}/{mode}"]
                cells += [f"{f['tokens_per_s']:.1f}", f"{f['e2e_tokens_per_s']:.1f}", f"{f['mat']:.2f}"]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        lines.append(f"identical to {modes[0]}: "
                     + ", ".join(f"{w} {runs[f'{w}/identical_to_{modes[0]}']}" for w in WORKLOADS))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BATCHES), figsize=(6 * len(BATCHES), 4.5))
    for ax, batch in zip(axes, BATCHES):
        for j, workload in enumerate(WORKLOADS):
            values = [result[batch][f"{workload}/{mode}"]["tokens_per_s"] for mode in MODES]
            ax.bar([i + 0.4 * j for i in range(len(MODES))], values, width=0.4, label=workload)
        ax.set_xticks([i + 0.2 for i in range(len(MODES))], MODES)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(batch)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M, torch forward on {result['gpu']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cuda_engine.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_engine.py needs a CUDA GPU")

    loop = asyncio.new_event_loop()
    # no prefix cache, as engine.py: each prompt recurs across modes, and a later one skipped its prefill
    engine = TorchEngine(TorchEngineConfig(device="cuda", max_batch_size=8, max_seq_len=4096, sa_global_pool_tokens=0,
                                           prefix_cache_bytes=0, speculation=SpeculationConfig()))
    loop.run_until_complete(engine.start())
    prompts = workloads(engine.tokenizer, args.prompts)
    result = {"settings": vars(args) | {"out": str(args.out)}, "gpu": gpu_description(), "machine": cpu_description(),
              "speculation": dataclasses.asdict(engine.config.speculation)}
    result["sa_update"] = bench_sa_update(engine.tokenizer, prompts["code_edit"])
    bench_engine(engine, loop, {w: p[:1] for w, p in prompts.items()}, 16, batch=1)  # warm-up: allocator, kernels
    result |= bench_modes(engine, loop, prompts, args.max_tokens)
    loop.run_until_complete(engine.shutdown())
    result["ratios"] = {f"{b}/{w}/{m}_vs_off": result[b][f"{w}/{m}"]["tokens_per_s"] / result[b][f"{w}/off"]["tokens_per_s"]
                        for b in BATCHES for w in WORKLOADS for m in MODES[1:]}
    result["ratios"] |= {f"{b}/{w}/hybrid_vs_hybrid_fixed": runs[f"{w}/hybrid"]["tokens_per_s"]
                         / runs[f"{w}/hybrid_fixed"]["tokens_per_s"]
                         for b, runs in result["adaptive"].items() for w in WORKLOADS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.out} and its .png and .md")
    differing = sorted(where for where, same in identical_flags(result) if not same)
    if differing:
        raise SystemExit(f"speculation changed greedy output: {', '.join(differing)}")


if __name__ == "__main__":
    main()
