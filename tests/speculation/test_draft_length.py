"""The measured draft rules: the length that pays, acceptance counted on every step, costs."""

from __future__ import annotations

import pytest

from replicas.speculation.draft_length import (DEFAULT_ASK_COST, DEFAULT_POSITION_COST, DEFAULT_ROW_COST,
                                               MATCH_LEN_BUCKETS, PRIOR_RATE, MtpYield, SaAcceptance, StepCosts,
                                               best_draft_len, draft_gain)
from replicas.torch_engine.draft_policy import DraftPolicy


def tokens_per_step_time(rate: float, row_cost: float, k: int, batch: int) -> float:
    """The model best_draft_len optimises, written out: the batch's tokens (this request's draft
    accepted token by token with probability `rate`) over the step's relative time."""
    return (batch + sum(rate ** i for i in range(1, k + 1))) / (1.0 + row_cost * k)


@pytest.mark.parametrize("rate", [0.05, 0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("row_cost", [0.05, 0.15, 0.4])
@pytest.mark.parametrize("batch", [1, 3])
def test_best_draft_len_is_the_most_tokens_per_unit_of_time(rate, row_cost, batch):
    k = best_draft_len(rate, row_cost, 16, batch)
    values = [tokens_per_step_time(rate, row_cost, j, batch) for j in range(17)]
    assert values[k] == pytest.approx(max(values))
    assert 0 <= k <= 16


def test_best_draft_len_drafts_nothing_that_cannot_pay_and_everything_that_is_free():
    assert best_draft_len(0.0, 0.1, 16) == 0
    assert best_draft_len(0.2, 0.3, 16) == 0  # a row costs more than the token it may save
    assert best_draft_len(0.0, 0.0, 16) == 16  # rows are free: the rules' whole draft
    assert best_draft_len(0.9, 0.1, 0) == 0


def test_best_draft_len_grows_with_acceptance_and_shrinks_with_cost_and_batch():
    by_rate = [best_draft_len(r / 20, 0.15, 16) for r in range(21)]
    assert by_rate == sorted(by_rate) and by_rate[0] == 0 and by_rate[-1] == 16
    by_cost = [best_draft_len(0.8, c / 20, 16) for c in range(1, 21)]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[0] > by_cost[-1]
    # the same row buys one request's tokens at batch 1, a quarter of four requests' at batch 4
    assert best_draft_len(0.3, 0.15, 16, batch=1) > 0 == best_draft_len(0.3, 0.15, 16, batch=4)


def test_sa_acceptance_counts_what_the_draft_would_have_had_accepted():
    acc = SaAcceptance()
    assert acc.rate(6) == PRIOR_RATE  # nothing seen: the prior
    for _ in range(30):
        acc.observe(6, [1, 2, 3, 4], [1, 2, 3, 4, 5][:2])  # a plain step emits 1, a verify more
    assert acc.rate(6) > 0.9
    for _ in range(30):
        acc.observe(6, [1, 2, 3, 4], [1, 7])  # parts at the second token
    parting = acc.rate(6)
    assert 0.3 < parting < 0.7
    for _ in range(60):
        acc.observe(6, [1, 2, 3, 4], [9])
    assert acc.rate(6) < min(0.2, parting)  # recent evidence outweighs the old


def test_sa_acceptance_keeps_match_lengths_apart_and_ignores_steps_without_a_draft():
    acc = SaAcceptance()
    for _ in range(40):
        acc.observe(2, [5, 6], [8])  # coincidental short matches
        acc.observe(20, [5, 6, 7], [5, 6, 7])  # a copy
        acc.observe(0, [5], [8])  # no match: no draft to judge
        acc.observe(8, [], [8])
    assert acc.rate(2) < 0.1 < 0.9 < acc.rate(20)
    assert acc.rate(8) == PRIOR_RATE


def test_the_exported_rates_name_each_match_length_bucket():
    acceptance = SaAcceptance()
    for _ in range(20):
        acceptance.observe(20, [1, 2, 3, 4], [1, 2, 3, 9])  # at a 20-token match: 3 accepted, then parted
    rates = acceptance.rates()
    assert tuple(rates) == MATCH_LEN_BUCKETS == ("1-2", "3-4", "5-8", "9-16", "17+")
    assert rates["17+"] == acceptance.rate(17) == acceptance.rate(40) > PRIOR_RATE
    assert rates["1-2"] == rates["9-16"] == PRIOR_RATE  # nothing seen there


def test_the_exported_mtp_yield_weighs_every_modes_asks():
    policy = DraftPolicy(mtp=None)
    assert policy.mtp_accepted_per_ask() == 0.0
    policy.mtp_yield["mtp"].add(4, 3)
    policy.mtp_yield["hybrid"].add(2, 0)
    assert policy.mtp_accepted_per_ask() == 1.5


def test_a_request_leans_on_the_engines_acceptance_until_it_has_its_own():
    engine, request = SaAcceptance(), SaAcceptance()
    for _ in range(40):
        engine.observe(4, [3], [4])
    assert request.rate(4, engine) == engine.rate(4) < 0.1
    for _ in range(40):
        request.observe(4, [3], [3])
    assert request.rate(4, engine) > 0.85


def test_mtp_yield_pays_while_its_tokens_outweigh_its_rows_and_its_run():
    fresh = MtpYield()
    assert fresh.pays(DEFAULT_ROW_COST, DEFAULT_ASK_COST, 0.0, 128)  # unmeasured: the head gets its chance
    good, unsure = MtpYield(), MtpYield()
    for _ in range(30):
        good.add(drafted=2, accepted=2)
        unsure.add(drafted=0, accepted=0)
    assert good.pays(0.15, 0.4, 0.0, 128) and not good.pays(0.15, 2.5, 0.0, 128)  # a run dearer than it saves
    assert not unsure.pays(0.15, 0.1, 0.0, 128)
    assert not MtpYield().pays(0.15, 0.2, 0.0, 128, prior=unsure)  # a new request starts from the engine's yield
    assert MtpYield().pays(0.15, 0.2, 0.0, 128, prior=good)


def test_mtp_yield_weighs_its_costs_by_the_tokens_a_batch_step_emits():
    good = MtpYield()
    for _ in range(30):
        good.add(drafted=2, accepted=1)
    # 1 token an ask against 0.5 of a plain step: it pays alone, not where the step is 8 requests'
    assert good.pays(0.15, 0.2, 0.0, 128, batch=1) and not good.pays(0.15, 0.2, 0.0, 128, batch=8)
    assert good.pays(0.01, 0.05, 0.0, 128, batch=8)  # where rows and asks are cheap, as on a GPU
    assert good.pays(0.15, 0.2, catch_up=10.0, tokens_left=128) and not good.pays(
        0.01, 0.05, catch_up=10.0, tokens_left=128, batch=8)  # catching up stalls the whole batch


def test_mtp_must_beat_the_sa_draft_it_would_replace():
    sure, hesitant = MtpYield(), MtpYield()
    for i in range(30):
        sure.add(drafted=2, accepted=1)
        hesitant.add(drafted=4 * (i % 4 == 0), accepted=2 * (i % 4 == 0))  # drafts on a quarter of asks
    fallback = draft_gain(0.6, 0.1, 3)  # 0.6 + 0.36 + 0.216 accepted, less 0.3: 0.876 tokens
    assert abs(fallback - 0.876) < 1e-9 and draft_gain(0.6, 0.1, 0) == 0.0
    assert sure.pays(0.1, 0.1, 0.0, 128) and not sure.pays(0.1, 0.1, 0.0, 128, alternative=fallback)
    # an unsure ask falls back to the SA draft: the head forgoes it only when it drafts
    assert hesitant.pays(0.1, 0.05, 0.0, 128, alternative=fallback)


def test_mtp_catch_up_pays_only_if_the_asks_left_repay_it():
    good = MtpYield()
    for _ in range(30):
        good.add(drafted=3, accepted=3)  # about 1.8 plain steps saved an ask, 3.6 tokens a step
    assert good.pays(0.15, 0.4, catch_up=5.0, tokens_left=128)  # a prompt behind a long answer
    assert not good.pays(0.15, 0.4, catch_up=5.0, tokens_left=8)  # ... behind an answer nearly done
    assert not good.pays(0.15, 0.4, catch_up=100.0, tokens_left=128)


def test_step_costs_measure_a_row_and_an_ask_against_a_plain_step():
    costs = StepCosts()
    assert costs.row(1) == DEFAULT_ROW_COST and costs.ask(1) == DEFAULT_ASK_COST
    assert costs.catch_up(1, 100) == 100 * DEFAULT_POSITION_COST
    costs.observe_step(1, 9, 0.020)  # one step cannot tell a row from the step ...
    assert costs.row(1) == DEFAULT_ROW_COST
    costs.observe_ask(1, 1, 2, 0.004)  # ... so an ask counts against the plain step it implies
    assert costs.ask(1) == pytest.approx(0.004 / (0.020 / (1 + 8 * DEFAULT_ROW_COST)))
    for _ in range(100):
        costs.observe_step(1, 1, 0.010)
        costs.observe_step(1, 9, 0.018)
        costs.observe_ask(1, 1, 2, 0.004)  # a steady ask
        costs.observe_ask(1, 1, 300, 0.010)  # a catch-up on 300 positions: 0.6 steps more
        costs.observe_step(2, 2, 0.012)
        costs.observe_ask(2, 2, 4, 0.006)
    assert costs.row(1) == pytest.approx(0.1, rel=1e-3)
    assert costs.ask(1) == pytest.approx(0.4, rel=1e-3) and costs.ask(2) == pytest.approx(0.25, rel=1e-3)
    assert costs.catch_up(1, 100) == pytest.approx(100 * 0.002, rel=1e-3)
    costs.observe_step(3, 2, 0.01)  # fewer rows than requests: not a step
    assert costs.row(3) == costs.row(1)  # no step at batch 3: the nearest measured's fraction


@pytest.mark.parametrize("row_seconds,plain_1,plain_8", [(0.00005, 0.010, 0.011),  # a GPU: launch-bound
                                                         (0.0006, 0.006, 0.010)])  # 2 CPU cores
def test_a_batch_size_never_drafted_prices_a_row_from_the_nearest_measured(row_seconds, plain_1, plain_8):
    """A batch of 8 whose steps never drafted (the gate was shut) has no line to fit: at the
    default row cost no draft of its could pay, so none would go to be timed. It prices a row
    at the seconds one adds at batch 1, against its own plain step, until its own drafts fit."""
    costs = StepCosts()
    assert best_draft_len(0.99, costs.row(8), 8, batch=8) == 0  # the default, alone
    for i in range(100):
        extra = 8 * (i % 2)
        costs.observe_step(1, 1 + extra, plain_1 + row_seconds * extra)
    for _ in range(20):
        costs.observe_step(8, 8, plain_8)
    assert costs.row(1) == pytest.approx(row_seconds / plain_1, rel=1e-6)
    assert costs.row(8) == pytest.approx(row_seconds / plain_8, rel=1e-6)
    assert best_draft_len(0.95, costs.row(8), 8, batch=8) > 0
    for i in range(100):  # batch 8's own drafts: a row there is dearer than at batch 1
        extra = 16 * (i % 2)
        costs.observe_step(8, 8 + extra, plain_8 + 2 * row_seconds * extra)
    assert costs.row(8) == pytest.approx(2 * row_seconds / plain_8, rel=1e-6)
    assert costs.row(4) == costs.row(1) and costs.row(6) == costs.row(8)  # the nearest, before they step


@pytest.mark.parametrize("slowdown", [2.0, 0.5])
def test_step_costs_follow_the_machine_when_every_step_drafts(slowdown):
    """Plain steps measured once, then only drafting steps of 1-8 extra rows on a machine that
    became slower (or faster): the row cost is what the drafting steps show, not what they show
    against the old plain step (against it, a row read 0.33-1.2 of a step, or 0)."""
    costs = StepCosts()
    for _ in range(30):
        costs.observe_step(1, 1, 0.010)
    plain = 0.010 * slowdown
    for i in range(200):
        extra = 1 + i % 8
        costs.observe_step(1, 1 + extra, plain * (1 + 0.1 * extra))
    assert costs.row(1) == pytest.approx(0.1, rel=1e-3)
    costs.observe_ask(1, 1, 1, plain * 0.3)
    assert costs.ask(1) == pytest.approx(0.3, rel=1e-3)


def test_a_row_cost_timed_on_a_busy_machine_relaxes_once_no_step_drafts():
    """Drafting steps timed while something else held the cores read a row as more than a plain
    step, so no draft pays and only plain steps follow: they lie on the fitted line, then no
    longer spread enough to fit one, and the cost would stand for good. Plain steps move it
    back to the prior instead, until drafts go."""
    costs = StepCosts()
    for i in range(100):
        costs.observe_step(1, 1 + 2 * (i % 2), 0.010 * (1 + 0.1 * 2 * (i % 2)))
    assert costs.row(1) == pytest.approx(0.1, rel=1e-3)
    for _ in range(3):  # three drafting steps held up by something else on the cores: 10x
        costs.observe_step(1, 3, 0.100)
    assert costs.row(1) > 1 and best_draft_len(0.9, costs.row(1), 8) == 0
    steps = 0
    while best_draft_len(0.9, costs.row(1), 8) == 0:
        costs.observe_step(1, 1, 0.010)  # what the rule does while no draft pays
        steps += 1
        assert steps < 400, costs.row(1)
    assert costs.row(1) > DEFAULT_ROW_COST
    for _ in range(1000):  # relaxed toward the prior, never past it
        costs.observe_step(1, 1, 0.010)
    assert costs.row(1) == pytest.approx(DEFAULT_ROW_COST) and costs.row(1) >= DEFAULT_ROW_COST


def test_step_costs_keep_the_last_row_cost_while_the_rows_do_not_spread():
    costs = StepCosts()
    for i in range(100):
        costs.observe_step(1, 1 + 2 * (i % 2), 0.010 * (1 + 0.2 * 2 * (i % 2)))
    assert costs.row(1) == pytest.approx(0.2, rel=1e-3)
    for _ in range(200):  # every step now drafts 16 tokens, a row a little dearer than before
        costs.observe_step(1, 17, 0.010 * (1 + 0.25 * 16))
    measured = costs.row(1)
    assert 0.2 < measured < 0.3  # fitted while the rows still spread: the old steps and the new
    for _ in range(100):  # alike steps cannot tell a row from the step: the last row cost stands
        costs.observe_step(1, 17, 0.010 * (1 + 0.25 * 16))
    assert costs.row(1) == measured
    costs.observe_ask(1, 1, 1, 0.010)  # against the plain step that row cost implies
    assert costs.ask(1) == pytest.approx(0.010 / (0.050 / (1 + 16 * measured)))
