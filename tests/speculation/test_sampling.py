"""The target distribution a request samples from: `sampling_probs` (temperature, top-k,
top-p, min-p) against a float64 oracle and tables, and the logit processors a verify step
applies row by row (repetition penalty, `min_tokens`), each row as plain decoding would see it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas.speculation.sampling import hold_stops_, repetition_penalize_, sampling_probs
from tests.speculation.sampling_reference import make_generator


def reference_probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int):
    """Straight-line float64 oracle of the documented filter order, one row at a time.

    Returns (probs [T, V], mass_before [T, V]): the mass ranked ahead of each candidate
    token (inf for tokens top-k drops), to spot ties with top_p that rounding may flip.
    """
    out = np.zeros_like(logits, dtype=np.float64)
    mass_before = np.full_like(out, np.inf)
    for row, values in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-values, kind="stable")
        if 0 < top_k < len(values):
            order = order[:top_k]
        kept = np.exp(values[order] - values[order].max())
        kept /= kept.sum()
        mass_before[row, order] = np.cumsum(kept) - kept
        keep = mass_before[row, order] < top_p if top_p < 1 else np.ones(len(kept), bool)
        out[row, order[keep]] = kept[keep] / kept[keep].sum()
    return out, mass_before


def logits_from_probs(probs) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))


@pytest.mark.parametrize(
    "probs, top_k, top_p, kept",
    [
        ([0.1, 0.4, 0.2, 0.3], 0, 1.0, {0, 1, 2, 3}),
        ([0.1, 0.4, 0.2, 0.3], 1, 1.0, {1}),
        ([0.1, 0.4, 0.2, 0.3], 2, 1.0, {1, 3}),
        ([0.1, 0.4, 0.2, 0.3], 4, 1.0, {0, 1, 2, 3}),  # k >= V: off
        ([0.1, 0.4, 0.2, 0.3], 9, 1.0, {0, 1, 2, 3}),
        ([0.1, 0.4, 0.2, 0.3], 0, 0.39, {1}),  # the top token alone reaches 0.39
        ([0.1, 0.4, 0.2, 0.3], 0, 0.41, {1, 3}),
        ([0.1, 0.4, 0.2, 0.3], 0, 0.69, {1, 3}),
        ([0.1, 0.4, 0.2, 0.3], 0, 0.71, {1, 3, 2}),
        ([0.1, 0.4, 0.2, 0.3], 0, 0.95, {0, 1, 2, 3}),
        ([0.1, 0.4, 0.2, 0.3], 0, 1e-6, {1}),  # the top token is always kept
        ([0.9, 0.05, 0.05], 0, 1e-6, {0}),
        ([0.1, 0.4, 0.2, 0.3], 0, 1e-46, {1}),  # under float32's least: it compared as 0 and dropped all
        # top-p runs on the top-k distribution: 0.4/0.7 = 0.57 >= 0.5 keeps one token here,
        # while on the full distribution 0.4 < 0.5 would keep two.
        ([0.1, 0.4, 0.2, 0.3], 2, 0.5, {1}),
        ([0.1, 0.4, 0.2, 0.3], 0, 0.5, {1, 3}),
    ],
)
def test_sampling_probs_keeps(probs, top_k, top_p, kept):
    out = sampling_probs(logits_from_probs(probs), temperature=1.0, top_p=top_p, top_k=top_k)[0]
    assert set(torch.nonzero(out).flatten().tolist()) == kept
    kept_mass = sum(probs[i] for i in kept)
    for i in kept:  # kept tokens keep their relative odds
        assert out[i].item() == pytest.approx(probs[i] / kept_mass, rel=1e-5)


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits / temperature, dim=-1)
        assert torch.allclose(sampling_probs(logits, temperature, 1.0, 0), expected, atol=1e-6)
    sharp, flat = (sampling_probs(logits, t, 1.0, 0)[0] for t in (0.5, 2.0))
    assert sharp[0] > flat[0] and sharp[-1] < flat[-1]
    # Temperature acts before top-p: a flatter distribution needs more tokens to reach 0.8.
    num_kept = {t: int((sampling_probs(logits, t, 0.8, 0) > 0).sum()) for t in (0.3, 3.0)}
    assert num_kept[0.3] < num_kept[3.0]


@pytest.mark.parametrize("vocab_size, scale", [(7, 1.0), (600, 8.0), (600, 0.1), (5000, 3.0)])
@pytest.mark.parametrize(
    "top_p, top_k", [(1.0, 0), (0.9, 0), (0.5, 0), (0.999, 0), (0.9, 40), (1.0, 3)]
)
def test_sampling_probs_matches_reference(vocab_size, scale, top_p, top_k):
    # Peaked and flat rows, and vocabularies past the partial top-k candidate sizes.
    logits = torch.randn(3, vocab_size, generator=make_generator(vocab_size)) * scale
    out = sampling_probs(logits, 0.8, top_p, top_k)
    assert torch.allclose(out.sum(-1), torch.ones(3), atol=1e-5)
    expected, mass_before = reference_probs(logits.numpy(), 0.8, top_p, top_k)
    # The kept sets agree, except for a token whose mass ahead ties top_p to float32 rounding.
    differs = (out.numpy() > 0) != (expected > 0)
    assert np.all(np.abs(mass_before[differs] - top_p) < 1e-5)
    assert differs.sum() <= 1
    assert np.allclose(out.numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("min_p, top_p, kept", [
    (0.5, 1.0, {1, 3}),  # at least half of 0.4: 0.3 stays, 0.2 does not
    (0.45, 1.0, {1, 3, 2}),  # 0.2 >= 0.18
    (1.0, 1.0, {1}),  # only the top token
    (0.5, 0.5, {1, 3}),  # top-p first keeps {1, 3}; min-p keeps both (0.3 / 0.7 >= 0.5 * 0.4 / 0.7)
    (0.8, 0.95, {1}),
])
def test_min_p_keeps_tokens_near_the_top_one(min_p, top_p, kept):
    probs = [0.1, 0.4, 0.2, 0.3]
    out = sampling_probs(logits_from_probs(probs), 1.0, top_p, 0, min_p)[0]
    assert set(torch.nonzero(out).flatten().tolist()) == kept
    kept_mass = sum(probs[i] for i in kept)
    for i in kept:
        assert out[i].item() == pytest.approx(probs[i] / kept_mass, rel=1e-5)


def test_min_p_rows_equal_one_row_at_a_time():
    logits = torch.randn(5, 3000, generator=make_generator(3)) * 4
    together = sampling_probs(logits, 0.9, 0.95, 50, 0.05)
    assert all(torch.equal(together[i], sampling_probs(logits[i:i + 1], 0.9, 0.95, 50, 0.05)[0]) for i in range(5))


@pytest.mark.parametrize("top_p, min_p", [(0.99, 0.0), (1.0, 0.01), (0.95, 0.001)])
def test_rows_equal_one_row_at_a_time_over_a_whole_vocabulary(top_p, min_p):
    """Over 49k tokens torch's sum splits a lone row between threads and a batch by rows: the
    kept mass renormalised by it, a row's probabilities depended on the drafts verified beside
    it (and a seeded token could, rarely, differ with speculation on)."""
    logits = torch.randn(5, 49152, generator=make_generator(7)) * 0.5  # flat: nuclei of thousands of tokens
    together = sampling_probs(logits, 1.0, top_p, 0, min_p)
    assert all(torch.equal(together[i], sampling_probs(logits[i:i + 1], 1.0, top_p, 0, min_p)[0]) for i in range(5))


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.7])
def test_a_rows_ties_are_broken_alike_whatever_rows_are_beside_it(top_p):
    """Which of tied tokens a nucleus keeps depends on how many tokens are ranked: that was
    decided for the whole batch, by its flattest row (a draft's), not by the row itself."""
    generator = make_generator(11)
    peaked = torch.full((49152,), -20.0)
    peaked[:50] = torch.randn(50, generator=generator)
    peaked[torch.randperm(49152, generator=generator)[:400]] = 0.3  # exact ties around the nucleus' edge
    flat = torch.randn(49152, generator=generator) * 0.1  # its nucleus: thousands of tokens
    together = sampling_probs(torch.stack([peaked, flat]), 1.0, top_p, 0)
    assert torch.equal(together[0], sampling_probs(peaked[None], 1.0, top_p, 0)[0])


def test_repetition_penalty_row_i_sees_the_draft_before_it():
    """Row i of a verify step penalises what plain decoding would at that position: the prompt
    and output, plus draft[:i]; positive logits divided, negative ones multiplied."""
    logits = torch.randn(3, 50, generator=make_generator(5))
    seen, draft = [4, 7, 7, 9], [11, 7]
    out = repetition_penalize_(logits.clone(), seen, draft, 1.5)
    for row, tokens in enumerate(({4, 7, 9}, {4, 7, 9, 11}, {4, 7, 9, 11})):
        expected = logits[row].clone()
        for t in tokens:
            expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
        assert torch.equal(out[row], expected), row
        plain = repetition_penalize_(logits[row:row + 1].clone(), seen + draft[:row], [], 1.5)
        assert torch.equal(out[row], plain[0]), row


def test_a_penalty_under_float32s_least_leaves_finite_logits():
    """repetition_penalty is in (0, 2]: 1e-300 is 0 in float32, and a positive logit over it
    was inf (NaN probabilities, garbage tokens); it is float32's largest instead."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = repetition_penalize_(logits.clone(), [0, 1, 3], [], 1e-300)
    assert torch.isfinite(out).all() and out[0, 1] == 0 and out[0, 0] == out[0, 3] == torch.finfo(torch.float32).max
    probs = sampling_probs(out, 1.0, 0.9, 0)
    assert torch.isfinite(probs).all() and set(torch.nonzero(probs[0]).flatten().tolist()) <= {0, 3}


def test_hold_stops_masks_only_the_positions_below_min_tokens():
    logits = torch.zeros(4, 10)
    hold_stops_(logits, first_position=5, min_tokens=7, stop_ids=[2, 8])
    assert torch.isinf(logits[:2, [2, 8]]).all() and (logits[:2, [0, 1, 3]] == 0).all()
    assert (logits[2:] == 0).all()
    assert (hold_stops_(torch.zeros(2, 10), 7, 7, [2]) == 0).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_sampling_probs_rejects_bad_settings(kwargs, field):
    settings = dict(temperature=1.0, top_p=1.0, top_k=0) | kwargs
    with pytest.raises(ValueError, match=field):
        sampling_probs(torch.zeros(1, 4), **settings)
    with pytest.raises(ValueError, match="logits"):
        sampling_probs(torch.zeros(4), 1.0, 1.0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("top_p", [0.5, 0.99])
def test_top_p_on_cuda_logits_rows_equal_one_row_at_a_time(top_p):
    """Top-p widens each row's search alone; the rows still to widen were indexed by a host
    `arange` with the device's `found` mask, which torch refuses ("indices should be either on
    cpu or on the same device"): every top-p request failed on a GPU."""
    generator = torch.Generator().manual_seed(13)
    logits = (torch.randn(5, 49152, generator=generator) * torch.tensor([[4.0], [0.1], [2.0], [0.1], [4.0]])).cuda()
    together = sampling_probs(logits, 0.8, top_p, 0)
    assert together.device == logits.device
    assert all(torch.equal(together[i], sampling_probs(logits[i:i + 1], 0.8, top_p, 0)[0]) for i in range(5))
