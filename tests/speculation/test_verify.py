"""Verification keeps the target's output exact; sampling_probs defines that target.

Greedy verification is checked with tables. Speculative sampling is checked statistically
against its defining property: whatever the drafter does, the emitted tokens are
distributed as the target's own samples (chi-square goodness of fit, fixed seeds, so the
outcome is deterministic). The general rule, any draft distribution, is the reference in
sampling_reference.py and is checked first; the engine's point-mass rule
(`verify_point_mass`) after it. `sample_at` is tested here too, next to the maths that
relies on it; `sampling_probs` and the logit processors that shape the target, in
test_sampling.py.
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import NormalDist

import numpy as np
import pytest
import torch

from replicas.speculation.sampling import greedy_tokens, position_uniforms, sample_at
from replicas.speculation.verify import Verdict, verify_greedy, verify_point_mass
from tests.speculation.sampling_reference import make_generator, sample, verify_sampling

# Significance of every goodness-of-fit test. Seeds are fixed, so a pass is reproducible;
# the small alpha keeps an honest implementation passing under any seed with high odds.
ALPHA = 1e-4


# --- helpers -----------------------------------------------------------------------------


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """Upper `alpha` quantile of chi-square(dof), Wilson-Hilferty (well within 1% for dof >= 3)."""
    z = NormalDist().inv_cdf(1 - alpha)
    h = 2 / (9 * dof)
    return dof * (1 - h + z * math.sqrt(h)) ** 3


def assert_fits(counts: Counter, expected_probs: dict, num_samples: int) -> None:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    unexpected = {k: c for k, c in counts.items() if expected_probs.get(k, 0.0) <= 0.0}
    assert not unexpected, f"outcomes with zero target probability: {unexpected}"
    statistic, cells = 0.0, 0
    pooled_observed, pooled_expected = 0, 0.0
    for outcome, prob in expected_probs.items():
        expected = prob * num_samples
        if expected < 5:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += expected
            continue
        statistic += (counts.get(outcome, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / max(pooled_expected, 1e-9)
        cells += 1
    assert cells >= 2, "test too small to say anything"
    critical = chi2_critical(cells - 1)
    assert statistic < critical, f"chi2 {statistic:.1f} >= {critical:.1f} over {cells} cells"


def random_dist(rng: np.random.Generator, size: int, zeros: int = 0) -> np.ndarray:
    """A random distribution over `size` outcomes, `zeros` of them with probability 0."""
    probs = rng.dirichlet(np.ones(size))
    probs[rng.choice(size, zeros, replace=False)] = 0.0
    return probs / probs.sum()


def as_probs(array: np.ndarray) -> torch.Tensor:
    return torch.tensor(array, dtype=torch.float32)


# --- verify_greedy -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "draft, target_argmax, num_accepted, tokens",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8]),  # all accepted, then the bonus
        ([5, 6, 7], [1, 6, 7, 8], 0, [1]),  # first rejected: the target's token replaces it
        ([5, 6, 7], [5, 6, 2, 8], 2, [5, 6, 2]),  # partial
        ([5, 6, 7], [5, 9, 7, 8], 1, [5, 9]),  # later agreement does not count after a miss
        ([], [4], 0, [4]),  # no draft: a plain decoding step
        ((3,), (3, 3), 1, [3, 3]),  # any sequence type, repeated tokens
    ],
)
def test_verify_greedy_table(draft, target_argmax, num_accepted, tokens):
    assert verify_greedy(draft, target_argmax) == Verdict(num_accepted=num_accepted, tokens=tokens)


def test_verify_greedy_accepts_tensors_and_returns_ints():
    verdict = verify_greedy(torch.tensor([1, 2]), torch.tensor([1, 2, 3]))
    assert verdict.tokens == [1, 2, 3] and all(type(t) is int for t in verdict.tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_tokens_are_torch_argmax_ties_masks_and_nan_included(dtype):
    """Each row's first maximum (a NaN counts as the maximum), whichever library computes it."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 49152, generator=gen).to(dtype)
    logits[1, 100] = logits[1, 40000] = logits[1].max() + 1  # a tie: the first wins
    logits[2, :] = float("-inf")  # a grammar mask that left one token
    logits[2, 31] = 0.0
    logits[3, :] = float("-inf")  # or none
    logits[4, 7], logits[4, 9] = float("nan"), float("inf")
    logits[5, 500], logits[5, 20] = float("inf"), float("nan")
    logits[6] = 1.0  # all equal
    tokens = greedy_tokens(logits)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[1:7] == [100, 31, 0, 7, 20, 0] and all(type(t) is int for t in tokens)
    assert greedy_tokens(logits[3:5, ::2]) == logits[3:5, ::2].argmax(dim=-1).tolist()  # a strided view


