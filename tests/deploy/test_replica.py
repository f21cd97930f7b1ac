"""The Replica class on its own (no Serve): reconfigure, stats, rejections, health checks."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import yaml

from replicas.engine import GenerationRequest, RequestRejected, SamplingParams, SpeculationConfig
from replicas.replica import LastSettings, Replica
from replicas.stats import NOT_GATED, EngineStats
from tests.deploy.fakes import FakeEngine
from tests.polling import async_wait_until


async def make_replica(user_config=None, engine_cls=FakeEngine) -> Replica:
    """A replica as Serve starts one: constructed, then its first `reconfigure`."""
    replica = Replica(engine_cls, metrics=False)
    await replica.reconfigure(user_config or {})
    return replica


class StagingEngine(FakeEngine):
    """Fixes its settings at build and only stages changes, like TensorRT-LLM."""

    def configure(self, speculation: SpeculationConfig) -> None:
        self.staged = speculation


def run(coro):
    return asyncio.run(coro)


def test_the_first_reconfigure_builds_the_engine_with_user_config():
    async def scenario():
        replica = Replica(FakeEngine, metrics=False)
        with pytest.raises(RuntimeError, match="no user_config"):
            await replica.check_health()
        await replica.reconfigure({"batch_gate": 2})
        assert replica.engine.started and replica.engine.speculation == SpeculationConfig(batch_gate=2)
        await replica.check_health()
    run(scenario())


def test_reconfigure_changes_the_engine_and_the_stats():
    async def scenario():
        replica = await make_replica({"batch_gate": 2})
        engine = replica.engine
        await replica.reconfigure({"batch_gate": 6, "mode": "sa"})
        stats = await replica.stats()
        assert replica.engine is engine  # reconfigured in place, not rebuilt
        assert stats["batch_gate"] == 6 and engine.speculation.mode == "sa"
        assert {"batch_size", "waiting", "speculating", "acceptance_length", "step_ms", "tokens_per_s"} <= set(stats)
        assert await replica.record_routing_stats() == await replica.record_autoscaling_stats() == stats
    run(scenario())


def test_a_refused_first_user_config_fails_the_start_naming_the_key():
    async def scenario():
        replica = Replica(FakeEngine, metrics=False)
        with pytest.raises(ValueError, match=r"user_config\.batch_gate"):
            await replica.reconfigure({"batch_gate": -1})
        with pytest.raises(RuntimeError, match="no user_config"):
            replica.engine
    run(scenario())


class KeptSettings(LastSettings):
    """LastSettings in this process (a Serve replica keeps them in Ray's internal KV store)."""

    def on_stop(self) -> None:  # nothing for a stop to forget
        return None

    def __init__(self) -> None:
        self.kept = None

    def get(self):
        return self.kept

    def put(self, user_config) -> None:
        self.kept = user_config


def test_a_replica_starting_while_a_refused_user_config_is_deployed_takes_the_last_settings_taken():
    """A restart or a scale-out while a refused user_config is deployed: the new replica starts
    with what its deployment's replicas last took (it failed to start until a good deploy: with
    one replica, an outage); with none taken yet, the start still fails naming the key."""
    async def scenario():
        kept = KeptSettings()
        with pytest.raises(ValueError, match=r"user_config\.batch_gate"):
            await Replica(FakeEngine, metrics=False, last_settings=kept).reconfigure({"batch_gate": -1})
        first = Replica(FakeEngine, metrics=False, last_settings=kept)
        await first.reconfigure({"batch_gate": 2})
        await first.reconfigure({"batch_gate": 6, "mode": "sa"})  # taken live
        await first.reconfigure({"batch_gate": -1})  # refused: 6 and sa stay
        restarted = Replica(FakeEngine, metrics=False, last_settings=kept)
        await restarted.reconfigure({"batch_gate": -1})
        stats = await restarted.stats()
        assert stats["batch_gate"] == 6 and stats["user_config_refused"] == 1
        assert restarted.engine.speculation.mode == "sa"
        await restarted.check_health()
        await restarted.reconfigure({"batch_gate": 3})
        assert (await restarted.stats())["user_config_refused"] == 0 and kept.kept == {"batch_gate": 3}
        # settings an engine refuses as it is built (as TensorRT-LLM's), and an engine that
        # failed to start, are never kept as taken
        with pytest.raises(ValueError, match=r"user_config\.mode"):
            await Replica(RefusingEngine, metrics=False, last_settings=KeptSettings()).reconfigure({"mode": "mtp"})
        refusing = Replica(RefusingEngine, metrics=False, last_settings=kept)
        await refusing.reconfigure({"mode": "mtp", "batch_gate": 5})
        assert refusing.engine.speculation == SpeculationConfig(batch_gate=3)
        assert (await refusing.stats())["user_config_refused"] == 1 and kept.kept == {"batch_gate": 3}
        with pytest.raises(RuntimeError, match="not started"):
            await Replica(NotStartingEngine, metrics=False, last_settings=kept).reconfigure({"batch_gate": 7})
        assert kept.kept == {"batch_gate": 3}
    run(scenario())


class NotStartingEngine(FakeEngine):
    async def start(self) -> None:
        raise RuntimeError("not started: no device")


class RefusingEngine(FakeEngine):
    """Refuses settings it cannot run, built or live, as TensorRT-LLM refuses EAGLE-3 without a
    draft model."""

    def __init__(self, speculation: SpeculationConfig) -> None:
        self.configure(speculation)
        super().__init__(speculation)

    def configure(self, speculation: SpeculationConfig) -> None:
        if speculation.mode == "mtp":
            raise ValueError("user_config.mode: this engine has no MTP head")
        super().configure(speculation)


@pytest.mark.parametrize("refused", [{"batch_gate": -1}, {"no_such_key": 1}, {"mode": "mtp"}])
def test_a_refused_live_user_config_keeps_the_settings_in_force(refused, caplog):
    async def scenario():
        replica = await make_replica({"batch_gate": 2}, engine_cls=RefusingEngine)
        engine = replica.engine
        assert (await replica.stats())["user_config_refused"] == 0
        await replica.reconfigure(refused)  # no raise: Serve would stop the replica for it
        stats = await replica.stats()
        assert replica.engine is engine and engine.speculation == SpeculationConfig(batch_gate=2)
        assert stats["user_config_refused"] == 1 and stats["batch_gate"] == 2
        assert any(r.levelname == "ERROR" and "user_config refused" in r.getMessage() and "user_config." in r.getMessage()
                   for r in caplog.records), caplog.text
        await replica.check_health()
        await replica.reconfigure({"batch_gate": 6})  # a good one clears the flag
        stats = await replica.stats()
        assert stats["user_config_refused"] == 0 and stats["batch_gate"] == 6
    run(scenario())


def test_autoscaling_stats_are_empty_until_the_engine_is_built():
    async def scenario():
        replica = Replica(FakeEngine, metrics=False)
        assert await replica.record_autoscaling_stats() == {}  # Serve asks before reconfigure
        await replica.reconfigure({})
        assert await replica.record_autoscaling_stats() == await replica.stats()
    run(scenario())


def test_stats_report_the_settings_the_engine_runs_with():
    async def scenario():
        replica = await make_replica({"batch_gate": 2}, engine_cls=StagingEngine)
        await replica.reconfigure({"batch_gate": 6})
        assert replica.engine.staged.batch_gate == 6
        assert (await replica.stats())["batch_gate"] == 2  # staged, not applied: the router sees 2
    run(scenario())


class UngatedEngine(FakeEngine):
    """Configured with a gate its engine cannot apply (a TensorRT-LLM mode that keeps drafting)."""

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), batch_gate=NOT_GATED, speculating=1)


