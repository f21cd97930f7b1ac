"""Stops, limits, aborts, bad input, seeded sampling and failure isolation on the real engine."""

from __future__ import annotations

import asyncio
import collections

import pytest
import torch

from replicas.engine import GenerationRequest, RequestSpeculation, SamplingParams, SpeculationConfig
from replicas.speculation.draft_length import MtpYield, StepCosts
from replicas.speculation.hybrid import MTP_MAX_BACKOFF
from replicas.torch_engine import core as engine_core
from replicas.torch_engine.draft_policy import MTP_OWN_ASKS
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
from replicas.torch_engine.native_model import DEFAULT_THREADS
from replicas.torch_engine.request_step import verify_rows
from replicas.torch_engine.step_drafts import step_drafts
from tests.torch_engine.engine_util import POEM, chat_prompt, collect, idle, request

pytestmark = pytest.mark.slow  # every test drives the real engine (conftest's `engine`)

def test_eos_finishes_with_stop_and_no_special_text(engine, loop):
    prompt = chat_prompt(engine, "What is the capital of France? Answer in one word.")
    tokens, text, last = loop.run_until_complete(collect(engine, request(prompt, max_tokens=64)))
    assert last.finish_reason == "stop" and last.stop_string is None
    assert "Paris" in text and "<|im_end|>" not in text
    assert tokens[-1] == engine.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_length_limit(engine, loop):
    tokens, _, last = loop.run_until_complete(collect(engine, request(chat_prompt(engine, POEM), max_tokens=7)))
    assert len(tokens) == 7 and last.finish_reason == "length" and last.completion_tokens == 7


def test_the_cross_request_pool_reports_what_it_holds(engine, loop):
    """A finished request's tokens go into the suffix automata's cross-request pool, which fills
    to its bound: the replica exports it (`spec_sa_pool_tokens`); a soak saw memory grow with it
    unseen. The device automata have no pool."""
    before = engine.stats().sa_pool_tokens
    loop.run_until_complete(collect(engine, request(chat_prompt(engine, POEM), max_tokens=7)))
    after = engine.stats().sa_pool_tokens
    assert (after == before == 0) if engine.config.device == "cuda" else after > before


@pytest.mark.parametrize("kept", [False, True], ids=["stop", "stop_after"])
@pytest.mark.parametrize("mode", ["off", "auto"])
def test_stop_string_spanning_tokens(engine, loop, mode, kept):
    prompt = chat_prompt(engine, POEM)
    tokens, text, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=40, mode="off")))
    # a stop string that starts inside one token and ends inside the next
    pieces = [engine.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    i = next(i for i in range(5, len(tokens)) if len(pieces[i]) - len(pieces[i - 1]) >= 3
             and len(pieces[i + 1]) - len(pieces[i]) >= 3)
    stop = text[len(pieces[i]) - 2: len(pieces[i]) + 2]
    never = "\u2603\u2603"  # listed first, never written: the stop string named is the one that ended it
    strings = {"stop_after" if kept else "stop": (never, stop)}
    tokens_to_stop, stopped, last = loop.run_until_complete(collect(engine, request(prompt, max_tokens=40, mode=mode,
                                                                                   **strings)))
    assert last.finish_reason == "stop" and last.stop_string == stop
    assert stopped == text[: text.find(stop) + len(stop) * kept]
    assert tokens_to_stop == tokens[:len(tokens_to_stop)]  # verified drafts past it may be in
    assert len(tokens_to_stop) == i + 1 if mode == "off" else len(tokens_to_stop) > i


def test_only_a_request_that_may_draft_with_mtp_feeds_the_head(engine, loop, monkeypatch):
    """The MTP head queues the hidden state of every position it is shown until a draft asks
    for them (2.3 KB a position): a request that never drafts with it shows it none, nor does
    one admitted while the server ran without it, once the server turns it on."""
    fed = []
    mtp = engine.core.mtp
    real = mtp.observe_rows
    monkeypatch.setattr(mtp, "observe_rows", lambda slots, hiddens, next_tokens: fed.extend(slots)
                        or real(slots, hiddens, next_tokens))
    prompt = chat_prompt(engine, POEM)
    plain, _, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=24, mode="off")))
    assert fed == []
    for mode, feeds in (("sa", False), ("mtp", True), ("auto", True)):
        fed.clear()
        tokens, _, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=24, mode=mode)))
        assert bool(fed) == feeds and tokens == plain, mode

    async def turned_on_midway():
        tokens = []
        async for delta in engine.generate(request(prompt, max_tokens=24)):
            tokens += delta.token_ids
            if len(tokens) == 1:
                engine.configure(SpeculationConfig(batch_gate=8))  # the fixture's: hybrid
        return tokens

    fed.clear()
    engine.configure(SpeculationConfig(mode="sa", batch_gate=8))
    try:
        assert loop.run_until_complete(turned_on_midway()) == plain
    finally:
        engine.configure(SpeculationConfig(batch_gate=8))
    assert fed == [] and engine.speculation.mode == "hybrid"


