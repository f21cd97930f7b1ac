"""The engine's measured draft rules (`speculation.draft_length`): what it has learnt while
serving, and the per-step decisions the core asks of it.

It keeps every request's SA acceptance and MTP yield beside the engine's own (the prior a
new request starts from; MTP's per mode, since hybrid asks the head only where the suffix
automaton cannot draft), and what a verify row and an ask of the head cost on this machine.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from replicas.speculation.draft_length import MtpYield, SaAcceptance, StepCosts, best_draft_len, draft_gain
from replicas.speculation.hybrid import MTP_MAX_BACKOFF, next_mtp_backoff

if TYPE_CHECKING:
    from replicas.torch_engine.mtp import MTPDrafter
    from replicas.torch_engine.sequence import Sequence

# Positions of context a request whose MTP asks do not pay keeps queued for its next probe.
MTP_PROBE_CONTEXT = 64
# Each probe that fails waits twice as long for the next, at most this many steps: on open
# chat the head is seldom sure enough to draft, and a probe (a catch-up on MTP_PROBE_CONTEXT
# positions) costs most of a plain step. An ask holds up the whole step, so in a batch of b
# the waits start b times longer.
MTP_MAX_PROBE_GAP = 128
# A request's first asks of the head go whatever the engine has seen: how much of the head's
# draft is accepted is the request's own (most of it on a copy-like edit, almost none on an
# open question), and its first ask after the prompt is often unsure (seen on every edit and
# chat prompt of the benchmark). In a batch they go only where an unmeasured head's would pay.
MTP_OWN_ASKS = 2


class DraftPolicy:
    """Draft lengths and MTP asks that pay, from the engine's own measurements."""

    def __init__(self, mtp: MTPDrafter | None) -> None:
        self.mtp = mtp
        self.sa_acceptance = SaAcceptance()
        self.mtp_yield: dict[str, MtpYield] = collections.defaultdict(MtpYield)
        self.costs = StepCosts()

    def sa_draft_len(self, seq: Sequence, limit: int, batch: int) -> int:
        """How much of an SA draft of up to `limit` tokens pays in a step of `batch` requests."""
        return best_draft_len(self._sa_rate(seq), self.costs.row(batch), limit, batch)

    def ask_mtp(self, seq: Sequence, mode: str, batch: int, fallback: int = 0) -> bool:
        """Ask the head for the request's draft this step, rather than draft `fallback` SA
        tokens (or none)? Once an ask does not pay, the request's queue is cut to its last
        MTP_PROBE_CONTEXT positions and it asks again only in a probe, to see whether it pays:
        MTP_MAX_BACKOFF x batch steps on, each probe that fails doubling the gap (from 2 x
        that), up to MTP_MAX_PROBE_GAP steps. Its first MTP_OWN_ASKS asks go all the same
        (in a batch, where an unmeasured head's would pay), on a queue cut as for a probe."""
        if self._mtp_pays(seq, mode, batch, fallback):
            return True
        if seq.mtp_backoff >= MTP_MAX_BACKOFF:  # a probe
            seq.mtp_probe_gap = min(MTP_MAX_PROBE_GAP, max(2 * seq.mtp_probe_gap, 2 * MTP_MAX_BACKOFF * batch))
            return True
        self.mtp.forget(seq.slot, keep=MTP_PROBE_CONTEXT)
        if seq.mtp_yield.made < MTP_OWN_ASKS and (batch == 1 or self._mtp_pays(seq, mode, batch, fallback, own=True)):
            return True
        seq.mtp_backoff = MTP_MAX_BACKOFF
        seq.mtp_skip = min(MTP_MAX_PROBE_GAP, MTP_MAX_BACKOFF * batch)
        return False

    def bound_mtp_queue(self, seq: Sequence, mode: str, batch: int) -> None:
        """For a request that does not ask the head this step (an SA draft, a backoff, the gate
        closed): keep a queue longer than twice MTP_PROBE_CONTEXT only while its asks would
        repay catching up on it, and then cut it to MTP_PROBE_CONTEXT (cutting it every step
        cost a batch of 8 behind a closed gate 5-8% of its speed). The queue holds 2.3 KB a
        position, a whole prompt at first."""
        if self.mtp.queued(seq.slot) > 2 * MTP_PROBE_CONTEXT and not self._mtp_pays(seq, mode, batch):
            self.mtp.forget(seq.slot, keep=MTP_PROBE_CONTEXT)

    def observe_emitted(self, seq: Sequence, emitted: list[int]) -> None:
        """The tokens a step emitted for `seq`, against the SA draft it held (drafted or not)."""
        for acceptance in (seq.sa_acceptance, self.sa_acceptance):
            acceptance.observe(seq.sa_match_len, seq.sa_draft, emitted)

    def mtp_outcome(self, seq: Sequence, mode: str, num_draft: int, num_accepted: int) -> None:
        """An ask of the head for `seq` drafted `num_draft` tokens (0: it was unsure), of
        which `num_accepted` were accepted."""
        seq.mtp_backoff = seq.mtp_skip = next_mtp_backoff(seq.mtp_backoff, num_accepted)
        if num_accepted:
            seq.mtp_probe_gap = 0
        elif seq.mtp_probe_gap:  # probing: the next probe waits the gap
            seq.mtp_skip = seq.mtp_probe_gap
        for mtp_yield in (seq.mtp_yield, self.mtp_yield[mode]):
            mtp_yield.add(num_draft, num_accepted)

    def mtp_accepted_per_ask(self) -> float:
        """Draft tokens accepted per ask of the head, over every mode's asks (decayed)."""
        yields = list(self.mtp_yield.values())  # stats() asks from the event loop's thread, as steps add modes
        asks = sum(y.asks for y in yields)
        return sum(y.accepted for y in yields) / asks if asks else 0.0

    def _sa_rate(self, seq: Sequence) -> float:
        return seq.sa_acceptance.rate(seq.sa_match_len, self.sa_acceptance)

    def _mtp_pays(self, seq: Sequence, mode: str, batch: int, fallback: int = 0, own: bool = False) -> bool:
        """`own`: from the request's yield alone, leaning on an unmeasured head's, not the engine's."""
        costs = self.costs
        alternative = draft_gain(self._sa_rate(seq), costs.row(batch), fallback, batch)
        return seq.mtp_yield.pays(costs.row(batch), costs.ask(batch), costs.catch_up(batch, self.mtp.queued(seq.slot)),
                                  seq.tokens_left, None if own else self.mtp_yield[mode], batch, max(0.0, alternative))
