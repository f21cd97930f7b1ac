"""The Engine protocol every replica engine implements, and the data it exchanges.

One engine per Serve replica. Requests arrive as `GenerationRequest`, leave as a stream of
`GenerationDelta`; speculation settings change live through `configure`. Validation
happens here, at construction, so a bad request fails before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Protocol, Sequence, runtime_checkable

from replicas.stats import EngineStats, SpecCounters

__all__ = [
    "Engine", "EngineStats", "GenerationDelta", "GenerationRequest", "RequestSpeculation",
    "SamplingParams", "SpeculationConfig", "SpecCounters", "FinishReason",
]

ServerMode = Literal["hybrid", "sa", "mtp", "off"]
RequestMode = Literal["auto", "sa", "mtp", "off"]
FinishReason = Literal["stop", "length", "abort", "error"]

SERVER_MODES = ("hybrid", "sa", "mtp", "off")
REQUEST_MODES = ("auto", "sa", "mtp", "off")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class SpeculationConfig:
    """Server-wide speculation settings; hot-swappable through `Engine.configure`."""

    mode: ServerMode = "hybrid"
    max_draft_len: int = 16  # SA drafts grow with their match up to this; MTP stops when unsure
    sa_threshold: int = 4  # SA draft when its match is at least this long, else MTP
    batch_gate: int = 4  # no speculation in a step with more running requests than this

    def __post_init__(self) -> None:
        _require(self.mode in SERVER_MODES, "mode", f"must be one of {SERVER_MODES}, got {self.mode!r}")
        _require(1 <= self.max_draft_len <= 64, "max_draft_len", f"must be in [1, 64], got {self.max_draft_len}")
        _require(self.sa_threshold >= 1, "sa_threshold", f"must be >= 1, got {self.sa_threshold}")
        _require(self.batch_gate >= 0, "batch_gate", f"must be >= 0, got {self.batch_gate}")


@dataclass(frozen=True)
class RequestSpeculation:
    """What a request asks for; it may narrow the server's setting, never widen it."""

    mode: RequestMode = "auto"
    max_draft_len: int | None = None

    def __post_init__(self) -> None:
        _require(self.mode in REQUEST_MODES, "speculation.mode", f"must be one of {REQUEST_MODES}, got {self.mode!r}")
        _require(
            self.max_draft_len is None or self.max_draft_len >= 1,
            "speculation.max_draft_len", f"must be >= 1, got {self.max_draft_len}",
        )


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        _require(all(s for s in self.stop), "stop", "stop strings must be non-empty")


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt as text or token ids; the engine tokenizes text with its own tokenizer."""

    request_id: str
    prompt: str | Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: RequestSpeculation = field(default_factory=RequestSpeculation)


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


@runtime_checkable
class Engine(Protocol):
    """One inference engine, owned by one replica; all methods are called on its event loop."""

    async def start(self) -> None:
        """Load weights and start the step loop."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream a request's output. Raises ValueError (naming the field) on bad input."""

    async def abort(self, request_id: str) -> None:
        """Finish a request with reason `abort` and free its resources; unknown ids: no-op."""

    def configure(self, speculation: SpeculationConfig) -> None:
        """Change speculation settings; takes effect at the next step."""

    def stats(self) -> EngineStats:
        """Live figures for routing, autoscaling and metrics."""

    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""
