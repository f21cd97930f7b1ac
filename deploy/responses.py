"""OpenAI's Responses API (`POST /v1/responses`) on the chat pipeline: its request and its
translation (the request's parts: `deploy/response_parts.py`).

A Responses request is turned into the chat request it means (`chat_request`: `instructions`
as the system message, input items as messages, `function_call` items as an assistant's
tool calls, `function_call_output` items as tool messages, function tools (a `namespace`'s
among them, by their own names), `text.format` as `response_format`), so it is rendered,
tokenized, constrained and generated exactly as `/v1/chat/completions` would, and the output
comes back as Responses output items: a `message` with its `output_text`, and a
`function_call` item per call (`OutputItems`, one state machine for the streamed events and
the final body, so the two agree on every id: `deploy/response_items.py`).

Kept: with `store` (the default, as OpenAI's), a finished response, its conversation and its
input items are kept (`deploy/response_store.py`) for `previous_response_id`, `item_reference`
input, `GET`/`DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`
(`response_items.input_items`); a background response is kept as it is queued and runs.
Only function tools (alone or in namespaces) and text in and out: another tool type or part
is a 400.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Dict, Iterable, List, Literal, Optional, Union

from pydantic import AfterValidator, Field, TypeAdapter, ValidationInfo, field_validator

from deploy.chat_protocol import (
    AllowedTools, AllowedToolsChoice, AssistantToolCall, ChatCompletionRequest, ChatMessage,
    FunctionCall, NamedToolChoice, Tool, ToolChoiceFunction, chat_meant,
)
from deploy.errors import ApiError
from deploy.protocol import (
    Metadata, PromptCacheRetention, RequestModel, ServiceTier, Text, check_stops, check_tool_choice, only_streamed,
)
from deploy.response_parts import (
    AllowedFunctionsChoice, AnyTool, FunctionCallItem, FunctionCallOutputItem, FunctionToolChoice, InputItem,
    InputMessage, ItemReference, NamespaceTool, Reasoning, ResponsesStreamOptions, TextConfig,
    TextFormatJsonSchema, functions, offered, unique_functions,
)
from replicas.engine import MAX_TOP_LOGPROBS, GenerationRequest, RequestSpeculation


class ResponsesRequest(RequestModel):
    """`POST /v1/responses`. Fields OpenAI has and we do not implement are accepted only at
    their neutral values; `include` takes
    logprobs (`top_logprobs` alone asks for them too; not beside tools) and what needs nothing
    from us (no output of ours has reasoning or search results)."""

    model: str = Field(min_length=1)
    input: Union[Text, List[InputItem]]
    instructions: Optional[Text] = None
    previous_response_id: Optional[str] = Field(None, min_length=1)
    store: bool = True
    stream: bool = False
    max_output_tokens: Optional[int] = Field(None, ge=1, description="capped by the server's limit")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    tools: Annotated[List[AnyTool], AfterValidator(unique_functions)] = []
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, AllowedFunctionsChoice] = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: Optional[int] = Field(None, ge=0)  # of built-in tools, of which none is served: unread
    text: TextConfig = TextConfig()
    metadata: Metadata = None
    include: List[Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                          "web_search_call.results"]] = []
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    truncation: Literal["disabled", "auto"] = "disabled"
    background: bool = Field(False, description="answered at once as queued; poll GET /v1/responses/{id}")
    service_tier: ServiceTier = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: PromptCacheRetention = None
    reasoning: Optional[Reasoning] = None  # hints: no output of ours has reasoning
    stream_options: Optional[ResponsesStreamOptions] = None
    speculation: Optional[RequestSpeculation] = None  # narrows the server's setting
    client_metadata: Optional[Dict[str, str]] = None  # Codex's ids of its session and turn: not read
    # vLLM's, as load generators send them here too (guidellm, aiperf): an output of a set length
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="EOS held back until this many tokens")
    stop: Optional[Union[Text, List[Text]]] = None

    @field_validator("input")
    @classmethod
    def _input(cls, value):  # (an id named twice: `repeated_id`, once references are resolved)
        if len(value) == 0:
            raise ValueError("must not be empty")
        return value

    _stream_options = field_validator("stream_options")(only_streamed)

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        return check_stops(stop)

    @field_validator("background")
    @classmethod
    def _background(cls, value, info: ValidationInfo):
        if value and not info.data.get("store", True):
            raise ValueError("needs store=true (the response is kept for GET /v1/responses/{id})")
        if value and info.data.get("stream"):
            raise ValueError("not with stream=true here: poll GET /v1/responses/{id}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        names = ([t.name for t in choice.tools] if isinstance(choice, AllowedFunctionsChoice) else
                 [choice.name] if isinstance(choice, FunctionToolChoice) else [])
        check_tool_choice(choice not in ("none", "auto"), names,
                          {f.name for _, f in functions(info.data.get("tools") or [])})
        return choice

    @field_validator("include", "top_logprobs")
    @classmethod
    def _logprobs(cls, value, info: ValidationInfo):
        # with tools the text is split into calls and prose, and a token's logprob has no one place
        asked = "message.output_text.logprobs" in value if info.field_name == "include" else value is not None
        if asked and info.data.get("tools"):
            raise ValueError("logprobs are not given beside tools")
        return value

    @property
    def items(self) -> list:
        """The input as items: a string is one user message."""
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    @property
    def namespaces(self) -> dict[str, str]:
        """A namespace's function's name -> the namespace's."""
        return {f.name: ns.name for ns, f in functions(self.tools) if ns is not None}

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in self.include or self.top_logprobs is not None


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens` (OpenAI's): a Responses request's fields, none required,
    for the tokens its prompt holds (`previous_response_id` alone counts that conversation)."""

    model: Optional[str] = Field(None, min_length=1)
    input: Union[Text, List[InputItem]] = Field(default_factory=list)


def repeated_id(items: list, taken: Iterable[str] = ()) -> Optional[tuple[str, str]]:
    """(the field, what is wrong) where an item's id names a second item, among `items` (an
    item_reference names one, not a second) and the ids `taken` (the items of the response
    `previous_response_id` names, which the conversation holds already: sent again, a call
    was in it twice); None where none does. An id names one item: the store keys its items by it."""
    first = dict.fromkeys(taken, "the id of an item of the previous_response_id response")
    for i, item in enumerate(items):
        item_id = None if isinstance(item, ItemReference) else getattr(item, "id", None)
        if item_id is None:
            continue
        if item_id in first:
            return f"input[{i}].id", f"{item_id!r} is {first[item_id]}"
        first[item_id] = f"input[{i}]'s id too"
    return None


def unmatched_call(items: list, history: List[ChatMessage]) -> Optional[tuple[str, str]]:
    """(the field, what is wrong) where a function_call_output answers no unanswered
    function_call before it, in `items` or in `history` (the conversation
    `previous_response_id` names), where a function_call takes the call_id of one not yet
    answered, or where a call of the input is left with no output (OpenAI's "No tool output
    found"; a stored response's call may be: one cut by max_output_tokens has nothing to run);
    None where none is. (A message may come between a call and its output, as OpenAI's
    Responses allow; chat's tool messages follow their calls.)"""
    unanswered: dict[str, Optional[str]] = {}  # call_id -> the input item that made the call (None: stored)
    for message in history:
        unanswered |= {call.id: None for call in message.tool_calls or []}
        unanswered.pop(message.tool_call_id, None)
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            if item.call_id in unanswered:
                return f"input[{i}].call_id", f"{item.call_id!r} is the call_id of an earlier call not answered yet"
            unanswered[item.call_id] = f"input[{i}]"
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in unanswered:
                return f"input[{i}].call_id", (f"no function_call with call_id {item.call_id!r} comes before it, "
                                               "or it was answered already")
            del unanswered[item.call_id]
    for call_id, field in unanswered.items():
        if field is not None:
            return field, f"no function_call_output found for the function_call with call_id {call_id!r}"
    return None


# -- the chat request it means -----------------------------------------------------------------
_INPUT_ITEM = TypeAdapter(InputItem)


def references(body: ResponsesRequest) -> dict[str, str]:
    """The stored items `body`'s input names by reference: `input[i].id` -> the item's id."""
    return {f"input[{i}].id": item.id for i, item in enumerate(body.items) if isinstance(item, ItemReference)}


def with_items(body: ResponsesRequest, items: dict[str, dict[str, Any]],
               max_bytes: Optional[int] = None) -> ResponsesRequest:
    """`body` with each item_reference replaced by the item it names (`items`: by id, as the
    response that made it was stored). The items referenced may come to no more than
    `max_bytes` (as JSON), as much as a body sent whole may hold, else a 413: a request of
    1 KB naming ten stored messages of 1 MB each had the Ingress tokenize 10 MB for 15 s (QA)."""
    named = [items[item.id] for item in body.items if isinstance(item, ItemReference)]
    size = sum(len(json.dumps(item, ensure_ascii=False).encode()) for item in named)
    if max_bytes is not None and size > max_bytes:
        raise ApiError(413, f"input: the items it references come to {size} bytes, more than a request body "
                            f"may hold ({max_bytes}: limits.max_body_bytes)", "input")
    resolved = [_INPUT_ITEM.validate_python(items[item.id]) if isinstance(item, ItemReference) else item
                for item in body.input]
    return body.model_copy(update={"input": resolved})


def conversation(body: ResponsesRequest, history: List[ChatMessage]) -> List[ChatMessage]:
    """The chat the model continues, instructions left out: `history` (what
    `previous_response_id` names: its input and output) and then `body.input` as messages."""
    return extended(history, body.items)


def continued(chat: List[ChatMessage], output: List[dict[str, Any]]) -> List[ChatMessage]:
    """What a `previous_response_id` naming this response continues: its `chat` and then its
    `output` items read as the same items sent back whole would be (an answer's text after a
    call had been joined to the text before it: another prompt than the one sent whole)."""
    return extended(chat, [_INPUT_ITEM.validate_python(item) for item in output])


def extended(messages: List[ChatMessage], items: list) -> List[ChatMessage]:
    """`messages` and then input `items` as messages, each run of function calls one assistant
    message (with the text the answer began with, if any)."""
    messages = list(messages)
    for item in items:
        if isinstance(item, InputMessage):
            messages.append(ChatMessage(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.text, tool_call_id=item.call_id))
        else:
            call = AssistantToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
    return messages


def chat_request(body: ResponsesRequest, messages: List[ChatMessage]) -> ChatCompletionRequest:
    """The chat completion `body` asks for, over `messages` (`conversation`)."""
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    fmt = body.text.format
    if isinstance(fmt, TextFormatJsonSchema):
        fmt = {"type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                      "schema": fmt.schema_, "strict": fmt.strict}}
    tool_choice = body.tool_choice
    def named(choice: FunctionToolChoice) -> NamedToolChoice:
        return NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))

    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = named(tool_choice)
    elif isinstance(tool_choice, AllowedFunctionsChoice):
        tool_choice = AllowedToolsChoice(type="allowed_tools", allowed_tools=AllowedTools(
            mode=tool_choice.mode, tools=[named(t) for t in tool_choice.tools]))
    return chat_meant(dict(
        model=body.model, messages=system + messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, speculation=body.speculation,
        tools=[Tool(type="function", function=offered(*each)) for each in functions(body.tools)] or None,
        tool_choice=tool_choice if body.tools else None, parallel_tool_calls=body.parallel_tool_calls,
        response_format=fmt, user=body.user, logprobs=body.logprobs,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None, ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, stop=body.stop))


def fitted(body: ResponsesRequest, chat: ChatCompletionRequest, messages: List[ChatMessage],
           build: Callable[[ChatCompletionRequest], GenerationRequest]) -> tuple[GenerationRequest, List[ChatMessage]]:
    """The engine request (`build`) for `chat`, the chat over `messages`, and those messages.
    With `truncation: "auto"`, a chat whose prompt is too long for the context window
    (`context_length_exceeded`) loses its oldest turns instead, whole (a turn starts at a user
    message, so no call is parted from its result), the system and developer messages among
    them kept: the longest such chat that fits, and its messages (what a stored response keeps,
    so a long chain stays one context window per response). One that cannot fit however short
    is the latest turn's error. Found galloping back from the latest turn, then bisecting: from
    the whole chat, bisection rendered half of it first (20,000 messages: 10 s of the Ingress)."""
    try:
        return build(chat), messages
    except ApiError as exc:
        if body.truncation == "disabled" or exc.code != "context_length_exceeded":
            raise
        too_long = exc
    starts = [i for i, m in enumerate(messages) if m.role == "user" and i > 0]
    low, high, best = 0, len(starts) - 1, None  # the earliest turn that fits is in [low, high + 1]

    def fits(k: int) -> bool:  # the chat from starts[k] on; where it fits, `best` and high below k
        nonlocal low, high, best, too_long
        kept = [m for m in messages[:starts[k]] if m.role in ("system", "developer")] + messages[starts[k]:]
        try:
            best, high = (build(chat_request(body, kept)), kept), k - 1
            return True
        except ApiError as exc:
            if exc.code != "context_length_exceeded":
                raise
            too_long, low = exc, k + 1
            return False

    span = 1
    while low <= high and fits(max(high + 1 - span, low)):
        span *= 2
    while low <= high:
        fits((low + high) // 2)
    if best is None:
        raise too_long
    return best


def fields(body: ResponsesRequest) -> dict[str, str]:
    """The chat pipeline's fields as `body` names them (ApiError.renamed): FIELDS, and each
    function's own path where a namespace parts its index among all functions from its place."""
    if not any(isinstance(t, NamespaceTool) for t in body.tools):
        return FIELDS
    paths: list[str] = []
    for j, tool in enumerate(body.tools):
        if isinstance(tool, NamespaceTool):
            paths += [f"tools[{j}].tools[{k}]" for k in range(len(tool.tools))]
        else:
            paths.append(f"tools[{j}]")
    return {**FIELDS, **{f"tools[{i}].function.{key}": f"{path}.{key}" for i, path in enumerate(paths)
                         for key in ("name", "parameters")}}


# the chat pipeline's fields as a Responses request names them (ApiError.renamed)
FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema",
          "tools[].function.parameters": "tools[].parameters", "logprobs": "include"}
