"""lm-evaluation-harness against the served model: what an evaluation run gets from us.

deploy.yaml's application is served on loopback and lm-evaluation-harness (the bench venv's
`lm_eval`, never a project dependency) runs its `local-completions` model, its tokenizer the
server's (`/tokenizer_info`, `/tokenize`, `/detokenize`), on two tasks made here from one
set of questions (capitals and sums):

- `local_mc`, 4 choices each: loglikelihoods through batched token-id prompts with `echo`,
  `logprobs: 1` and `max_tokens: 1`. Beside it, the same context and continuation token ids
  scored by transformers' fp32 forward in this process (lm-eval's `hf` model computes the
  same sums): each side's accuracy, how often they pick the same choice, how far their
  choice loglikelihoods are apart (ours reads the GGUF's Q4_1/Q8_0 weights).
- `local_gen`, the answer generated greedily up to a newline or a full stop (batched prompts
  with stop strings). Beside it, the embedded engine in this process without speculation:
  the server (hybrid speculation, batched) must generate exactly its text for every question.
- `local_ppl`, `loglikelihood_rolling` over code files of 600-2,000 tokens (one window each
  behind the end-of-text token: prompts the server prefills and scores in several chunks).
  Beside it, transformers' fp32 loglikelihood of the same tokens: word perplexity both ways
  and the mean gap per token.

Writes benchmarks/results/lm_eval.json (lm-eval's wall time too).

    PYTHONPATH=. .venv/bin/python benchmarks/lm_eval_check.py [--batch-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import cpu_description  # noqa: E402
from benchmarks.serve import APP, app_document, apply, free_port  # noqa: E402
from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig  # noqa: E402
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402
from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir  # noqa: E402
from training.corpora import code_edits  # noqa: E402

LM_EVAL = ROOT / ".venv-bench" / "bin" / "lm_eval"
TASKS = ("local_mc", "local_gen", "local_ppl")
GEN_TOKENS = 16
PPL_TEXTS = 6
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Russia", "Moscow"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
            ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
            ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"),
            ("Chile", "Santiago"), ("Canada", "Ottawa"), ("China", "Beijing")]


def write_tasks(folder: Path, tokenizer, sums: int = 20) -> tuple[list[dict], list[str]]:
    """The tasks in lm-eval's YAML, their data local JSON files: (the questions, the texts)."""
    rng, docs = random.Random(0), []
    for country, capital in CAPITALS:
        choices = rng.sample([c for _, c in CAPITALS if c != capital], 3) + [capital]
        rng.shuffle(choices)
        docs.append({"question": f"The capital of {country} is", "choices": [f" {c}" for c in choices],
                     "answer": choices.index(capital)})
    for _ in range(sums):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        choices = rng.sample([x for x in range(4, 41) if x != a + b], 3) + [a + b]
        rng.shuffle(choices)
        docs.append({"question": f"{a} + {b} =", "choices": [f" {c}" for c in choices],
                     "answer": choices.index(a + b)})
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
            'test_split: test\ndoc_to_text: "{{question}}"\ntarget_delimiter: ""\n')
    (folder / "local_mc.yaml").write_text(
        f"task: local_mc\n{data}output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    (folder / "local_gen.yaml").write_text(
        f"task: local_gen\n{data}output_type: generate_until\ndoc_to_target: \"{{{{choices[answer]}}}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    texts = [row["before"] for row in code_edits()
             if 600 <= len(tokenizer.encode(row["before"], add_special_tokens=False)) <= 2000][:PPL_TEXTS]
    (folder / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "local_ppl.yaml").write_text(
        f"task: local_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'texts.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n")
    return docs, texts


def run_lm_eval(url: str, folder: Path, batch_size: int) -> tuple[float, dict[str, dict[int, list]]]:
    """(lm-eval's wall seconds, per task each doc's responses: the choices' loglikelihoods, or
    the generated text) from `local-completions`."""
    args = [str(LM_EVAL), "run", "--model", "local-completions", "--model_args",
            f"base_url={url}/v1/completions,model=smollm2-135m-instruct,num_concurrent=1,max_retries=1",
            "--tasks", ",".join(TASKS), "--include_path", str(folder), "--batch_size", str(batch_size),
            "--output_path", str(folder / "out"), "--log_samples"]
    started = time.perf_counter()
    subprocess.run(args, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - started
    responses = {}
    for task in TASKS:
        (samples,) = (folder / "out").rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        responses[task] = {row["doc_id"]: [r[0] for r in row["resps"]] for row in rows}
    return seconds, responses


def engine_answers(docs: list[dict]) -> list[str]:
    """The embedded engine's greedy answers in this process, speculation off, up to a newline or a
    full stop."""
    engine = TorchEngine(TorchEngineConfig(mtp_weights=None, speculation=SpeculationConfig(mode="off")))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())

    async def answer(i: int, doc: dict) -> str:
        request = GenerationRequest(f"gen-{i}", engine.tokenizer.encode(doc["question"], add_special_tokens=False),
                                    SamplingParams(max_tokens=GEN_TOKENS, stop=("\n", ".")),
                                    RequestSpeculation(mode="off"))
        return "".join([delta.text async for delta in engine.generate(request)])

    try:
        return [loop.run_until_complete(answer(i, doc)) for i, doc in enumerate(docs)]
    finally:
        loop.run_until_complete(engine.shutdown())


