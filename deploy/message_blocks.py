"""A Messages answer (`deploy/messages.py`'s requests) as Anthropic's content blocks: the
stream's events as each delta arrives (`ContentBlocks`), and the finished Message's body
(`message_body`, written by `MessageResponse`).
"""

from __future__ import annotations

import copy
import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi.responses import JSONResponse
from pydantic_core import from_json

from deploy.openai_format import Accumulated
from deploy.output_parts import OutputParts
from deploy.tool_calls import json_loads
from replicas.engine import GenerationDelta

class ContentBlocks(OutputParts):
    """The answer's content blocks (`parts`) and the stream events each delta makes: a `text`
    block per run of text, a `tool_use` block per call, its input streamed as JSON text."""

    def __init__(self, tools: bool, one_call: bool = False, continues: bool = False) -> None:
        super().__init__(tools, one_call=one_call, continues=continues)
        self._arguments: dict[str, str] = {}  # a tool_use block's id -> its input as JSON text so far
        self._whole_calls = 0  # tool_use blocks closed whole (not cut, nor left malformed)

    def text_part(self) -> dict[str, Any]:
        return {"type": "text", "text": ""}

    def call_part(self, name: str) -> dict[str, Any]:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": {}}
        self._arguments[block["id"]] = ""
        return block

    def on_open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "content_block_start", "index": self.index, "content_block": copy.deepcopy(block)}]

    def on_text(self, block: dict[str, Any], text: str, logprobs: Any) -> list[dict[str, Any]]:
        block["text"] += text
        return [{"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}]

    def on_arguments(self, block: dict[str, Any], arguments: str) -> list[dict[str, Any]]:
        self._arguments[block["id"]] += arguments
        return [{"type": "content_block_delta", "index": self.index,
                 "delta": {"type": "input_json_delta", "partial_json": arguments}}]

    def on_close(self, block: dict[str, Any], finish_reason: str) -> list[dict[str, Any]]:
        if block["type"] == "tool_use":
            self._whole_calls += finish_reason == "stop"
            block["input"] = call_input(self._arguments[block["id"]])
        return [{"type": "content_block_stop", "index": self.index}]  # the block closed is the last begun

    def stop_reason(self, acc: Accumulated) -> str:
        if acc.finish_reason == "length":
            return "max_tokens"
        if acc.stop_string is not None:
            return "stop_sequence"
        return "tool_use" if self._whole_calls else "end_turn"


@dataclass(frozen=True)
class RawJson:
    """JSON text that a body holds as it is (`MessageResponse` writes it unquoted)."""

    text: str


def parsed_input(text: str) -> Any:
    """A tool_use block's input: the object `text` spells, or `RawJson(text)` where Python
    holds one of its numbers as no JSON number (1e999 parses to inf, which JSON cannot spell,
    and an answer with it was a 500), as zero (1e-400) or not at all (an integer of over 4,300
    digits). Not JSON (NaN, a call cut short): ValueError."""
    lossy = False

    def number(kind: type) -> Any:
        def parse(spelt: str) -> Any:
            nonlocal lossy
            try:
                value = kind(spelt)
            except ValueError:  # int's digit limit
                lossy = True
                return 0
            # inf, or a nonzero spelling that underflowed to 0 (1e-400)
            underflow = value == 0 and any(d in "123456789" for d in spelt.lower().partition("e")[0])
            lossy = lossy or not math.isfinite(value) or underflow
            return value
        return parse

    value = json_loads(text, parse_float=number(float), parse_int=number(int), parse_constant=_no_constant)
    return RawJson(text) if lossy else value


def call_input(text: str) -> Any:
    """A tool_use block's input from its JSON text: `parsed_input`'s; where the text is cut
    short, the object its streamed `partial_json` gives as the anthropic client reads it (jiter's
    partial mode: an unfinished string or literal left out), so the answer is the same streamed
    or not; {} where that is no object JSON can write."""
    try:
        return parsed_input(text or "{}")
    except ValueError:
        pass
    try:
        value = from_json(text, allow_partial=True)
        json.dumps(value, allow_nan=False)  # 1e999 reads as inf; an integer past Python's digit limit
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity, which no JSON writer may write


class MessageResponse(JSONResponse):
    """A Message's JSON body, each `RawJson` in it written as the text it holds."""

    def render(self, content: Any) -> bytes:
        raw: list[str] = []
        mark = f"raw-{uuid.uuid4().hex}-"

        def placeholder(value: Any) -> str:
            if not isinstance(value, RawJson):
                raise TypeError(f"{type(value).__name__} is not JSON")
            raw.append(value.text)
            return f"{mark}{len(raw) - 1}"

        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=placeholder)
        for i, spelt in enumerate(raw):
            text = text.replace(f'"{mark}{i}"', spelt, 1)
        return text.encode("utf-8")


def usage(acc: Accumulated) -> dict[str, int]:
    return {"input_tokens": acc.prompt_tokens - acc.cached_tokens, "output_tokens": acc.completion_tokens,
            "cache_read_input_tokens": acc.cached_tokens, "cache_creation_input_tokens": 0}


def message_body(message_id: str, model: str, blocks: ContentBlocks, acc: Optional[Accumulated] = None,
                 first: Optional[GenerationDelta] = None) -> dict[str, Any]:
    """The Message object: finished (`acc`), or begun, its usage the prompt's as the stream's
    `first` delta tells it (the part the prefix cache held apart, as the finished one's)."""
    begun = acc is None
    if begun:
        acc = Accumulated(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens)
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [] if begun else blocks.parts,
        "stop_reason": None if begun else blocks.stop_reason(acc),
        "stop_sequence": None if begun else acc.stop_string,
        "usage": usage(acc),
    }
