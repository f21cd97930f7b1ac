"""Aborts, consumers that go away and request ids on the real engine: every request's
resources come back, and a request id is one request's at a time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from replicas.engine import RequestError
from tests.polling import async_wait_until
from tests.torch_engine.engine_util import POEM, chat_prompt, collect, idle, request

pytestmark = pytest.mark.slow  # every test drives the real engine (conftest's `engine`)

def test_abort_mid_stream_frees_kv_and_sa(engine, loop):
    async def run():
        req = request(chat_prompt(engine, POEM), max_tokens=200, mode="auto")
        deltas = []
        async for delta in engine.generate(req):
            deltas.append(delta)
            if len(deltas) == 3:
                await engine.abort(req.request_id)
        return deltas

    deltas = loop.run_until_complete(run())
    assert deltas[-1].finish_reason == "abort"
    assert loop.run_until_complete(async_wait_until(lambda: idle(engine), timeout_s=10))


def test_consumer_going_away_frees_resources(engine, loop):
    async def run():
        stream = engine.generate(request(chat_prompt(engine, POEM), max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()  # what a disconnecting HTTP client does to the iterator
        return await async_wait_until(lambda: idle(engine), timeout_s=10)

    assert loop.run_until_complete(run())


def test_a_request_id_taken_between_generate_and_the_first_delta_is_refused(engine, loop):
    """generate() refuses a live id at once; a twin made before either stream started is
    refused when it starts (it took over the first one's queue, which then hung)."""
    prompt = chat_prompt(engine, POEM)
    first = engine.generate(request(prompt, max_tokens=4, rid="twin"))
    second = engine.generate(request(prompt, max_tokens=4, rid="twin"))

    async def run():
        ones = [await first.__anext__()]  # the first is running when the second starts
        twos = [d async for d in second]
        return ones + [d async for d in first], twos

    ones, twos = loop.run_until_complete(asyncio.wait_for(run(), 60))
    assert ones[-1].finish_reason == "length" and sum(len(d.token_ids) for d in ones) == 4
    assert [d.finish_reason for d in twos] == ["error"] and "already running" in twos[0].error
    assert idle(engine)


def test_a_gone_consumers_id_stays_taken_until_its_request_is_freed(engine, loop):
    """A client goes away and its id is sent again before the next step: the twin was let in,
    took the abort meant for the first (found first, waiting) and the first's deltas, while
    the first ran on, read by nobody, to max_tokens. Now the id is refused until it is free."""
    def twin():
        return request(chat_prompt(engine, "Hi."), max_tokens=5, rid="twice", ignore_eos=True)

    async def run():
        stream = engine.generate(request(chat_prompt(engine, POEM), max_tokens=200, rid="twice", ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()  # its abort is pending until the loop applies it
        with pytest.raises(RequestError, match="'twice' is already running"):
            engine.generate(twin())
        assert await async_wait_until(lambda: idle(engine), timeout_s=10)
        return [d async for d in engine.generate(twin())]

    again = loop.run_until_complete(asyncio.wait_for(run(), 60))
    assert again[-1].finish_reason == "length" and sum(len(d.token_ids) for d in again) == 5
    assert idle(engine)


def test_a_twin_let_in_once_a_gone_consumers_request_finished_is_not_aborted(engine, loop, monkeypatch):
    """The consumer goes away while its request's last step is in flight: that step's deltas
    free the id, and a twin sent before the loop applied the pending abort took it (aborted
    with no token). The last step waits for the consumer to go, and the twin starts right
    after that step's deltas, from the loop's own callback, to land in that window every time."""
    twin, in_flight, gone = [], threading.Event(), threading.Event()
    publish, step = engine._publish, engine.core.step

    async def send_twin():
        return [d async for d in engine.generate(request(chat_prompt(engine, "Hi."), max_tokens=5, rid="gone",
                                                         ignore_eos=True))]

    def publish_then_send_twin(deltas):
        publish(deltas)
        if not twin and any(d.request_id == "gone" and d.finish_reason for d in deltas):
            twin.append(loop.create_task(send_twin()))

    def last_step_once_the_consumer_is_gone():
        if not in_flight.is_set() and any(s.request_id == "gone" and len(s.output_ids) == 1
                                          for s in engine.core.running):
            in_flight.set()
            gone.wait(30)
        return step()

    async def run():
        stream = engine.generate(request(chat_prompt(engine, POEM), max_tokens=2, rid="gone", ignore_eos=True))
        async for _ in stream:  # the first token
            break
        assert await async_wait_until(in_flight.is_set, timeout_s=30)  # the last is being computed
        await stream.aclose()
        gone.set()
        assert await async_wait_until(lambda: bool(twin), timeout_s=30)
        return await twin[0]

    monkeypatch.setattr(engine, "_publish", publish_then_send_twin)
    monkeypatch.setattr(engine.core, "step", last_step_once_the_consumer_is_gone)
    deltas = loop.run_until_complete(asyncio.wait_for(run(), 60))
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 5
    assert idle(engine)


def test_a_request_whose_freeing_fails_still_gets_its_last_delta(engine, loop, monkeypatch):
    """Freeing a finished request raising took its step's deltas with it: the engine failed the
    requests still live, and the finished one's client waited for its last delta for ever."""
    remove = engine.core.suffix.remove

    def remove_then_fail(sa_id):
        remove(sa_id)  # freed, so the engine is idle after: only the raise is under test
        raise RuntimeError("freeing failed")

    monkeypatch.setattr(engine.core.suffix, "remove", remove_then_fail)
    tokens, _, last = loop.run_until_complete(asyncio.wait_for(
        collect(engine, request(chat_prompt(engine, POEM), max_tokens=3, ignore_eos=True)), 30))
    assert len(tokens) == 3 and last.finish_reason == "length"
    assert idle(engine)


def test_abort_unknown_id_is_a_noop(engine, loop):
    loop.run_until_complete(engine.abort("no-such-request"))
    assert idle(engine)