def transformers_loglikelihood(model, ids: list[int], start: int) -> float:
    """The summed fp32 logprobs of `ids[start:]`, each given the ids before it."""
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, start - 1:-1].float(), dim=-1)
    return float(logprobs.gather(1, torch.tensor(ids[start:]).reshape(-1, 1)).sum())


def transformers_scores(tokenizer, docs: list[dict], texts: list[str]) -> tuple[dict[int, list[float]], list[float]]:
    """Under transformers' fp32 forward, as lm-eval tokenizes and windows them: each doc's
    choice loglikelihoods (context and continuation tokenized apart), and each text's (one
    window behind the end-of-text token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(), dtype=torch.float32).eval()
    with torch.inference_mode():
        scores = {i: [transformers_loglikelihood(model, context + tokenizer.encode(c, add_special_tokens=False),
                                                 len(context)) for c in doc["choices"]]
                  for i, doc in enumerate(docs)
                  for context in [tokenizer.encode(doc["question"], add_special_tokens=False)]}
        texts_ll = [transformers_loglikelihood(model, [tokenizer.eos_token_id] + tokenizer.encode(
            t, add_special_tokens=False), 1) for t in texts]
    return scores, texts_ll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per completions request")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lm_eval.json")
    args = parser.parse_args()
    if not LM_EVAL.exists():
        sys.exit(f"{LM_EVAL} missing: `make bench-lm-eval` installs it")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    doc = app_document(argparse.Namespace(autoscaling=False, mtp_weights=None, gate_hold_s=None))
    tokenizer = load_tokenizer(resolve_model_dir())
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        apply(doc)
        with tempfile.TemporaryDirectory() as tmp:
            docs, texts = write_tasks(Path(tmp), tokenizer)
            seconds, responses = run_lm_eval(f"http://127.0.0.1:{port}", Path(tmp), args.batch_size)
    finally:
        serve.delete(APP)
        serve.shutdown()
        ray.shutdown()
    ours = {i: [float(r[0]) for r in choices] for i, choices in responses["local_mc"].items()}
    theirs, texts_theirs = transformers_scores(tokenizer, docs, texts)
    texts_ours = [float(responses["local_ppl"][i][0]) for i in range(len(texts))]
    words = sum(len(re.split(r"\s+", t)) for t in texts)  # lm-eval's count_words
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    text_gap = sum(abs(a - b) for a, b in zip(texts_ours, texts_theirs))
    generated = [responses["local_gen"][i][0] for i in range(len(docs))]
    reference = engine_answers(docs)
    pick = {name: [max(range(4), key=s[i].__getitem__) for i in range(len(docs))]
            for name, s in (("ours", ours), ("transformers", theirs))}
    gaps = [abs(a - b) for i in range(len(docs)) for a, b in zip(ours[i], theirs[i])]
    result = {
        "machine": cpu_description(), "docs": len(docs), "batch_size": args.batch_size,
        "lm_eval_seconds": round(seconds, 1),
        "accuracy": {name: round(sum(p == d["answer"] for p, d in zip(picks, docs)) / len(docs), 3)
                     for name, picks in pick.items()},
        "same_choice": round(sum(a == b for a, b in zip(pick["ours"], pick["transformers"])) / len(docs), 3),
        "choice_loglikelihood_gap": {"mean": round(statistics.fmean(gaps), 4), "max": round(max(gaps), 3)},
        "generate_until": {
            "exact_match": round(sum(g.strip() == d["choices"][d["answer"]].strip()
                                     for g, d in zip(generated, docs)) / len(docs), 3),
            "identical_to_engine_without_speculation": sum(g == r for g, r in zip(generated, reference)),
            "of": len(docs), "examples": [[d["question"], g] for d, g in list(zip(docs, generated))[::10]]},
        "loglikelihood_rolling": {
            "texts": len(texts), "tokens": tokens,
            "word_perplexity": {"ours": round(math.exp(-sum(texts_ours) / words), 4),
                                "transformers": round(math.exp(-sum(texts_theirs) / words), 4)},
            "loglikelihood_gap_per_token": round(text_gap / tokens, 4)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
