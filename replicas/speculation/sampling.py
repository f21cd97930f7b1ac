"""The target distribution a request samples from, and the draw itself.

`sampling_probs` is the single definition of "what the model samples": the plain decoding
path draws from it, and speculative verification (`replicas.speculation.verify`) accepts or
rejects drafts against it, which is what makes speculative sampling exact.

Randomness comes only from `position_uniforms`, a stream keyed by the request's seed and
the output position and computed on the CPU, so a seed reproduces the same tokens whatever
device holds the logits and whatever was drafted.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
from torch import Tensor

from replicas.engine import TokenLogprob


# Top-p looks for the nucleus among the few most likely tokens first, widening a row's search
# only when its nucleus is larger: a partial top-k over a 49k vocabulary is ~10x cheaper than
# a full sort, and nuclei are usually small.
_NUCLEUS_CANDIDATES = (256, 4096)
_F32_MAX = torch.finfo(torch.float32).max


def greedy_tokens(logits: Tensor) -> list[int]:
    """Each row's argmax over `logits [T, V]`: the first maximum, or the first NaN, as torch's.
    On the CPU numpy's (vectorised) is taken: 4 us for a row of 49k where torch's takes 75 us,
    which was 6% of a batch of 8's decode step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16, torch.float64):
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sampling_probs(logits: Tensor, temperature: float, top_p: float, top_k: int, min_p: float = 0.0) -> Tensor:
    """Temperature, then top-k, then top-p, then min-p over `logits [T, V]`; returns `probs [T, V]`
    float32.

    Top-k keeps the `top_k` most likely tokens (0 = off) and renormalises. Top-p then keeps
    the smallest set of most likely tokens whose mass is at least `top_p`; the most likely
    token is always kept. Min-p then keeps the tokens at least `min_p` times as likely as the
    most likely one (0 = off). Rows sum to 1. Ties are broken deterministically, in no
    documented order; a row's bits never depend on the rows beside it (a verify step's
    drafts). Greedy decoding (temperature 0) never comes here: it is an argmax.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 here (greedy is argmax), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k: must be >= 0, got {top_k}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p: must be in [0, 1], got {min_p}")
    probs = _top_k_top_p(logits.float() / temperature, top_p, top_k)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / _row_sums(probs)
    return probs


def _row_sums(probs: Tensor) -> Tensor:
    """`[T, 1]`: each row of `probs [T, N]` added up in order. torch's sum splits one long row
    between threads but a batch by rows, so a row's sum (in its last bits) would depend on the
    rows beside it: a verify step's drafts."""
    return torch.cumsum(probs, dim=-1)[:, -1:]


def _top_k_top_p(scaled: Tensor, top_p: float, top_k: int) -> Tensor:
    vocab_size = scaled.shape[-1]
    use_top_k = 0 < top_k < vocab_size
    if not use_top_k and top_p >= 1:
        return torch.softmax(scaled, dim=-1)  # the common case needs no ranking at all
    if use_top_k:
        kept_logits, kept_ids = torch.topk(scaled, top_k, dim=-1)
        kept_probs = torch.softmax(kept_logits, dim=-1)  # renormalised over the top-k
        return _nucleus(kept_probs, kept_ids, top_p, vocab_size)
    probs = torch.softmax(scaled, dim=-1)
    out = torch.empty_like(probs)
    rows = torch.arange(probs.shape[0], device=probs.device)  # the rows whose nucleus is still to find
    for num_candidates in (*_NUCLEUS_CANDIDATES, vocab_size):
        # Each row widens alone: which of tied tokens a ranking keeps depends on how many it
        # ranks, so a row widened for the drafts beside it could keep another token.
        if num_candidates >= vocab_size:  # a full ranking: sort beats topk(V)
            kept_probs, kept_ids = torch.sort(probs[rows], dim=-1, descending=True)
        else:
            kept_probs, kept_ids = torch.topk(probs[rows], num_candidates, dim=-1)
        found = (torch.cumsum(kept_probs, dim=-1)[:, -1] >= top_p) | (num_candidates >= vocab_size)
        out[rows[found]] = _nucleus(kept_probs[found], kept_ids[found], top_p, vocab_size)
        rows = rows[~found]
        if not len(rows):
            break
    return out


def _nucleus(kept_probs: Tensor, kept_ids: Tensor, top_p: float, vocab_size: int) -> Tensor:
    """`[T, V]`: the fewest most likely of `kept_probs [T, N]` (descending, token ids
    `kept_ids [T, N]`) whose mass reaches top_p, renormalised; zero elsewhere."""
    if top_p < 1:
        # A token stays while the mass strictly before it is short of top_p: that is the
        # smallest prefix reaching top_p, and the first token (mass before it 0) always stays.
        dropped = torch.cumsum(kept_probs, dim=-1) - kept_probs >= top_p
        dropped[:, 0] = False  # also where top_p is under float32's least (it compared as 0)
        kept_probs = kept_probs.masked_fill(dropped, 0.0)
        kept_probs = kept_probs / _row_sums(kept_probs)
    return kept_probs.new_zeros((kept_probs.shape[0], vocab_size)).scatter_(-1, kept_ids, kept_probs)


