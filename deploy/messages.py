"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat
pipeline, for the clients that speak it (the `anthropic` SDK, Claude Code with
`ANTHROPIC_BASE_URL`).

A request is turned into the chat completion it means (`chat_request`: `system` as the system
message, `tool_use` blocks as an assistant's tool calls, `tool_result` blocks as tool messages,
`input_schema` tools, `tool_choice` auto / any / tool / none), so it is rendered, tokenized,
constrained and generated exactly as `/v1/chat/completions` would; the answer comes back as
content blocks (`deploy/message_blocks.py`: a `text` block per run of text, a `tool_use` block per call),
streamed as Anthropic's events. `cache_control` marks are taken and not read: the prefix cache
finds a prompt's cached prefix by itself (Claude Code's billing header, which changes with
every request, is left out of the prompt for it). Text only: an image or document block is a
400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from deploy.chat_protocol import (
    PART_SEPARATOR, AssistantToolCall, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition,
    NamedToolChoice, Tool, ToolChoiceFunction, chat_meant,
)
from deploy.errors import ApiError
from deploy.message_parts import (
    THINKING, CacheControl, Message, MessagesMetadata, OutputConfig, TextBlock, Thinking, ToolChoice, ToolDefinition,
)
from deploy.protocol import RequestModel, Text, check_stops, check_tool_choice, unique_names
from replicas.engine import RequestSpeculation

# Anthropic documents no limit on `stop_sequences` (OpenAI's `stop` takes 4): a bound on the
# stop search each step makes, which a client of ours sending a long list stays well within.
MAX_STOP_SEQUENCES = 256

# -- request -----------------------------------------------------------------------------------
class CountTokensRequest(RequestModel):
    """`POST /v1/messages/count_tokens`: what the prompt of these messages costs."""

    model: str = Field(min_length=1)
    messages: List[Message] = Field(min_length=1)
    system: Optional[Union[Text, List[TextBlock]]] = None
    tools: Annotated[List[ToolDefinition], AfterValidator(unique_names)] = Field([], validate_default=True)
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[CacheControl] = None  # a hint, not read
    speed: Optional[Literal["standard"]] = None
    context_management: Optional[Dict[str, Any]] = None  # server-side context edits: not made, the context is kept

    @field_validator("messages")
    @classmethod
    def _contents(cls, messages: List[Message]) -> List[Message]:
        """Anthropic's rules: text that says something (the final assistant message, a prefill,
        may be empty), and a prefill that ends in no whitespace. Consecutive messages of a role
        are then one (`_merged`)."""
        for i, message in enumerate(messages):
            blocks = [message.content] if isinstance(message.content, str) else message.content
            texts = [block if isinstance(block, str) else block.text for block in blocks
                     if isinstance(block, str) or block.type == "text"]
            if i == len(messages) - 1 and message.role == "assistant" and texts in ([], [""]):
                continue
            if texts == [""] or not blocks:
                raise ValueError(f"messages[{i}]: all messages must have non-empty content except for the "
                                 f"optional final assistant message")
            if any(not text.strip() for text in texts):
                raise ValueError(f"messages[{i}]: text content blocks must contain non-whitespace text")
        messages, at = _merged(messages)
        _check_tool_ids(messages, at)
        begun = _answer_begun(messages)
        if begun and begun != begun.rstrip():
            raise ValueError("the final assistant content (a prefill) cannot end with whitespace")
        if len(messages) == 1 and begun == "":
            raise ValueError("nothing to answer: the only message is an empty assistant message")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools, info: ValidationInfo):
        used = any(not isinstance(m.content, str) and any(b.type in ("tool_use", "tool_result") for b in m.content)
                   for m in info.data.get("messages") or [])
        if used and not tools:
            raise ValueError("requests which include tool_use or tool_result blocks must define tools")
        return tools

    @field_validator("system")
    @classmethod
    def _system(cls, system):
        if isinstance(system, list) and any(not block.text.strip() for block in system):
            raise ValueError("text content blocks must contain non-whitespace text")
        return system

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        forces = choice is not None and choice.type in ("any", "tool")
        named = [choice.name] if forces and choice.type == "tool" else []
        check_tool_choice(forces, named, {t.name for t in info.data.get("tools") or []})
        return choice


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. Anthropic's current API has no sampling settings (its clients send
    none: temperature 1); earlier clients' `temperature`, `top_p` and `top_k` are honoured."""

    max_tokens: int = Field(ge=1, description="capped by the server's limit")
    stop_sequences: Optional[List[Text]] = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    metadata: Optional[MessagesMetadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None  # we have one tier
    inference_geo: Optional[str] = None  # a label, not read
    diagnostics: Optional[Any] = None  # Claude Code's, not read
    user_profile_id: Optional[str] = None  # a label, not read
    speculation: Optional[RequestSpeculation] = None  # narrows the server's setting
    # vLLM's, as load generators send them here too (aiperf): an output of a set length
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="EOS held back until this many tokens")
    thread: Optional[Any] = Field(None, description="Anthropic's message threads (the conversation kept by the "
                                  "server): refused so that the client sends the whole conversation instead")

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, stops):
        return check_stops(stops, MAX_STOP_SEQUENCES)


