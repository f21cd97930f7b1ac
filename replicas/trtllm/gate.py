"""Our batch gate -> what TensorRT-LLM really does with it, per mode. Pure functions.

Read in upstream's source (NVIDIA/TensorRT-LLM):
- `tensorrt_llm/llmapi/llm_args.py`, DecodingBaseConfig: `max_concurrency` ("speculation will
  be disabled at batch sizes above this value") becomes `draft_len_schedule =
  {max_concurrency: max_draft_len}` only where `spec_dec_mode.support_dynamic_draft_len()`
  holds; a schedule maps each batch size to the draft length of the smallest key at or above
  it, and drafts 0 above its largest key.
- `tensorrt_llm/_torch/speculative/interface.py`: `support_dynamic_draft_len()` is one-model
  EAGLE-3 in the 1.3 line (later builds add more one-engine modes).
- `tensorrt_llm/_torch/pyexecutor/model_engine.py`: "for one engine mode, we are not able to
  turn off spec decode at runtime": MTP and standalone SA draft inside the target's forward
  at every batch size, whatever max_concurrency says (only two-model drafters read it).
- The SA enhancer (`_torch/speculative/sa_enhancer.py`) extends its automaton only in
  drafting steps, so a zero-length step leaves it stale: the acceptance collapse reported in
  TensorRT-LLM #16888, whose fix floors the scheduled draft length at 1 for SA-enhanced
  configs (`min_runtime_draft_len`). We pass that floor ourselves, so a release before the
  fix behaves as one after it.

So per mode, with a gate below max_batch_size:
  mtp, drafter eagle3 (EAGLE-3 alone)  gated: max_concurrency (or the taper's schedule);
                                       no drafts above the gate
  hybrid, drafter eagle3 (EAGLE-3+SA)  not gated: a schedule {..., gate: d, max_batch_size: 1}
                                       drafts 1 token above the gate, never 0
  mtp / hybrid with drafter mtp, sa    not gated: nothing to pass, drafts at every batch size
A gate at or above max_batch_size never trips (not gated either); gate 0 builds no
speculation at all. "Not gated" is what the engine reports (stats.NOT_GATED), so the router
and the autoscaler never count on a gate the engine does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replicas.engine import SpeculationConfig
from replicas.stats import NOT_GATED
from replicas.trtllm.api import UnsupportedRelease
from replicas.trtllm.config import TrtllmEngineConfig

# Upstream config classes whose steps follow a draft-length schedule (see above). UNVERIFIED
# for 1.3.0rc27 exactly: a build that already lets MTP-Eagle or SA follow one would gate
# them too (MTP-Eagle) or floor them at 1 (SA); `make gpu-check` shows which.
DYNAMIC_DRAFT_LEN = frozenset({"Eagle3DecodingConfig"})
SA_ENHANCED_FLOOR = 1  # the least draft length of an SA-enhanced config (#16888)


@dataclass(frozen=True)
class GatePlan:
    """The gate kwargs for `speculative_config` and the gate the engine will apply."""

    kwargs: dict[str, Any]
    batch_gate: int = NOT_GATED  # above it the built engine drafts nothing; NOT_GATED: no such size
    notes: tuple[str, ...] = ()  # why a configured gate is not applied, for a log line


def plan_gate(config: TrtllmEngineConfig, spec: SpeculationConfig, config_class: str,
              have: frozenset[str]) -> GatePlan:
    """Map `spec.batch_gate` onto `config_class` (whose fields are `have`), as upstream runs it."""
    gate, k = spec.batch_gate, spec.max_draft_len
    if gate >= config.max_batch_size:
        return GatePlan({})
    if config_class not in DYNAMIC_DRAFT_LEN:
        return GatePlan({}, notes=(
            f"speculation.batch_gate={gate} is not applied: TensorRT-LLM's {config_class} drafts inside "
            f"the target's forward and cannot switch speculation off by batch size; reported as not gated",))
    floor = SA_ENHANCED_FLOOR if spec.mode == "hybrid" else 0
    if not (floor or config.draft_len_taper):
        return GatePlan({_field(have, "max_concurrency", gate): gate}, gate)
    schedule = draft_len_schedule(k, gate, config.draft_len_taper, floor, config.max_batch_size)
    kwargs = {_field(have, "draft_len_schedule", gate): schedule}
    if not floor:
        return GatePlan(kwargs, gate)
    return GatePlan(kwargs, notes=(
        f"speculation.batch_gate={gate}: with the suffix-automaton enhancer TensorRT-LLM drafts at least "
        f"{floor} token above the gate (never 0: TensorRT-LLM #16888); reported as not gated",))


def draft_len_schedule(max_draft_len: int, gate: int, taper: tuple[tuple[int, int], ...],
                       floor: int = 0, max_batch_size: int = 0) -> dict[int, int]:
    """Upstream's schedule {batch size: draft len, for batches up to it} from a taper, cut at
    the gate (above the largest key upstream drafts nothing, so the gate is a key). With a
    `floor`, every length is at least it and `max_batch_size` maps to it: above the gate the
    engine drafts `floor` tokens, a taper rather than a switch. Upstream requires the
    smallest key to map to max_draft_len."""
    entries = sorted((b, max(floor, min(d, max_draft_len))) for b, d in taper if b <= gate)
    schedule = dict(entries)
    schedule.setdefault(gate, entries[-1][1] if entries else max_draft_len)
    if floor and max_batch_size > gate:
        schedule[max_batch_size] = floor
    if schedule[min(schedule)] != max_draft_len:
        raise ValueError(f"draft_len_taper: the smallest batch size must draft max_draft_len={max_draft_len}")
    return schedule


def _field(have: frozenset[str], name: str, gate: int) -> str:
    if name not in have:
        raise UnsupportedRelease(f"speculation.batch_gate={gate} needs {name}, which this TensorRT-LLM lacks")
    return name