def test_drafts_that_cannot_pay_are_not_made(engine, loop, monkeypatch):
    """Where a verify row is measured dearer than a plain step and an ask of the MTP head
    dearer than the tokens it could save, no SA draft goes and, after the request's own first
    asks, the head is asked only every MTP_MAX_BACKOFF steps (a probe), its queue dropped
    unseen; the output is unchanged. With adaptive drafts off, the same request drafts as the
    rules allow."""
    core = engine.core
    prompt = chat_prompt(engine, "Repeat after me: the cat sat on the mat. The cat sat on the mat.")
    plain, _, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=40, mode="off")))
    asks, forgotten = [], []
    propose, forget = core.mtp.propose, core.mtp.forget
    monkeypatch.setattr(core.mtp, "propose", lambda slots, *a: asks.append(len(slots)) or propose(slots, *a))
    monkeypatch.setattr(core.mtp, "forget", lambda slot, keep=0: forgotten.append(slot) or forget(slot, keep))
    dear = StepCosts()
    for _ in range(20):
        dear.observe_step(1, 1, 0.010)
        dear.observe_step(1, 9, 1.000)  # a row: 12.4 plain steps
        dear.observe_ask(1, 1, 1, 0.050)  # an ask: 5 plain steps
    monkeypatch.setattr(core.drafts, "costs", dear)

    def run() -> tuple[list[int], int]:
        sa_before = core.totals.draft_tokens["sa"]
        tokens, _, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=40)))
        return tokens, core.totals.draft_tokens["sa"] - sa_before

    tokens, sa_drafted = run()
    assert tokens == plain and sa_drafted == 0
    assert forgotten and len(asks) <= MTP_OWN_ASKS + 40 // MTP_MAX_BACKOFF
    stats = core.stats()  # idle: batch 1's costs, what the Replica's gauges show
    # The run's own plain steps move the line's plain time (on a GPU a step took 10-16 ms, and a
    # row read 1.8 plain steps where 2.4 had been set): a row still costs more than a step.
    assert (stats.draft_row_cost, stats.mtp_ask_cost) == (dear.row(1), dear.ask(1)) and dear.row(1) > 1
    engine.configure(SpeculationConfig(batch_gate=8, adaptive_drafts=False))
    try:
        tokens, sa_drafted = run()
    finally:
        engine.configure(SpeculationConfig(batch_gate=8))
    assert tokens == plain and sa_drafted > 0


def test_a_request_judges_the_head_by_its_own_first_asks(engine, loop, monkeypatch):
    """However little the head has yielded for earlier requests, a new request asks it
    MTP_OWN_ASKS times before the rule judges (a copy-like edit has most of a draft accepted
    where an open question has none): within fewer steps than a probe's backoff, it is asked."""
    core = engine.core
    prompt = chat_prompt(engine, "Repeat after me: the cat sat on the mat. The cat sat on the mat.")
    plain, _, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=12, mode="off")))
    asks = []
    propose = core.mtp.propose
    monkeypatch.setattr(core.mtp, "propose", lambda slots, *a: asks.append(len(slots)) or propose(slots, *a))
    poor = collections.defaultdict(MtpYield, mtp=MtpYield(asks=50.0))  # 50 asks, nothing drafted
    monkeypatch.setattr(core.drafts, "mtp_yield", poor)
    tokens, _, _ = loop.run_until_complete(collect(engine, request(prompt, max_tokens=12, mode="mtp")))
    assert tokens == plain and len(asks) >= MTP_OWN_ASKS


def test_seeded_sampling_is_the_same_with_and_without_speculation(engine, loop):
    """Sampling is keyed by output position, so drafts (and the cross-request SA pool, which
    changes them between runs) never change what a seed produces."""
    prompt = chat_prompt(engine, "Repeat after me: the cat sat on the mat. The cat sat on the mat.")
    runs = {mode: loop.run_until_complete(collect(engine, request(prompt, max_tokens=32, mode=mode, temperature=0.8,
                                                                  top_p=0.95, seed=7)))
            for mode in ("off", "auto", "sa")}
    assert runs["auto"][0] == runs["off"][0] == runs["sa"][0] and len(runs["off"][0]) > 0
    assert runs["sa"][2].speculation["draft_tokens"] > 0
    other = loop.run_until_complete(collect(engine, request(prompt, max_tokens=32, temperature=0.8, top_p=0.95, seed=8)))
    assert other[0] != runs["off"][0]


