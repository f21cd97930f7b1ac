"""Scoring texts (completions' `echo` with `logprobs`, what evaluation harnesses ask): the
embedded engine against transformers on the same texts, threads and CPU.

Each text (code files and open questions from ../shared, cut to `--tokens` tokens) is sent
as a token-id prompt with `max_tokens` 1, once plain and once with its prompt scored
(`prompt_logprobs` 1, as lm-evaluation-harness's `logprobs: 1`), alternating which goes
first; transformers runs the same ids through its fp32 forward and a log-softmax. Per side:
median milliseconds per text and scored tokens per second; for ours, what scoring adds to a
plain prefill. Agreement with transformers' fp32 (ours reads the GGUF's Q4_1/Q8_0 weights):
the mean and largest absolute logprob difference and how often the two agree on the likeliest
next token. Then each text as a multiple-choice question, as a harness scores one: its head as
the context and `--choices` endings of 32 tokens (its own, the next texts'), one prompt each,
scored in turn by an engine without prefix cache and by one with it (and the MTP head, whose
hidden states the cache keeps: the lm_head scores a cached context from them); median
milliseconds per question, and whether both give the same logprobs. Writes
benchmarks/results/scoring.json.

    .venv/bin/python benchmarks/scoring.py [--texts 8] [--tokens 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_description  # noqa: E402
from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig  # noqa: E402
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402
from replicas.torch_engine.loader import resolve_model_dir  # noqa: E402
from training.corpora import SPEC_BENCH, code_edits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENDING = 32  # tokens of a multiple-choice question's each ending


def texts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """Half code files, half questions, each cut to `tokens` token ids (the longest first)."""
    files = sorted((row["before"] for row in code_edits()), key=len, reverse=True)
    questions = sorted((" ".join(json.loads(line)["turns"]) for line in SPEC_BENCH.open()), key=len, reverse=True)
    picked = files[:count - count // 2] + questions[:count // 2]
    return [tokenizer.encode(t, add_special_tokens=False)[:tokens] for t in picked]


async def ours(engine: TorchEngine, ids: list[int], scored: bool) -> tuple[float, list]:
    """(seconds, prompt logprobs) of one request for `ids`."""
    request = GenerationRequest(f"score-{time.monotonic_ns()}", ids, SamplingParams(
        max_tokens=1, prompt_logprobs=1 if scored else None), RequestSpeculation(mode="off"))
    started, logprobs = time.perf_counter(), []
    async for delta in engine.generate(request):
        logprobs += delta.prompt_logprobs
    return time.perf_counter() - started, logprobs


def questions(batch: list[list[int]], choices: int, ending: int = ENDING) -> list[list[list[int]]]:
    """Each text as a question's prompts: its head, then the last `ending` tokens of it and of
    the next `choices - 1` texts."""
    return [[ids[:-ending] + batch[(i + k) % len(batch)][-ending:] for k in range(choices)]
            for i, ids in enumerate(batch)]


async def question(engine: TorchEngine, prompts: list[list[int]]) -> tuple[float, list]:
    """(seconds, each choice's prompt logprobs) of one question, its choices scored in turn."""
    seconds, scored = 0.0, []
    for ids in prompts:
        elapsed, logprobs = await ours(engine, ids, True)
        seconds, scored = seconds + elapsed, scored + [logprobs]
    return seconds, scored


def transformers_scores(model, ids: list[int]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(seconds, each prompt token's logprob after the first, the likeliest token at each)."""
    with torch.inference_mode():
        started = time.perf_counter()
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(ids[1:]).reshape(-1, 1)).squeeze(1)
        seconds = time.perf_counter() - started
    return seconds, chosen, logprobs.argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--choices", type=int, default=4, help="endings per multiple-choice question")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/scoring.json")
    args = parser.parse_args()
    if args.tokens <= 2 * ENDING or args.texts < args.choices:  # else the questions have no context or one ending
        parser.error(f"--tokens must exceed {2 * ENDING} (a question's context and its {ENDING}-token ending) and "
                     f"--texts be at least --choices (each choice another text's ending)")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    engine = TorchEngine(TorchEngineConfig(num_threads=args.threads, mtp_weights=None, prefix_cache_bytes=0,
                                           speculation=SpeculationConfig(mode="off")))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(), dtype=torch.float32).eval()
    batch = texts(engine.tokenizer, args.texts, args.tokens)
    loop.run_until_complete(ours(engine, batch[0], True))  # warm both
    transformers_scores(hf, batch[0])
    plain_s, scored_s, hf_s, diffs, agree = [], [], [], [], []
    for i, ids in enumerate(batch):
        runs = {}
        for scored in ((False, True) if i % 2 == 0 else (True, False)):
            runs[scored] = loop.run_until_complete(ours(engine, ids, scored))
        seconds, chosen, likeliest = transformers_scores(hf, ids)
        plain_s.append(runs[False][0])
        scored_s.append(runs[True][0])
        hf_s.append(seconds)
        mine = runs[True][1]
        diffs += (torch.tensor([e.logprob for e in mine], dtype=torch.float64) - chosen.double()).abs().tolist()
        agree += [e.top[0][0] == int(t) for e, t in zip(mine, likeliest)]
        print(f"  text {i}: {len(ids)} tokens, ours plain {runs[False][0] * 1e3:.0f} ms, scored "
              f"{runs[True][0] * 1e3:.0f} ms, transformers {seconds * 1e3:.0f} ms", flush=True)
    cached = TorchEngine(TorchEngineConfig(num_threads=args.threads, speculation=SpeculationConfig(mode="off")))
    loop.run_until_complete(cached.start())  # the shipped defaults: the MTP head, the prefix cache
    cold_s, cached_s, same = [], [], True
    for i, prompts in enumerate(questions(batch, args.choices)):
        runs = {}
        for which in ((engine, cached) if i % 2 == 0 else (cached, engine)):
            runs[which] = loop.run_until_complete(question(which, prompts))
        cold_s.append(runs[engine][0])
        cached_s.append(runs[cached][0])
        same = same and runs[engine][1] == runs[cached][1]
        print(f"  question {i}: {args.choices} x {len(prompts[0])} tokens, without prefix cache "
              f"{runs[engine][0] * 1e3:.0f} ms, with {runs[cached][0] * 1e3:.0f} ms", flush=True)
    for one in (engine, cached):
        loop.run_until_complete(one.shutdown())
    scored_tokens = sum(len(ids) - 1 for ids in batch)
    result = {
        "machine": cpu_description(), "threads": args.threads, "texts": len(batch),
        "tokens_per_text": [len(ids) for ids in batch],
        "ms_per_text_median": {"ours_plain_prefill": round(statistics.median(plain_s) * 1e3, 1),
                               "ours_scored": round(statistics.median(scored_s) * 1e3, 1),
                               "transformers_fp32_scored": round(statistics.median(hf_s) * 1e3, 1)},
        "scored_tokens_per_s": {"ours": round(scored_tokens / sum(scored_s), 1),
                                "transformers_fp32": round(scored_tokens / sum(hf_s), 1)},
        "ours_scored_over_plain": round(statistics.median(s / p for s, p in zip(scored_s, plain_s)), 3),
        "ours_over_transformers_speed": round(sum(hf_s) / sum(scored_s), 2),
        "vs_transformers_fp32": {"mean_abs_logprob_diff": round(statistics.fmean(diffs), 4),
                                 "max_abs_logprob_diff": round(max(diffs), 3),
                                 "same_likeliest_token": round(sum(agree) / len(agree), 4)},
        "multiple_choice": {
            "choices": args.choices, "ending_tokens": ENDING,
            "ms_per_question_median": {"without_prefix_cache": round(statistics.median(cold_s) * 1e3, 1),
                                       "with_prefix_cache": round(statistics.median(cached_s) * 1e3, 1)},
            "speedup": round(statistics.median(c / w for c, w in zip(cold_s, cached_s)), 2),
            "identical_logprobs": same},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if not same:
        raise SystemExit("a choice scored after its cached context got other logprobs than scored whole")


if __name__ == "__main__":
    main()
