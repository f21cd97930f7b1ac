"""Helpers for engine tests: prompts, requests, and running a request to the end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams
from replicas.torch_engine.engine import TorchEngine
from training.corpora import CODE_EDITS, EDIT_PREFILL

POEM = "Write a short poem about the sea."


def idle(engine: TorchEngine) -> bool:
    """No request live, and every KV and SA slot free again."""
    core = engine.core
    return (engine.num_live_requests == 0 and core.cache.num_free == engine.config.max_batch_size
            and core.suffix.pool.num_active == 0)


def chat_prompt(engine: TorchEngine, user: str, prefill: str = "") -> str:
    messages = [{"role": "user", "content": user}]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + prefill


def code_edit_prompts(engine: TorchEngine, count: int, max_chars: int = 1500) -> list[str]:
    """Real edits from ../shared when present, else an edit of this repo's own source."""
    edits = []
    if CODE_EDITS.exists():
        for line in CODE_EDITS.open():
            row = json.loads(line)
            if len(row["before"]) <= max_chars:
                edits.append((row["instruction"], row["before"]))
    if not edits:
        source = Path(__file__).read_text()[:max_chars]
        edits = [("Rename `engine` to `eng`.", source)]
    return [
        chat_prompt(engine, f"{instruction}\n\n```python\n{before}```\nOutput the whole updated file.", EDIT_PREFILL)
        for instruction, before in edits[:count]
    ]


@contextlib.contextmanager
def every_draft(engine: TorchEngine):
    """The server's speculation drafting all its rules allow, the server's own again after: the
    measured draft rule stands a mode down where its drafts do not pay on the machine it runs
    on, and a test of verifying drafts that drafted none would test nothing."""
    engine.configure(dataclasses.replace(engine.config.speculation, adaptive_drafts=False))
    try:
        yield
    finally:
        engine.configure(engine.config.speculation)


def request(prompt, max_tokens=48, mode="auto", rid=None, **sampling) -> GenerationRequest:
    request.counter = getattr(request, "counter", 0) + 1
    return GenerationRequest(
        request_id=rid or f"req-{request.counter}",
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        speculation=RequestSpeculation(mode=mode),
    )


async def collect(engine: TorchEngine, req: GenerationRequest):
    """Run one request to the end: (token ids, text, last delta)."""
    tokens, text, _, last = await collect_logprobs(engine, req)
    return tokens, text, last


async def collect_logprobs(engine: TorchEngine, req: GenerationRequest):
    """Run one request to the end: (token ids, text, logprobs, last delta)."""
    tokens, text, logprobs, last = [], "", [], None
    async for delta in engine.generate(req):
        tokens += delta.token_ids
        text += delta.text
        logprobs += delta.logprobs
        last = delta
    return tokens, text, logprobs, last
