"""Whether a draft pays, and how long: live acceptance against the live cost of verifying.

A draft of k tokens makes the step verify k more rows. With each drafted token accepted with
probability a (given the ones before it were), the step emits 1 + a + a^2 + ... + a^k tokens
on average; each extra row costs `row_cost` of a plain step. `best_draft_len` picks the k that
emits the most tokens per unit of step time, and 0 where no draft beats a plain step: on
open chat, where the suffix automaton's short matches are mostly coincidence, drafts of 4-5
tokens verified at 1.8x a plain step (a 2-core Xeon) made speculation slower than none.
An MTP draft costs its head's run besides: `MtpYield.pays` weighs the tokens an ask of the
head has saved against its verify rows, its own time and the SA draft it would replace
(`draft_gain`), all in tokens of the whole step, and the asks a request has left against
catching the head up on the positions queued since its last ask.

All of it is measured while serving, so the rules fit the machine and the workload:

- `SaAcceptance`: the SA's acceptance per match length, counted on every step whether or not
  its draft went. The tokens a step emits do not depend on what was drafted (exact
  verification), so comparing them with the draft the SA held shows what that draft would
  have had accepted: the rule keeps learning on steps where it chose not to draft.
- `MtpYield`: per ask of the MTP head, the tokens it drafted and had accepted.
- `StepCosts`: step time against verify rows per batch size (a line fitted over the recent
  steps, drafting or not), and an MTP ask's time (its own, and per position it catches up
  on), each as a fraction of a plain step.

Standard library only, like the other speculation rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Match-length buckets: acceptance climbs steeply with the match (a 2-token match is often
# coincidence, a 16-token one is a copy), so each bucket keeps its own count.
_BUCKET_STARTS = (1, 3, 5, 9, 17)
# Their names where they are exported: "1-2", "3-4", "5-8", "9-16", "17+".
MATCH_LEN_BUCKETS = (*(f"{a}-{b - 1}" for a, b in zip(_BUCKET_STARTS, _BUCKET_STARTS[1:])), f"{_BUCKET_STARTS[-1]}+")
# Counts decay by this much per observation: about the last 30 tokens of evidence decide.
_DECAY = 0.97
# A request's own counts are blended with the engine's as if the engine's rate were this
# many observations (tokens for the SA, asks for MTP, of which a request makes far fewer);
# the engine's start from PRIOR_RATE worth as many.
_PRIOR_WEIGHT = 4.0
_MTP_PRIOR_WEIGHT = 2.0
PRIOR_RATE = 0.5
# Until measured, a verify row costs this fraction of a plain step (2 threads, 1,024 tokens:
# about 0.11 on a Xeon with AMX, 0.23 on its AVX2 path).
DEFAULT_ROW_COST = 0.15
# Until measured, an ask of the MTP head costs this fraction of a plain step (2 Zen 4 cores:
# about a fifth; a 2-core Xeon: about a third).
DEFAULT_ASK_COST = 0.2
# Until measured, a queued position the head catches up on costs this fraction of a plain
# step (a packed run of its one layer: a 60th to a 100th on a 2-core Xeon).
DEFAULT_POSITION_COST = 0.01
# Positions per request an ask may find queued and still time an ask's own cost (a step or
# two of accepted tokens).
STEADY_QUEUE = 8
# Ask times are smoothed over about this many asks of each kind.
_TIME_SMOOTHING = 0.1
# Step times weigh this much less per later step of the same batch size (about the last 20).
_FIT_DECAY = 0.95
# A fitted line's slope stands only where the steps' extra rows spread this much (variance,
# rows squared): steps that all draft alike say what a step costs, not what a row adds.
_MIN_ROW_SPREAD = 0.25


def _bucket(match_len: int) -> int:
    return sum(match_len >= start for start in _BUCKET_STARTS) - 1


def best_draft_len(rate: float, row_cost: float, limit: int, batch: int = 1) -> int:
    """The draft length in [0, limit] that emits the most tokens per unit of step time.

    `rate`: probability that a drafted token is accepted, the ones before it having been.
    `row_cost`: an extra verify row's time as a fraction of a plain step of `batch` requests
    (each emitting one token). With `row_cost` 0 every row is free: the whole `limit` goes.
    """
    if limit <= 0:
        return 0
    if row_cost <= 0.0:
        return limit
    best, best_k, expected, term = float(batch), 0, float(batch), 1.0
    for k in range(1, limit + 1):
        term *= rate
        expected += term
        value = expected / (1.0 + row_cost * k)
        if value > best:
            best, best_k = value, k
    return best_k


@dataclass
class _Rate:
    """Decayed counts of accepted tokens and rejections (a geometric run's estimate)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: int, rejected: bool) -> None:
        decay = _DECAY ** (accepted + rejected)  # once per token judged
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + rejected

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)