@pytest.mark.parametrize("target_argmax", [[1, 2], [1, 2, 3, 4]])
def test_verify_greedy_rejects_wrong_lengths(target_argmax):
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy([1, 2], target_argmax)


# --- reference verify_sampling: exact cases ----------------------------------------------


def test_certain_drafts_are_all_accepted_and_bonus_comes_from_last_row():
    vocab_size = 6
    target = torch.zeros(4, vocab_size)
    target[0, 2] = target[1, 3] = target[2, 4] = target[3, 1] = 1.0  # p puts all mass on the draft
    for seed in range(20):
        verdict = verify_sampling([2, 3, 4], target, make_generator(seed))
        assert verdict == Verdict(num_accepted=3, tokens=[2, 3, 4, 1])


def test_impossible_draft_is_rejected_and_never_emitted():
    probs = as_probs(np.array([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]))
    generator = make_generator(1)
    for _ in range(200):
        verdict = verify_sampling([0], probs, generator)
        assert verdict.num_accepted == 0 and verdict.tokens[0] in (1, 2)


def test_rejection_stops_at_first_bad_draft():
    vocab_size = 5
    target = torch.full((4, vocab_size), 1.0 / vocab_size)
    target[1] = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5])  # draft[1] = 0 is impossible
    for seed in range(30):
        verdict = verify_sampling([1, 0, 2], target, make_generator(seed), draft_probs=target[:3])
        # draft[0] has p == q, so it is always kept; draft[1] never is.
        assert verdict.num_accepted == 1 and verdict.tokens[0] == 1 and verdict.tokens[1] in (3, 4)


def test_empty_draft_samples_from_the_only_row():
    probs = as_probs(np.array([[0.0, 0.0, 1.0]]))
    assert verify_sampling([], probs, make_generator(0)) == Verdict(num_accepted=0, tokens=[2])


