"""Step-time profiles and workload mixes for the simulator, with where each figure comes from.

A replica's decode step over `batch` sequences processing `tokens` tokens in all (batch when
not speculating, sum of 1 + draft length when verifying) costs a fixed part, a memory part
(weights once per step, KV cache per sequence) and a compute part (per token); see
`StepTime`. Two profiles:

- `cpu`: fitted to `benchmarks/results/forward.json` (our lean forward, SmolLM2-135M, 2
  cores) when present, else to the HF-forward medians in DESIGN.md (measured here).
- `gpu-h100-llama8b`: a roofline from published datasheet figures, not a measurement:
  NVIDIA H100 SXM 3.35 TB/s HBM3 and 989 TFLOP/s dense BF16; Llama-3.1-8B, 8.03 B
  parameters (16.06 GB in BF16), 32 layers x 8 KV heads x 128 dims (128 KiB of KV per
  token). Assumed: 70 % of peak bandwidth, 50 % of peak FLOP/s, 2,048 tokens of context
  per sequence, 1 ms per-step overhead; a step takes the larger of its memory and compute
  time (so verification is nearly free until the step turns compute-bound).

Acceptance lengths (tokens per verify step, bonus included) do not depend on the hardware:
they come from `benchmarks/results/engine.json` (hybrid mode, code edits and chat) when
present, else from `drafters.json` (our suffix automaton, teacher-forced on recorded
responses), else from the assumed figures below.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

# DESIGN.md, "Facts learned the hard way": HF forward, fp32, 2 AVX2 cores, 1k-token cache.
# (batch, new tokens per sequence) -> median ms.
FALLBACK_CPU_FORWARD_MS = {(1, 1): 165.0, (1, 2): 304.0, (1, 9): 338.0, (1, 17): 384.0,
                           (8, 1): 340.0, (8, 9): 790.0}
FALLBACK_ACCEPTANCE = {"code_edit": 3.5, "chat": 1.8}  # assumed when engine.json is absent
FALLBACK_DRAFT_LEN = {"code_edit": 8, "chat": 3}


@dataclass(frozen=True)
class StepTime:
    """step_ms = fixed + memory-side + compute-side, the two sides added (CPU fit, no overlap)
    or overlapped (`overlap=True`: a roofline, the larger side wins)."""

    fixed_ms: float  # per step, whatever the batch (framework overhead, launches)
    per_seq_ms: float  # KV cache read per sequence
    per_token_ms: float  # arithmetic per token put through the model
    weights_ms: float = 0.0  # weights read once per step (memory side)
    overlap: bool = False

    def step_ms(self, batch: int, tokens: int) -> float:
        memory = self.weights_ms + self.per_seq_ms * batch
        compute = self.per_token_ms * tokens
        return self.fixed_ms + (max(memory, compute) if self.overlap else memory + compute)

    def prefill_ms(self, prompt_tokens: int) -> float:
        return self.step_ms(1, prompt_tokens)

    def compiled(self):
        """`step_ms` as a closure over plain floats, for the simulator's inner loop."""
        fixed, weights, per_seq, per_token = self.fixed_ms, self.weights_ms, self.per_seq_ms, self.per_token_ms
        if self.overlap:
            return lambda batch, tokens: fixed + max(weights + per_seq * batch, per_token * tokens)
        return lambda batch, tokens: fixed + weights + per_seq * batch + per_token * tokens