def bias_(logits: Tensor, logit_bias: Sequence[tuple[int, float]]) -> Tensor:
    """OpenAI's logit_bias on `logits [K+1, V]` in place: the same addition on every row."""
    token_ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long, device=logits.device)
    logits[:, token_ids] += torch.tensor([b for _, b in logit_bias], dtype=logits.dtype, device=logits.device)
    return logits


def penalize_(logits: Tensor, output_ids: Sequence[int], draft: Sequence[int], presence: float,
              frequency: float) -> Tensor:
    """OpenAI's presence and frequency penalties on `logits [K+1, V]` in place, row i counting
    the output plus `draft[:i]`: what plain decoding would count at that position, so the
    subtraction gives the same bits with or without a draft."""
    counts = Counter(output_ids)
    for row in range(len(draft) + 1):
        if counts:
            token_ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
            occurrences = torch.tensor(list(counts.values()), dtype=torch.float32, device=logits.device)
            logits[row, token_ids] -= frequency * occurrences + presence
        if row < len(draft):
            counts[int(draft[row])] += 1
    return logits


def repetition_penalize_(logits: Tensor, seen: Sequence[int], draft: Sequence[int], penalty: float) -> Tensor:
    """vLLM's repetition penalty on `logits [K+1, V]` in place: row i's tokens among `seen` (the
    prompt and the output) and `draft[:i]` have a positive logit divided by `penalty`, a
    negative one multiplied, the same operation on the same values as plain decoding."""
    token_ids = set(seen)
    for row in range(len(draft) + 1):
        ids = torch.tensor(sorted(token_ids), dtype=torch.long, device=logits.device)
        values = logits[row, ids]
        # finite: a penalty under float32's least divided by 0 (inf logits, NaN probabilities)
        logits[row, ids] = torch.where(values > 0, values / penalty, values * penalty).clamp(-_F32_MAX, _F32_MAX)
        if row < len(draft):
            token_ids.add(int(draft[row]))
    return logits


def hold_stops_(logits: Tensor, first_position: int, min_tokens: int, stop_ids: Sequence[int]) -> Tensor:
    """`min_tokens` on `logits [K+1, V]` in place: row i samples output position first_position + i,
    and below min_tokens none of `stop_ids` may come there."""
    rows = min(max(min_tokens - first_position, 0), logits.shape[0])
    if rows and stop_ids:
        logits[:rows, torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def sample_at(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF sampling of `probs [T, V]` at given points `uniforms [T]` in [0, 1)."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [T, V]; float64 so the tail keeps its mass
    # First index whose CDF exceeds the point: a zero-mass token has the same CDF as its
    # predecessor, so it can never be the first to exceed it.
    points = uniforms.to(cdf).reshape(-1, 1) * cdf[:, -1:]  # [T, 1]
    token_ids = torch.searchsorted(cdf, points, right=True)  # [T, 1]
    return token_ids.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


_MASK64 = (1 << 64) - 1


def position_uniforms(seed: int, first_position: int, count: int) -> Tensor:
    """Uniforms in [0, 1) for output positions [first, first + count) of a seeded request.

    A counter-based stream (splitmix64 of seed and position): the number used at output
    position t depends on nothing else, not on how many draws drafts consumed before it,
    so a seeded request samples the same tokens with any draft, batch or gate.
    """
    values = []
    for position in range(first_position, first_position + count):
        z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        values.append((z >> 11) * 2.0**-53)  # 53 random bits: a double in [0, 1)
    return torch.tensor(values, dtype=torch.float64)


def token_logprobs(logits: Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Each emitted token's logprob under its row of `logits [T, V]`, its rank there, and the
    row's `num_top` most likely tokens: the model's own distribution (temperature 1, before
    top-k / top-p), with penalties and a grammar's mask already applied. Forbidden tokens
    (-inf) are never listed."""
    logprobs = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)  # [T, V]
    index = torch.tensor(token_ids, dtype=torch.long, device=logits.device).reshape(-1, 1)
    chosen = logprobs.gather(1, index)  # [T, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if num_top:
        top_values, top_ids = torch.topk(logprobs, num_top, dim=-1)
        tops = [tuple((i, v) for i, v in zip(ids, values) if v != float("-inf"))
                for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    return [TokenLogprob(int(t), lp, top, rank)
            for t, lp, top, rank in zip(token_ids, chosen.squeeze(1).tolist(), tops, ranks)]
