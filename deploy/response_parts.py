"""The parts of a Responses API request (`deploy/responses.py`): input items (messages, earlier
function calls and their outputs, references to stored items), tools (functions, alone or in
a `namespace`), tool choices, the text format, stream options and reasoning hints."""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator

from deploy.chat_protocol import FunctionDefinition, joined_text
from deploy.protocol import (
    FunctionName, JsonObject, ParametersSchema, ReasoningEffort, RequestModel, ResponseFormatJsonObject,
    ResponseFormatText, Text, Verbosity, type_tag, unique_names,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(RequestModel):
    type: Literal["input_text"]
    text: Text


class OutputText(RequestModel):
    """Text of an earlier answer, as the client got it back (annotations and logprobs unread)."""

    type: Literal["output_text"]
    text: Text
    annotations: List[Any] = []
    logprobs: Optional[List[Any]] = None


ContentPart = Annotated[Union[Annotated[InputText, Tag("type=input_text")],
                              Annotated[OutputText, Tag("type=output_text")]], Discriminator(type_tag)]


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[Text, List[ContentPart]]  # as a chat message's
    id: Optional[str] = None
    status: Optional[ItemStatus] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None  # an earlier answer's, as dumped back (unread)

    @field_validator("content")
    @classmethod
    def _content(cls, content):  # here, not as the list's min_length: the union's error was the string's
        if isinstance(content, list) and not content:
            raise ValueError("a list of content parts must not be empty")
        return content

    @property
    def text(self) -> str:
        return joined_text(self.content)


class FunctionCallItem(RequestModel):
    """A call the model made earlier, as the client got it back (`async`, `caller`, `namespace`
    as the SDK dumps them, unread: a function's name is unique among all the namespaces')."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: FunctionName
    arguments: Text
    id: Optional[str] = None
    status: Optional[ItemStatus] = None
    async_: Optional[bool] = Field(None, alias="async")
    caller: Optional[Dict[str, Any]] = None
    namespace: Optional[str] = None


class FunctionCallOutputItem(RequestModel):
    """The client's result of a call (`call_id`), which the model reads as a tool message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[Text, List[InputText]]
    id: Optional[str] = None
    status: Optional[ItemStatus] = None

    @property
    def text(self) -> str:
        return joined_text(self.output)


class ItemReference(RequestModel):
    """An item of a stored response named by its id (`msg_...`, `fc_...`): what clients send
    back instead of an earlier answer when it was stored (the Vercel AI SDK's default)."""

    type: Optional[Literal["item_reference"]] = "item_reference"  # optional in OpenAI's ItemReference
    id: str = Field(min_length=1)


def _item_tag(value: Any) -> Optional[str]:
    if not isinstance(value, dict) or value.get("type") is not None:
        return type_tag(value)
    # typeless: an item reference names only its id; a message may leave out its type (OpenAI's
    # "easy input message")
    return "type=item_reference" if "role" not in value and "id" in value else "type=message"


InputItem = Annotated[Union[
    Annotated[InputMessage, Tag("type=message")],
    Annotated[FunctionCallItem, Tag("type=function_call")],
    Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
    Annotated[ItemReference, Tag("type=item_reference")],
], Discriminator(_item_tag)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[ParametersSchema] = None
    strict: Optional[bool] = None

    @field_validator("type", mode="before")
    @classmethod
    def _function(cls, kind: Any) -> Any:
        """Another type (OpenAI's hosted `web_search`, `file_search`...) said so, not as the
        type's literal mismatch."""
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"{kind!r} tools are not served here, only 'function' tools (alone or in a 'namespace')")
        return kind


class NamespaceTool(RequestModel):
    """Functions offered as a group (Codex's `multi_agent_v1`): the model sees each by its own
    name, and a call of one names its `namespace` too."""

    type: Literal["namespace"]
    name: FunctionName
    description: Text = ""  # required in OpenAI's, whose SDK needs a string in the response's echo
    tools: List[FunctionTool] = Field(min_length=1)


def _tool_tag(value: Any) -> str:  # any other type is a function's, so FunctionTool says it is not served
    return "type=namespace" if isinstance(value, dict) and value.get("type") == "namespace" else "type=function"


AnyTool = Annotated[Union[Annotated[FunctionTool, Tag("type=function")],
                          Annotated[NamespaceTool, Tag("type=namespace")]], Discriminator(_tool_tag)]


def unique_functions(tools: list) -> list:
    """Tools whose functions, a namespace's among them, have a name of their own each."""
    unique_names([f for _, f in functions(tools)])
    return tools


def functions(tools: list) -> list[tuple[Optional[NamespaceTool], FunctionTool]]:
    """(its namespace or None, the function) for each function `tools` offer, in order."""
    out: list[tuple[Optional[NamespaceTool], FunctionTool]] = []
    for tool in tools:
        out += [(tool, f) for f in tool.tools] if isinstance(tool, NamespaceTool) else [(None, tool)]
    return out


def offered(namespace: Optional[NamespaceTool], function: FunctionTool) -> FunctionDefinition:
    """The chat's function: a namespace's description (OpenAI's "shown to the model") is
    its functions' first line."""
    definition = function.model_dump(exclude={"type"}, exclude_none=True)
    if namespace is not None and namespace.description:
        definition["description"] = "\n".join(filter(None, (namespace.description, function.description)))
    return FunctionDefinition(**definition)


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: FunctionName


class AllowedFunctionsChoice(RequestModel):
    """Chat's `allowed_tools` choice (its tools named as this API names them)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: List[FunctionToolChoice] = Field(min_length=1)


class TextFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    name: FunctionName
    description: Optional[Text] = None
    schema_: JsonObject = Field(alias="schema")
    strict: Optional[bool] = None


TextFormat = Annotated[Union[
    Annotated[ResponseFormatText, Tag("type=text")],
    Annotated[ResponseFormatJsonObject, Tag("type=json_object")],
    Annotated[TextFormatJsonSchema, Tag("type=json_schema")],
], Discriminator(type_tag)]


class TextConfig(RequestModel):
    format: TextFormat = ResponseFormatText(type="text")
    verbosity: Verbosity = None


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool = True  # no obfuscation padding is sent either way
    include_usage: bool = False  # chat's, as aiperf sends it here too: the usage is in the last event anyway


class Reasoning(RequestModel):
    effort: ReasoningEffort = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None
