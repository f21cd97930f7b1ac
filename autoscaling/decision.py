"""The acceptance-aware scaling decision: plain data in, a replica count out.

Standard library only (and the gate's pure rules): KubeRay's dashboard imports the policy on
a CPU-only head, and the simulator calls the same function on every control tick.

Why a custom rule: a replica's capacity is nonlinear in its batch. At or under the
speculation gate it drafts and verifies, emitting `acceptance_length` tokens per request per
step; above the gate it decodes one token per request per step. So while speculation pays,
keeping every replica's batch at or under the gate (spreading) buys a lower time per output
token at little or no cost in replicas; when it doesn't pay, packing replicas up to
`target_ongoing_requests` is the cheaper layout, as in Serve's default policy. Nor does it
pay where no replica's engine gates by batch size (they report `stats.NOT_GATED`: a
TensorRT-LLM mode that cannot stop drafting, or speculation off): there is no gate to keep
batches under, so such a fleet is packed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, Optional

from replicas.speculation.gate import gates_by_batch

Mode = Literal["latency", "throughput"]
MODES = ("latency", "throughput")


class PolicySettingError(ValueError):
    """A `policy_kwargs` value the policy refuses; `key` is "policy_kwargs" for unknown keys."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"autoscaling policy {key}: {message}")
        self.key, self.message = key, message


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise PolicySettingError(name, message)


