"""A Responses answer (`deploy/responses.py`'s requests) as OpenAI's output items: the stream's
events as each delta arrives and the final body from one state machine (`OutputItems`), the
response object (`response_body`), and a request's input as `GET .../input_items` lists it.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any, Optional

from deploy.errors import ApiError
from deploy.openai_format import Accumulated, TokenTexts, tool_call_id
from deploy.output_parts import OutputParts
from deploy.response_parts import InputMessage
from deploy.responses import ResponsesRequest

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`body`'s input as the items `GET /v1/responses/{id}/input_items` lists (item references
    resolved, `with_items`): each with an id (its own, else a new one) and status completed."""
    listed = []
    for item in body.items:
        kept = item.model_dump(by_alias=True, exclude_none=True)
        if isinstance(item, InputMessage) and isinstance(item.content, str):  # as a list of parts
            part = {"type": "input_text", "text": item.content}
            kept["content"] = [{**part, "type": "output_text", "annotations": []} if item.role == "assistant" else part]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kept["type"]]
        listed.append({"id": _id(prefix), "status": "completed", **kept})  # an item's own status kept
    return listed


class OutputItems(OutputParts):
    """The output items of one response (`parts`) and the stream events each delta makes, each
    with its `sequence_number`: a `message` item per run of text, a `function_call` item per
    call, its arguments streamed as the model writes them (with its `namespace` where `namespaces`,
    a function's name -> its namespace's, has one)."""

    def __init__(self, tools: bool, logprobs: Optional[TokenTexts] = None, one_call: bool = False,
                 namespaces: Optional[dict[str, str]] = None) -> None:
        super().__init__(tools, logprobs, one_call)
        self._seq = 0
        self._namespaces = namespaces or {}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def text_part(self) -> dict[str, Any]:
        text = {"type": "output_text", "text": "", "annotations": [], **({"logprobs": []} if self._token_texts else {})}
        return {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": [text]}

    def call_part(self, name: str) -> dict[str, Any]:
        namespace = {"namespace": self._namespaces[name]} if name in self._namespaces else {}
        return {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": tool_call_id(),
                "name": name, **namespace, "arguments": ""}

    def on_open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        if item["type"] != "message":
            return [self.event("response.output_item.added", output_index=self.index, item=copy.deepcopy(item))]
        text = item["content"][0]
        return [self.event("response.output_item.added", output_index=self.index,
                           item={**copy.deepcopy(item), "content": []}),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                           content_index=0, part=copy.deepcopy(text))]

    def on_text(self, item: dict[str, Any], text: str,
                logprobs: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        part = item["content"][0]
        part["text"] += text
        if logprobs is not None:
            part["logprobs"] += logprobs
        return [self.event("response.output_text.delta", item_id=item["id"], output_index=self.index,
                           content_index=0, delta=text, logprobs=logprobs or [])]

    def on_arguments(self, item: dict[str, Any], arguments: str) -> list[dict[str, Any]]:
        item["arguments"] += arguments
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self.index,
                           delta=arguments)]

    def on_close(self, item: dict[str, Any], finish_reason: str) -> list[dict[str, Any]]:
        item["status"] = "incomplete" if finish_reason == "length" else "completed"
        where = {"item_id": item["id"], "output_index": self.parts.index(item)}
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                 logprobs=part.get("logprobs", [])),
                      self.event("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=copy.deepcopy(item))]


def failed(response: dict[str, Any], error: ApiError) -> dict[str, Any]:
    """A Response object that ended with `error` (the request's own fault: `invalid_prompt`)."""
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    return {**response, "status": "failed", "error": {"code": code, "message": error.message}}


def response_body(body: ResponsesRequest, response_id: str, created_at: int, model: str,
                  items: Optional[OutputItems] = None, acc: Optional[Accumulated] = None) -> dict[str, Any]:
    """The Response object: in progress (no `acc` yet), or finished with its output and usage."""
    status, incomplete, usage = "in_progress", None, None
    if acc is not None:
        status = "incomplete" if acc.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        # nothing is billed for what the prefix cache writes: cache_write_tokens 0, as the SDK's type needs one
        cached = {"cached_tokens": acc.cached_tokens, "cache_write_tokens": 0}
        usage = {"input_tokens": acc.prompt_tokens, "input_tokens_details": cached,
                 "output_tokens": acc.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": acc.prompt_tokens + acc.completion_tokens, "speculation": acc.speculation}
    text = body.text.model_dump(by_alias=True, exclude_none=True)
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if acc is not None else None, "error": None,
        "incomplete_details": incomplete, "instructions": body.instructions, "model": model,
        "output": items.parts if items is not None and acc is not None else [],
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump(),
        "tools": [t.model_dump() for t in body.tools], "text": text, "truncation": body.truncation,
        "store": body.store, "metadata": body.metadata or {}, "user": body.user, "usage": usage,
        # what the request set, echoed as OpenAI's object does (a hint, or a neutral value, here)
        "top_logprobs": body.top_logprobs, "max_tool_calls": body.max_tool_calls, "background": body.background,
        "service_tier": "default", "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
    }

