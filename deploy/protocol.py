"""OpenAI-compatible request models (the HTTP edge's schema): the completions request and the
parts and rules every API's request shares (`deploy/chat_protocol.py`, `deploy/responses.py`
and `deploy/messages.py` hold theirs; the response bodies' schema is `deploy/response_bodies.py`).

Requests forbid unknown fields, so a typo is a 400 naming it rather than a silently ignored
setting; a field we do not implement is accepted only at its neutral value (chat's `store:
false`, `service_tier` "auto" or "default", `modalities: ["text"]`, `audio: null`,
completions' `best_of: 1` and `suffix: null`); an explicit null is a field's default, as
OpenAI's nullable fields take it (`"temperature": null` samples at 1); labels and hints are
taken and not read (`user`, `metadata`, `safety_identifier`, `prompt_cache_key` and
`prompt_cache_retention`: our prefix cache finds a prompt's prefix by itself; reasoning
models' `reasoning_effort` and `verbosity`). Every string must be valid Unicode, text a
tokenizer reads and a label or an id alike: a lone UTF-16 surrogate (JSON `"\ud800"`, or
the raw bytes ed a0 80) is a 400 naming its field. The OpenAPI schema FastAPI generates
from these models is what schemathesis fuzzes.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Dict, Iterable, List, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator,
                      model_validator)

from deploy.tool_calls import object_schema
from replicas.engine import MAX_TOP_LOGPROBS, RequestSpeculation

MAX_CHOICES = 8  # most choices (`n`) one request may ask for: as many as a replica has KV slots by default
MAX_PROMPTS = 64  # most engine requests (prompts x n) one batched completions request may make


class RequestModel(BaseModel):
    """A request body or a part of one: unknown fields are a 400, values frozen, types strict
    (as OpenAI's: `"5"` is not an integer, nor `true`, nor `2.0`; an integer is a number)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True,
                              allow_inf_nan=False)  # JSON has no NaN: a bound's error would misname it

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default is that default: OpenAI's optional fields
        are nullable, and clients send `"temperature": null` for "not set"."""
        if isinstance(data, dict):
            defaulted = _defaulted_keys(cls)
            return {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """No field holds a lone UTF-16 surrogate, a label or an id as much as text: one echoed
        or stored (`user`, an item's `id`) could not be encoded in the answer (a 500, or a
        stream cut, after the model ran)."""
        try:
            _surrogate_free(value)
        except RecursionError:
            raise ValueError("nested too deep") from None
        return value


@functools.cache
def _defaulted_keys(model: type[BaseModel]) -> frozenset[str]:
    """The names and aliases of `model`'s fields whose default is not None."""
    return frozenset(key for name, field in model.model_fields.items()
                     if not field.is_required() and field.default is not None for key in (name, field.alias) if key)


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate at character {exc.start}") from None
    return text


def _surrogate_free(value: Any) -> None:
    """Raises as `_unicode` does where `value` or a string inside it (a list's, a dict's keys
    and values; a request part checks its own fields) holds a lone surrogate."""
    if isinstance(value, str):
        _unicode(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _surrogate_free(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _surrogate_free(key)
            _surrogate_free(item)


def _unicode_json(value: dict) -> dict:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except RecursionError:  # the body was read a few frames up the stack: a few levels short of this
        raise ValueError("nested too deep") from None
    _unicode(text)
    return value


Text = Annotated[str, AfterValidator(_unicode)]  # text the tokenizer or the grammar engine reads
JsonObject = Annotated[Dict[str, Any], AfterValidator(_unicode_json)]  # JSON the model reads: a schema, a call's input
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]

ParametersSchema = Annotated[JsonObject, AfterValidator(object_schema)]  # a function's arguments
Metadata = Annotated[Optional[Dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]],
                     Field(max_length=16)]  # OpenAI's: up to 16 labels
ServiceTier = Optional[Literal["auto", "default"]]  # we have one tier


class ResponseFormatText(RequestModel):
    type: Literal["text"]


class ResponseFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class JsonSchemaFormat(RequestModel):
    name: FunctionName
    description: Optional[Text] = None
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


def type_tag(value: Any) -> Optional[str]:
    """A union member's tag, "type=<its type>" (see ResponseFormat)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if isinstance(kind, str) else None


# Tagged "type=..." rather than by the bare type, so an error's field path skips the tag:
# `response_format.json_schema`, not `response_format.json_schema.json_schema`.
ResponseFormat = Annotated[Union[
    Annotated[ResponseFormatText, Tag("type=text")],
    Annotated[ResponseFormatJsonObject, Tag("type=json_object")],
    Annotated[ResponseFormatJsonSchema, Tag("type=json_schema")],
], Discriminator(type_tag)]


def check_tool_choice(needs_tools: bool, names: Iterable[str], tools: set[str]) -> None:
    """A tool choice that forces a call has tools to call, and the functions one names (a named
    choice's one, allowed_tools' several) are among `tools` (ValueError otherwise): chat's, the
    Responses API's and the Messages API's."""
    if needs_tools and not tools:
        raise ValueError("needs tools")
    for name in names:
        if name not in tools:
            raise ValueError(f"names {name!r}, which is not among the tools")


def check_unique_names(names: List[str]) -> None:
    """Each offered function has a name of its own (ValueError otherwise): chat's, the
    Responses API's and the Messages API's tools."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"function names must be unique; repeated: {', '.join(repeated)}")