def _blocks_of(message: Message) -> list:
    return [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content


def _merged(messages: List[Message]) -> tuple[List[Message], List[List[int]]]:
    """The conversation with each run of user (or assistant) messages one message of their
    blocks, as Anthropic's API combines consecutive turns of a role; and, for each message,
    the client's message each of its blocks came from (text content: one block)."""
    merged: List[Message] = []
    at: List[List[int]] = []
    for i, message in enumerate(messages):
        blocks = _blocks_of(message)
        if not merged or message.role == "system" or message.role != merged[-1].role:
            merged.append(message)
            at.append([i] * max(1, len(blocks)))
            continue
        kept = [(b, where) for b, where in (*zip(_blocks_of(merged[-1]), at[-1]), *((b, i) for b in blocks))
                if b.type != "text" or b.text]  # an empty last answer adds nothing
        merged[-1] = Message.model_construct(role=message.role, content=[b for b, _ in kept])
        at[-1] = [where for _, where in kept] or [at[-1][0]]
    return merged, at


def _check_tool_ids(messages: List[Message], at: List[List[int]]) -> None:
    """Anthropic's pairing: tool_use ids are unique, and the user message after an assistant
    message with tool_use blocks (system messages may come between) answers each of them, once,
    with tool_result blocks that come first in its content; a tool_result answers nothing else.
    An error names the client's message its block came from (`at`, `_merged`'s): for calls left
    unanswered, the first's."""
    seen: set[str] = set()
    unanswered: list[str] = []  # the tool_use ids of the last assistant message, until answered
    asked_at: dict[str, int] = {}  # the client's message of each

    def missing() -> ValueError:
        return ValueError(f"messages[{asked_at[unanswered[0]]}]: tool_use ids were found without tool_result "
                          f"blocks immediately after: {', '.join(unanswered)}; each tool_use needs its tool_result "
                          f"in the next message")

    for i, message in enumerate(messages):
        blocks = [] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            if unanswered:
                raise missing()
            unanswered = []
            for k, block in enumerate(blocks):
                if block.type != "tool_use":
                    continue
                if block.id in seen:
                    raise ValueError(f"messages[{at[i][k]}]: tool_use ids must be unique, {block.id!r} is used twice")
                seen.add(block.id)
                unanswered.append(block.id)
                asked_at[block.id] = at[i][k]
            continue
        if message.role != "user":
            continue
        results = [b.tool_use_id for b in blocks if b.type == "tool_result"]
        late = next((k for k, b in enumerate(blocks) if k >= len(results) and b.type == "tool_result"), None)
        if late is not None:
            raise ValueError(f"messages[{at[i][late]}]: tool_result blocks must come first in the content, before "
                             f"any other")
        for k, result in enumerate(results):
            if result not in unanswered or result in results[:k]:
                raise ValueError(f"messages[{at[i][k]}]: unexpected tool_use_id {result!r} in a tool_result block: "
                                 f"each answers, once, a tool_use block of the assistant message before it")
        unanswered = [use for use in unanswered if use not in results]
        if unanswered:
            raise missing()
    if unanswered:
        raise missing()


# -- the chat request it means -----------------------------------------------------------------
def _answer_begun(messages: List[Message]) -> Optional[str]:
    """The start of the answer the conversation ends with (Anthropic's prefill: a last
    assistant message of text only, which the answer continues; "" is no prefill), or None.
    Thinking blocks, never rendered, do not count."""
    last = messages[-1]
    blocks = [] if isinstance(last.content, str) else [b for b in last.content if b.type not in THINKING]
    if last.role != "assistant" or any(b.type != "text" for b in blocks):
        return None
    return last.content if isinstance(last.content, str) else PART_SEPARATOR.join(b.text for b in blocks)


# Claude Code leads its system prompt with a block of its own that changes with every request
# ("x-anthropic-billing-header: cc_version=...; cch=..."): read by Anthropic's billing, not by
# the model, and kept it would leave no prompt a cached prefix to share.
BILLING_HEADER = "x-anthropic-billing-header:"


def _chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    # the request's system blocks are one text, as vLLM's Messages API joins them (Claude Code's
    # own begin with their newline); a message's blocks are parts (PART_SEPARATOR)
    system = body.system if isinstance(body.system, str) else "".join(
        b.text for b in body.system or [] if not b.text.startswith(BILLING_HEADER))
    messages = [ChatMessage(role="system", content=system)] if system else []
    for m in body.messages:
        if m is body.messages[-1] and _answer_begun(body.messages) == "":
            continue  # an empty last answer: no prefill
        if isinstance(m.content, str) or m.role == "system":
            messages.append(ChatMessage(role=m.role, content=m.content if isinstance(m.content, str) else
                                        PART_SEPARATOR.join(b.text for b in m.content)))
        elif m.role == "assistant":
            text = PART_SEPARATOR.join(b.text for b in m.content if b.type == "text")
            calls = [AssistantToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(
                b.input, ensure_ascii=False))) for b in m.content if b.type == "tool_use"]
            messages.append(ChatMessage(role="assistant", content=(text or None) if calls else text,
                                        tool_calls=calls or None))
        else:  # results first (Anthropic's order), each a tool message; each run of text a user message
            text = None
            for b in m.content:
                if b.type == "tool_result":
                    messages.append(ChatMessage(role="tool", content=b.text, tool_call_id=b.tool_use_id))
                    text = None
                elif text is None:
                    text = ChatMessage(role="user", content=b.text)
                    messages.append(text)
                else:
                    messages[-1] = text = text.model_copy(update={"content": text.text + PART_SEPARATOR + b.text})
    return messages


