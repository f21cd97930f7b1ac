"""The Replica class on its own (no Serve): reconfigure, stats, rejections, health checks."""

from __future__ import annotations

import asyncio

import pytest

from replicas.engine import GenerationRequest, SamplingParams
from replicas.replica import Replica, RequestRejected, speculation_config
from tests.deploy.fakes import FakeEngine


async def make_replica(speculation=None, engine_cls=FakeEngine) -> Replica:
    replica = Replica.__new__(Replica)
    await replica.__init__(engine_cls, speculation, metrics=False)
    return replica


def run(coro):
    return asyncio.run(coro)


def test_reconfigure_changes_the_engine_and_the_stats():
    async def scenario():
        replica = await make_replica({"batch_gate": 2})
        assert replica._engine.speculation.batch_gate == 2
        replica.reconfigure({"batch_gate": 6, "mode": "sa"})
        stats = await replica.stats()
        assert stats["batch_gate"] == 6 and replica._engine.speculation.mode == "sa"
        assert {"batch_size", "waiting", "speculating", "acceptance_length", "step_ms", "tokens_per_s"} <= set(stats)
        assert await replica.record_routing_stats() == await replica.record_autoscaling_stats() == stats
    run(scenario())


@pytest.mark.parametrize("user_config,field", [
    ({"batch_gates": 2}, "user_config"), ({"mode": "turbo"}, "mode"), ({"max_draft_len": 0}, "max_draft_len"),
])
def test_bad_user_config_names_the_field(user_config, field):
    with pytest.raises(ValueError, match=field):
        speculation_config(user_config)


def test_engine_validation_becomes_a_rejection_and_speculate_false_turns_it_off():
    async def scenario():
        replica = await make_replica()
        too_long = GenerationRequest("r1", [1] * 250, SamplingParams(max_tokens=20))
        items = [item async for item in replica.generate(too_long)]
        assert items == [RequestRejected(items[0].message, "max_tokens")]

        seen = []
        original = replica._engine.generate
        replica._engine.generate = lambda request: seen.append(request) or original(request)
        deltas = [d async for d in replica.generate(GenerationRequest("r2", "hi", SamplingParams(max_tokens=3)),
                                                    speculate=False)]
        assert seen[0].speculation.mode == "off" and deltas[-1].finish_reason == "length"
    run(scenario())


def test_closing_the_stream_aborts_the_request():
    async def scenario():
        replica = await make_replica()
        stream = replica.generate(GenerationRequest("r3", "SLOW", SamplingParams(max_tokens=50)))
        await stream.__anext__()
        assert replica._engine.num_live_requests == 1
        await stream.aclose()
        assert replica._engine.num_live_requests == 0 and replica._live == 0
    run(scenario())


class StuckEngine(FakeEngine):
    """Accepts requests and never produces a token."""

    async def _stream(self, request, prompt, prompt_tokens):
        self.live.add(request.request_id)
        try:
            await asyncio.Event().wait()
            yield  # pragma: no cover
        finally:
            self.live.discard(request.request_id)


class BrokenEngine(FakeEngine):
    async def _stream(self, request, prompt, prompt_tokens):
        from replicas.engine import GenerationDelta

        yield GenerationDelta(request.request_id, (), "", "error", "no device")


def test_health_check_probes_an_idle_engine():
    async def scenario():
        await (await make_replica()).check_health()
        broken = await make_replica(engine_cls=BrokenEngine)
        with pytest.raises(RuntimeError, match="health probe failed"):
            await broken.check_health()
    run(scenario())


def test_health_check_fails_when_live_requests_stop_progressing():
    async def scenario():
        replica = await make_replica(engine_cls=StuckEngine)
        stream = replica.generate(GenerationRequest("r4", "hi", SamplingParams(max_tokens=5)))
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        await replica.check_health()  # two checks without progress: still healthy
        await replica.check_health()
        with pytest.raises(RuntimeError, match="no progress"):
            await replica.check_health()
        pending.cancel()
    run(scenario())
