"""Accepting drafts: greedy matching and exact speculative sampling of point-mass drafts.

The target model scores the context plus K drafted tokens in one forward pass, giving K+1
next-token predictions. These functions decide how many drafts survive and which token
follows them, so that the output is exactly what the target alone would produce: the same
tokens under greedy decoding, the same distribution under sampling (Leviathan et al. 2023,
Chen et al. 2023). Every drafter here proposes tokens, not distributions (suffix-automaton
copies, greedy MTP heads), so only the point-mass case of rejection sampling is needed; the
general rule lives in tests/speculation/sampling_reference.py as the tests' reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from replicas.speculation.sampling import sample_at


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


def verify_point_mass(draft: Sequence[int], target_probs: Tensor, uniforms: Tensor) -> Verdict:
    """Exact speculative sampling of point-mass drafts, reproducible per output position.

    `uniforms [K+1]` belong to the output positions, not to the draft. Position i samples
    y_i = inverse_cdf(p_i, u_i) and the draft survives while y_i == x_i. That accepts x_i
    with probability p_i(x_i) and otherwise emits y_i ~ p_i restricted to y != x_i, i.e.
    renormalised max(0, p - q) for q a point mass at x_i: exactly the rejection sampling
    rule (min(1, p/q) to accept, the residual after a rejection). Since y_i never depends on
    the draft, a seeded request emits the same tokens with speculation on or off.
    """
    num_draft = len(draft)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft + 1:
        raise ValueError(
            f"target_probs: expected [{num_draft + 1}, V] for {num_draft} drafts, "
            f"got {tuple(target_probs.shape)}"
        )
    if uniforms.shape != (num_draft + 1,):
        raise ValueError(f"uniforms: expected [{num_draft + 1}], got {tuple(uniforms.shape)}")
    sampled = sample_at(target_probs, uniforms).tolist()  # [K+1] the target's own tokens
    num_accepted = 0
    while num_accepted < num_draft and int(draft[num_accepted]) == sampled[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted=num_accepted, tokens=sampled[: num_accepted + 1])