@dataclass
class SaAcceptance:
    """The SA's acceptance rate by match length, for one request or a whole engine."""

    buckets: list[_Rate] = field(default_factory=lambda: [_Rate() for _ in _BUCKET_STARTS])

    def observe(self, match_len: int, draft: list[int], emitted: list[int]) -> None:
        """What `draft` (the SA's, held at `match_len`) would have had accepted against the
        tokens the step `emitted`: the common prefix, then a rejection if they part within
        the emitted tokens (past them nothing is known)."""
        if match_len <= 0 or not draft:
            return
        span = min(len(draft), len(emitted))
        accepted = 0
        while accepted < span and draft[accepted] == emitted[accepted]:
            accepted += 1
        self.buckets[_bucket(match_len)].add(accepted, accepted < span)

    def rate(self, match_len: int, prior: SaAcceptance | None = None) -> float:
        """This one's rate at `match_len`, leaning on `prior`'s (else PRIOR_RATE) while its own
        counts are few."""
        b = _bucket(max(1, match_len))
        base = prior.rate(match_len) if prior is not None else PRIOR_RATE
        return self.buckets[b].rate(base, _PRIOR_WEIGHT)

    def rates(self) -> dict[str, float]:
        """The rate in each match-length bucket (MATCH_LEN_BUCKETS), as `rate` gives it."""
        return {label: self.rate(start) for label, start in zip(MATCH_LEN_BUCKETS, _BUCKET_STARTS)}


@dataclass
class MtpYield:
    """Per ask of the MTP head (decayed): the asks it was sure enough to draft for, the tokens
    it drafted and had accepted (an unsure head drafts none); `made` counts the asks, undecayed."""

    asks: float = 0.0
    sure: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0
    made: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.made += 1
        self.asks = self.asks * _DECAY + 1.0
        self.sure = self.sure * _DECAY + (drafted > 0)
        self.drafted = self.drafted * _DECAY + drafted
        self.accepted = self.accepted * _DECAY + accepted

    def pays(self, row_cost: float, ask_cost: float, catch_up: float, tokens_left: int,
             prior: MtpYield | None = None, batch: int = 1, alternative: float = 0.0) -> bool:
        """Does asking the head pay, in tokens of the step's throughput (a plain step of `batch`
        requests emits `batch` tokens, so time costs `batch` tokens a plain step): do an ask's
        accepted tokens outweigh its verify rows and its own run, and `alternative` besides,
        the tokens the step gains without asking (an SA fallback, `draft_gain`), which a sure
        ask forgoes (an unsure one falls back to it); and do the asks the request has left (one
        a step, each step emitting 1 + accepted tokens) repay `catch_up`, the plain steps of
        running the head over the positions queued since the last ask? The counts lean on
        `prior`'s (else PRIOR_RATE accepted of one drafted token) while they are few."""
        if prior is not None and prior.asks > 0:
            sure_prior, drafted_prior, accepted_prior = (prior.sure / prior.asks, prior.drafted / prior.asks,
                                                         prior.accepted / prior.asks)
        else:
            sure_prior, drafted_prior, accepted_prior = 1.0, 1.0, PRIOR_RATE
        asks = self.asks + _MTP_PRIOR_WEIGHT
        sure = (self.sure + sure_prior * _MTP_PRIOR_WEIGHT) / asks
        drafted = (self.drafted + drafted_prior * _MTP_PRIOR_WEIGHT) / asks
        accepted = (self.accepted + accepted_prior * _MTP_PRIOR_WEIGHT) / asks
        saved = accepted - batch * (row_cost * drafted + ask_cost) - sure * alternative
        return saved > 0.0 and saved * tokens_left / (1.0 + accepted) >= batch * catch_up


def draft_gain(rate: float, row_cost: float, k: int, batch: int = 1) -> float:
    """Tokens of throughput a k-token draft gains a step of `batch` requests: its expected
    accepted tokens (rate + rate^2 + ... + rate^k) less its k rows' time."""
    accepted, term = 0.0, 1.0
    for _ in range(k):
        term *= rate
        accepted += term
    return accepted - batch * row_cost * k


@dataclass
class _StepLine:
    """Step time against a step's extra verify rows, by decayed least squares."""

    weight: float = 0.0
    rows: float = 0.0
    time: float = 0.0
    rows_sq: float = 0.0
    rows_time: float = 0.0

    def add(self, extra_rows: int, seconds: float) -> None:
        d = _FIT_DECAY
        self.weight = self.weight * d + 1.0
        self.rows = self.rows * d + extra_rows
        self.time = self.time * d + seconds
        self.rows_sq = self.rows_sq * d + extra_rows * extra_rows
        self.rows_time = self.rows_time * d + extra_rows * seconds

    def slope(self) -> float | None:
        """Seconds a row adds, or None where the rows do not spread enough to tell."""
        spread = self.weight * self.rows_sq - self.rows * self.rows
        if spread <= _MIN_ROW_SPREAD * self.weight * self.weight:
            return None
        return (self.weight * self.rows_time - self.rows * self.time) / spread

    def plain(self, row_cost: float) -> float:
        """A plain step's seconds, each extra row costing `row_cost` of it."""
        return self.time / (self.weight + row_cost * self.rows)