@dataclass(frozen=True)
class PolicyConfig:
    """What `policy_kwargs` may set. Unknown keys are an error, not silently dropped.

    `min_acceptance_length` is the gain speculation must show before spreading pays: the
    measured tokens per verify step (bonus included) at which a replica at the gate emits
    at least as many tokens per second as a packed replica at `target_ongoing_requests`.
    `python -m autoscaling.simulate` prints this break-even figure for its step-time profiles.

    `gate_fill` leaves headroom under the gate: just above it a replica stops speculating
    and its tokens/s fall several-fold, so a burst that tips replicas over the gate while
    new ones start (Serve's upscale delay plus model load) costs far more than the spare
    batch slots. In the simulator, with the router's gate hold, half the gate absorbed
    1.3x bursts on a rising load for replicas that take a minute to start (the default);
    three quarters did for CPU replicas that start in 15 s (deploy.yaml's setting).

    `max_scale_in` bounds a shrink: Serve applies the newest decision once its downscale
    delay has passed, so without a bound a momentary dip in the load sets the fleet's size,
    and the load's return then tips the few replicas left over the gate.
    """

    mode: Mode = "latency"
    batch_gate: int = 4  # until the replicas report theirs (the Serve adapter reads it live)
    min_acceptance_length: float = 2.5  # spread while the fleet's acceptance is at least this
    acceptance_band: float = 0.25  # hysteresis: stop spreading only below min - band
    gate_fill: float = 0.5  # spread to gate_fill * batch_gate: headroom below the gate
    target_ongoing_requests: Optional[float] = None  # pack target; None: Serve's config value
    downscale_tolerance: float = 0.1  # shrink only if the smaller fleet stays under (1-tol)*target
    max_scale_in: float = 0.5  # one spreading decision removes at most this share of the replicas
    min_reporting_fraction: float = 0.5  # fewer replicas reporting acceptance: queue-length rule
    metrics_stale_s: float = 30.0  # a replica whose last report is older counts as silent

    def __post_init__(self) -> None:
        for f in fields(self):  # YAML's "4" or an empty value: named here, not a TypeError below
            value = getattr(self, f.name)
            if f.name != "mode" and not (value is None and f.default is None):
                _require(isinstance(value, (int, float)) and not isinstance(value, bool), f.name,
                         f"must be a number, got {value!r}")
        _require(self.mode in MODES, "mode", f"must be one of {MODES}, got {self.mode!r}")
        _require(self.batch_gate >= 1, "batch_gate", f"must be >= 1, got {self.batch_gate}")
        _require(self.min_acceptance_length >= 1.0, "min_acceptance_length",
                 f"must be >= 1 (a verify step emits at least one token), got {self.min_acceptance_length}")
        _require(0.0 <= self.acceptance_band < self.min_acceptance_length, "acceptance_band",
                 f"must be in [0, min_acceptance_length), got {self.acceptance_band}")
        _require(0.0 < self.gate_fill <= 1.0, "gate_fill", f"must be in (0, 1], got {self.gate_fill}")
        _require(self.target_ongoing_requests is None or self.target_ongoing_requests > 0,
                 "target_ongoing_requests", f"must be > 0, got {self.target_ongoing_requests}")
        _require(0.0 <= self.downscale_tolerance < 1.0, "downscale_tolerance",
                 f"must be in [0, 1), got {self.downscale_tolerance}")
        _require(0.0 < self.max_scale_in <= 1.0, "max_scale_in", f"must be in (0, 1], got {self.max_scale_in}")
        _require(0.0 < self.min_reporting_fraction <= 1.0, "min_reporting_fraction",
                 f"must be in (0, 1], got {self.min_reporting_fraction}")
        _require(self.metrics_stale_s > 0, "metrics_stale_s", f"must be > 0, got {self.metrics_stale_s}")

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "PolicyConfig":
        """Build from `policy_kwargs`, naming any key this policy does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        _require(not unknown, "policy_kwargs", f"unknown keys {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class ReplicaSignals:
    """One running replica's figures over Serve's look-back window; None = not reported."""

    batch_size: Optional[float] = None
    acceptance_length: Optional[float] = None  # 0.0 (no verify step yet) counts as missing
    speculating: Optional[float] = None  # fraction of the window with the gate open
    tokens_per_s: Optional[float] = None
    batch_gate: Optional[float] = None  # the gate its engine applies (stats.NOT_GATED: none)

    @property
    def gated(self) -> Optional[bool]:
        """Does its engine stop speculating above a batch size? None: not reported."""
        return None if self.batch_gate is None else gates_by_batch(round(self.batch_gate))

    @property
    def measured_acceptance(self) -> Optional[float]:
        a = self.acceptance_length
        return a if a is not None and a >= 1.0 else None


@dataclass(frozen=True)
class Signals:
    """Everything `decide` reads, as plain data (the Serve adapter and the simulator build it)."""

    total_requests: float  # Serve's ongoing requests (running + queued at handles)
    replicas: tuple[ReplicaSignals, ...] = ()  # one per running replica
    min_replicas: int = 1  # bounds in force (Serve's capacity-adjusted ones)
    max_replicas: int = 1
    spreading: bool = False  # the mode this policy chose last time (hysteresis)


def fleet_acceptance(signals: Signals, config: PolicyConfig) -> Optional[float]:
    """Mean measured acceptance length, or None when too few replicas report one."""
    measured = [a for r in signals.replicas if (a := r.measured_acceptance) is not None]
    needed = max(1, math.ceil(config.min_reporting_fraction * len(signals.replicas)))
    return sum(measured) / len(measured) if len(measured) >= needed else None


def fleet_gates(signals: Signals) -> bool:
    """False when replicas report their gate and none of them gates by batch size (spreading
    then keeps nothing under a gate); True otherwise, an unreported fleet included."""
    reported = [g for r in signals.replicas if (g := r.gated) is not None]
    return not reported or any(reported)


def spread_pays(signals: Signals, config: PolicyConfig) -> Optional[bool]:
    """True: spread to the gate; False: pack; None: metrics missing, use the queue-length rule."""
    if config.mode == "throughput" or not fleet_gates(signals):
        return False
    acceptance = fleet_acceptance(signals, config)
    if acceptance is None:
        return None
    threshold = config.min_acceptance_length - (config.acceptance_band if signals.spreading else 0.0)
    return acceptance >= threshold


def spread_equivalent_load(signals: Signals) -> float:
    """Ongoing requests, with what replicas above the gate hold counted at speculating speed.

    A replica that stopped speculating decodes its batch `acceptance_length` times slower,
    so by Little's law its requests stay (and count) that many times longer: load that
    appears only because the gate closed, not new demand. Counting that batch share at
    1/acceptance stops the policy from chasing its own overshoot (more replicas -> batches
    back under the gate -> the count collapses -> fewer replicas -> over the gate again).
    Replicas without all three figures count as they are, and so do replicas that do not
    gate by batch size (their `speculating` says nothing about a gate).
    """
    inflated = 0.0
    for r in signals.replicas:
        a = r.measured_acceptance
        if a is None or r.batch_size is None or r.speculating is None or r.gated is False:
            continue
        closed = min(1.0, max(0.0, 1.0 - r.speculating))
        inflated += r.batch_size * closed * (1.0 - 1.0 / a)
    return max(0.0, float(signals.total_requests) - inflated)


def decide(signals: Signals, current_replicas: int, config: PolicyConfig) -> int:
    """How many replicas the deployment should run.

    Rule (`config.target_ongoing_requests` must be resolved, see the Serve adapter):

    1. Spread (latency mode, fleet acceptance >= `min_acceptance_length`, or >= min -
       `acceptance_band` while already spreading): ceil(load / (gate_fill * batch_gate)),
       so each replica's batch stays at or under the gate and keeps speculating. The load
       is Serve's ongoing request count with the batches of replicas above the gate counted
       at speculating speed (`spread_equivalent_load`). Hysteresis: grow at once; shrink
       only as far as the fleet still carries the load under `(1 - downscale_tolerance)`
       of the per-replica target, and by at most `max_scale_in` of the running replicas
       at once (a dip in the load is not a new level). Floor: never fewer than
       ceil(ongoing / batch_gate) replicas, the raw count: a fleet tipped over the gate
       decodes several times slower, and without room to get back under it its backlog only
       grows (the simulator saw a 10-replica fleet shrink into that state and stay there).
    2. Pack (speculation not paying, throughput mode, or no replica gating by batch size:
       every reporting replica says NOT_GATED): Serve's default rule exactly,
       ceil(load / target_ongoing_requests), so where speculation does not pay this policy
       is the default, by construction.
    3. Missing metrics (fewer than `min_reporting_fraction` of replicas report an
       acceptance length: new replicas, silent ones): the same queue-length rule, never a
       decision on zeros.
    4. Clamp to [min_replicas, max_replicas]. Serve's upscale/downscale delays, scaling
       factors and bounds still apply on top (its wrapper around any custom policy).

    Worked example, batch_gate 4, gate_fill 1.0, target_ongoing_requests 8,
    min_acceptance_length 2.0, acceptance_band 0.25, downscale_tolerance 0.1: 3 replicas, 18 ongoing requests,
    acceptance lengths (3.1, 2.9, none yet). Two of three report (>= 0.5), mean 3.0 >= 2.0,
    so spread: ceil(18 / 4) = 5 replicas (Serve's default keeps ceil(18 / 8) = 3, batches of
    6 that never speculate). With 5 running and the load down to 15, ceil(15 / 4) = 4 is
    wanted, but 4 replicas would hold 3.75 each, above 0.9 x 4 = 3.6, so the fleet stays at
    ceil(15 / 3.6) = 5. A dip to 2 ongoing would want 1, but max_scale_in 0.5 keeps
    ceil(5 x 0.5) = 3. If acceptance then falls to 1.6 (under 2.0 - 0.25): pack,
    ceil(15 / 8) = 2.
    """
    target_ongoing = config.target_ongoing_requests
    _require(target_ongoing is not None, "target_ongoing_requests", "unresolved (None) in decide()")
    load = max(0.0, float(signals.total_requests))
    if spread_pays(signals, config):
        per_replica = config.gate_fill * config.batch_gate
        equivalent = spread_equivalent_load(signals)
        wanted = math.ceil(equivalent / per_replica)
        if wanted < current_replicas:
            keep = math.ceil(equivalent / (per_replica * (1.0 - config.downscale_tolerance)))
            # at least one less: under max_scale_in 0.5 the ceil kept a small fleet whole, never
            # scaling in even with no load (0.1 held 6 replicas at 6)
            bounded = min(current_replicas - 1, math.ceil(current_replicas * (1.0 - config.max_scale_in)))
            wanted = min(current_replicas, max(wanted, keep, bounded))
        # ... but never fewer than hold today's requests at the gate: a fleet tipped over it
        # decodes several times slower, so without room its backlog never drains
        wanted = max(wanted, math.ceil(load / config.batch_gate))
    else:  # packing, or metrics missing: exactly Serve's default rule
        wanted = math.ceil(load / target_ongoing)
    return max(signals.min_replicas, min(signals.max_replicas, wanted))
