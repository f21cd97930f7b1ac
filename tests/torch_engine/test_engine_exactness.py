"""Speculation never changes greedy output: every mode against the same engine with it off.

Token for token, with no tie tolerance: the native forward computes every row of a verify
step bit for bit as a plain decode step would (tests/torch_engine/test_native_model.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from replicas.engine import SpeculationConfig
from replicas.speculation.hybrid import MTP_MAX_BACKOFF
from replicas.torch_engine.suffix_drafts import suffix_drafts
from tests.torch_engine.engine_util import (
    chat_prompt, code_edit_prompts, collect, collect_logprobs, every_draft, request,
)

pytestmark = pytest.mark.slow  # every test drives the real engine (conftest's `engine`)


@pytest.fixture(scope="module")
def prompts(engine):
    chats = [
        chat_prompt(engine, "Write a short poem about the sea."),
        chat_prompt(engine, "Explain what a hash map is, in two sentences."),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "one two three four one two three four one two three four one two",
    ]
    return chats + code_edit_prompts(engine, 2)


@pytest.fixture(scope="module")
def reference(engine, loop, prompts):
    """Speculation off: the output every other mode must reproduce token for token."""
    return [loop.run_until_complete(collect(engine, request(p, mode="off")))[0] for p in prompts]


@pytest.mark.parametrize("mode", ["sa", "mtp", "auto"])
def test_greedy_speculation_equals_off(engine, loop, prompts, reference, mode):
    # (on an H100 the measured rule once stood mode mtp down over all six prompts)
    drafted = 0
    with every_draft(engine):
        for prompt, expected in zip(prompts, reference):
            tokens, _, last = loop.run_until_complete(collect(engine, request(prompt, mode=mode)))
            assert tokens == expected
            drafted += last.speculation["draft_tokens"]
    assert drafted > 0, f"mode {mode} never speculated"


def test_code_edit_drafts_mostly_accepted(engine, loop, prompts):
    prompt = code_edit_prompts(engine, 1)[0]
    _, _, last = loop.run_until_complete(collect(engine, request(prompt, max_tokens=96, mode="auto")))
    spec = last.speculation
    assert spec["acceptance_length"] > 2.0, spec  # copying a file: long SA matches


def test_gate_closing_and_reopening_mid_request(engine, loop, prompts, reference):
    prompt, expected = prompts[-1], reference[-1]

    async def run():
        tokens, seen, last = [], 0, None
        async for last in engine.generate(request(prompt, mode="auto")):
            tokens += last.token_ids
            seen += 1
            if seen == 2:
                engine.configure(dataclasses.replace(engine.config.speculation, adaptive_drafts=False, batch_gate=0))
            if seen == 5:
                engine.configure(dataclasses.replace(engine.config.speculation, adaptive_drafts=False))
        return tokens, last

    with every_draft(engine):
        tokens, last = loop.run_until_complete(run())
    assert tokens == expected and last.speculation["draft_tokens"] > 0  # drafted while the gate was open


def test_concurrent_requests_equal_alone(engine, loop, prompts, reference):
    async def run_all():
        reqs = [request(p, mode="auto") for p in prompts] + [request(p, mode="off") for p in prompts[:2]]
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    with every_draft(engine):
        results = loop.run_until_complete(run_all())
    for prompt, expected, (tokens, _, _) in zip(prompts + prompts[:2], reference + reference[:2], results):
        assert tokens == expected
    assert sum(last.speculation["draft_tokens"] for _, _, last in results) > 0


def test_request_cannot_widen_server_setting(engine, loop, prompts):
    engine.configure(SpeculationConfig(mode="off"))
    try:
        _, _, last = loop.run_until_complete(collect(engine, request(prompts[-1], mode="sa")))
        assert last.speculation["draft_tokens"] == 0
    finally:
        engine.configure(engine.config.speculation)


def test_sa_fallback_behind_an_unsure_head_is_exact(engine, loop, prompts, reference):
    # No SA match ever reaches the threshold, and the head is never sure enough (confidence
    # is at most 1): every draft is the SA fallback behind an MTP plan that proposed nothing.
    core = engine.core
    engine.configure(dataclasses.replace(engine.config.speculation, sa_threshold=64))
    core.mtp_min_confidence = 1.01
    before = dict(core.totals.draft_tokens)
    try:
        for prompt, expected in zip(prompts, reference):
            tokens, _, _ = loop.run_until_complete(collect(engine, request(prompt, mode="auto")))
            assert tokens == expected
    finally:
        core.mtp_min_confidence = engine.config.mtp_min_confidence
        engine.configure(engine.config.speculation)
    assert core.totals.draft_tokens["mtp"] == before["mtp"]
    assert core.totals.draft_tokens["sa"] > before["sa"]


def test_an_unsure_head_is_asked_less_and_less(engine, loop, prompts, reference):
    # The head proposes nothing at confidence 1.01, so each ask backs MTP off for 1, 2, 4 ...
    # up to MTP_MAX_BACKOFF steps: over a request's decode steps it is asked a handful of
    # times, not every step, and the output is the same.
    core = engine.core
    asked = []
    propose = core.mtp.propose
    core.mtp.propose = lambda slots, *args: asked.append(len(slots)) or propose(slots, *args)
    engine.configure(dataclasses.replace(engine.config.speculation, mode="mtp"))
    core.mtp_min_confidence = 1.01
    try:
        tokens, _, last = loop.run_until_complete(collect(engine, request(prompts[0], mode="auto")))
    finally:
        del core.mtp.propose
        core.mtp_min_confidence = engine.config.mtp_min_confidence
        engine.configure(engine.config.speculation)
    assert tokens == reference[0]
    steps = len(tokens) - 1  # decode steps after the token prefill emitted
    assert last.speculation["draft_tokens"] == 0
    assert 1 <= sum(asked) <= 2 + steps // MTP_MAX_BACKOFF + 5, (sum(asked), steps)


def test_logit_bias_does_what_it_says_and_is_exact_under_speculation(engine, loop, prompts, reference):
    # -100 bans the token the model emits first, +100 forces one; every mode emits what off
    # does under the same bias (the bias is one addition per row, the same in every row).
    prompt, expected = prompts[-1], reference[-1]
    forced = loop.run_until_complete(collect(engine, request(prompt, max_tokens=6, logit_bias={42: 100.0})))[0]
    assert forced == [42] * 6
    bias = {expected[0]: -100.0, expected[2]: 2.5}
    off = loop.run_until_complete(collect(engine, request(prompt, mode="off", logit_bias=bias)))[0]
    assert off[0] != expected[0] and expected[0] not in off
    drafted = 0
    with every_draft(engine):
        for mode in ("sa", "mtp", "auto"):
            tokens, _, last = loop.run_until_complete(collect(engine, request(prompt, mode=mode, logit_bias=bias)))
            assert tokens == off, mode
            drafted += last.speculation["draft_tokens"]
    assert drafted > 0


@pytest.fixture
def no_global_pool(engine):
    """For one test, the engine's automata without the cross-request pool (where every earlier
    answer would be drafted from), drafting all their rules allow (what they draft, not whether
    the measured draft rule finds it pays on this machine now)."""
    core, cfg = engine.core, engine.config
    pooled, core.suffix = core.suffix, suffix_drafts(torch.device(cfg.device), cfg.max_batch_size, cfg.max_seq_len, 0)
    with every_draft(engine):
        yield
    core.suffix = pooled


def test_a_prediction_is_drafted_and_changes_nothing(engine, loop, prompts, reference, no_global_pool):
    # OpenAI's Predicted Outputs: the chat answer the client expects. Right, it is drafted from
    # the first output token on (an open question gives the SA nothing to copy otherwise);
    # wrong, or cut to the room left in the automaton, it costs drafts and changes nothing.
    # Greedy and seeded, the output is the one without a prediction.
    prompt, expected = prompts[0], reference[0]
    right = loop.run_until_complete(collect(engine, predicted(prompt, expected)))
    assert right[0] == expected
    plain = loop.run_until_complete(collect(engine, request(prompt)))
    assert right[2].speculation["accepted_tokens"] >= len(expected) // 2 > plain[2].speculation["accepted_tokens"]
    assert right[2].speculation["steps"] < plain[2].speculation["steps"]
    for prediction in (reference[1], expected * 100):  # the second, past the automaton's 2048 positions
        assert loop.run_until_complete(collect(engine, predicted(prompt, prediction)))[0] == expected
    seeded = dict(temperature=0.9, seed=11)
    alone = loop.run_until_complete(collect_logprobs(engine, request(prompt, logprobs=2, **seeded)))
    with_prediction = loop.run_until_complete(collect_logprobs(engine, predicted(prompt, alone[0], logprobs=2, **seeded)))
    assert with_prediction[:3] == alone[:3]
    assert with_prediction[3].speculation["accepted_tokens"] >= len(alone[0]) // 2


def predicted(prompt, prediction, max_tokens=48, **sampling):
    return dataclasses.replace(request(prompt, max_tokens=max_tokens, **sampling), prediction=tuple(prediction))


def test_a_stop_string_met_inside_accepted_drafts_ends_the_output_as_off_does(engine, loop, prompts):
    # A stop string the drafts of one step run past: the tokens after the one that completes
    # it go too, so tokens, logprobs and usage are speculation off's (they had counted them).
    with every_draft(engine):
        for prompt in (prompts[3], prompts[-1]):
            text = loop.run_until_complete(collect(engine, request(prompt, max_tokens=64, mode="off")))[1]
            for at in (len(text) // 3, 2 * len(text) // 3):
                stop = text[at:at + 3]
                runs = [loop.run_until_complete(collect_logprobs(engine, request(
                    prompt, max_tokens=64, mode=mode, stop=[stop], logprobs=1))) for mode in ("off", "sa")]
                (tokens, cut, logprobs, last), (sa_tokens, sa_cut, sa_logprobs, sa_last) = runs
                assert stop not in cut and cut == text[:text.index(stop)]
                assert last.finish_reason == sa_last.finish_reason == "stop"
                assert sa_last.speculation["accepted_tokens"] > 0
                assert (sa_tokens, sa_cut, sa_logprobs) == (tokens, cut, logprobs)
                assert sa_last.completion_tokens == last.completion_tokens == len(tokens) == len(logprobs)
