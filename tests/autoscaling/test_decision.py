"""decide() as tables of plain data: spread, pack, hysteresis, bounds, missing metrics."""

import dataclasses

import pytest

from autoscaling.decision import (
    PolicyConfig,
    ReplicaSignals,
    Signals,
    decide,
    fleet_acceptance,
    spread_equivalent_load,
    spread_pays,
)

CFG = PolicyConfig(batch_gate=4, gate_fill=1.0, target_ongoing_requests=8.0, min_acceptance_length=2.0,
                   acceptance_band=0.25, downscale_tolerance=0.2, min_reporting_fraction=0.5, max_scale_in=1.0)
HALF = dataclasses.replace(CFG, gate_fill=0.5)
HALVING = dataclasses.replace(CFG, max_scale_in=0.5)


def fleet(*acceptance):
    """Replicas reporting these acceptance lengths (None: not reported)."""
    return tuple(ReplicaSignals(batch_size=4.0, acceptance_length=a) for a in acceptance)


def sig(load, replicas, lo=1, hi=100, spreading=False):
    return Signals(total_requests=load, replicas=replicas, min_replicas=lo, max_replicas=hi, spreading=spreading)


# (name, signals, current replicas, config, expected)
CASES = [
    # spread: speculation pays, keep batches at or under the gate
    ("spread worked example", sig(18, fleet(3.1, 2.9, None)), 3, CFG, 5),
    ("spread exact fit", sig(16, fleet(3.0, 3.0)), 2, CFG, 4),
    ("spread partial fill", sig(16, fleet(3.0, 3.0)), 2, dataclasses.replace(CFG, gate_fill=0.5), 8),
    ("spread at threshold", sig(16, fleet(2.0, 2.0)), 2, CFG, 4),
    # pack: speculation does not pay, or throughput mode
    ("pack low acceptance", sig(18, fleet(1.5, 1.4, 1.6)), 3, CFG, 3),
    ("pack grows", sig(40, fleet(1.5, 1.5)), 2, CFG, 5),
    ("throughput mode always packs", sig(18, fleet(3.5, 3.5, 3.5)), 3,
     dataclasses.replace(CFG, mode="throughput"), 3),
    # hysteresis on the mode: already spreading, 1.9 is inside the band, keep spreading
    ("band keeps spreading", sig(16, fleet(1.9, 1.9), spreading=True), 4, CFG, 4),
    ("band does not start spreading", sig(16, fleet(1.9, 1.9), spreading=False), 2, CFG, 2),
    ("below band packs", sig(18, fleet(1.7, 1.7), spreading=True), 5, CFG, 3),
    # hysteresis on the count: shrink only while the load stays under 0.8 * target
    ("dead band holds", sig(13, fleet(3.0,) * 5), 5, CFG, 5),  # ceil(13/4)=4, ceil(13/3.2)=5
    ("dead band shrinks partly", sig(9, fleet(3.0,) * 5), 5, CFG, 3),  # ceil(9/4)=3, ceil(9/3.2)=3
    ("no load shrinks to min", sig(0, fleet(3.0,) * 5), 5, CFG, 1),
    ("growth is immediate", sig(21, fleet(3.0,) * 5), 5, CFG, 6),
    # a shrink removes at most max_scale_in of the running replicas: a dip is not a level
    ("a dip halves at most", sig(2, fleet(3.0,) * 10), 10, HALVING, 5),
    ("halving rounds up", sig(0, fleet(3.0,) * 5), 5, HALVING, 3),
    # a share that rounds to no replica still removes one: the ceil kept a small fleet whole
    ("a tenth of 6 is still one", sig(0, fleet(3.0,) * 6), 6, dataclasses.replace(CFG, max_scale_in=0.1), 5),
    ("a third of 2 is still one", sig(0, fleet(3.0,) * 2), 2, dataclasses.replace(CFG, max_scale_in=0.3), 1),
    ("a small shrink is not held back", sig(26, fleet(3.0,) * 10), 10, HALVING, 9),  # ceil(26/3.2)=9
    ("packing is not bounded (Serve's rule)", sig(2, fleet(1.5,) * 10), 10, HALVING, 1),
    # bounds
    ("max bound", sig(400, fleet(3.0, 3.0)), 2, CFG, 100),
    ("min bound", sig(1, fleet(3.0, 3.0)), 2, dataclasses.replace(CFG), 1),
    ("min bound above want", sig(1, fleet(3.0, 3.0), lo=3), 3, CFG, 3),
    ("max bound below want", sig(18, fleet(3.0, 3.0), hi=2), 2, CFG, 2),
    # missing metrics: Serve's queue-length rule ceil(load / target), never zeros
    ("no replica reports", sig(18, fleet(None, None, None)), 3, CFG, 3),
    ("zero acceptance is missing", sig(18, fleet(0.0, 0.0, 0.0)), 3, CFG, 3),
    ("too few report", sig(18, fleet(3.0, None, None)), 3, CFG, 3),
    ("queue-length grows", sig(40, fleet(None, None)), 2, CFG, 5),
    ("queue-length has no dead band", sig(13, fleet(None,) * 5), 5, CFG, 2),
    ("no replicas yet", sig(18, ()), 0, CFG, 3),
    # above the gate, batches count at speculating speed (gate_fill 0.5: 2 per replica): 2
    # replicas of 12 with the gate open half the time, acceptance 3: 24 - 2 * 12 * 0.5 *
    # (1 - 1/3) = 16 equivalent, ceil(16 / 2) = 8, not ceil(24 / 2) = 12
    ("half-closed gates count half",
     sig(24, (ReplicaSignals(batch_size=12, acceptance_length=3.0, speculating=0.5),) * 2), 2, HALF, 8),
    # gates closed all the time: 8 equivalent would want ceil(8 / 2) = 4 replicas, but the 24
    # requests there now need ceil(24 / 4) = 6 to get back under the gate and drain
    ("a backlog over the gate gets room to drain",
     sig(24, (ReplicaSignals(batch_size=12, acceptance_length=3.0, speculating=0.0),) * 2), 2, HALF, 6),
    ("packing counts raw load",
     sig(24, (ReplicaSignals(batch_size=12, acceptance_length=1.5, speculating=0.0),) * 2), 2, CFG, 3),
]