def unique_names(tools: list) -> list:
    """A list of tools that have a `name` each (the Responses and Messages APIs'), checked."""
    check_unique_names([t.name for t in tools])
    return tools


MAX_STOPS = 4  # OpenAI's; a validation context's "max_stops" overrides it (the Messages API's)


def only_streamed(options: Any, info: ValidationInfo) -> Any:
    """A `stream_options` validator: refused without `stream: true` (the field before it), as
    OpenAI and vLLM refuse it."""
    if options is not None and not info.data.get("stream"):
        raise ValueError("only with stream=true")
    return options


def check_stops(stop: Union[str, List[str], None], limit: int = MAX_STOPS) -> Union[str, List[str], None]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    if len(stops) > limit:
        raise ValueError(f"at most {limit} stop strings, got {len(stops)}")
    return stop


# Hints for reasoning models, taken and not read: this model does not reason and has one
# verbosity (agent clients send them whatever the model: Codex CLI sends reasoning effort
# "none" to a model it does not know).
ReasoningEffort = Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]]
Verbosity = Optional[Literal["low", "medium", "high"]]
PromptCacheRetention = Optional[Literal["in_memory", "24h"]]  # our prefix cache keeps what its budget holds


class StreamOptions(RequestModel):
    include_usage: bool = False
    include_obfuscation: bool = True  # no obfuscation padding is sent either way
    # vLLM's (guidellm sends it with every stream; aiperf's --per-chunk-usage): with
    # include_usage, each chunk carries the usage so far; a step of speculation sends several
    # tokens in one chunk, which a client counting chunks as tokens would miscount
    continuous_usage_stats: bool = False


class SamplingRequest(RequestModel):
    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="capped by the server's limit")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)  # OpenAI's int64; the engine's seed is it mod 2^63
    stop: Optional[Union[Text, List[Text]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    speculation: Optional[RequestSpeculation] = None  # narrows the server's setting
    response_format: Optional[ResponseFormat] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # vLLM's: for clients and harnesses written against it
    repetition_penalty: float = Field(1.0, gt=0, le=2, description="a seen token's logit / this (x this if negative)")
    min_p: float = Field(0.0, ge=0, le=1, description="keep tokens at least this times as likely as the top one")
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids held back until this many tokens")
    stop_token_ids: List[Annotated[int, Field(ge=0)]] = Field([], max_length=64,
                                                              description="token ids that end the output")
    logit_bias: Optional[Dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None  # token id -> bias
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each generated as a request of its own")
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                           description="vLLM's: each prompt token's logprob, rank and this many "
                                                       "alternatives (not streamed)")
    user: Optional[str] = None
    skip_special_tokens: Literal[True] = True  # vLLM's: the text leaves special tokens out (logprobs show them)
    # vLLM's: the prefix cache reuses only what requests with the same salt (and API key) stored
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop, info: ValidationInfo):
        return check_stops(stop, (info.context or {}).get("max_stops", MAX_STOPS))

    _stream_options = field_validator("stream_options")(only_streamed)

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream"):  # as vLLM: they are not in any chunk
            raise ValueError("not with stream=true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        # a token id's few digits: int() refuses over 4,300 (a 500, named nowhere)
        if bias and not all(key.isascii() and key.isdigit() and len(key) <= 18 for key in bias):
            raise ValueError("keys must be token ids (decimal digits)")
        return bias

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


Prompt = Union[Text, List[int]]


def _batch(prompt: Union[Prompt, List[Text], List[List[int]]]) -> list[Prompt]:
    """A completions `prompt` as its batch: one text or token-id list, or a list of them."""
    return list(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`: a raw prompt (text or token ids), continued as it is, or a batch
    of them (a list of texts or of token-id lists: `n` choices each, in the prompts' order)."""

    prompt: Union[Text, List[int], List[Text], List[List[int]]]
    max_tokens: Optional[int] = Field(None, ge=0, description="capped by the server's limit; 0 with echo scores "
                                                              "the prompt alone (nothing generated)")
    echo: bool = Field(False, description="the prompt before each choice's text (and, with logprobs, "
                                          "its tokens' logprobs, the first token's null)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                    description="each token's logprob and this many alternatives")
    best_of: Literal[1] = Field(1, description="OpenAI's legacy best-of: 1 only (n asks for choices)")
    suffix: None = Field(None, description="OpenAI's legacy insertion: not supported")
    # vLLM's (and llama.cpp's, transformers'): a text prompt gets the tokens its tokenizer adds
    # (a Llama's BOS; the embedded SmolLM2's adds none)
    add_special_tokens: bool = Field(True, description="a text prompt with the tokenizer's special tokens (a BOS)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind(cls, prompt):
        if isinstance(prompt, list) and len({type(p) for p in prompt} & {str, list, int}) > 1:
            raise ValueError("a text, a token-id list, or a list of either kind, not of both")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        # each prompt's own checks are `engine_requests`', which name it `prompt[i]`
        if len(_batch(prompt)) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in a batch, got {len(_batch(prompt))}")
        return prompt

    @property
    def prompts(self) -> list[Prompt]:
        """The batch's prompts (one, unless a list of texts or of token-id lists came)."""
        return _batch(self.prompt)