@dataclass(frozen=True)
class Profile:
    """One kind of replica and the deployment settings it is run with."""

    name: str
    source: str
    step: StepTime
    batch_gate: int  # speculation on while batch <= gate
    pack_target: float  # target_ongoing_requests of the deployment
    max_ongoing: int  # max_ongoing_requests (= the engine's max batch)
    gate_fill: float  # the policy spreads to gate_fill * gate: headroom below the gate for
    # the load that arrives while new replicas start (the gpu's 60 s starts need half the
    # gate; the cpu's 15 s starts a quarter)
    startup_s: float  # scale-up request to a ready replica
    tick_s: float  # the simulator's time step
    tpot_slo_ms: float
    ttft_slo_s: float
    graceful_shutdown_s: float = 300.0
    queue_timeout_s: float = 120.0

    def break_even_acceptance(self, draft_len: int, fill: float = 1.0) -> float:
        """Acceptance at which a replica holding `fill * gate` requests, speculating, emits as
        many tokens/s as one packed at the target without: at fill 1 the natural
        `min_acceptance_length` (speculation at the gate beats packing)."""
        spread, pack = max(1.0, fill * self.batch_gate), self.pack_target
        spec_ms = self.step.step_ms(round(spread), round(spread * (1 + draft_len)))
        plain_ms = self.step.step_ms(round(pack), round(pack))
        return (pack / spread) * spec_ms / plain_ms


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    acceptance_levels: tuple[float, ...]  # equally likely per request
    draft_len: int  # drafts verified per speculating step
    output_tokens: int  # median (lognormal)
    output_sigma: float
    prompt_tokens: int


@dataclass(frozen=True)
class Mix:
    name: str
    classes: tuple[RequestClass, ...]

    def mean_acceptance(self) -> float:
        total = sum(c.weight for c in self.classes)
        return sum(c.weight * sum(c.acceptance_levels) / len(c.acceptance_levels) for c in self.classes) / total


def fit_step_time(points: dict[tuple[int, int], float]) -> StepTime:
    """Least squares of ms ~ base + per_seq*B + per_token*B*T with non-negative coefficients
    (best over the subsets of free coefficients, so three unknowns need no library), in
    relative error: each point's equation divided by its own time. Measured steps span 5 to
    90 ms, and in absolute error the largest (8 requests x 9 verify rows, a step the simulator
    never runs: no drafts above the gate) set the fit, which then put a 1-row step at 2.7 ms
    against the 4.9 measured (Zen 4, 2026-11-27; relative: 4.6)."""
    rows = [((1.0 / ms, b / ms, b * t / ms), 1.0) for (b, t), ms in points.items()]
    best: Optional[tuple[float, tuple[float, float, float]]] = None
    for free in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (3, 2, 1)):
        coef = _solve_subset(rows, free)
        if coef is None or min(coef) < 0:
            continue
        err = sum((sum(c * x for c, x in zip(coef, xs)) - y) ** 2 for xs, y in rows)
        if best is None or err < best[0] - 1e-9:
            best = (err, coef)
    assert best is not None  # the base-only subset is always feasible for positive timings
    base, per_seq, per_token = best[1]
    return StepTime(fixed_ms=base, per_seq_ms=per_seq, per_token_ms=per_token)


def _solve_subset(rows, free) -> Optional[tuple[float, float, float]]:
    n = len(free)
    a = [[sum(xs[i] * xs[j] for xs, _ in rows) for j in free] + [sum(xs[i] * y for xs, y in rows)] for i in free]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    coef = [0.0, 0.0, 0.0]
    for k, i in enumerate(free):
        coef[i] = a[k][n] / a[k][k]
    return tuple(coef)


def cpu_forward_points(results: Path = RESULTS) -> tuple[dict[tuple[int, int], float], str]:
    path = results / "forward.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        threads = max(r["threads"] for r in rows)
        points = {(r["batch"], r["new_tokens"]): float(r["ours_ms"]) for r in rows if r["threads"] == threads}
        return points, f"fitted to {path.name} (our forward, {threads} threads)"
    return dict(FALLBACK_CPU_FORWARD_MS), "fallback: DESIGN.md HF-forward medians (forward.json absent)"


def acceptance_lengths(results: Path = RESULTS) -> tuple[dict[str, float], str]:
    """Per workload: the engine's end-to-end hybrid MAT (engine.json), else the suffix
    automaton's teacher-forced MAT on recorded responses (drafters.json: code edits, and
    ShareGPT as chat, a floor for chat since MTP drafts there), else assumed figures."""
    engine = results / "engine.json"
    if engine.exists():
        batch1 = json.loads(engine.read_text()).get("batch1", {})
        try:
            return ({"code_edit": float(batch1["code_edit/hybrid"]["mat"]),
                     "chat": float(batch1["chat/hybrid"]["mat"])}, f"{engine.name} (hybrid, batch 1)")
        except KeyError:
            pass
    drafters = results / "drafters.json"
    if drafters.exists():
        mat = json.loads(drafters.read_text()).get("mat", {})
        try:
            return ({"code_edit": float(mat["code_edits"]["ours SA"]["mat"]),
                     "chat": float(mat["sharegpt"]["ours SA"]["mat"])},
                    f"{drafters.name} (our SA, teacher-forced: code_edits, sharegpt as chat)")
        except KeyError:
            pass
    return dict(FALLBACK_ACCEPTANCE), "fallback: assumed (engine.json and drafters.json absent)"


