"""Behind a closed gate: the SA drafts requests would have verified, held and settled by the
tokens they emit, so the acceptance length keeps measuring the workload."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from replicas.engine import SpeculationConfig
from replicas.stats import Ewma
from replicas.torch_engine.draft_policy import DraftPolicy
from replicas.torch_engine.step_drafts import shadow_drafts, shadow_kept
from tests.torch_engine.engine_util import code_edit_prompts, collect, request


@pytest.mark.parametrize("emitted, kept", [
    ([[5], [6], [9]], [None, None, 3]),  # parts at its third token: 2 accepted + the correction
    ([[5], [6], [7], [8]], [None, None, None, 4]),  # all of it: 3 + the bonus token
    ([[4]], [1]),  # parts at once
    ([[5, 6, 9, 1]], [3]),  # a step of several tokens settles it too
])
def test_a_shadow_draft_keeps_what_its_verify_would_have(emitted, kept):
    seq = SimpleNamespace(shadow_draft=[5, 6, 7], shadow_matched=0)
    assert [shadow_kept(seq, tokens) for tokens in emitted] == kept
    assert seq.shadow_draft == [] and shadow_kept(seq, [1]) is None  # settled: let go


def test_an_open_gate_lets_the_drafts_held_go():
    # else their settling counted beside the real verifies of the same tokens, or moved the
    # figure of a server set to mode off
    seq = SimpleNamespace(shadow_draft=[5, 6], shadow_matched=1)
    shadow_drafts([seq], SpeculationConfig(), DraftPolicy(None), 100, gate_closed=False)
    assert (seq.shadow_draft, seq.shadow_matched) == ([], 0)


@pytest.mark.slow
def test_behind_a_closed_gate_the_acceptance_length_follows_the_sa_drafts_held(engine, loop):
    prompt = code_edit_prompts(engine, 1)[0]  # output copying its prompt: long SA matches
    alone, *_ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=64, mode="off")))
    engine.core.acceptance_ewma = Ewma()  # unmeasured (0.0), as on a replica packed from its start
    engine.configure(dataclasses.replace(engine.config.speculation, batch_gate=1))
    try:
        before = engine.stats()

        async def two():  # the same answer: they end in one step, each step over the gate
            return await asyncio.gather(*(collect(engine, request(prompt, max_tokens=64)) for _ in range(2)))

        outputs = loop.run_until_complete(two())
        after = engine.stats()
    finally:
        engine.configure(engine.config.speculation)
    assert [tokens for tokens, *_ in outputs] == [alone, alone]
    assert after.speculating == 0 and after.draft_tokens == before.draft_tokens  # nothing drafted
    assert before.acceptance_length == 0.0 and after.acceptance_length > 1.5