def test_the_reported_gate_is_the_engines_not_the_setting():
    async def scenario():
        replica = await make_replica({"batch_gate": 4}, engine_cls=UngatedEngine)
        assert replica.engine.speculation.batch_gate == 4
        stats = await replica.stats()
        assert stats["batch_gate"] == NOT_GATED and stats["speculating"] == 1
    run(scenario())


@pytest.mark.parametrize("user_config,field", [
    ({"batch_gates": 2}, "user_config.batch_gates"), ({"mode": "turbo"}, "user_config.mode"),
    ({"max_draft_len": 0}, "user_config.max_draft_len"), ([2], "user_config"),
    ({"max_draft_len": "8"}, "user_config.max_draft_len"), ({"grammar_drafts": "yes"}, "user_config.grammar_drafts"),
])
def test_bad_user_config_names_the_field(user_config, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        run(make_replica(user_config))


def test_a_bare_yaml_off_is_mode_off():
    # YAML 1.1 reads `mode: off` as false: the setting it means, not a refused user_config
    assert SpeculationConfig.from_user_config(yaml.safe_load("mode: off")).mode == "off"
    with pytest.raises(ValueError, match="^user_config.mode"):
        SpeculationConfig.from_user_config(yaml.safe_load("mode: on"))


def test_engine_validation_becomes_a_rejection_and_speculate_false_marks_it_over_the_gate():
    async def scenario():
        replica = await make_replica()
        too_long = GenerationRequest("r1", [1] * 250, SamplingParams(max_tokens=20))
        items = [item async for item in replica.generate(too_long)]
        assert items == [RequestRejected(items[0].message, "max_tokens")]

        seen = []
        original = replica.engine.generate
        replica.engine.generate = lambda request: seen.append(request) or original(request)
        deltas = [d async for d in replica.generate(GenerationRequest("r2", "hi", SamplingParams(max_tokens=3)),
                                                    speculate=False)]
        assert seen[0].over_gate and seen[0].speculation.mode == "auto" and deltas[-1].finish_reason == "length"
    run(scenario())


def test_a_request_or_a_tokenizer_for_another_model_is_refused():
    """What the Ingress of a deploy that changes the model meets in a Replica still serving the
    model before (tests/deploy/test_replica_loss.py has it under Serve)."""
    async def scenario():
        replica = Replica(FakeEngine, metrics=False, model_identity="/m/a")
        await replica.reconfigure({})
        other = GenerationRequest("r1", "hi", SamplingParams(max_tokens=2), model_identity="/m/b")
        (refused,) = [item async for item in replica.generate(other)]
        assert isinstance(refused, RequestRejected) and refused.another_model and "'/m/b'" in refused.message
        assert await replica.tokenizer("/m/b") is None
        assert await replica.tokenizer("/m/a") is replica.engine.tokenizer is await replica.tokenizer()
        assert (await replica.record_routing_stats())["model_identity"] == "/m/a"  # what the routers read
        for identity in ("/m/a", None):  # its own, or a request that names none
            own = GenerationRequest("r2", "hi", SamplingParams(max_tokens=2), model_identity=identity)
            assert [d async for d in replica.generate(own)][-1].finish_reason == "length"
    run(scenario())


def test_closing_the_stream_aborts_the_request():
    async def scenario():
        replica = await make_replica()
        stream = replica.generate(GenerationRequest("r3", "SLOW", SamplingParams(max_tokens=50)))
        await stream.__anext__()
        assert replica.engine.num_live_requests == 1
        await stream.aclose()
        assert replica.engine.num_live_requests == 0
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


class ProbedEngine(FakeEngine):
    def __init__(self, speculation: SpeculationConfig) -> None:
        super().__init__(speculation)
        self.probes: list[GenerationRequest] = []

    def generate(self, request):
        self.probes.append(request)
        return super().generate(request)


def test_health_check_probes_an_idle_engine():
    async def scenario():
        probed = await make_replica(engine_cls=ProbedEngine)
        await probed.check_health()
        [probe] = probed.engine.probes
        assert probe.probe and probe.sampling.max_tokens == 1  # left out of the engine's figures
        broken = await make_replica(engine_cls=BrokenEngine)
        with pytest.raises(RuntimeError, match="health probe failed"):
            await broken.check_health()
    run(scenario())


class PrefillingEngine(StuckEngine):
    """Runs steps (a long prompt going in, chunk by chunk) and has no token out yet."""

    steps = 0

    def stats(self) -> EngineStats:
        self.steps += 1
        return dataclasses.replace(super().stats(), steps=self.steps)


@pytest.mark.parametrize("engine_cls,healthy", [(StuckEngine, False), (PrefillingEngine, True)])
def test_health_check_fails_when_live_requests_stop_progressing(engine_cls, healthy):
    async def scenario():
        replica = await make_replica(engine_cls=engine_cls)
        stream = replica.generate(GenerationRequest("r4", "hi", SamplingParams(max_tokens=5)))
        pending = asyncio.ensure_future(stream.__anext__())
        assert await async_wait_until(lambda: replica.engine.num_live_requests == 1, 10)
        await replica.check_health()  # two checks without a token or a step: still healthy
        await replica.check_health()
        if healthy:
            await replica.check_health()
        else:
            with pytest.raises(RuntimeError, match="no progress"):
                await replica.check_health()
        pending.cancel()
    run(scenario())
