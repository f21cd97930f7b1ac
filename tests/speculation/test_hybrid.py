"""The hybrid rule: request narrowing and per-step drafter choice, as tables."""

from __future__ import annotations

import itertools

import pytest

from replicas.engine import REQUEST_MODES, SERVER_MODES, RequestSpeculation, SpeculationConfig
from replicas.speculation.hybrid import (
    MTP_MAX_BACKOFF, SA_DRAFT_PER_MATCHED_TOKEN, SA_MIN_MATCH, DraftPlan, effective_settings, next_mtp_backoff,
    plan_draft,
)

# (server mode, request mode) -> effective mode. Requests narrow; they never add a source.
MODE_TABLE = {
    ("hybrid", "auto"): "hybrid",
    ("hybrid", "sa"): "sa",
    ("hybrid", "mtp"): "mtp",
    ("hybrid", "off"): "off",
    ("sa", "auto"): "sa",
    ("sa", "sa"): "sa",
    ("sa", "mtp"): "off",  # the server runs no MTP: no speculation rather than an error
    ("sa", "off"): "off",
    ("mtp", "auto"): "mtp",
    ("mtp", "sa"): "off",
    ("mtp", "mtp"): "mtp",
    ("mtp", "off"): "off",
    ("off", "auto"): "off",
    ("off", "sa"): "off",
    ("off", "mtp"): "off",
    ("off", "off"): "off",
}


def test_mode_table_covers_every_combination():
    assert set(MODE_TABLE) == set(itertools.product(SERVER_MODES, REQUEST_MODES))


@pytest.mark.parametrize("server_mode, request_mode", sorted(MODE_TABLE))
def test_effective_mode(server_mode, request_mode):
    server = SpeculationConfig(mode=server_mode, max_draft_len=6)
    mode, max_draft_len = effective_settings(server, RequestSpeculation(mode=request_mode))
    assert mode == MODE_TABLE[server_mode, request_mode]
    assert max_draft_len == (0 if mode == "off" else 6)


@pytest.mark.parametrize(
    "server_len, request_len, expected",
    [(8, None, 8), (8, 3, 3), (8, 8, 8), (8, 20, 8), (1, 5, 1), (64, 1, 1)],
)
def test_request_draft_length_caps_never_raises(server_len, request_len, expected):
    server = SpeculationConfig(mode="hybrid", max_draft_len=server_len)
    request = RequestSpeculation(mode="auto", max_draft_len=request_len)
    assert effective_settings(server, request) == ("hybrid", expected)


def plan(mode="hybrid", max_draft_len=8, sa_threshold=4, sa_match_len=0, mtp_available=True,
         speculate=True, tokens_left=100, num_forced=0, sa_extends_forced=False):
    return plan_draft(mode, max_draft_len, sa_threshold, sa_match_len, mtp_available, speculate,
                      tokens_left, num_forced, sa_extends_forced)


@pytest.mark.parametrize(
    "kwargs, source",
    [
        # hybrid: SA from the threshold up, MTP below it, nothing when MTP is missing.
        (dict(sa_match_len=4), "sa"),
        (dict(sa_match_len=50), "sa"),
        (dict(sa_match_len=3), "mtp"),
        (dict(sa_match_len=0), "mtp"),
        (dict(sa_match_len=3, mtp_available=False), "sa"),  # the fallback, with no head to ask
        (dict(sa_match_len=1, mtp_available=False), None),
        (dict(sa_match_len=4, mtp_available=False), "sa"),
        (dict(sa_match_len=1, sa_threshold=1), "sa"),
        (dict(sa_match_len=0, sa_threshold=1), "mtp"),
        # sa: a match of SA_MIN_MATCH tokens, regardless of the threshold; never MTP.
        (dict(mode="sa", sa_match_len=SA_MIN_MATCH), "sa"),
        (dict(mode="sa", sa_match_len=SA_MIN_MATCH - 1), None),
        (dict(mode="sa", sa_match_len=0), None),
        (dict(mode="sa", sa_match_len=2, sa_threshold=10), "sa"),
        # mtp: whenever the heads exist, whatever the SA match.
        (dict(mode="mtp", sa_match_len=30), "mtp"),
        (dict(mode="mtp", mtp_available=False, sa_match_len=30), None),
        # off, or the gate closed: nothing, whatever else holds.
        (dict(mode="off", sa_match_len=30), None),
        (dict(speculate=False, sa_match_len=30), None),
        (dict(mode="sa", speculate=False, sa_match_len=30), None),
        (dict(mode="mtp", speculate=False), None),
    ],
)
def test_plan_source(kwargs, source):
    result = plan(**kwargs)
    assert result.source == source
    if source is None:
        assert result.num_draft == 0
    elif source == "mtp":
        assert result.num_draft == 8
    else:
        assert result.num_draft == min(8, SA_DRAFT_PER_MATCHED_TOKEN * kwargs["sa_match_len"])


