"""Reference speculative sampling (Leviathan et al. 2023, Chen et al. 2023), for the tests.

The engine verifies point-mass drafts only, at uniforms keyed by output position
(`replicas.speculation.verify.verify_point_mass`). `verify_sampling` here is the general
rule it specialises: any draft distribution q, random numbers from one `torch.Generator`.
The tests check it against its defining property (the emitted tokens follow the target),
so it documents the exact accept/reject maths the engine's rule must agree with.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from replicas.speculation.sampling import sample_at
from replicas.speculation.verify import Verdict

# Below this residual mass, max(0, p - q) is rounding noise rather than a distribution.
_RESIDUAL_EPS = 1e-6


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded when `seed` is given, else from OS entropy."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One token per row of `probs [T, V]` (need not be normalised); returns `[T]` int64.

    Inverse-CDF sampling with uniforms drawn on the CPU generator, so it runs on any device.
    Zero-probability tokens are never drawn.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs: expected [T, V], got shape {tuple(probs.shape)}")
    # float32 uniforms are at most 1 - 2**-24, so u * total stays strictly below total in
    # float64 and the search never runs off the end.
    return sample_at(probs, torch.rand(probs.shape[0], generator=generator).double())


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