def test_degenerate_residual_falls_back_to_target():
    # q over-covers p everywhere, so max(0, p - q) is all zero; the correction must still
    # come from p (token 1), not from an all-zero "distribution".
    target = as_probs(np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    draft_probs = as_probs(np.array([[0.5, 1.0, 0.5]]))
    for seed in range(20):
        verdict = verify_sampling([0], target, make_generator(seed), draft_probs=draft_probs)
        assert verdict == Verdict(num_accepted=0, tokens=[1])


def test_same_seed_same_verdicts():
    rng = np.random.default_rng(3)
    target = as_probs(np.stack([random_dist(rng, 8) for _ in range(5)]))
    draft_probs = as_probs(np.stack([random_dist(rng, 8) for _ in range(4)]))
    runs = []
    for _ in range(2):
        generator = make_generator(1234)
        runs.append(
            [verify_sampling([1, 2, 3, 4], target, generator, draft_probs) for _ in range(50)]
        )
    assert runs[0] == runs[1]
    assert len({v.num_accepted for v in runs[0]}) > 1  # the draws really vary


@pytest.mark.parametrize(
    "draft, target_shape, draft_shape, field",
    [
        ([1, 2], (2, 5), None, "target_probs"),
        ([1, 2], (3,), None, "target_probs"),
        ([1, 2], (3, 5), (1, 5), "draft_probs"),
        ([1, 2], (3, 5), (2, 4), "draft_probs"),
    ],
)
def test_verify_sampling_rejects_bad_shapes(draft, target_shape, draft_shape, field):
    draft_probs = None if draft_shape is None else torch.full(draft_shape, 0.2)
    with pytest.raises(ValueError, match=field):
        verify_sampling(draft, torch.full(target_shape, 0.2), make_generator(0), draft_probs)


# --- reference verify_sampling: the emitted distribution is the target's ---------------


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("which", ["likely", "unlikely", "impossible"])
def test_first_token_is_target_distributed_for_point_mass_drafts(case, which):
    rng = np.random.default_rng(100 + case)
    vocab_size = 5 + case
    p = random_dist(rng, vocab_size, zeros=1)
    drafted = {"likely": int(np.argmax(p)), "unlikely": int(np.argmin(np.where(p > 0, p, 2))),
               "impossible": int(np.argmin(p))}[which]
    target = as_probs(np.stack([p] + [random_dist(rng, vocab_size) for _ in range(3)]))
    draft = [drafted, 0, 1]  # later drafts are arbitrary; only the first token is measured
    generator = make_generator(case)
    num_samples = 6000
    counts = Counter(
        verify_sampling(draft, target, generator).tokens[0] for _ in range(num_samples)
    )
    assert_fits(counts, dict(enumerate(p)), num_samples)


@pytest.mark.parametrize("case", range(4))
def test_first_token_is_target_distributed_for_sampled_drafts(case):
    rng = np.random.default_rng(200 + case)
    vocab_size = 5 + case
    # Mismatched supports on purpose: q puts mass where p has none and vice versa.
    p = random_dist(rng, vocab_size, zeros=case % 2)
    q = random_dist(rng, vocab_size, zeros=1 + case % 2)
    target = as_probs(np.stack([p, random_dist(rng, vocab_size)]))
    draft_probs = as_probs(q[None, :])
    generator = make_generator(case)
    num_samples = 12000
    drafts = rng.choice(vocab_size, size=num_samples, p=q)
    counts = Counter(
        verify_sampling([int(x)], target, generator, draft_probs).tokens[0] for x in drafts
    )
    assert_fits(counts, dict(enumerate(p)), num_samples)


def _markov_continuations(target_matrix, draft_matrix, greedy_drafts, num_samples, seed):
    """Counts of the 3 tokens after token 0, decoding speculatively with K = 2 drafts."""
    rng = np.random.default_rng(seed)
    generator = make_generator(seed)
    target_t, draft_t = as_probs(target_matrix), as_probs(draft_matrix)
    counts = Counter()
    for _ in range(num_samples):
        emitted = [0]
        while len(emitted) < 4:
            draft = []
            for _ in range(2):
                row = draft_matrix[(emitted + draft)[-1]]
                drafted = np.argmax(row) if greedy_drafts else rng.choice(len(row), p=row)
                draft.append(int(drafted))
            # Row i is the law after emitted + draft[:i]: for a Markov chain, its last token.
            context = emitted + draft
            last_tokens = context[len(emitted) - 1:]  # [K+1]: the token each row follows
            target_probs = target_t[last_tokens]
            draft_probs = None if greedy_drafts else draft_t[last_tokens[:2]]
            emitted += verify_sampling(draft, target_probs, generator, draft_probs).tokens
        counts[tuple(emitted[1:4])] += 1
    return counts


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_markov_continuations_follow_the_target(greedy_drafts):
    rng = np.random.default_rng(7)
    vocab_size = 4
    target_matrix = np.stack([random_dist(rng, vocab_size, zeros=1) for _ in range(vocab_size)])
    draft_matrix = np.stack([random_dist(rng, vocab_size) for _ in range(vocab_size)])
    num_samples = 8000
    counts = _markov_continuations(target_matrix, draft_matrix, greedy_drafts, num_samples, seed=11)
    expected = {
        (a, b, c): target_matrix[0, a] * target_matrix[a, b] * target_matrix[b, c]
        for a in range(vocab_size) for b in range(vocab_size) for c in range(vocab_size)
    }
    assert_fits(counts, expected, num_samples)


# --- sample_at through the reference's sample, and the uniforms it draws at -----------------------
def test_sample_follows_probs_and_skips_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    num_samples = 20000
    drawn = sample(probs.expand(num_samples, -1), make_generator(5))
    assert drawn.dtype == torch.int64 and drawn.shape == (num_samples,)
    assert_fits(Counter(drawn.tolist()), dict(enumerate(probs.tolist())), num_samples)
    # Unnormalised weights are fine: twice the weights, the same law.
    assert torch.equal(sample((2 * probs).expand(50, -1), make_generator(9)),
                       sample(probs.expand(50, -1), make_generator(9)))


def test_seeded_generators_repeat_and_unseeded_differ():
    probs = torch.full((200, 50), 1 / 50)
    assert torch.equal(sample(probs, make_generator(42)), sample(probs, make_generator(42)))
    assert not torch.equal(sample(probs, make_generator(42)), sample(probs, make_generator(43)))
    assert not torch.equal(sample(probs, make_generator(None)), sample(probs, make_generator(None)))
    assert make_generator(0).device.type == "cpu"


# --- verify_point_mass: sampling keyed by output position --------------------------------

def test_position_uniforms_are_keyed_by_seed_and_position_only():
    whole = position_uniforms(3, 0, 10)
    assert torch.equal(whole[4:7], position_uniforms(3, 4, 3))
    assert not torch.equal(whole, position_uniforms(4, 0, 10))
    many = position_uniforms(11, 0, 20000)
    assert 0.0 <= float(many.min()) and float(many.max()) < 1.0
    counts = torch.histc(many.float(), bins=10, min=0.0, max=1.0)
    assert float((counts - 2000).abs().max()) < 200  # ~4.5 sigma for a uniform stream


def test_point_mass_verdict_keeps_the_target_tokens_whatever_the_draft():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 6, generator=gen) * 2, dim=-1)  # [K+1, V]
    uniforms = position_uniforms(9, 0, 5)
    target = sample_at(probs, uniforms).tolist()
    for draft in ([], target[:4], target[:2] + [(target[2] + 1) % 6, target[3]], [(target[0] + 1) % 6] * 4):
        k = len(draft)
        verdict = verify_point_mass(draft, probs[: k + 1], uniforms[: k + 1])
        agree = next((i for i, (d, t) in enumerate(zip(draft, target)) if d != t), k)
        assert verdict.num_accepted == agree
        assert verdict.tokens == target[: agree + 1]


def test_point_mass_verification_is_exact_in_distribution():
    """Over seeds, the first emitted token follows p and the draft is accepted w.p. p(x)."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    n = 20000
    first, accepted = torch.zeros(4), 0
    for seed in range(n):
        verdict = verify_point_mass([1], probs, position_uniforms(seed, 0, 2))
        first[verdict.tokens[0]] += 1
        accepted += verdict.num_accepted
    expected = probs[0] * n
    chi2 = float(((first - expected) ** 2 / expected).sum())
    assert chi2 < 21.1  # chi-square, 3 degrees of freedom, alpha 1e-4
    assert abs(accepted / n - 0.3) < 0.015


@pytest.mark.parametrize(
    "target_shape, uniforms_shape, field",
    [
        ((2, 5), (3,), "target_probs"),
        ((3,), (3,), "target_probs"),
        ((3, 5), (2,), "uniforms"),
        ((3, 5), (3, 1), "uniforms"),
    ],
)
def test_verify_point_mass_rejects_bad_shapes(target_shape, uniforms_shape, field):
    with pytest.raises(ValueError, match=field):
        verify_point_mass([1, 2], torch.full(target_shape, 0.2), torch.zeros(uniforms_shape))
