"""What a step decides for one request alone: the draft its grammar admits, the SA draft
behind an MTP plan the head could not fill, and the verdict on its verified rows."""

from __future__ import annotations

import torch

from replicas.speculation.hybrid import NO_DRAFT, DraftPlan
from replicas.speculation.sampling import (
    bias_, greedy_tokens, hold_stops_, penalize_, position_uniforms, repetition_penalize_, sampling_probs,
)
from replicas.speculation.verify import Verdict, verify_greedy, verify_point_mass
from replicas.torch_engine.sequence import Sequence


def grammar_admitted(seq: Sequence, plan: DraftPlan, draft: list[int]) -> tuple[DraftPlan, list[int]]:
    """A draft cut at the first token the request's grammar forbids (never emitted anyway)."""
    if seq.constraint is None or not draft or plan.source == "grammar":
        return plan, draft
    draft = seq.constraint.valid_prefix(draft)
    return (DraftPlan(plan.source, len(draft)), draft) if draft else (NO_DRAFT, [])


def sa_fallback(seq: Sequence, plan: DraftPlan) -> tuple[DraftPlan, list[int]]:
    """A step planned for MTP without it: the short SA match behind it, or no draft."""
    if not plan.sa_fallback:
        return NO_DRAFT, []
    return DraftPlan("sa", plan.sa_fallback), seq.sa_draft[: plan.sa_fallback]


def verify_rows(seq: Sequence, draft: list[int], logits: torch.Tensor) -> Verdict:
    """Greedy, or sampled at uniforms keyed by output position (identical with or without drafts),
    from `logits [K+1, V]` biased, penalised, held from stopping before `min_tokens` and masked
    by the request's grammar in place."""
    p = seq.sampling
    if p.logit_bias:
        bias_(logits, p.logit_bias)
    if p.presence_penalty or p.frequency_penalty:
        penalize_(logits, seq.output_ids, draft, p.presence_penalty, p.frequency_penalty)
    if p.repetition_penalty != 1:
        repetition_penalize_(logits, seq.prompt_ids + seq.output_ids, draft, p.repetition_penalty)
    if p.min_tokens > len(seq.output_ids):
        hold_stops_(logits, len(seq.output_ids), p.min_tokens, seq.stop_ids)
    if seq.constraint is not None:
        seq.constraint.mask_(logits, draft)
    if seq.seed is None:
        return verify_greedy(draft, greedy_tokens(logits))
    uniforms = position_uniforms(seq.seed, len(seq.output_ids), len(draft) + 1)
    return verify_point_mass(draft, sampling_probs(logits, p.temperature, p.top_p, p.top_k, p.min_p), uniforms)