def test_failure_in_one_request_leaves_others_running(engine, loop, monkeypatch):
    def flaky(seq, draft, logits):
        if seq.request_id == "doomed":
            raise RuntimeError("injected")
        return verify_rows(seq, draft, logits)

    monkeypatch.setattr(engine_core, "verify_rows", flaky)
    prompt = chat_prompt(engine, POEM)

    async def run():
        return await asyncio.gather(collect(engine, request(prompt, max_tokens=12, rid="doomed")),
                                    collect(engine, request(prompt, max_tokens=12, rid="fine")))

    (_, _, bad), (tokens, _, good) = loop.run_until_complete(run())
    assert bad.finish_reason == "error" and "injected" in bad.error
    assert good.finish_reason == "length" and len(tokens) == 12
    assert idle(engine)


def test_a_failed_step_fails_its_requests_and_the_next_ones_run(engine, loop, monkeypatch):
    """An exception out of a whole step finishes every live request with an error, and the
    next request runs: the failed step's tokens still queued for the suffix automata go with
    it (they named automata the failure had removed, and every later step failed feeding them)."""
    core, failed = engine.core, []

    def flaky(seqs, *args, **kwargs):
        if core._to_feed and not failed:  # a request prefilled this step, beside one decoding
            failed.append(True)
            raise RuntimeError("injected")
        return step_drafts(seqs, *args, **kwargs)

    monkeypatch.setattr(engine_core, "step_drafts", flaky)
    prompt = chat_prompt(engine, POEM)

    async def run():
        decoding = engine.generate(request(prompt, max_tokens=200)).__aiter__()
        await decoding.__anext__()  # it decodes when the second one joins
        joined = await collect(engine, request(prompt, max_tokens=8))
        first = [delta async for delta in decoding][-1]
        return first, joined[-1], await collect(engine, request(prompt, max_tokens=8))

    first, joined, (tokens, _, after) = loop.run_until_complete(run())
    assert failed and first.finish_reason == joined.finish_reason == "error" and "injected" in joined.error
    assert after.finish_reason == "length" and len(tokens) == 8
    assert idle(engine)


