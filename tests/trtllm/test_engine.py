"""TrtllmEngine against the contract fake: streaming, finish reasons, abort, stats, settings."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from replicas.engine import Engine, RequestError, Resume
from replicas.stats import NOT_GATED
from replicas.trtllm.translate import UnsupportedRelease
from replicas.trtllm_engine import TrtllmEngine
from tests.polling import async_wait_until
from tests.trtllm.conftest import collect, engine_config, fake_api, joined, request, run, started

PROMPT = "def f(x):\n    return x\n"


def test_implements_the_engine_protocol():
    assert isinstance(TrtllmEngine(engine_config(), api=fake_api()), Engine)


@pytest.mark.parametrize("mode", ["off", "sa", "mtp", "hybrid"])
def test_stream_maps_to_deltas(mode):
    async def go():
        engine = await started(engine_config(mode))
        deltas = await collect(engine, request(PROMPT, max_tokens=30))
        await engine.shutdown()
        return deltas

    deltas = run(go())
    text, tokens = joined(deltas)
    expected = (PROMPT * 3)[:30]  # the toy model repeats its prompt, speculating or not
    assert text == expected and tokens == [ord(c) for c in expected]
    last = deltas[-1]
    assert last.finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert (last.prompt_tokens, last.completion_tokens) == (len(PROMPT), 30)
    usage = last.speculation
    if mode == "off":
        assert usage["draft_tokens"] == 0 and usage["steps"] == 0
    else:
        # every generation step verified a draft: emitted = accepted + steps after the first token
        assert usage["accepted_tokens"] + usage["steps"] == 29
        assert usage["acceptance_length"] == pytest.approx(29 / usage["steps"], abs=1e-3)
    if mode in ("sa", "hybrid"):  # SA copies the repeated prompt: whole drafts accepted
        assert usage["acceptance_length"] > 3


def test_token_id_prompts_and_stop_token_ids():
    async def go():
        engine = await started(engine_config())
        deltas = await collect(engine, request([ord(c) for c in "abcdef"], max_tokens=20, stop_token_ids=(ord("d"),)))
        await engine.shutdown()
        return deltas

    deltas = run(go())
    assert deltas[-1].finish_reason == "stop"
    assert joined(deltas)[0] == "abcd"  # upstream keeps a stop token id in the output


def test_stop_string_is_never_streamed():
    async def go():
        engine = await started(engine_config("hybrid"))
        deltas = await collect(engine, request("one two. three ", max_tokens=60, stop=("o. t",)))
        await engine.shutdown()
        return deltas

    deltas = run(go())
    text, _ = joined(deltas)
    assert text == "one tw" and (deltas[-1].finish_reason, deltas[-1].stop_string) == ("stop", "o. t")
    assert all("o." not in d.text for d in deltas)  # upstream cut it from the text: its stop_reason names it


def test_stop_after_ends_the_output_after_it_and_aborts_upstream():
    async def go():
        engine = await started(engine_config("hybrid"))
        deltas = await collect(engine, request("one two. three ", max_tokens=60, stop_after=("o. t",)))
        aborts = len(engine._llm.abort_calls)
        await engine.shutdown()
        return deltas, aborts

    deltas, aborts = run(go())
    assert joined(deltas)[0] == "one two. t" and aborts == 1  # upstream is never told of it
    assert (deltas[-1].finish_reason, deltas[-1].stop_string) == ("stop", "o. t")


def test_a_stop_string_upstream_missed_is_cut_and_aborted_upstream():
    async def go():
        engine = await started(engine_config("off"))
        # stop strings are matched upstream on token ids; pass one only to our tracker
        req = request("xyz", max_tokens=40)
        stream = engine.generate(req)
        live_tracker = None
        deltas = []
        async for d in stream:
            if live_tracker is None:
                live_tracker = engine._live["r1"].tracker
                live_tracker.stops = ("zx",)
            deltas.append(d)
        aborts = len(engine._llm.abort_calls)
        await engine.shutdown()
        return deltas, aborts

    deltas, aborts = run(go())
    assert joined(deltas)[0] == "xy" and deltas[-1].finish_reason == "stop" and aborts == 1


def test_abort_mid_stream():
    async def go():
        engine = await started(engine_config("off"))
        deltas = []
        async for d in engine.generate(request(PROMPT, max_tokens=200)):
            deltas.append(d)
            if len(deltas) == 2:
                await engine.abort("r1")
        await engine.abort("r1")  # finished: a no-op
        await engine.abort("unknown")
        state = (len(engine._llm.abort_calls), engine.num_live_requests)
        await engine.shutdown()
        return deltas, state

    deltas, (aborts, live) = run(go())
    assert deltas[-1].finish_reason == "abort" and len(deltas) == 3
    assert aborts == 1 and live == 0


def test_closing_the_stream_aborts_upstream():
    async def go():
        engine = await started(engine_config())
        stream = engine.generate(request(PROMPT, max_tokens=200))
        await anext(stream)
        await stream.aclose()
        state = (len(engine._llm.abort_calls), engine.num_live_requests)
        await engine.shutdown()
        return state

    assert run(go()) == (1, 0)


def test_not_iterating_submits_nothing():
    async def go():
        engine = await started(engine_config())
        engine.generate(request(PROMPT))
        await asyncio.sleep(0.05)  # a chance to submit: it must not take it (nothing to poll for)
        active = len(engine._llm._active)
        await engine.shutdown()
        return active

    assert run(go()) == 0


@pytest.mark.parametrize("req,match", [
    (request(""), "prompt"),
    (request([]), "prompt"),
    (request([1, -2]), "prompt"),
    (request("x" * 500, max_tokens=100), "max_tokens"),
    (request("x", logit_bias={3: 1.0}), "logit_bias"),  # not mapped upstream yet
    (request("x", logprobs=1), "^logprobs"),
    (request("x", prompt_logprobs=1), "^prompt_logprobs"),
])
def test_bad_requests_fail_before_streaming(req, match):
    async def go():
        engine = await started(engine_config())
        try:
            with pytest.raises(ValueError, match=match):
                engine.generate(req)
        finally:
            await engine.shutdown()

    run(go())


def test_duplicate_ids_and_not_started():
    engine = TrtllmEngine(engine_config(), api=fake_api())
    with pytest.raises(RuntimeError, match="not started"):
        engine.generate(request(PROMPT))

    async def go():
        await engine.start()
        stream = engine.generate(request(PROMPT, max_tokens=100))
        await anext(stream)
        with pytest.raises(ValueError, match="request_id"):
            engine.generate(request(PROMPT))
        await stream.aclose()
        await engine.shutdown()

    run(go())


@pytest.mark.parametrize("mode,source", [("hybrid", "mtp"), ("sa", "sa"), ("off", None)])
@pytest.mark.parametrize("as_json", [False, True])
def test_stats_from_iteration_rows(mode, source, as_json):
    async def go():
        engine = await started(engine_config(mode))
        engine._llm.stats_as_json = as_json
        await asyncio.gather(*(collect(engine, request(PROMPT, max_tokens=40, rid=f"r{i}")) for i in range(3)))

        def folded() -> bool:  # the poller has read rows, with drafts where the mode drafts
            stats = engine.stats()
            return stats.tokens_per_s > 0 and (source is None or stats.draft_tokens[source] > 0)

        assert await async_wait_until(folded, timeout_s=10), "no iteration stats read"
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = run(go())
    assert stats.step_ms == pytest.approx(10.0) and stats.tokens_per_s > 0
    if source is None:
        assert sum(stats.draft_tokens.values()) == 0 and stats.acceptance_length == 0
        return
    other = "sa" if source == "mtp" else "mtp"
    assert stats.draft_tokens[source] > 0 and stats.draft_tokens[other] == 0
    assert 0 < stats.accepted_tokens[source] <= stats.draft_tokens[source]
    assert 1 < stats.acceptance_length <= 5


@pytest.mark.parametrize("mode,drafter,gate,live,speculating,reported_gate", [
    ("mtp", "eagle3", 1, 1, 1, 1), ("mtp", "eagle3", 1, 2, 0, 1),  # EAGLE-3 alone: gated
    ("hybrid", "eagle3", 1, 2, 1, NOT_GATED),  # the SA enhancer keeps drafting: not gated
    ("hybrid", "mtp", 1, 2, 1, NOT_GATED),  # one-engine MTP cannot stop drafting
    ("mtp", "eagle3", 8, 8, 1, NOT_GATED),  # a gate at max_batch_size never trips
    ("off", "eagle3", 8, 1, 0, NOT_GATED), ("hybrid", "eagle3", 0, 1, 0, NOT_GATED),  # no speculation
])
def test_stats_report_the_gate_the_engine_applies(mode, drafter, gate, live, speculating, reported_gate):
    async def go():
        engine = await started(engine_config(mode, drafter, batch_gate=gate))
        streams = [engine.generate(request(PROMPT, max_tokens=200, rid=f"r{i}")) for i in range(live)]
        for s in streams:
            await anext(s)
        stats = engine.stats()
        for s in streams:
            await s.aclose()
        await engine.shutdown()
        return stats

    stats = run(go())
    assert (stats.batch_size, stats.waiting, stats.speculating) == (live, 0, speculating)
    assert stats.batch_gate == reported_gate


def test_a_closed_gate_is_what_the_engine_does():
    """Above its reported gate the engine drafts nothing; not gated, it drafts on."""
    async def go(mode):
        engine = await started(engine_config(mode, batch_gate=1))
        await asyncio.gather(*(collect(engine, request(PROMPT, max_tokens=40, rid=f"r{i}")) for i in range(4)))
        drafted = engine._llm.args.speculative_config.runtime_draft_len(4)
        gate = engine.stats().batch_gate
        await engine.shutdown()
        return gate, drafted

    assert run(go("mtp")) == (1, 0)
    assert run(go("hybrid")) == (NOT_GATED, 1)


def test_configure_stages_and_restart_applies():
    async def go():
        engine = await started(engine_config("mtp", batch_gate=4))
        spec = engine.config.speculation
        engine.configure(spec)
        assert engine.restart_required == ()
        engine.configure(dataclasses.replace(spec, max_draft_len=2, batch_gate=2))
        assert engine.restart_required == ("max_draft_len", "batch_gate")
        assert engine._llm.args.speculative_config.max_draft_len == 4  # the running LLM keeps its build
        old_llm = engine._llm
        await engine.restart()
        built = engine._llm.args.speculative_config
        state = (old_llm.shut_down, built.max_draft_len, built.max_concurrency, engine.restart_required)
        deltas = await collect(engine, request(PROMPT, max_tokens=10))
        await engine.shutdown()
        return state, deltas[-1].finish_reason

    (was_shut, k, gate, pending), finish = run(go())
    assert was_shut and (k, gate, pending) == (2, 2, ()) and finish == "length"


def test_a_staged_gate_is_not_reported_until_restart():
    async def go():
        engine = await started(engine_config("mtp", batch_gate=4))
        engine.configure(dataclasses.replace(engine.config.speculation, batch_gate=2))
        staged = engine.stats().batch_gate
        await engine.restart()
        restarted = engine.stats().batch_gate
        await engine.shutdown()
        return staged, restarted

    assert run(go()) == (4, 2)


def test_settings_the_release_cannot_build_fail_fast():
    api = fake_api()
    api.classes.pop("SAEnhancerConfig")  # a release without the SA enhancer
    with pytest.raises(UnsupportedRelease, match="sa_config"):  # at construction
        TrtllmEngine(engine_config("hybrid", "mtp"), api=api)
    engine = TrtllmEngine(engine_config("sa", draft_model=None), api=fake_api())
    with pytest.raises(ValueError, match="draft_model"):  # at configure, not at restart
        engine.configure(dataclasses.replace(engine.config.speculation, mode="hybrid"))
    assert engine.restart_required == ()


def test_health_and_tokenizer():
    async def go():
        engine = TrtllmEngine(engine_config(), api=fake_api())
        with pytest.raises(RuntimeError, match="not started"):
            await engine.check_health()
        await engine.start()
        await engine.check_health()
        hf = type(engine.tokenizer).__name__
        engine._llm.fatal = True
        with pytest.raises(RuntimeError, match="fatal"):
            await engine.check_health()
        await engine.shutdown()
        return hf

    assert run(go()) == "FakeTokenizer"  # the raw tokenizer, not upstream's wrapper


def test_a_failed_submission_is_an_error_delta():
    async def go():
        engine = await started(engine_config())

        def broken(*args, **kwargs):
            raise RuntimeError("executor is shut down")

        engine._llm.generate_async = broken
        deltas = await collect(engine, request(PROMPT))
        await engine.shutdown()
        return deltas

    (delta,) = run(go())
    assert delta.finish_reason == "error" and "executor is shut down" in delta.error


def test_a_prompt_over_max_num_tokens_goes_in_chunks():
    """Upstream's PyTorch backend refuses a prompt over max_num_tokens unless it prefills in
    chunks: one the window admits failed mid-request with a server error."""
    async def go():
        engine = await started(engine_config(max_num_tokens=64))
        deltas = await collect(engine, request(list(range(1, 201))))
        chunked = engine._llm.args.enable_chunked_prefill
        await engine.shutdown()
        return deltas, chunked

    deltas, chunked = run(go())
    assert chunked and deltas[-1].finish_reason == "length" and len(joined(deltas)[1]) == 24


def test_an_upstream_failure_mid_stream_is_an_error_delta(monkeypatch):
    from tests.trtllm.fake_tensorrt_llm.llm import FakeRequestOutput

    original = FakeRequestOutput.__anext__

    async def flaky(self):
        if self.decoding_iter >= 2:
            raise RuntimeError("CUDA error: an illegal memory access")
        return await original(self)

    monkeypatch.setattr(FakeRequestOutput, "__anext__", flaky)

    async def go():
        engine = await started(engine_config("off"))
        deltas = await collect(engine, request(PROMPT, max_tokens=50))
        await engine.shutdown()
        return deltas

    deltas = run(go())
    assert deltas[-1].finish_reason == "error" and "illegal memory access" in deltas[-1].error
    assert len(deltas) == 3


def test_a_resumed_request_is_refused_not_rerun():
    async def go():
        engine = await started(engine_config())
        try:
            with pytest.raises(RequestError) as info:
                engine.generate(dataclasses.replace(request(PROMPT), resume=Resume((1, 2), 2)))
            assert info.value.param == "resume"
        finally:
            await engine.shutdown()

    run(go())


def test_a_prediction_is_served_not_refused():
    # The engine does not draft from a prediction (OpenAI's Predicted Outputs) yet; a request
    # that carries one is served as without it (the ingress counts it against the output).
    async def go():
        engine = await started(engine_config())
        try:
            plain = await collect(engine, request(PROMPT, max_tokens=20))
            predicted = await collect(engine, dataclasses.replace(request(PROMPT, max_tokens=20),
                                                                  prediction=tuple(map(ord, PROMPT))))
            return joined(plain), joined(predicted), predicted[-1].finish_reason
        finally:
            await engine.shutdown()

    plain, predicted, finish = run(go())
    assert predicted == plain and finish == "length"


def test_penalties_are_taken_under_speculation():
    """A release whose speculative configs have `enable_penalty` refuses a penalised request
    unless it is on: the adapter turns it on (found by a review against upstream)."""
    async def go():
        engine = await started(engine_config("hybrid"))
        deltas = await collect(engine, request(PROMPT, presence_penalty=0.5, repetition_penalty=1.1))
        await engine.shutdown()
        return deltas

    assert run(go())[-1].finish_reason == "length"
