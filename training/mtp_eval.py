"""Measuring an MTP head: chained acceptance, confidence calibration, draft cost.

The eval text is the target's own greedy output, so a draft that equals the target's greedy
prediction is exactly a draft the engine accepts. Acceptance at draft position k is the
fraction of anchor positions whose first k chained drafts all match: with K drafts and no
early stop, a verify step emits 1 + sum_{k<=K} acceptance_k tokens on average (the bonus
token included, as `replicas/stats.py` defines acceptance length).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from replicas.torch_engine.model import LlamaModel, SeqSpan
from replicas.torch_engine.mtp import MTPDrafter, MTPModule

CONFIDENCE_BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)


@torch.inference_mode()
def generate_greedy(target: LlamaModel, prompts: list[list[int]], new_tokens: int,
                    eos_id: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Greedy continuations (EOS included when reached), one packed decode step for all prompts.

    Per prompt: (generated ids [G], hidden [P+G-1, d] fp16 of every position that was fed,
    greedy [P+G-1]): the states the engine would have observed while serving it.
    """
    cache = target.make_cache(len(prompts), max(map(len, prompts)) + new_tokens)
    slots = [cache.allocate() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    hiddens: list[list[torch.Tensor]] = [[] for _ in prompts]
    greedy: list[list[torch.Tensor]] = [[] for _ in prompts]

    def record(i: int, h: torch.Tensor) -> int:
        pred = target.logits(h).argmax(-1)
        hiddens[i].append(h.half())
        greedy[i].append(pred)
        return int(pred[-1])

    last = [record(i, target(torch.tensor(p), [SeqSpan(slot, 0, len(p))], cache))
            for i, (slot, p) in enumerate(zip(slots, prompts))]
    live = list(range(len(prompts)))
    while live:
        for i in live:
            outs[i].append(last[i])
        live = [i for i in live if last[i] != eos_id and len(outs[i]) < new_tokens]
        if live:
            spans = [SeqSpan(slots[i], cache.lengths[slots[i]], 1) for i in live]
            h = target(torch.tensor([last[i] for i in live]), spans, cache)
            for row, i in enumerate(live):
                last[i] = record(i, h[row:row + 1])
    return [(outs[i], torch.cat(hiddens[i]), torch.cat(greedy[i])) for i in range(len(prompts))]


@torch.inference_mode()
def evaluate(module: MTPModule, target: LlamaModel, samples, vocab_sizes: list[int], shipped_vocab: int,
             max_k: int = 5, simulate_per_domain: int = 3) -> dict:
    """Per domain (sample.source): chained acceptance per draft position for each draft-vocab
    size (prefixes of module.draft_vocab) and the full vocabulary; calibration of the shipped
    size; a cross-check through the cached drafter (simulated greedy engine, K = max_k) on
    the first `simulate_per_domain` samples of each domain."""
    head = target.lm_head.weight.detach()
    sizes = sorted(set(vocab_sizes))
    correct = defaultdict(list)   # (domain, size) -> list of [A, max_k] bool
    calib = defaultdict(lambda: [[0, 0] for _ in CONFIDENCE_BINS[:-1]])  # domain -> bins of [n, accepted]
    for s in samples:
        length, first = len(s.tokens), s.prompt_len - 1
        anchors = torch.arange(first, length - max_k)  # every label g_{n+1..n+max_k} exists
        if anchors.numel() == 0:
            continue
        outs = module.unrolled(s.hidden[: length - 1].float(), target.embed_tokens(s.tokens[1:]),
                               target.rope(torch.arange(length - 1)), max_k)
        for name, weight, ids in [(n, head[module.draft_vocab[:n]], module.draft_vocab[:n]) for n in sizes] + \
                                 [("full", head, None)]:
            hits, probs = [], []
            for k in range(max_k):
                logits = outs[k][anchors + k] @ weight.T
                pred = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
                hits.append(pred == s.greedy[anchors + k + 1])
                probs.append(logits.softmax(-1).amax(-1))
            hits_t = torch.stack(hits, 1)
            correct[(s.source, name)].append(hits_t)
            if name == shipped_vocab:
                _bin_confidences(calib[s.source], torch.stack(probs, 1), hits_t)
    report: dict = {"max_k": max_k, "acceptance_by_vocab": {}, "calibration": {}, "simulated": {}}
    for (domain, name), parts in sorted(correct.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        hits = torch.cat(parts)
        chained = hits.cumprod(1).float().mean(0).tolist()  # first k all right
        report["acceptance_by_vocab"].setdefault(domain, {})[str(name)] = {
            "anchors": hits.shape[0], "top1_per_step": [round(x, 3) for x in hits.float().mean(0).tolist()],
            "chained": [round(x, 3) for x in chained],
            "tokens_per_step_K3": round(1 + sum(chained[:3]), 3), "tokens_per_step_K5": round(1 + sum(chained[:5]), 3)}
    for domain, bins in calib.items():
        report["calibration"][domain] = [
            {"conf": f"{lo:.1f}-{min(hi, 1.0):.1f}", "n": n, "accept": round(a / n, 3) if n else None}
            for (lo, hi), (n, a) in zip(zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:]), bins)]
    shipped = MTPModule(module.cfg, module.draft_vocab[:shipped_vocab].clone())
    shipped.load_state_dict({k: v for k, v in module.state_dict().items() if k != "draft_vocab"}, strict=False)
    drafter = MTPDrafter(shipped.eval(), target, max_slots=1, max_seq_len=max(len(s.tokens) for s in samples) + max_k)
    by_domain = defaultdict(lambda: [0, 0])
    seen: dict[str, int] = defaultdict(int)
    for s in samples:
        if seen[s.source] == simulate_per_domain:
            continue
        seen[s.source] += 1
        steps, emitted = simulate_greedy(drafter, s, max_k)
        by_domain[s.source][0] += steps
        by_domain[s.source][1] += emitted
    report["simulated"] = {d: {"verify_steps": st, "tokens_per_step": round(em / st, 3)} for d, (st, em) in by_domain.items()}
    return report


