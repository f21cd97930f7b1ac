"""replicas/trtllm/outputs.py: upstream snapshots as our deltas (finish reasons, stop strings
cut or kept, text held back), and the per-request speculation figures."""

from __future__ import annotations

import pytest

from replicas.trtllm.outputs import FINISH_REASONS, OutputTracker, releasable_text, request_usage


@pytest.mark.parametrize("upstream,ours", [("stop", "stop"), ("length", "length"),
                                           ("cancelled", "abort"), ("timeout", "error"), ("weird", "error")])
def test_finish_reason_mapping(upstream, ours):
    tracker = OutputTracker("r", 3)
    delta = tracker.update("ab", [1, 2], upstream, {})
    assert delta.finish_reason == ours and delta.text == "ab"
    assert (delta.error is None) == (ours != "error")
    assert tracker.update("abc", [1, 2, 3], None, {}) is None  # nothing after the end
    assert FINISH_REASONS.get(upstream, "error") == ours


@pytest.mark.parametrize("text,sent,stops,finished,expected", [
    ("hello wo", 0, ("wor",), False, ("hello wo", 6, None)),  # "wo" may grow into "wor"
    ("hello wor", 0, ("wor",), False, ("hello ", 6, "wor")),
    ("a stop b end", 0, ("end", "stop"), False, ("a ", 2, "stop")),  # the first in the text, not in the list
    ("hello wo", 0, ("wor",), True, ("hello wo", 8, None)),
    ("caf\ufffd", 0, (), False, ("caf\ufffd", 3, None)),  # an incomplete UTF-8 character
    ("caf\ufffd", 0, (), True, ("caf\ufffd", 4, None)),  # ended by the model: as it is
])
def test_releasable_text(text, sent, stops, finished, expected):
    assert releasable_text(text, sent, stops, finished) == expected


def test_a_character_max_tokens_cut_inside_is_left_out():
    assert releasable_text("caf\ufffd", 0, (), True, cut=True) == ("caf\ufffd", 3, None)


def test_the_tokens_bytes_tell_a_u_fffd_written_whole_from_an_incomplete_character():
    """As the embedded engine's: where the tokenizer gives its tokens' bytes, a U+FFFD the
    model wrote whole (bytes ef bf bd) is sent as it comes and kept at a cut; only an
    incomplete last character's is held back."""
    raw = {1: b"caf", 2: b"\xef\xbf\xbd", 3: b"\xf0\x9f"}.get
    for ids, cut, sent in (([1, 2], False, "caf\ufffd"), ([1, 2], True, "caf\ufffd"), ([1, 3], False, "caf"),
                           ([1, 3], True, "caf")):
        tracker = OutputTracker("r", 3, raw=raw)
        delta = tracker.update("caf\ufffd", ids, "length" if cut else None, {})
        assert delta.text == sent, (ids, cut)
    assert releasable_text("caf\ufffd\ufffd", 0, (), False, incomplete=True) == ("caf\ufffd\ufffd", 4, None)


@pytest.mark.parametrize("text,stops,kept,expected", [
    ("a</c> b", (), ("</c>",), ("a</c>", 5, "</c>")),  # kept in the text
    ("a</c", (), ("</c>",), ("a</c", 4, None)),  # nothing to hold back: the string is sent anyway
    ("a</c> b", ("c>",), ("</c>",), ("a</", 3, "c>")),  # a stop string inside a kept one still cuts
    ("a</c> b", (" b",), ("</c>",), ("a</c>", 5, "</c>")),
])
def test_releasable_text_keeps_stop_after_strings(text, stops, kept, expected):
    assert releasable_text(text, 0, stops, False, kept) == expected


def test_request_usage():
    perf = type("P", (), {"speculative_decoding": type("S", (), {
        "total_draft_tokens": 12, "total_accepted_draft_tokens": 9})()})()
    assert request_usage(perf, 4, 13) == {"draft_tokens": 12, "accepted_tokens": 9, "acceptance_length": 4.0, "steps": 3}
    assert request_usage(perf, 0, 13)["steps"] == 3  # without decoding_iter: from token counts
    assert request_usage(None, 5, 13) == {"draft_tokens": 0, "accepted_tokens": 0, "acceptance_length": 0.0, "steps": 0}