def draft_lengths(results: Path = RESULTS) -> dict[str, int]:
    """Per workload: tokens drafted per verify step by the engine's hybrid mode at batch 1
    (engine.json; steps = accepted / (MAT - 1)), else the assumed figures. SA drafts run up
    to twice their match and MTP drafts stop when unsure, so this is well under the cap."""
    lengths = dict(FALLBACK_DRAFT_LEN)
    engine = results / "engine.json"
    if engine.exists():
        batch1 = json.loads(engine.read_text()).get("batch1", {})
        for workload in lengths:
            row = batch1.get(f"{workload}/hybrid", {})
            if row.get("mat", 1.0) > 1.0 and row.get("accepted_tokens"):
                steps = row["accepted_tokens"] / (row["mat"] - 1.0)
                lengths[workload] = max(1, round(row["draft_tokens"] / steps))
    return lengths


def gpu_h100_llama8b() -> StepTime:
    bandwidth = 3.35e12 * 0.70  # bytes/s achieved
    flops = 989e12 * 0.50
    weights, kv_per_token, context = 16.06e9, 2 * 32 * 8 * 128 * 2, 2048
    return StepTime(fixed_ms=1.0, weights_ms=weights / bandwidth * 1e3,
                    per_seq_ms=kv_per_token * context / bandwidth * 1e3,
                    per_token_ms=2 * 8.03e9 / flops * 1e3, overlap=True)


def profiles(results: Path = RESULTS) -> dict[str, Profile]:
    points, cpu_source = cpu_forward_points(results)
    return {
        "cpu": Profile("cpu", cpu_source, fit_step_time(points), batch_gate=4, pack_target=8, max_ongoing=16,
                       gate_fill=0.75, startup_s=15.0, tick_s=0.5, tpot_slo_ms=600.0, ttft_slo_s=20.0),
        # gate 16: a K=8 verify step of 16 x 9 = 144 tokens is still memory-bound on this
        # roofline (the ridge is ~210 tokens at the assumed efficiencies).
        "gpu-h100-llama8b": Profile(
            "gpu-h100-llama8b", "roofline from published H100 SXM / Llama-3.1-8B figures (not measured)",
            gpu_h100_llama8b(), batch_gate=16, pack_target=48, max_ongoing=64, gate_fill=0.5, startup_s=60.0,
            tick_s=0.5, tpot_slo_ms=25.0, ttft_slo_s=5.0),
    }


def _levels(mean: float) -> tuple[float, ...]:
    """Three equally likely per-request acceptance lengths around a mean (none below 1)."""
    return tuple(round(max(1.0, mean * f), 3) for f in (0.6, 1.0, 1.4))


def mixes(results: Path = RESULTS) -> tuple[dict[str, Mix], str]:
    acc, source = acceptance_lengths(results)
    k = draft_lengths(results)
    edit = RequestClass("code_edit", 0.8, _levels(acc["code_edit"]), draft_len=k["code_edit"], output_tokens=600,
                        output_sigma=0.5, prompt_tokens=900)
    chat = RequestClass("chat", 0.2, _levels(acc["chat"]), draft_len=k["chat"], output_tokens=300, output_sigma=0.7,
                        prompt_tokens=150)
    prose = RequestClass("chat", 1.0, chat.acceptance_levels, chat.draft_len, chat.output_tokens,
                         chat.output_sigma, chat.prompt_tokens)
    return {"code_edit": Mix("code_edit", (edit, chat)), "non_repetitive": Mix("non_repetitive", (prose,))}, source