@pytest.mark.parametrize("name,signals,current,config,expected", CASES, ids=[c[0] for c in CASES])
def test_decide(name, signals, current, config, expected):
    assert decide(signals, current, config) == expected


def test_docstring_worked_example():
    cfg = PolicyConfig(batch_gate=4, gate_fill=1.0, target_ongoing_requests=8.0, min_acceptance_length=2.0,
                       acceptance_band=0.25, downscale_tolerance=0.1)
    assert decide(sig(18, fleet(3.1, 2.9, None)), 3, cfg) == 5
    assert decide(sig(15, fleet(3.0,) * 5, spreading=True), 5, cfg) == 5
    assert decide(sig(15, fleet(1.6,) * 5, spreading=True), 5, cfg) == 2


@pytest.mark.parametrize("acceptance,spreading,mode,expected", [
    ((3.0, 3.0), False, "latency", True),
    ((1.9,), True, "latency", True),
    ((1.9,), False, "latency", False),
    ((1.74,), True, "latency", False),
    ((3.0,), False, "throughput", False),
    ((None,), False, "latency", None),
])
def test_spread_pays(acceptance, spreading, mode, expected):
    signals = sig(10, fleet(*acceptance), spreading=spreading)
    assert spread_pays(signals, dataclasses.replace(CFG, mode=mode)) is expected


def test_fleet_acceptance_ignores_silent_replicas():
    assert fleet_acceptance(sig(0, fleet(3.0, 2.0, None)), CFG) == pytest.approx(2.5)
    assert fleet_acceptance(sig(0, fleet(3.0, None, None)), CFG) is None


