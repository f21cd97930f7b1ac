"""The hybrid rule: which drafter serves a request this step, and how many tokens it drafts.

Two pure decisions over plain data, so the scheduler only calls them and tests are tables:

- `effective_settings`: a request may narrow the server's speculation setting, never widen
  it. It may turn speculation off, pin one of the sources the server runs, or lower the
  draft length.
- `plan_draft`: per step, given the gate's verdict, the tokens a grammar forces and the
  suffix automaton's current match, pick the grammar (forced tokens: free and accepted
  unless the model spells the same text with other tokens), SA (long matches: copying is
  nearly free and accepted at length), MTP (the steady default, with a short SA match
  behind it for when the head is unsure), or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.engine import RequestSpeculation, SpeculationConfig

# The sources each server mode runs; a request can only pick among these.
_SERVER_SOURCES = {"hybrid": ("sa", "mtp"), "sa": ("sa",), "mtp": ("mtp",), "off": ()}
# An SA match shorter than this is noise: replaying engine outputs (code edits and chat),
# drafting on 1-token matches verified more rows than it gained. It bounds "sa" mode, where
# no other drafter takes over below `sa_threshold`.
SA_MIN_MATCH = 2
# An SA draft runs at most this many times its match length: a copy that has matched m
# tokens rarely goes on for more than ~2m, and every drafted row costs verify time.
SA_DRAFT_PER_MATCHED_TOKEN = 2


# After an MTP proposal with nothing accepted (or none made: the head was unsure), MTP sits
# out the next 1, 2, 4 ... up to this many steps of that request. Asking the head costs a
# head forward over the positions seen since it was last asked (about 1 ms on 2 Zen 4 cores,
# a fifth of a decode step); skipped positions are caught up in one packed forward later,
# which is far cheaper per position. Where the head keeps failing (open chat) this removes
# most of its cost; where it is accepted, every accepted proposal resets the backoff.
MTP_MAX_BACKOFF = 16


def next_mtp_backoff(backoff: int, num_accepted: int) -> int:
    """Steps without MTP after a proposal of which `num_accepted` tokens were accepted, given
    the backoff the previous proposal set: 0 after a success, else double it (1, 2, 4 ...)."""
    return 0 if num_accepted > 0 else min(MTP_MAX_BACKOFF, max(1, 2 * backoff))


@dataclass(frozen=True)
class DraftPlan:
    """What to draft for one request in one step."""

    source: str | None  # "grammar", "sa", "mtp", or None: no speculation this step
    num_draft: int  # tokens to draft; 0 exactly when source is None
    sa_fallback: int = 0  # hybrid, MTP planned: SA tokens to draft instead if MTP proposes none


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


def drafts_with_mtp(mode: str) -> bool:
    """Does a request in this effective mode (`effective_settings`) ever draft with the MTP head?"""
    return "mtp" in _SERVER_SOURCES[mode]


def plan_draft(
    mode: str,
    max_draft_len: int,
    sa_threshold: int,
    sa_match_len: int,
    mtp_available: bool,
    speculate: bool,
    tokens_left: int,
    num_forced: int = 0,
    sa_extends_forced: bool = False,
) -> DraftPlan:
    """Pick the drafter and draft length for one request this step.

    `mode` and `max_draft_len` come from `effective_settings`; `speculate` is the batch gate's
    verdict; `sa_match_len` is the suffix automaton's current match length; `tokens_left` is
    how many tokens the request may still emit. A verify step emits up to num_draft + 1
    tokens, so drafting stops one short of `tokens_left` and never runs past max_tokens.

    `num_forced` tokens forced by the request's grammar come first, in any mode but "off"
    and whatever the gate says: they are accepted almost surely, so each verify row saves a
    whole step even in a full batch. Only an SA draft that would go this step anyway and
    begins with them (`sa_extends_forced`: copying an earlier JSON or call) goes instead,
    being longer; other drafts wait for the next step.

    SA drafts need a match of `sa_threshold` tokens in hybrid mode (below it MTP drafts)
    and of `SA_MIN_MATCH` in "sa" mode; they are at most `SA_DRAFT_PER_MATCHED_TOKEN` x the match long.
    In hybrid mode a shorter match of at least `SA_MIN_MATCH` is the fallback for a step where
    the MTP head is too unsure to propose anything (`sa_fallback`).
    """
    if mode not in _SERVER_SOURCES:
        raise ValueError(f"mode: must be one of {tuple(_SERVER_SOURCES)}, got {mode!r}")
    num_draft = min(max_draft_len, tokens_left - 1)
    if mode == "off" or num_draft <= 0:
        return NO_DRAFT
    plan = _plan_sa_mtp(mode, num_draft, sa_threshold, sa_match_len, mtp_available) if speculate else NO_DRAFT
    if not num_forced:
        return plan
    forced = DraftPlan(source="grammar", num_draft=min(num_forced, num_draft))
    return plan if sa_extends_forced and plan.source == "sa" and plan.num_draft > forced.num_draft else forced


def _plan_sa_mtp(mode: str, num_draft: int, sa_threshold: int, sa_match_len: int, mtp_available: bool) -> DraftPlan:
    sa_draft = min(num_draft, SA_DRAFT_PER_MATCHED_TOKEN * sa_match_len)
    if mode == "hybrid" and sa_match_len >= sa_threshold or mode == "sa" and sa_match_len >= SA_MIN_MATCH:
        return DraftPlan(source="sa", num_draft=sa_draft)
    fallback = sa_draft if mode == "hybrid" and sa_match_len >= SA_MIN_MATCH else 0
    if drafts_with_mtp(mode) and mtp_available:
        return DraftPlan(source="mtp", num_draft=num_draft, sa_fallback=fallback)
    return DraftPlan(source="sa", num_draft=fallback) if fallback else NO_DRAFT