def threads_refused() -> ApiError:
    """A request asking for a message thread. The anthropic SDK's tool runner asks for one and,
    told so in `details` as Anthropic's API tells it, goes on without: each turn then carries
    the whole conversation (which the prefix cache serves)."""
    return ApiError(400, "thread: message threads are not supported here; send the whole conversation", "thread",
                    details={"error_code": "thread_unsupported_request", "unsupported": []})


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion `body` asks for (of a count, only the prompt it renders is read)."""
    choice = body.tool_choice
    if choice is None or choice.type != "tool":
        tool_choice = {"auto": "auto", "none": "none", "any": "required"}.get(getattr(choice, "type", None))
    else:
        tool_choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
    sampling = {}
    if isinstance(body, MessagesRequest):
        fmt = body.output_config and body.output_config.format
        sampling = dict(max_completion_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                        top_k=body.top_k, stop=body.stop_sequences, stream=body.stream, speculation=body.speculation,
                        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                        user=body.metadata.user_id if body.metadata else None, response_format=fmt and {
                            "type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}})
    prefill = bool(_answer_begun(body.messages))
    tools = [Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                               parameters=t.input_schema)) for t in body.tools]
    return chat_meant(dict(
        model=body.model, messages=_chat_messages(body), **sampling, tools=tools or None,
        tool_choice=tool_choice if body.tools else None,
        parallel_tool_calls=not getattr(choice, "disable_parallel_tool_use", False),
        add_generation_prompt=not prefill, continue_final_message=prefill), context={"max_stops": MAX_STOP_SEQUENCES})


# the chat pipeline's fields as a Messages request names them (ApiError.renamed)
FIELDS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format",
          "response_format.json_schema.schema": "output_config.format.schema",
          "tools[].function.parameters": "tools[].input_schema"}
