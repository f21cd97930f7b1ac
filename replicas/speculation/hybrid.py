"""The hybrid rule: which drafter serves a request this step, and how many tokens it drafts.

Two pure decisions over plain data, so the scheduler only calls them and tests are tables:

- `effective_settings`: a request may narrow the server's speculation setting, never widen
  it. It may turn speculation off, pin one of the sources the server runs, or lower the
  draft length.
- `plan_draft`: per step, given the gate's verdict and the suffix automaton's current match,
  pick SA (long matches: copying is nearly free and accepted at length), MTP (the steady
  default), or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.engine import RequestSpeculation, SpeculationConfig

# The sources each server mode runs; a request can only pick among these.
_SERVER_SOURCES = {"hybrid": ("sa", "mtp"), "sa": ("sa",), "mtp": ("mtp",), "off": ()}


@dataclass(frozen=True)
class DraftPlan:
    """What to draft for one request in one step."""

    source: str | None  # "sa", "mtp", or None: no speculation this step
    num_draft: int  # tokens to draft; 0 exactly when source is None


NO_DRAFT = DraftPlan(source=None, num_draft=0)


def effective_settings(server: SpeculationConfig, request: RequestSpeculation) -> tuple[str, int]:
    """(mode, max_draft_len) for one request: the server's setting as narrowed by the request.

    - server "off", or request "off": ("off", 0).
    - request "auto": the server's mode.
    - request "sa" / "mtp": that mode when the server runs that source ("hybrid" runs both);
      asking for a source the server does not run gives "off" rather than an error, since
      speculation never changes the output, only its speed.
    - request max_draft_len lowers the server's, never raises it.
    """
    if request.mode == "auto":
        mode = server.mode
    elif request.mode in _SERVER_SOURCES[server.mode]:
        mode = request.mode
    else:
        mode = "off"
    if mode == "off":
        return "off", 0
    max_draft_len = server.max_draft_len
    if request.max_draft_len is not None:
        max_draft_len = min(max_draft_len, request.max_draft_len)
    return mode, max_draft_len


def plan_draft(
    mode: str,
    max_draft_len: int,
    sa_threshold: int,
    sa_match_len: int,
    mtp_available: bool,
    speculate: bool,
    tokens_left: int,
) -> DraftPlan:
    """Pick the drafter and draft length for one request this step.

    `mode` and `max_draft_len` come from `effective_settings`; `speculate` is the batch gate's
    verdict; `sa_match_len` is the suffix automaton's current match length; `tokens_left` is
    how many tokens the request may still emit. A verify step emits up to num_draft + 1
    tokens, so drafting stops one short of `tokens_left` and never runs past max_tokens.
    """
    if mode not in _SERVER_SOURCES:
        raise ValueError(f"mode: must be one of {tuple(_SERVER_SOURCES)}, got {mode!r}")
    num_draft = min(max_draft_len, tokens_left - 1)
    if not speculate or mode == "off" or num_draft <= 0:
        return NO_DRAFT
    if mode == "hybrid":
        if sa_match_len >= sa_threshold:
            source = "sa"
        else:
            source = "mtp" if mtp_available else None
    elif mode == "sa":
        source = "sa" if sa_match_len >= 1 else None
    else:  # "mtp"
        source = "mtp" if mtp_available else None
    return NO_DRAFT if source is None else DraftPlan(source=source, num_draft=num_draft)
