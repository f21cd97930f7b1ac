"""Accepting drafts: greedy matching and exact speculative (rejection) sampling.

The target model scores the context plus K drafted tokens in one forward pass, giving K+1
next-token predictions. These functions decide how many drafts survive and which token
follows them, so that the output is exactly what the target alone would produce: the same
tokens under greedy decoding, the same distribution under sampling (Leviathan et al. 2023,
Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from replicas.speculation.sampling import sample, sample_at

# Below this residual mass, max(0, p - q) is rounding noise rather than a distribution.
_RESIDUAL_EPS = 1e-6


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one request's draft."""

    num_accepted: int  # drafts kept, a prefix of the draft
    tokens: list[int]  # the accepted drafts, then one bonus/correction token from the target


def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """Keep the longest draft prefix the target's argmax agrees with, then the target's token.

    `target_argmax[i]` is the target's greedy token after the context plus `draft[:i]`, for
    i = 0..K, so it always has one entry more than `draft`.
    """
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(
            f"target_argmax: expected {len(draft) + 1} entries for {len(draft)} drafts, "
            f"got {len(target_argmax)}"
        )
    num_accepted = 0
    for drafted, target in zip(draft, target_argmax):
        if int(drafted) != int(target):
            break
        num_accepted += 1
    tokens = [int(t) for t in draft[:num_accepted]]
    # On a mismatch the target's own token replaces the draft; after a full match it is the bonus.
    tokens.append(int(target_argmax[num_accepted]))
    return Verdict(num_accepted=num_accepted, tokens=tokens)


def verify_sampling(
    draft: Sequence[int],
    target_probs: Tensor,
    generator: torch.Generator,
    draft_probs: Tensor | None = None,
) -> Verdict:
    """Speculative sampling: the emitted tokens are distributed exactly as target sampling.

    `target_probs [K+1, V]` are the target's sampling distributions (through
    `sampling_probs`) after the context plus `draft[:i]`. `draft_probs [K, V]` are the
    distributions the drafts were sampled from; None means every draft is a point mass
    (q = 1 at the drafted token), as for suffix-automaton drafts and greedy MTP drafts.
    Random numbers come only from `generator`.
    """
    num_draft = len(draft)
    _check_shapes(num_draft, target_probs, draft_probs)
    if num_draft == 0:
        return Verdict(num_accepted=0, tokens=[int(sample(target_probs[:1], generator)[0])])

    device = target_probs.device
    draft_ids = torch.as_tensor([int(t) for t in draft], dtype=torch.long, device=device)  # [K]
    rows = torch.arange(num_draft, device=device)
    p_draft = target_probs[rows, draft_ids].double()  # [K] p_i(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [K] point masses
    else:
        q_draft = draft_probs[rows, draft_ids].double()  # [K] q_i(x_i)

    # Accept draft x_i with probability min(1, p(x_i) / q(x_i)): the part of q that p covers
    # is kept as is, the excess q - p is thrown back and refilled from the residual below.
    uniform = torch.rand(num_draft, generator=generator, dtype=torch.float64).to(device)  # [K]
    rejected = (uniform * q_draft >= p_draft).tolist()
    num_accepted = rejected.index(True) if True in rejected else num_draft
    tokens = [int(t) for t in draft[:num_accepted]]

    if num_accepted == num_draft:
        # Every draft kept: the target's prediction after the last one is a free extra token.
        tokens.append(int(sample(target_probs[num_draft:], generator)[0]))
        return Verdict(num_accepted=num_accepted, tokens=tokens)

    # After a rejection, draw from norm(max(0, p - q)): together with the accepted mass
    # min(p, q) this sums back to exactly p. For a point mass it is p with x_i zeroed.
    p_row = target_probs[num_accepted].double()  # [V]
    if draft_probs is None:
        residual = p_row.clone()
        residual[draft_ids[num_accepted]] = 0.0
    else:
        residual = torch.clamp(p_row - draft_probs[num_accepted].double(), min=0.0)
    # When p ~= q, rejections are near impossible and the residual is rounding noise; any
    # draw is then correct to within that noise, and p itself is the sane one.
    if float(residual.sum()) <= _RESIDUAL_EPS * float(p_row.sum()):
        residual = p_row
    tokens.append(int(sample(residual[None, :], generator)[0]))
    return Verdict(num_accepted=num_accepted, tokens=tokens)


def verify_point_mass(draft: Sequence[int], target_probs: Tensor, uniforms: Tensor) -> Verdict:
    """Exact speculative sampling of point-mass drafts, reproducible per output position.

    `uniforms [K+1]` belong to the output positions, not to the draft. Position i samples
    y_i = inverse_cdf(p_i, u_i) and the draft survives while y_i == x_i. That accepts x_i
    with probability p_i(x_i) and otherwise emits y_i ~ p_i restricted to y != x_i, i.e.
    renormalised max(0, p - q) for q a point mass at x_i: exactly the rule of
    `verify_sampling`. Since y_i never depends on the draft, a seeded request emits the same
    tokens with speculation on or off.
    """
    num_draft = len(draft)
    _check_shapes(num_draft, target_probs, None)
    if uniforms.shape != (num_draft + 1,):
        raise ValueError(f"uniforms: expected [{num_draft + 1}], got {tuple(uniforms.shape)}")
    sampled = sample_at(target_probs, uniforms).tolist()  # [K+1] the target's own tokens
    num_accepted = 0
    while num_accepted < num_draft and int(draft[num_accepted]) == sampled[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted=num_accepted, tokens=sampled[: num_accepted + 1])


def _check_shapes(num_draft: int, target_probs: Tensor, draft_probs: Tensor | None) -> None:
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft + 1:
        raise ValueError(
            f"target_probs: expected [{num_draft + 1}, V] for {num_draft} drafts, "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (num_draft, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs: expected [{num_draft}, {target_probs.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