def smallest_good_vocab(acceptance: dict, sizes: list[int], tolerance: float = 0.005) -> int:
    """The smallest draft-vocab size whose mean chained acceptance (over domains and draft
    positions) is within `tolerance` of the best size's: a smaller head drafts faster."""
    def score(n: int) -> float:
        rows = [acceptance[d][str(n)]["chained"] for d in acceptance]
        return sum(sum(r) / len(r) for r in rows) / len(rows)

    best = max(score(n) for n in sizes)
    return min(n for n in sizes if score(n) >= best - tolerance)


def _bin_confidences(bins, probs, hits) -> None:
    """Count draft k by its confidence among anchors whose drafts before k were all accepted."""
    reached = torch.cat((torch.ones_like(hits[:, :1]), hits.cumprod(1)[:, :-1].bool()), 1)
    for p, h in zip(probs[reached].tolist(), hits[reached].tolist()):
        i = next(j for j, hi in enumerate(CONFIDENCE_BINS[1:]) if p < hi)
        bins[i][0] += 1
        bins[i][1] += int(h)


def simulate_greedy(drafter: MTPDrafter, sample, num_draft: int, slot: int = 0) -> tuple[int, int]:
    """Replay greedy serving of `sample` (prompt, then the target's own greedy text) through
    the cached drafter: (verify steps, tokens emitted). Accepts leading drafts that equal the
    text, as a greedy verifier would; the bonus token is the next text token."""
    tokens, hidden, end = sample.tokens, sample.hidden, len(sample.tokens) - 1
    drafter.add(slot)
    try:
        n = sample.prompt_len - 1  # last position whose hidden state is known; t_{n+1} = bonus
        drafter.observe(slot, hidden[: n + 1], tokens[1: n + 2])
        steps = emitted = 0
        while n + 2 <= end:  # the step's bonus token t_{n+a+2} must exist in the text
            (draft,) = drafter.propose([slot], [min(num_draft, end - n - 2)])
            accepted = 0
            while accepted < len(draft) and draft[accepted] == int(tokens[n + 2 + accepted]):
                accepted += 1
            steps, emitted = steps + 1, emitted + accepted + 1
            drafter.observe(slot, hidden[n + 1: n + accepted + 2], tokens[n + 2: n + accepted + 3])
            n += accepted + 1
        return steps, emitted
    finally:
        drafter.remove(slot)


@torch.inference_mode()
def time_drafting(module: MTPModule, target: LlamaModel, context: int = 256, reps: int = 15) -> dict:
    """Median ms of one chained draft step (batch 1 and 8), of flushing one observed position,
    and of the target's own 1-token decode step at the same context, for scale."""
    torch.manual_seed(0)
    ids = torch.randint(0, target.cfg.vocab_size, (context + 1,))
    cache = target.make_cache(1, context + 1)
    slot = cache.allocate()
    hidden = target(ids[:context], [SeqSpan(slot, 0, context)], cache)
    target_ms = _median_ms(lambda: (cache.truncate(slot, context), target.logits(target(ids[context:], [SeqSpan(slot, context, 1)], cache))), reps)
    out = {"context": context, "target_decode_step_ms": target_ms}
    for batch in (1, 8):
        drafter = MTPDrafter(module, target, max_slots=batch, max_seq_len=context + 16)
        slots = list(range(batch))
        for s in slots:
            drafter.add(s)
            drafter.observe(s, hidden[:-1], ids[1:context])
        drafter.propose(slots, [1] * batch)
        one = _median_ms(lambda: drafter.propose(slots, [1] * batch), reps)
        five = _median_ms(lambda: drafter.propose(slots, [5] * batch), reps)
        out[f"draft_step_ms_batch{batch}"] = round((five - one) / 4, 2)
    drafter = MTPDrafter(module, target, max_slots=1, max_seq_len=context + reps * 4 + 16)
    drafter.add(0)
    drafter.observe(0, hidden[:-1], ids[1:context])
    drafter.propose([0], [1])
    out["flush_one_position_ms"] = _median_ms(lambda: (drafter.observe(0, hidden[-1:], ids[-1:]), drafter.propose([0], [1])), reps)
    return out


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)