def test_no_flapping_under_steady_load():
    """Feeding each decision back as the current count settles and stays put."""
    replicas, history = 1, []
    for _ in range(10):
        replicas = decide(sig(30, fleet(3.0,) * replicas, spreading=True), replicas, CFG)
        history.append(replicas)
    assert history[-5:] == [8] * 5


@pytest.mark.parametrize("kwargs,field", [
    ({"mode": "fast"}, "mode"),
    ({"batch_gate": 0}, "batch_gate"),
    ({"min_acceptance_length": 0.5}, "min_acceptance_length"),
    ({"acceptance_band": 3.0}, "acceptance_band"),
    ({"gate_fill": 0.0}, "gate_fill"),
    ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
    ({"downscale_tolerance": 1.0}, "downscale_tolerance"),
    ({"max_scale_in": 0.0}, "max_scale_in"),
    ({"max_scale_in": 1.5}, "max_scale_in"),
    ({"min_reporting_fraction": 0}, "min_reporting_fraction"),
    ({"metrics_stale_s": 0}, "metrics_stale_s"),
    ({"batch_gat": 4}, "policy_kwargs"),
    # YAML that quotes a number, or leaves it empty: named, not a TypeError from a comparison
    ({"batch_gate": "4"}, "batch_gate"),
    ({"min_acceptance_length": None}, "min_acceptance_length"),
    ({"gate_fill": "0.5"}, "gate_fill"),
    ({"metrics_stale_s": True}, "metrics_stale_s"),
])
def test_config_is_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyConfig.from_kwargs(kwargs)


def test_config_is_frozen_and_decide_needs_a_target():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.batch_gate = 8
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        decide(sig(1, ()), 1, PolicyConfig())


@pytest.mark.parametrize("replicas,load,expected", [
    ((), 10.0, 10.0),
    ((ReplicaSignals(batch_size=8, acceptance_length=2.0, speculating=0.0),), 10.0, 6.0),
    ((ReplicaSignals(batch_size=8, acceptance_length=2.0, speculating=1.0),), 10.0, 10.0),
    ((ReplicaSignals(batch_size=8, acceptance_length=2.0),), 10.0, 10.0),  # no speculating figure
    ((ReplicaSignals(batch_size=8, acceptance_length=None, speculating=0.0),), 10.0, 10.0),
    ((ReplicaSignals(batch_size=40, acceptance_length=4.0, speculating=0.0),), 10.0, 0.0),  # never negative
])
def test_spread_equivalent_load(replicas, load, expected):
    assert spread_equivalent_load(sig(load, replicas)) == pytest.approx(expected)


def gated(batch_gate, *acceptance):
    """Replicas reporting acceptance and the gate their engine applies (0: stats.NOT_GATED)."""
    return tuple(ReplicaSignals(batch_size=4.0, acceptance_length=a, speculating=1.0, batch_gate=batch_gate)
                 for a in acceptance)


@pytest.mark.parametrize("name,replicas,expected", [
    ("no replica gates: nothing to spread for", gated(0.0, 3.5, 3.5), False),
    ("one replica gates", gated(0.0, 3.5) + gated(4.0, 3.5), True),
    ("every replica gates", gated(4.0, 3.5, 3.5), True),
    ("gates not reported yet", fleet(3.5, 3.5), True),
])
def test_a_fleet_that_cannot_gate_is_packed(name, replicas, expected):
    assert spread_pays(sig(18, replicas), CFG) is expected
    assert decide(sig(18, replicas), 3, CFG) == (5 if expected else 3)  # ceil(18/4) spread, ceil(18/8) packed


def test_an_ungated_replicas_batch_is_not_counted_as_over_a_gate():
    closed = ReplicaSignals(batch_size=8.0, acceptance_length=3.0, speculating=0.0, batch_gate=0.0)
    assert spread_equivalent_load(sig(20, (closed,))) == 20.0  # speculation off, not a gate shut
    assert spread_equivalent_load(sig(20, (dataclasses.replace(closed, batch_gate=4.0),))) < 20.0