class StepCosts:
    """What verifying and drafting cost, as fractions of a plain step, from the engine's own times.

    Per batch size, a line through the recent steps' times against their extra verify rows (one
    row per request is a plain step) gives a plain step's time and a row's: drafting steps count
    too, so the line follows the machine and the context as they change even where nearly every
    step drafts (a plain step's time kept apart went stale there, and a row then read as free).
    Where the rows have not spread enough to fit a slope, the last row cost measured stands,
    except that plain steps move one above the prior back toward it. A batch size not yet
    measured takes as its prior the seconds a row adds at the nearest batch size measured, over
    its own plain step: its drafts must go to be timed, and at DEFAULT_ROW_COST no draft pays in
    a batch of 7 or more, though a GPU verifies a row for a hundredth of a step (its batch of 8
    drafted only as it shrank, half of what it could). An ask of the MTP head runs it over every
    position queued since the request's last ask, then drafts: asks that found few positions
    queued (at most STEADY_QUEUE per request) time an ask's own cost per request, the others
    what a queued position adds. Until measured (a row's, at any batch size), the DEFAULT_
    costs stand.
    """

    def __init__(self) -> None:
        self._lines: dict[int, _StepLine] = {}
        self._per_row: dict[int, float] = {}
        self._row_seconds: dict[int, float] = {}  # a fitted line's slope
        self._ask: dict[int, float] = {}
        self._per_position: dict[int, float] = {}

    def observe_step(self, batch: int, rows: int, seconds: float) -> None:
        if batch <= 0 or rows < batch or seconds <= 0.0:
            return
        line = self._lines.setdefault(batch, _StepLine())
        line.add(rows - batch, seconds)
        slope = line.slope()
        if slope is not None:
            plain = (line.time - slope * line.rows) / line.weight  # the line at no extra row
            if plain > 0.0:
                self._row_seconds[batch] = max(0.0, slope)
                self._per_row[batch] = self._row_seconds[batch] / plain
        elif rows == batch and self.row(batch) > (prior := self._prior_row(batch)):
            # A row cost read too high (drafting steps timed while the machine was busy) stops
            # the drafts that would time it again, and once the plain steps alone are left no
            # slope can be fitted: each such step moves it back toward the prior, until drafts
            # go again and are timed.
            self._per_row[batch] = prior + (self.row(batch) - prior) * _FIT_DECAY

    def observe_ask(self, batch: int, asked: int, queued: int, seconds: float) -> None:
        """An MTP ask for `asked` of the step's `batch` requests, with `queued` positions
        queued among them, took `seconds`."""
        plain = self._plain(batch)
        if asked <= 0 or plain is None:
            return
        steps = seconds / plain
        if queued <= STEADY_QUEUE * asked:
            self._ask[batch] = _smooth(self._ask.get(batch), steps / asked)
        else:
            sample = max(0.0, steps - asked * self.ask(batch)) / queued
            self._per_position[batch] = _smooth(self._per_position.get(batch), sample)

    def row(self, batch: int) -> float:
        measured = self._per_row.get(batch)
        return self._prior_row(batch) if measured is None else measured

    def _prior_row(self, batch: int) -> float:
        """The seconds a row adds at the nearest other batch size measured, over this one's
        plain step (its steps' line at that slope; that batch size's own fraction before this
        one has stepped), else DEFAULT_ROW_COST."""
        # list(): stats() reads costs from the event loop's thread while steps add batch sizes
        others = [b for b in list(self._row_seconds) if b != batch]
        if not others:
            return DEFAULT_ROW_COST
        near = min(others, key=lambda b: (abs(b - batch), b))
        seconds, line = self._row_seconds[near], self._lines.get(batch)
        plain = 0.0 if line is None else (line.time - seconds * line.rows) / line.weight
        return seconds / plain if plain > 0.0 else self._per_row.get(near, DEFAULT_ROW_COST)

    def ask(self, batch: int) -> float:
        """An ask for one request of a step of `batch`, its catching up aside."""
        return self._ask.get(batch, DEFAULT_ASK_COST)

    def catch_up(self, batch: int, queued: int) -> float:
        """Running the head over `queued` positions, in a step of `batch`."""
        return queued * self._per_position.get(batch, DEFAULT_POSITION_COST)

    def _plain(self, batch: int) -> float | None:
        line = self._lines.get(batch)
        return None if line is None else line.plain(self.row(batch))


def _smooth(old: float | None, sample: float) -> float:
    return sample if old is None else old + _TIME_SMOOTHING * (sample - old)