@pytest.mark.parametrize("match_len, num_draft", [(2, 4), (3, 6), (4, 8), (5, 10), (8, 16), (40, 16)])
def test_sa_draft_grows_with_the_match(match_len, num_draft):
    assert plan(mode="sa", max_draft_len=16, sa_match_len=match_len) == DraftPlan("sa", num_draft)
    assert plan(mode="hybrid", max_draft_len=16, sa_threshold=2, sa_match_len=match_len) == DraftPlan("sa", num_draft)


@pytest.mark.parametrize(
    "max_draft_len, tokens_left, num_draft",
    [
        (8, 100, 8),
        (8, 9, 8),  # 8 drafts + 1 bonus fill the budget exactly
        (8, 8, 7),
        (8, 2, 1),
        (8, 1, 0),  # only one token left: a plain step
        (8, 0, 0),
        (3, 100, 3),
    ],
)
def test_plan_never_drafts_past_max_tokens(max_draft_len, tokens_left, num_draft):
    for mode, match_len in (("hybrid", 10), ("hybrid", 0), ("sa", 10), ("mtp", 0)):
        result = plan(mode=mode, max_draft_len=max_draft_len, sa_match_len=match_len,
                      tokens_left=tokens_left)
        assert result.num_draft == num_draft
        assert (result.source is None) == (num_draft == 0)


@pytest.mark.parametrize(
    "kwargs, fallback",
    [
        (dict(sa_match_len=3), 6),  # under the threshold: MTP, with the short match behind it
        (dict(sa_match_len=SA_MIN_MATCH - 1), 0),  # too short to fall back on
        (dict(sa_match_len=3, max_draft_len=4), 4),
        (dict(mode="mtp", sa_match_len=3), 0),  # a pinned MTP never drafts from SA
    ],
)
def test_sa_fallback_behind_mtp(kwargs, fallback):
    result = plan(**kwargs)
    assert result.source == "mtp" and result.sa_fallback == fallback


@pytest.mark.parametrize(
    "kwargs, num_draft",
    [
        # forced tokens come first, in every drafting mode, the gate closed or not
        (dict(num_forced=3), 3),
        (dict(num_forced=3, sa_match_len=50), 3),
        (dict(num_forced=3, mode="sa"), 3),
        (dict(num_forced=3, mode="mtp", mtp_available=False), 3),
        (dict(num_forced=3, speculate=False), 3),
        # capped by the draft length and by what the request may still emit
        (dict(num_forced=20), 8),
        (dict(num_forced=20, tokens_left=4), 3),
        # never when speculation is off or nothing may follow
        (dict(num_forced=3, mode="off"), 0),
        (dict(num_forced=3, tokens_left=1), 0),
        # an SA draft that starts with them and goes on is only taken when it would go anyway
        (dict(num_forced=3, sa_extends_forced=True, sa_match_len=1), 3),
        (dict(num_forced=3, sa_extends_forced=True, sa_match_len=20, speculate=False), 3),
        (dict(num_forced=3, sa_extends_forced=False, sa_match_len=20), 3),
        (dict(num_forced=8, sa_extends_forced=True, sa_match_len=20), 8),  # no longer: forced
    ],
)
def test_grammar_forced_tokens_are_drafted_first(kwargs, num_draft):
    result = plan(**kwargs)
    assert result.num_draft == num_draft
    assert result.source == ("grammar" if num_draft else None)


@pytest.mark.parametrize("mode, sa_match_len, num_draft", [("hybrid", 4, 8), ("hybrid", 20, 8), ("sa", 3, 6)])
def test_a_longer_sa_copy_of_the_forced_tokens_goes_instead(mode, sa_match_len, num_draft):
    result = plan(mode=mode, sa_match_len=sa_match_len, num_forced=2, sa_extends_forced=True)
    assert (result.source, result.num_draft) == ("sa", num_draft)


def test_no_speculation_plan_is_the_empty_plan():
    assert plan(speculate=False) == DraftPlan(source=None, num_draft=0)


def test_plan_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        plan(mode="auto")  # a request mode, not an effective one


def test_settings_feed_the_plan():
    # A request pinned to "sa" on a hybrid server drafts from SA below the hybrid threshold.
    server = SpeculationConfig(mode="hybrid", max_draft_len=8, sa_threshold=5)
    mode, max_draft_len = effective_settings(server, RequestSpeculation(mode="sa", max_draft_len=2))
    result = plan_draft(mode, max_draft_len, server.sa_threshold, sa_match_len=2,
                        mtp_available=True, speculate=True, tokens_left=50)
    assert result == DraftPlan(source="sa", num_draft=2)


def test_mtp_backoff_doubles_on_failure_and_resets_on_success():
    backoff, seen = 0, []
    for _ in range(8):
        backoff = next_mtp_backoff(backoff, num_accepted=0)
        seen.append(backoff)
    assert seen == [1, 2, 4, 8, 16, 16, 16, 16] and MTP_MAX_BACKOFF == 16
    assert next_mtp_backoff(backoff, num_accepted=1) == 0
    assert next_mtp_backoff(0, num_accepted=3) == 0
