"""A request resumed after any delta of an interrupted attempt continues exactly: the client's
text, tokens and logprobs are those of the uninterrupted request (greedy, seeded, constrained).

The resumed engine prefills prompt + delivered tokens in one pass, which the row-invariant
forward computes bit for bit as the interrupted attempt's decode steps did.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from replicas.engine import GrammarSpec, RequestError, Resume
from tests.torch_engine.engine_util import chat_prompt, code_edit_prompts, every_draft, request

pytestmark = pytest.mark.slow  # every test drives the real engine (conftest's `engine`)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


def deltas(engine, loop, req):
    async def go():
        return [d async for d in engine.generate(req)]
    return loop.run_until_complete(go())


def delivered(chunks):
    """(tokens, text, logprobs) the client got from these deltas."""
    return ([t for d in chunks for t in d.token_ids], "".join(d.text for d in chunks),
            [e for d in chunks for e in d.logprobs])


@pytest.fixture(scope="module")
def cases(engine):
    chat = chat_prompt(engine, "Write a short poem about the sea.")
    edit = code_edit_prompts(engine, 1)[0]
    return [
        ("greedy chat", request(chat, max_tokens=40, logprobs=2)),
        ("seeded chat", request(chat, max_tokens=40, logprobs=2, temperature=0.9, seed=11, frequency_penalty=0.5)),
        ("code edit", request(edit, max_tokens=60, logprobs=1)),
        ("constrained", dataclasses.replace(
            request(chat_prompt(engine, "A JSON record of a sailor."), max_tokens=60, logprobs=1),
            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))),
    ]


def test_resuming_after_any_delta_continues_exactly(engine, loop, cases):
    drafted = []
    with every_draft(engine):
        for name, req in cases:
            full = deltas(engine, loop, req)
            tokens, text, logprobs = delivered(full)
            assert len(full) > 2, name
            drafted.append(full[-1].speculation["draft_tokens"])
            for cut in sorted({1, 2, len(full) // 2, len(full) - 1}):
                before = delivered(full[:cut])
                resume = Resume(tuple(before[0]), len(before[1]))
                after = delivered(deltas(engine, loop, dataclasses.replace(req, resume=resume)))
                assert before[0] + after[0] == tokens, (name, cut)
                assert before[1] + after[1] == text, (name, cut)
                assert before[2] + after[2] == logprobs, (name, cut)
    assert all(drafted), drafted  # each resumed a request that verified drafts


def test_a_bad_resume_is_a_request_error(engine, loop, cases):
    _, req = cases[0]
    for resume in (Resume((10**7,)), Resume(tuple(range(req.sampling.max_tokens)))):
        with pytest.raises(RequestError) as info:
            engine.generate(dataclasses.replace(req, resume=resume))
        assert info.value.param == "resume"
    constrained = cases[-1][1]
    with pytest.raises(RequestError, match="grammar"):
        engine.generate(dataclasses.replace(constrained, resume=Resume(tuple(engine.tokenizer.encode("hello")))))
    assert engine.num_live_requests == 0


def test_a_resumed_request_stopped_among_accepted_drafts_sends_their_logprobs_as_tokens(engine, loop):
    """A stop string in a step's accepted drafts cuts the logprobs where it cuts the tokens:
    counted from the output's start, the resumed tokens among them (which have no logprobs
    here), the cut fell past the end and the logprobs of the dropped drafts went out."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"
    req = request(chat_prompt(engine, f"Repeat exactly: {words}"), max_tokens=48, mode="sa", logprobs=0)
    with every_draft(engine):
        full = deltas(engine, loop, req)
        for i in range(1, len(full)):
            stop = engine.tokenizer.decode(full[i].token_ids[1:2]).strip()
            if len(full[i].token_ids) >= 3 and len(stop) >= 3 and stop not in delivered(full[:i])[1] + full[i].text[:1]:
                break
        else:
            pytest.fail(f"no delta of 3 or more tokens to stop within: {[len(d.token_ids) for d in full]}")
        stopped = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, stop=(stop,)))
        whole = delivered(deltas(engine, loop, stopped))
        before = delivered(full[:i])
        after = delivered(deltas(engine, loop, dataclasses.replace(
            stopped, resume=Resume(tuple(before[0]), len(before[1])))))
    assert len(after[2]) == len(after[0]), (len(after[2]), len(after[0]))
    assert (before[0] + after[0], before[1] + after[1], before[2] + after[2]) == whole
