"""A fake engine and tokenizer for the Serve-layer tests (fast, deterministic, scriptable).

FakeEngine implements the Engine protocol the way TorchEngine behaves at its edges
(eager RequestError naming the field, abort on close, stats); FakeTokenizer is byte-level
with a ChatML-like template. Prompts steer it: "FAIL_RAISE" raises mid-stream,
"FAIL_DELTA" ends with an error delta, "SLOW" emits a token every 50 ms, "DIE_AT:<k>:<path>"
kills its replica's process at token k unless <path> exists (it creates it, and <path>.dead as
it dies), "NO_RESUME" refuses a `Resume` as TensorRT-LLM's engine does, "ECHO:<text>"
answers the rest of its message (a character a token, then "stop"; up to a stop string or
through a `stop_after` one, as engines end it) instead of the alphabet, and "SETTINGS" a hex
digest of what shapes an engine's output (sampling, speculation, grammar): two requests asking
alike answer alike.
A `Resume` continues after the tokens it carries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
from functools import partial
from pathlib import Path
from typing import AsyncIterator

from deploy.config import AppArgs
from replicas.engine import (GenerationDelta, GenerationRequest, RequestError, SpeculationConfig, TokenLogprob,
                             find_stop)
from replicas.stats import EngineStats

ALPHABET = "abcdefghij"


class FakeTokenizer:
    """Token id = UTF-8 byte."""

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [bytes([i]).decode(errors="replace") for i in ids]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("tool messages are not supported by this template")
        text = ""
        for i, m in enumerate(messages):
            text += f"<{m['role']}>{m['content']}"
            if not (continue_final_message and i == len(messages) - 1):
                text += "</>"
        return text + ("<assistant>" if add_generation_prompt else "")


def _die_at(prompt: str) -> tuple[int, Path | None]:
    """"DIE_AT:<k>:<path>": the token index at which the replica dies, once (-1: never), and the
    file to touch as it does."""
    if "DIE_AT:" not in prompt:
        return -1, None
    index, path = prompt.split("DIE_AT:", 1)[1].split()[0].split(":", 1)
    marker = Path(path)
    if marker.exists():
        return -1, None
    marker.touch()
    return int(index), marker.with_suffix(".dead")


class FakeEngine:
    def __init__(self, speculation: SpeculationConfig, max_seq_len: int = 256) -> None:
        self.speculation = speculation
        self.max_seq_len = max_seq_len
        self.tokenizer = FakeTokenizer()
        self.live: set[str] = set()
        self.started = False

    async def start(self) -> None:
        self.started = True

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        ids = self.tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        if len(ids) + request.sampling.max_tokens > self.max_seq_len:
            raise RequestError("max_tokens", f"{request.sampling.max_tokens} + {len(ids)} prompt tokens "
                                             f"exceed the context window of {self.max_seq_len}")
        if request.grammar is not None and not request.grammar.optional:  # like an engine without
            # constrained decoding: refuse, never ignore (an optional grammar runs unconstrained)
            raise RequestError(request.grammar.param, "the fake engine does not constrain output")
        if request.sampling.prompt_logprobs is not None:  # as TensorRT-LLM's does
            raise RequestError("prompt_logprobs", "the fake engine does not score prompts")
        if request.resume is not None and "NO_RESUME" in self.tokenizer.decode(ids):  # as TensorRT-LLM's does
            raise RequestError("resume", "the fake engine cannot continue an interrupted request")
        return self._stream(request, self.tokenizer.decode(ids), len(ids))

    async def _stream(self, request: GenerationRequest, prompt: str, prompt_tokens: int):
        self.live.add(request.request_id)
        spec = {"draft_tokens": 2, "accepted_tokens": 1, "acceptance_length": 2.0, "steps": 1}
        resumed = len(request.resume.token_ids) if request.resume is not None else 0  # continue after them
        die_at, dying = _die_at(prompt)
        echo = prompt.split("ECHO:", 1)[1].split("</>")[0] if "ECHO:" in prompt else None
        if "SETTINGS" in prompt:
            echo = hashlib.sha256(repr((request.sampling, request.speculation, request.grammar)).encode()).hexdigest()
        stop = find_stop(echo, 0, request.sampling.stop, request.sampling.stop_after) if echo else None
        if stop is not None and stop[0] > 0:
            echo = echo[:stop[0]]
        try:
            for i in range(resumed, min(request.sampling.max_tokens, len(echo) if echo else 1 << 30)):
                if i == die_at:
                    await asyncio.sleep(0.5)  # what was yielded reaches the client first (the tests check)
                    dying.touch()
                    os._exit(1)  # the replica actor's process dies, as on a kill -9
                await asyncio.sleep(0.05 if "SLOW" in prompt else 0)
                if i == 2 and "FAIL_RAISE" in prompt:
                    raise RuntimeError("fake engine exploded")
                if i == 2 and "FAIL_DELTA" in prompt:
                    yield GenerationDelta(request.request_id, (), "", "error", "fake step failure")
                    return
                if i == 2 and "FAIL_FORMAT" in prompt:  # as the torch engine fails a grammar past its limits
                    yield GenerationDelta(request.request_id, (), "", "error", "response_format: the grammar engine "
                                          "gave up on this format", error_param="response_format")
                    return
                char = echo[i] if echo else ALPHABET[i % len(ALPHABET)]
                finish = "length" if i + 1 == request.sampling.max_tokens else None
                if echo and i + 1 == len(echo):
                    finish = "stop"
                num_top = request.sampling.logprobs
                logprobs = () if num_top is None else (TokenLogprob(ord(char), -0.5, tuple(
                    (ord(c), -0.5 - j) for j, c in enumerate((char + ALPHABET)[:num_top]))),)
                yield GenerationDelta(
                    request.request_id, (ord(char),), char, finish, None,
                    prompt_tokens, i + 1, spec if finish else {}, logprobs,
                    stop_string=stop[1] if finish == "stop" and stop is not None else None,
                )
        finally:
            self.live.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.live.discard(request_id)

    def configure(self, speculation: SpeculationConfig) -> None:
        self.speculation = speculation

    def stats(self) -> EngineStats:
        gate = self.speculation.batch_gate  # the gate in force (0: never speculates, NOT_GATED)
        return EngineStats(batch_size=len(self.live), speculating=int(len(self.live) <= gate),
                           acceptance_length=2.0, batch_gate=gate)

    async def check_health(self) -> None:
        if not self.started:
            raise RuntimeError("not started")

    @property
    def num_live_requests(self) -> int:
        return len(self.live)


def fake_engine_factory(speculation: SpeculationConfig) -> FakeEngine:
    return FakeEngine(speculation)


ENGINE_WINDOW = 100  # the fake engine's own window, smaller than the ingress's, to test its ValueErrors
small_window_engine = partial(FakeEngine, max_seq_len=ENGINE_WINDOW)


def engine_unless(marker: str, speculation: SpeculationConfig) -> FakeEngine:
    """A FakeEngine, unless the file `marker` exists: then a replica that cannot start (as one
    whose engine cannot load its model)."""
    if Path(marker).exists():
        raise RuntimeError(f"this replica cannot start while {marker} exists")
    return FakeEngine(speculation)


class NextModelEngine(FakeEngine):
    """The model a deploy rolls out: it starts once the file `marker` exists (a model loading),
    and answers in upper case."""

    def __init__(self, marker: str, speculation: SpeculationConfig) -> None:
        super().__init__(speculation)
        self.marker = Path(marker)

    async def start(self) -> None:
        while not self.marker.exists():
            await asyncio.sleep(0.1)
        await super().start()

    async def _stream(self, request: GenerationRequest, prompt: str, prompt_tokens: int):
        async for delta in super()._stream(request, prompt, prompt_tokens):
            yield dataclasses.replace(delta, text=delta.text.upper())


def fake_args(limits: dict | None = None, **replica) -> AppArgs:
    """An app of fakes with small limits, whose API keys are in $SPECSERVE_TEST_KEYS."""
    return AppArgs(
        engine={"max_seq_len": 256}, served_model_name="fake", api_keys_env="SPECSERVE_TEST_KEYS",
        limits={"max_body_bytes": 8192, "max_prompt_tokens": 200, "max_tokens": 64, **(limits or {})},
        replica={"num_cpus": 0, **replica},
    )
