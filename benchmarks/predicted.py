"""Predicted Outputs (OpenAI's `prediction`): the embedded engine with and without one.

Batch 1, greedy, exactly `--max-tokens` tokens per request (EOS ignored), modes alternating
per prompt (each first in turn), the cross-request SA pool off (it would draft each answer
from an earlier run of its prompt) and the prefix cache off (every run prefills its prompt, so
end to end compares alike whichever mode ran a prompt first). Two workloads:

- `code_edit`: what an editor sends: an instruction and the file, the answer not prefilled,
  the file as it was for the prediction. The prompt holds the file too, so the SA copies it
  with or without the prediction.
- `regenerate`: an open chat question whose answer the client already has (a retry, or the
  answer served before by another replica, whose pool the request does not reach): the
  prediction is that answer, or (`stale`) that answer with one token in 8 replaced.

Each is run with speculation off, hybrid, and hybrid with the prediction; decode and
end-to-end tokens/s, tokens per verify step, and OpenAI's accepted / rejected prediction
tokens. Outputs must be identical in every mode. Writes benchmarks/results/predicted.json
and predicted.png.

    .venv/bin/python benchmarks/predicted.py [--prompts 6] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import run_request, summarize  # noqa: E402
from benchmarks.machine import cpu_description  # noqa: E402
from deploy.openai_format import prediction_details  # noqa: E402
from replicas.engine import SpeculationConfig  # noqa: E402
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402
from training.corpora import SPEC_BENCH, code_edits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# mode -> (server mode, which prediction the request carries)
MODES = {"off": ("off", None), "hybrid": ("hybrid", None), "hybrid+prediction": ("hybrid", "right"),
         "hybrid+stale_prediction": ("hybrid", "stale")}
WORKLOAD_MODES = {"code_edit": ("off", "hybrid", "hybrid+prediction"),
                  "regenerate": ("off", "hybrid", "hybrid+prediction", "hybrid+stale_prediction")}
STALE_EVERY = 8  # a stale prediction has one token in this many replaced


def prompts(tokenizer, count: int) -> dict[str, list[tuple[str, str]]]:
    """(chat prompt, predicted text or "" where the answer is to be generated first) per workload."""
    def chat(user: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)

    edits = [(chat(f"{row['instruction']}\n\n```python\n{row['before']}```\n"
                   "Apply the change and output the whole updated file."), row["before"])
             for row in code_edits() if 1200 <= len(row["before"]) <= 2600]
    questions = [chat(row["turns"][0]) for row in map(json.loads, SPEC_BENCH.open())
                 if row["category"] in ("writing", "roleplay", "stem", "humanities", "qa", "reasoning")]
    return {"code_edit": edits[:: max(1, len(edits) // count)][:count],
            "regenerate": [(q, "") for q in questions[:: max(1, len(questions) // count)][:count]]}


def run(engine: TorchEngine, loop, prompt: str, mode: str, max_tokens: int, prediction: list[int]) -> dict:
    engine.configure(dataclasses.replace(engine.config.speculation, mode=MODES[mode][0]))
    return loop.run_until_complete(run_request(engine, mode, prompt, max_tokens, prediction=tuple(prediction)))


def stale(tokens: list[int], vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab) if i % STALE_EVERY == STALE_EVERY - 1 else t for i, t in enumerate(tokens)]


def bench(engine: TorchEngine, loop, work: dict[str, list[tuple[str, str]]], max_tokens: int) -> dict:
    out, rng = {}, random.Random(0)
    vocab = engine.core.model.cfg.vocab_size
    for workload, items in work.items():
        modes = WORKLOAD_MODES[workload]
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for k, (prompt, predicted_text) in enumerate(items):
            if predicted_text:
                right = engine.tokenizer.encode(predicted_text, add_special_tokens=False)
            else:  # the answer the client already has: this prompt's, generated once beforehand
                right = run(engine, loop, prompt, "off", max_tokens, [])["tokens"]
            predictions = {None: [], "right": right, "stale": stale(right, vocab, rng)}
            for mode in modes[k % len(modes):] + modes[:k % len(modes)]:
                prediction = predictions[MODES[mode][1]]
                result = run(engine, loop, prompt, mode, max_tokens, prediction)
                result["prediction"] = prediction_details(prediction, result["tokens"]) if prediction else None
                runs[mode].append(result)
        reference = [r["tokens"] for r in runs["off"]]
        for mode in modes:
            rs = runs[mode]  # one after another: their walls add up
            summary = summarize(rs, sum(r["end_s"] - r["first_s"] for r in rs),
                                sum(r["end_s"] - r["submit_s"] for r in rs))
            summary["identical_to_off"] = [r["tokens"] for r in rs] == reference
            if rs[0]["prediction"] is not None:
                for key in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
                    summary[key] = sum(r["prediction"][key] for r in rs)
            out[f"{workload}/{mode}"] = summary
            print(f"  {workload:10s} {mode:24s} {summary['tokens_per_s']:7.1f} tok/s decode, "
                  f"{summary['e2e_tokens_per_s']:7.1f} end-to-end, {summary['mat']:.2f} tokens/step"
                  + (f", prediction accepted/rejected {summary['accepted_prediction_tokens']}"
                     f"/{summary['rejected_prediction_tokens']}" if "accepted_prediction_tokens" in summary else ""),
                  flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOAD_MODES), figsize=(11, 4))
    for ax, (workload, modes) in zip(axes, WORKLOAD_MODES.items()):
        values = [result["results"][f"{workload}/{m}"]["tokens_per_s"] for m in modes]
        ax.bar(range(len(modes)), values, color=["#999999", "#4c72b0", "#55a868", "#c4ad66"][: len(modes)])
        ax.set_xticks(range(len(modes)), [m.replace("+", "\n+") for m in modes], fontsize=8)
        ax.set_title(workload)
        ax.set_ylabel("decode tokens/s")
    machine = result["machine"]
    fig.suptitle(f"Predicted outputs, batch 1, {result['settings']['max_tokens']} tokens: {machine['model']} "
                 f"(family {machine['family']} model {machine['model_number']}), {result['kernel_path']} kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "predicted.json")
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    engine = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=4096, sa_global_pool_tokens=0,
                                           prefix_cache_bytes=0, speculation=SpeculationConfig()))
    loop.run_until_complete(engine.start())
    result = {"settings": vars(args) | {"out": str(args.out)}, "machine": cpu_description(),
              "kernel_path": getattr(engine.core.model, "isa", "torch"), "threads": engine.core.model.num_threads}
    print(f"predicted outputs ({result['kernel_path']} kernels, {result['threads']} threads):")
    result["results"] = bench(engine, loop, prompts(engine.tokenizer, args.prompts), args.max_tokens)
    loop.run_until_complete(engine.shutdown())
    r = result["results"]
    result["ratios"] = {f"{w}/{m}_vs_{base}": r[f"{w}/{m}"]["tokens_per_s"] / r[f"{w}/{base}"]["tokens_per_s"]
                        for w, modes in WORKLOAD_MODES.items() for m in modes[2:] for base in ("off", "hybrid")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    for key, value in result["ratios"].items():
        print(f"  {key:50s} {value:5.2f}x")
    print(f"wrote {args.out} and its .png")
    if differing := [k for k, v in r.items() if isinstance(v, dict) and v.get("identical_to_off") is False]:
        raise SystemExit(f"a prediction or speculation changed the output: {', '.join(differing)}")


if __name__ == "__main__":
    main()
