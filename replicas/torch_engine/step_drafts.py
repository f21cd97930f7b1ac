"""What a decode step drafts for each running request.

The hybrid rule (`plan_draft`) picks a source and a length per request; the measured draft
rules (`adaptive_drafts`) cut an SA draft to what pays and decide whether an MTP ask pays;
the head is asked once for every request that still wants it; a grammar cuts each draft at
its first forbidden token. Nothing here runs the target or touches the KV cache.

Behind a closed gate nothing is drafted, and the acceptance length that the autoscaling
policy and the router read would stand at its last verified value however the workload
changed (a packed fleet then stays packed where spreading it would pay). So there each
request holds the SA draft it would make at the gate's batch size (`shadow_drafts`), and the
tokens it then emits settle it (`shadow_kept`): the tokens do not depend on drafting
(verification is exact, sampling keyed by output position), so their common prefix with the
draft is what its verify would have accepted. A request the rule would hand to the MTP head
(asking it costs most of a step), or whose grammar would cut its drafts, holds none; so the
figure there is the SA's part, and a draft a request's end leaves unsettled is not counted.
Once the gate opens the drafts held are let go: real verifies measure again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from replicas.engine import SpeculationConfig
from replicas.speculation.gate import speculate_this_step
from replicas.speculation.hybrid import NO_DRAFT, DraftPlan, effective_settings, plan_draft
from replicas.torch_engine.draft_policy import DraftPolicy
from replicas.torch_engine.request_step import grammar_admitted, sa_fallback
from replicas.torch_engine.sequence import Sequence

if TYPE_CHECKING:
    from replicas.torch_engine.mtp import MTPDrafter

Planned = tuple[DraftPlan, list[int]]  # the plan and its draft tokens


def request_mode(cfg: SpeculationConfig, seq: Sequence) -> str:
    """The request's mode now: the server's setting as the request narrows it."""
    return effective_settings(cfg, seq.speculation)[0]


def step_drafts(seqs: list[Sequence], cfg: SpeculationConfig, drafts: DraftPolicy, mtp: MTPDrafter | None,
                mtp_min_confidence: float, max_seq_len: int) -> list[Planned]:
    """Each request's draft for this step, in `seqs`' order."""
    batch = len(seqs)
    speculate = speculate_this_step(batch, cfg.batch_gate)
    plans = [_request_plan(seq, cfg, drafts, max_seq_len, speculate, batch) for seq in seqs]
    asking = []  # (index, request) of the MTP asks that go
    for i, seq in enumerate(seqs):
        if plans[i][0].source != "mtp":
            continue
        if seq.mtp_skip:  # backing off after unfruitful proposals
            seq.mtp_skip -= 1
            plans[i] = sa_fallback(seq, plans[i][0])
        elif not cfg.adaptive_drafts or drafts.ask_mtp(seq, request_mode(cfg, seq), batch, plans[i][0].sa_fallback):
            asking.append((i, seq))
        else:
            plans[i] = sa_fallback(seq, plans[i][0])
    if asking:
        queued = sum(mtp.queued(s.slot) for _, s in asking)
        asked = time.perf_counter()
        proposals = mtp.propose([s.slot for _, s in asking], [plans[i][0].num_draft for i, _ in asking],
                                mtp_min_confidence)
        drafts.costs.observe_ask(batch, len(asking), queued, time.perf_counter() - asked)
        for (i, seq), draft in zip(asking, proposals):
            if draft:
                plans[i] = (plans[i][0], list(draft))
            else:  # the head is unsure
                drafts.mtp_outcome(seq, request_mode(cfg, seq), 0, 0)
                plans[i] = sa_fallback(seq, plans[i][0])
    if mtp is not None and cfg.adaptive_drafts:
        asked_slots = {seq.slot for _, seq in asking}
        for seq in seqs:
            if seq.mtp_fed and seq.slot not in asked_slots:
                drafts.bound_mtp_queue(seq, request_mode(cfg, seq), batch)
    return [grammar_admitted(seq, *plan) for seq, plan in zip(seqs, plans)]


def _request_plan(seq: Sequence, cfg: SpeculationConfig, drafts: DraftPolicy, max_seq_len: int, speculate: bool,
                  batch: int) -> Planned:
    """The hybrid rule's plan for one request; an SA draft already cut to what pays, an MTP plan
    still to be filled by the head."""
    mode, max_draft_len = effective_settings(cfg, seq.speculation)
    room = max_seq_len - seq.num_cached - 1  # KV positions left after the last token
    forced = []
    if seq.constraint is not None and cfg.grammar_drafts and mode != "off":
        forced = seq.constraint.forced_tokens()
    plan = plan_draft(mode, max_draft_len, cfg.sa_threshold, seq.sa_match_len, seq.mtp_fed,
                      speculate and not seq.over_gate, min(seq.tokens_left, room + 1), len(forced),
                      bool(forced) and seq.sa_draft[: len(forced)] == forced)
    if plan.source == "grammar":
        return plan, forced[: plan.num_draft]
    if plan.source == "sa":
        num_draft = drafts.sa_draft_len(seq, plan.num_draft, batch) if cfg.adaptive_drafts else plan.num_draft
        return (DraftPlan("sa", num_draft), seq.sa_draft[:num_draft]) if num_draft else (NO_DRAFT, [])
    if plan.sa_fallback and cfg.adaptive_drafts:
        plan = dataclasses.replace(plan, sa_fallback=drafts.sa_draft_len(seq, plan.sa_fallback, batch))
    return plan, []


def shadow_drafts(seqs: list[Sequence], cfg: SpeculationConfig, drafts: DraftPolicy, max_seq_len: int,
                  gate_closed: bool) -> None:
    """Behind a closed gate, each request holding no shadow draft takes the SA draft the hybrid
    rule would make at the gate's batch size (cut to what pays there, as `adaptive_drafts`
    cuts); with the gate open, the drafts held are let go."""
    for seq in seqs:
        if not gate_closed:
            seq.shadow_draft, seq.shadow_matched = [], 0
            continue
        if seq.shadow_draft or seq.constraint is not None:
            continue
        mode, max_draft_len = effective_settings(cfg, seq.speculation)
        room = max_seq_len - seq.num_cached - 1
        plan = plan_draft(mode, max_draft_len, cfg.sa_threshold, seq.sa_match_len, seq.mtp_fed, True,
                          min(seq.tokens_left, room + 1))
        if plan.source != "sa":
            continue
        num_draft = plan.num_draft
        if cfg.adaptive_drafts:
            num_draft = drafts.sa_draft_len(seq, num_draft, max(1, cfg.batch_gate))
        seq.shadow_draft, seq.shadow_matched = seq.sa_draft[:num_draft], 0


def shadow_kept(seq: Sequence, emitted: list[int]) -> int | None:
    """The tokens a verify of the request's shadow draft would have kept (1 + accepted), once
    the tokens it emitted settle it, the draft then let go; None while it is unsettled."""
    draft = seq.shadow_draft
    for token in emitted:
        if not draft:
            return None
        if seq.shadow_matched < len(draft) and token == draft[seq.shadow_matched]:
            seq.shadow_matched += 1
            continue
        kept = seq.shadow_matched + 1  # the correction, or the bonus token after a whole draft
        seq.shadow_draft, seq.shadow_matched = [], 0
        return kept
    return None
