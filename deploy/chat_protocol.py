"""Chat Completions' request (`POST /v1/chat/completions`) and its messages, tools and tool
choice, which the Responses and Messages APIs' requests become (`deploy/responses.py`,
`deploy/messages.py`). The shared parts and the rules every request follows are
`deploy/protocol.py`'s.
"""

from __future__ import annotations

from typing import Any, List, Literal, Optional, Union

from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from deploy.errors import validation_error
from deploy.protocol import (
    FunctionName, Metadata, ParametersSchema, PromptCacheRetention, ReasoningEffort, RequestModel, SamplingRequest,
    ServiceTier, Text, Verbosity, check_tool_choice, check_unique_names,
)
from replicas.engine import MAX_TOP_LOGPROBS


class TextPart(RequestModel):
    # other keys are taken and not read: the Agents SDK (JavaScript) sends an answer back with
    # its other fields in its text part (`role`, `tool_calls`; `annotations` streamed), and
    # a 400 for them ended its runs at their second turn (found by QA)
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


# What goes between a message's text parts (or blocks) in its one text: a newline, as vLLM's,
# TensorRT-LLM's and llama.cpp's servers join them ("Summarize:" and "The text..." stay two lines)
PART_SEPARATOR = "\n"


def joined_text(content: Union[str, List[TextPart], None]) -> str:
    """A message's content (text or text parts) as one text."""
    if isinstance(content, list):
        return PART_SEPARATOR.join(part.text for part in content)
    return content or ""


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: Text  # JSON text, as OpenAI sends it
    # the SDK's parse() adds its reading of them: taken, not read (nor in the schema: the answer's
    # calls are of this model too)
    parsed_arguments: SkipJsonSchema[Any] = None


