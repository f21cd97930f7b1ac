"""Engine deltas -> OpenAI response bodies and SSE chunks. Pure functions over plain data.

Completions and chat differ only in the choice shape (`text` vs `delta`/`message`), so
each builder takes the endpoint `kind` and stays in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from replicas.engine import GenerationDelta

Kind = Literal["completion", "chat"]
DONE = "data: [DONE]\n\n"


@dataclass
class Accumulated:
    """A request's output so far: text and the last delta's figures."""

    text: str = ""
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    speculation: dict[str, float] = field(default_factory=dict)

    def add(self, delta: GenerationDelta) -> None:
        self.text += delta.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.prompt_tokens = delta.prompt_tokens
            self.completion_tokens = delta.completion_tokens
            self.speculation = dict(delta.speculation)


def usage(acc: Accumulated) -> dict[str, Any]:
    spec = acc.speculation
    return {
        "prompt_tokens": acc.prompt_tokens,
        "completion_tokens": acc.completion_tokens,
        "total_tokens": acc.prompt_tokens + acc.completion_tokens,
        "speculation": {
            "draft_tokens": int(spec.get("draft_tokens", 0)),
            "accepted_tokens": int(spec.get("accepted_tokens", 0)),
            "acceptance_length": float(spec.get("acceptance_length", 0.0)),
            "steps": int(spec.get("steps", 0)),
        },
    }


def full_response(kind: Kind, response_id: str, created: int, model: str, acc: Accumulated) -> dict[str, Any]:
    """The non-streaming body."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": acc.text},
                  "logprobs": None, "finish_reason": acc.finish_reason}
    else:
        choice = {"index": 0, "text": acc.text, "logprobs": None, "finish_reason": acc.finish_reason}
    return {"id": response_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage(acc)}


def chunk(kind: Kind, response_id: str, created: int, model: str, text: Optional[str],
          finish_reason: Optional[str] = None, role: bool = False) -> dict[str, Any]:
    """One streamed chunk; for chat, `role=True` opens the assistant message."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: Kind, response_id: str, created: int, model: str, acc: Accumulated) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(acc)}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
