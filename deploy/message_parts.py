"""The parts of an Anthropic Messages API request (`deploy/messages.py` has the request and what
it means as a chat): content blocks, messages, tools, tool choices and settings, as Anthropic's
clients send them (the `anthropic` SDK, Claude Code)."""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

from deploy.chat_protocol import PART_SEPARATOR
from deploy.protocol import FunctionName, JsonObject, ParametersSchema, RequestModel, Text, type_tag


class CacheControl(RequestModel):
    """A prefix-cache mark, taken and not read (settings a newer client adds too: Claude Code's
    `scope`): the prefix cache finds a prompt's cached prefix by itself."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"]


class TextBlock(RequestModel):
    type: Literal["text"]
    text: Text
    cache_control: Optional[CacheControl] = None
    citations: Optional[List[Any]] = None


class ToolUseBlock(RequestModel):
    """A call the model made earlier, as the client got it back."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: FunctionName
    input: JsonObject
    cache_control: Optional[CacheControl] = None
    caller: Optional[Dict[str, Any]] = None  # who made the call (a server tool's code): not read
    toolset_name: Optional[str] = None  # an MCP toolset's name: not read


class ToolReferenceBlock(RequestModel):
    """A tool named in a tool result (Claude Code's tool search): nothing for the model to read."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_reference"]


class OmittedBlock(RequestModel):
    """An image or a document a tool returned (Claude Code's Read of a picture or a PDF): the
    model reads text only, so it reads a note saying so. (In a user's own message such a block
    is a 400: there the request asks about it.)"""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image", "document"]

    @property
    def text(self) -> str:
        return f"[{self.type} omitted: this model reads text only]"


ResultBlock = Annotated[Union[
    Annotated[TextBlock, Tag("type=text")],
    Annotated[ToolReferenceBlock, Tag("type=tool_reference")],
    Annotated[OmittedBlock, Tag("type=image")],
    Annotated[OmittedBlock, Tag("type=document")],
], Discriminator(type_tag)]


class ToolResultBlock(RequestModel):
    """The client's result of call `tool_use_id`, which the model reads as a tool message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[Text, List[ResultBlock]] = ""
    is_error: bool = False
    cache_control: Optional[CacheControl] = None
    toolset_name: Optional[str] = None  # an MCP toolset's name: not read

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else PART_SEPARATOR.join(
            b.text for b in self.content if b.type != "tool_reference")
        return f"Error: {text}" if self.is_error else text


THINKING = ("thinking", "redacted_thinking")


class ThinkingBlock(RequestModel):
    """Another model's thinking in an earlier answer (a session begun on Claude): not rendered,
    as Anthropic's API drops earlier turns' thinking."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[Union[
    Annotated[TextBlock, Tag("type=text")],
    Annotated[ToolUseBlock, Tag("type=tool_use")],
    Annotated[ToolResultBlock, Tag("type=tool_result")],
    Annotated[ThinkingBlock, Tag("type=thinking")],
    Annotated[ThinkingBlock, Tag("type=redacted_thinking")],
], Discriminator(type_tag)]


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]  # a system instruction mid-conversation (Claude Code's)
    content: Union[Text, List[ContentBlock]]

    @field_validator("content")
    @classmethod
    def _blocks(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if isinstance(content, list) and not content and role != "assistant":  # only an answer may be empty
            raise ValueError("a list of content blocks must not be empty")
        allowed = {"user": {"text", "tool_result"},
                   "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}.get(role, {"text"})
        misplaced = sorted({block.type for block in content} - allowed) if isinstance(content, list) else []
        if misplaced:
            raise ValueError(f"{'an' if role == 'assistant' else 'a'} {role} message has no {misplaced[0]} blocks")
        return content


class ToolDefinition(RequestModel):
    type: Optional[Literal["custom"]] = None
    name: FunctionName
    description: Optional[Text] = None
    input_schema: ParametersSchema
    strict: Optional[bool] = None  # every call follows its schema (the grammar, forced or under auto)
    cache_control: Optional[CacheControl] = None
    eager_input_streaming: Optional[bool] = None  # a hint (Claude Code's): inputs stream as written anyway
    # Tool search and programmatic calls: every tool is offered from the start, and any caller's
    # call reads the same
    defer_loading: Optional[bool] = None
    input_examples: Optional[List[Dict[str, Any]]] = None
    allowed_callers: Optional[List[Any]] = None


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[Union[
    Annotated[ToolChoiceAuto, Tag("type=auto")],
    Annotated[ToolChoiceAny, Tag("type=any")],
    Annotated[ToolChoiceTool, Tag("type=tool")],
    Annotated[ToolChoiceNone, Tag("type=none")],
], Discriminator(type_tag)]


class Thinking(RequestModel):
    """Extended thinking, taken and not read: the model has no thinking mode, so an answer has
    no thinking blocks. Claude Code sends `adaptive` with every request."""

    model_config = ConfigDict(extra="ignore")  # whatever settings a newer client adds
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=0)


class MessagesMetadata(RequestModel):
    user_id: Optional[str] = None  # a label, not read


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(RequestModel):
    format: Optional[JsonOutputFormat] = None  # the answer is JSON valid against the schema
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # a hint; the model has one effort
