"""OpenAI-compatible request and response models (the HTTP edge's schema).

Requests forbid unknown fields, so a typo is a 400 naming it rather than a silently
ignored setting; the OpenAI fields we do not implement are accepted only at their
neutral value (`n=1`, penalties 0, no logprobs). The OpenAPI schema FastAPI generates
from these models is what schemathesis fuzzes.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from replicas.engine import RequestSpeculation


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="capped by the server's limit")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    speculation: Optional[RequestSpeculation] = None  # narrows the server's setting
    # OpenAI fields accepted at their neutral values only
    n: Literal[1] = 1
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logprobs: Optional[Literal[False]] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: a raw prompt (text or token ids), continued as it is."""

    prompt: Union[str, List[int]]
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        if len(prompt) == 0:
            raise ValueError("must not be empty")
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("token ids must be >= 0")
        return prompt


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`, rendered with the model's chat template.

    vLLM's `continue_final_message: true` + `add_generation_prompt: false` continue a
    last assistant message (a prefilled answer) instead of opening a new turn.
    """

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

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


# -- responses ---------------------------------------------------------------------------------
class SpeculationUsage(BaseModel):
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_length: float = 0.0  # tokens emitted per verify step, bonus included
    steps: int = 0  # verify steps


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Optional[str]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Optional[str]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
