"""The OpenAI-compatible response bodies as the OpenAPI schema documents them: the routes'
`response_model`s. `deploy/openai_format.py` builds the bodies themselves."""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, Field

from deploy.chat_protocol import AssistantToolCall


class SpeculationUsage(BaseModel):
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_length: float = 0.0  # tokens emitted per verify step, bonus included
    steps: int = 0  # verify steps


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0  # of the prediction, tokens the output has too
    rejected_prediction_tokens: int = 0  # the rest of the prediction


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage
    completion_tokens_details: Optional[CompletionTokensDetails] = None  # with a prediction


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[float]
    top_logprobs: Optional[List[Dict[str, float]]] = None
    text_offset: List[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="1 + the tokens strictly likelier")
    decoded_token: str


# vLLM's: null for the prompt's first token, then {token id: ...}, the prompt token's own first
PromptLogprobs = List[Optional[Dict[str, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str]
    stop_reason: Union[str, int, None] = Field(None, description="vLLM's: the stop string or stop id that ended it")
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Optional[List[AssistantToolCall]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]]


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: Optional[List[TokenLogprob]]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str]
    stop_reason: Union[str, int, None] = Field(None, description="vLLM's: the stop string or stop id that ended it")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[PromptLogprobs] = None


class ModelCard(BaseModel):
    """OpenAI's model object, with the fields of Anthropic's (its SDK's `models.list` reads them)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    type: Literal["model"] = "model"
    display_name: str
    created_at: str  # RFC 3339
    max_model_len: int  # vLLM's: the context window a request's prompt and output share


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]
    has_more: bool = False  # Anthropic's page fields
    first_id: Optional[str] = None
    last_id: Optional[str] = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