@pytest.mark.parametrize("make, field", [
    (lambda: GenerationRequest("x", "hi " * 3000), "prompt"),
    (lambda: GenerationRequest("x", "", SamplingParams()), "prompt"),
    (lambda: GenerationRequest("x", [10**9]), "prompt"),
    (lambda: GenerationRequest("x", "hi", SamplingParams(max_tokens=5000)), "max_tokens"),
    (lambda: GenerationRequest("x", "hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda: GenerationRequest("x", "hi", SamplingParams(temperature=-1)), "temperature"),
    (lambda: GenerationRequest("x", "hi", SamplingParams(top_p=0)), "top_p"),
    (lambda: GenerationRequest("x", "hi", SamplingParams(top_k=-1)), "top_k"),
    (lambda: GenerationRequest("x", "hi", speculation=RequestSpeculation(mode="fast")), "mode"),
    (lambda: GenerationRequest("x", "hi", prediction=(5, -1)), "prediction"),
])
def test_bad_input_names_the_field_before_any_work(engine, make, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(make())
    assert idle(engine)


def test_torch_runs_single_threaded_beside_the_native_forward(engine, loop):
    """On CPU the native pool does the heavy work. Torch's own ops between steps run on the
    engine's thread alone: an OpenMP team would spin on after them, on the pool's cores. The
    pool still gets the process's threads, also in an engine built after another one set 1."""
    if engine.config.device == "cuda":
        pytest.skip("the CUDA forward: torch's CPU threads are not in its way")
    in_engine_thread = loop.run_until_complete(loop.run_in_executor(engine._executor, torch.get_num_threads))
    assert in_engine_thread == 1
    later = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=256, mtp_weights=None, sa_global_pool_tokens=0,
                                          prefix_cache_bytes=0))
    loop.run_until_complete(later.start())
    try:
        assert later.core.model.num_threads == engine.core.model.num_threads == DEFAULT_THREADS
    finally:
        loop.run_until_complete(later.shutdown())


def parked(engine) -> None:
    """Wait out the engine's step thread: the run of steps that finished the last test's
    request may not have seen its queue empty yet, and would step requests a test adds to the
    core along with the test (each step prefilling them twice). The event loop is not running,
    so no run starts after it."""
    engine._executor.submit(lambda: None).result(timeout=60)


def stepped(core, monkeypatch, seqs, budget: int, every_step=None) -> list[int]:
    """Add `seqs` and step the core (the engine is idle: the test steps it) at `budget` until
    they finish; the positions each step prefilled. `every_step` runs after each step."""
    monkeypatch.setattr(core, "max_prefill_tokens", budget)
    per_step, prefill = [], core._prefill

    def counted(seq, budget, reused_hidden=None):
        done = prefill(seq, budget, reused_hidden)
        per_step[-1] += done
        return done

    monkeypatch.setattr(core, "_prefill", counted)
    for seq in seqs:
        core.add(seq)
    while any(seq.finish_reason is None for seq in seqs):
        per_step.append(0)
        core.step()
        if every_step is not None:
            every_step()
    monkeypatch.setattr(core, "_prefill", prefill)
    return per_step


def test_a_step_prefills_within_its_token_budget(engine, monkeypatch):
    """A step prefills at most max_prefill_tokens positions: of the prompts under way, then of
    waiting requests while the budget lasts, a longer prompt going on in the next steps; the
    output is the same however the prompts were cut."""
    core = engine.core
    parked(engine)
    questions = ("Name three moons of Jupiter.", "Why do cats purr?", "What is 7 times 8?")

    def run(budget: int) -> tuple[list[int], list[list[int]]]:
        seqs = [engine._make_sequence(request(chat_prompt(engine, q), max_tokens=6, mode="off", ignore_eos=True))
                for q in questions]
        per_step = stepped(core, monkeypatch, seqs, budget)
        assert idle(engine)
        return [n for n in per_step if n], [seq.output_ids for seq in seqs]

    assert core.max_prefill_tokens == 512  # TorchEngineConfig's default
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        TorchEngineConfig(max_prefill_tokens=0)
    cut = run(5)  # first: the prompts' ends are in no prefix cache yet
    whole = run(2048)
    assert len(whole[0]) == 1 and len(cut[0]) > 3 and max(cut[0]) == 5
    assert cut[1] == whole[1] and all(len(out) == 6 for out in cut[1])


@pytest.mark.parametrize("mode", ["off", "auto"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_long_prompt_goes_in_over_steps_while_the_running_request_decodes(engine, monkeypatch, mode, prefix_cache):
    """A prompt longer than the step's max_prefill_tokens goes in a chunk a step, and the
    request already running gets a token in every one of those steps (one step for the whole
    prompt held them all back); the long request's tokens and logprobs equal those of the same
    prompt prefilled in one step (drafting, the MTP head's queue is fed chunk by chunk; with the
    prefix cache, the chunks' blocks are offered as they go in and the one-step run reuses them)."""
    core = engine.core
    parked(engine)
    if not prefix_cache:
        monkeypatch.setattr(core, "prefix", None)
    log = "\n".join(f"line {i}: worker {i % 7} {mode} {prefix_cache} finished job {i * 13 % 97} in {i % 11 + 1} ms"
                    for i in range(30))
    prompt = chat_prompt(engine, "Which worker finished the most jobs?\n" + log)

    def run(budget: int) -> tuple[int, list[int], list]:
        runner = engine._make_sequence(request(chat_prompt(engine, POEM), max_tokens=300, mode=mode, ignore_eos=True))
        monkeypatch.setattr(core, "max_prefill_tokens", budget)
        core.add(runner)
        while not runner.output_ids:
            core.step()
        long = engine._make_sequence(request(prompt, max_tokens=16, mode=mode, ignore_eos=True, logprobs=2))
        emitted = []
        per_step = stepped(core, monkeypatch, [long], budget, lambda: emitted.append(len(runner.output_ids)))
        prefilling = per_step.index(0) if 0 in per_step else len(per_step)  # steps until the first token
        assert all(b > a for a, b in zip(emitted[:prefilling], emitted[1:prefilling + 1]))
        assert runner.finish_reason is None and max(per_step) <= budget
        core.abort(runner.request_id)
        assert idle(engine)
        return prefilling, long.output_ids, long.logprobs

    assert len(engine.tokenizer.encode(prompt)) > 18 * 32
    steps, tokens, logprobs = run(32)
    assert steps > 16
    assert run(2048) == (1, tokens, logprobs)


def test_shutdown_mid_generation_stops_stepping(loop):
    """Steps run back to back in the worker thread; shutdown() ends them within a step, not
    at the end of the work in flight (which would hold shutdown for the whole request)."""
    engine = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=2048, mtp_weights=None,
                                           sa_global_pool_tokens=0, prefix_cache_bytes=0))
    loop.run_until_complete(engine.start())
    max_tokens = 1500

    async def run():
        stream = engine.generate(request(chat_prompt(engine, POEM), max_tokens=max_tokens, mode="off", ignore_eos=True))
        await anext(stream)  # decoding has begun
        await engine.shutdown()
        await stream.aclose()
        return engine.core.running

    running = loop.run_until_complete(run())
    assert len(running) == 1 and len(running[0].output_ids) < max_tokens // 2