class AssistantToolCall(RequestModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: SkipJsonSchema[Optional[int]] = None  # the SDK's stream helper keeps a streamed call's: taken, not read


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # only an assistant's may be left out (OpenAI's rule; its calls are in tool_calls)
    content: Optional[Union[Text, List[TextPart]]] = Field(None, validate_default=True)
    name: Optional[Text] = None
    tool_calls: Optional[List[AssistantToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = Field(None, validate_default=True)  # a tool message: the call it answers
    # what the SDK's dump of an answer carries back (`messages.append(message.model_dump())`,
    # or the message itself, as its parse() and stream helpers return it, `parsed` with it):
    # taken and not read (this server answers no refusal, annotation or audio)
    parsed: SkipJsonSchema[Any] = None
    refusal: Optional[Text] = None
    annotations: Optional[List[Any]] = None
    audio: None = None
    function_call: None = None  # the legacy form of tool_calls: null only

    @field_validator("content")
    @classmethod
    def _content(cls, content, info: ValidationInfo):
        if isinstance(content, list) and not content:
            raise ValueError("a list of content parts must not be empty")
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, tool_calls, info: ValidationInfo):
        if tool_calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return tool_calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, call_id, info: ValidationInfo):
        if not call_id and info.data.get("role") == "tool":
            raise ValueError("a tool message names the call it answers")
        return call_id

    @property
    def text(self) -> str:
        return joined_text(self.content)


class Prediction(RequestModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file being edited)."""

    type: Literal["content"]
    content: Union[Text, List[TextPart]]

    @property
    def text(self) -> str:  # parts of one expected output, not a message's parts: nothing between them
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[ParametersSchema] = None  # none: the function takes no arguments
    strict: Optional[bool] = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: List[NamedToolChoice] = Field(min_length=1)  # {"type": "function", "function": {"name": ...}}


class AllowedToolsChoice(RequestModel):
    """OpenAI's `allowed_tools`: every tool is offered (the prompt, and what the prefix cache
    keeps of it, stays the same from turn to turn) and calls name these alone, as `mode` says."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.allowed_tools.tools]


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`, rendered with the model's chat template.

    vLLM's `continue_final_message: true` + `add_generation_prompt: false` continue a
    last assistant message (a prefilled answer) instead of opening a new turn.
    """

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedToolsChoice]] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: Literal[False] = False  # vLLM's: the chat template writes them (a BOS on top doubles it)
    prediction: Optional[Prediction] = None  # drafted from; never changes the output
    metadata: Metadata = None
    store: Literal[False] = False  # no chat completion is kept for later
    service_tier: ServiceTier = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: PromptCacheRetention = None
    reasoning_effort: ReasoningEffort = None
    verbosity: Verbosity = None
    modalities: Optional[List[Literal["text"]]] = None  # text is all this server answers
    audio: None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value, info: ValidationInfo):
        # the newer name of max_tokens: OpenAI refuses both, vLLM takes this one; two that agree
        # are taken (clients that set both alike), two that disagree never silently lose one
        max_tokens = info.data.get("max_tokens")
        if value is not None and max_tokens is not None and value != max_tokens:
            raise ValueError(f"{value} disagrees with max_tokens {max_tokens}: set one (the same limit)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs=true")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools):
        check_unique_names([t.function.name for t in tools or []])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        names = (choice.names if isinstance(choice, AllowedToolsChoice) else
                 [choice.function.name] if isinstance(choice, NamedToolChoice) else [])
        check_tool_choice(choice not in (None, "none"), names, {t.function.name for t in info.data.get("tools") or []})
        return choice

    @property
    def functions(self) -> list[dict[str, Any]]:
        """The offered functions as OpenAI dicts; none when tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_mode(self) -> tuple[Literal["none", "auto", "required"], list[dict[str, Any]]]:
        """Whether the answer may call (auto) or calls (required), and the functions it may call:
        the offered ones, or those a named choice (one call, as vLLM's) or `allowed_tools` names."""
        functions, choice = self.functions, self.tool_choice
        if not functions:
            return "none", []
        if isinstance(choice, NamedToolChoice):
            return "required", [f for f in functions if f["name"] == choice.function.name]
        if isinstance(choice, AllowedToolsChoice):
            return choice.allowed_tools.mode, [f for f in functions if f["name"] in choice.names]
        return choice or "auto", functions

    @field_validator("continue_final_message")
    @classmethod
    def _continuation(cls, value: bool, info: ValidationInfo) -> bool:
        # a field validator, so the error names this field; the fields it reads come first
        if value:
            if info.data.get("add_generation_prompt", True):
                raise ValueError("needs add_generation_prompt=false")
            messages = info.data.get("messages")
            if messages and messages[-1].role != "assistant":
                raise ValueError("the last message must be the assistant's")
        return value

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


def misplaced_tool_message(messages: List[ChatMessage]) -> Optional[tuple[str, str]]:
    """(the field, what is wrong) where a tool message answers no call of the assistant message
    its run of tool messages follows, or a call it already answered, or where an assistant
    message names one call id twice (OpenAI's rule: the chat template would render a result
    with no call, or two calls the model cannot tell apart); None where none does."""
    open_calls: set[str] = set()  # the last assistant message's calls not answered yet
    for i, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id not in open_calls:
                return f"messages[{i}].tool_call_id", (
                    f"{message.tool_call_id!r} is no call of the assistant message before it, or was answered "
                    "already (tool messages follow the assistant message whose tool_calls they answer, one each)")
            open_calls.remove(message.tool_call_id)
            continue
        open_calls = set()
        for j, call in enumerate(message.tool_calls or []):
            if call.id in open_calls:
                return f"messages[{i}].tool_calls[{j}].id", f"{call.id!r} is the id of an earlier call of this message"
            open_calls.add(call.id)
    return None


def chat_meant(fields: dict[str, Any], context: Optional[dict[str, Any]] = None) -> ChatCompletionRequest:
    """The chat request another request means (a Responses or Messages request, a tokenize
    call's chat), from its `fields`: what that request's own checks let through and chat's
    refuse is a 400 all the same, named as a body's own validation errors are."""
    try:
        return ChatCompletionRequest.model_validate(fields, context=context)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None
