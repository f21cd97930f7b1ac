"""MTP draft head (DeepSeek-V3 style, one module chained K times) and its batched drafter.

At target position j, with the target's final-normed hidden state h_j and the token that
followed, t_{j+1}, the module predicts t_{j+2}:

    x_j  = proj([hidden_norm(h_j) ; embed_norm(embed(t_{j+1}))])      2d -> d
    g_j  = DecoderLayer(x_j)      causal attention over the head's own KV cache
    h'_j = out_norm(g_j)          logits = lm_head(h'_j), over a reduced draft vocabulary

`embed` and `lm_head` are the target's own (shared, frozen, never stored with the head).
Chaining feeds h'_j back as the hidden state of the next position, so one module drafts
any number of tokens; `training/mtp_train.py` trains it unrolled that way (EAGLE-3's
training-time test).

Drafts are greedy over the N most frequent target predictions (`draft_vocab`, FR-Spec):
a [N, d] head instead of [49152, d] is most of why a draft step is cheap. Greedy drafts are
point masses, which keeps the engine's rejection sampling exact.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replicas.torch_engine.hf_checkpoint import read_safetensors_file
from replicas.torch_engine.kv_cache import KVCache
from replicas.torch_engine.model import DecoderLayer, RMSNorm, SeqSpan, apply_rope
from replicas.torch_engine.model_config import ModelConfig

DEFAULT_WEIGHTS_DIR = Path(__file__).parent / "weights" / "smollm2-135m-instruct"
WEIGHTS_FILE = "mtp.safetensors"
META_FILE = "mtp.json"
DEFAULT_MTP_WEIGHTS = "default"  # the `mtp_weights` setting that names DEFAULT_WEIGHTS_DIR


def weights_dir(setting: str) -> Path:
    """The directory an `mtp_weights` setting names ("default": the head shipped for the default model)."""
    return DEFAULT_WEIGHTS_DIR if setting == DEFAULT_MTP_WEIGHTS else Path(setting).expanduser()


def setting_problems(setting: str | None, target_cfg: ModelConfig) -> list[str]:
    """What is wrong with an engine's `mtp_weights` setting for a target of `target_cfg`, as
    the engine checks it when it starts and `deploy.config_check` before a deploy."""
    if setting is None:
        return []
    problem = weights_problem(weights_dir(setting), target_cfg)
    return [f"mtp_weights: {problem}"] if problem else []


def weights_problem(path: str | Path, target_cfg: ModelConfig) -> str | None:
    """Why the MTP head in `path` cannot draft for a target of `target_cfg` (None: it can),
    read from its files' presence and `mtp.json` alone."""
    path = Path(path).expanduser()
    missing = [name for name in (META_FILE, WEIGHTS_FILE) if not (path / name).is_file()]
    if missing:
        return (f"{str(path)!r} holds no {' or '.join(missing)} (an MTP head's directory, as "
                f"training/mtp_train.py writes it; null turns MTP drafting off)")
    try:
        trained_for = ModelConfig(**json.loads((path / META_FILE).read_text())["target_config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{str(path / META_FILE)!r} is not an MTP head's metadata ({type(exc).__name__}: {exc})"
    shape_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    diffs = [f for f in shape_fields if getattr(trained_for, f) != getattr(target_cfg, f)]
    if diffs:
        return (f"the MTP head in {str(path)!r} was trained for another target ({', '.join(diffs)} differ); "
                f"train one for this model with training/mtp_train.py, or set null to draft without it")
    return None


class MTPModule(nn.Module):
    """The trainable head: two input norms, the 2d -> d fusion, one decoder layer, an output norm."""

    def __init__(self, cfg: ModelConfig, draft_vocab: Tensor) -> None:
        super().__init__()
        if draft_vocab.dim() != 1 or draft_vocab.numel() < 1:
            raise ValueError(f"draft_vocab must be a non-empty 1-D id tensor, got shape {tuple(draft_vocab.shape)}")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= cfg.vocab_size:
            raise ValueError(f"draft_vocab ids must lie in [0, {cfg.vocab_size})")
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.hidden_norm = RMSNorm(d, eps)
        self.embed_norm = RMSNorm(d, eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(replace(cfg, qkv_bias=False))  # a Qwen2 target's head has none
        self.out_norm = RMSNorm(d, eps)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.int64))  # [N] full-vocab ids

    def fuse(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        """hidden, embeds [..., d] -> layer input [..., d]."""
        return self.proj(torch.cat((self.hidden_norm(hidden), self.embed_norm(embeds)), dim=-1))

    def step(self, hidden: Tensor, embeds: Tensor, rope: tuple[Tensor, Tensor], spans: Sequence[SeqSpan],
             k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Cached path over packed positions [N]: writes their K/V, returns h' [N, d]."""
        return self.out_norm(self.layer(self.fuse(hidden, embeds), rope, spans, k_cache, v_cache))

    def unrolled(self, hidden: Tensor, embeds: Tensor, rope: tuple[Tensor, Tensor], num_steps: int) -> list[Tensor]:
        """Training path, no cache: every position of a window is an anchor, chained `num_steps` deep.

        hidden [T, d]: target states at consecutive positions; embeds [T, d]: embeddings of the
        token that followed each; rope: (cos, sin) [T, hd] of those positions. Returns h' [T, d]
        per step s: row p is step s of the chain anchored at p - s (rows p < s are padding).
        Step s sees step-0 keys of positions <= p - s plus the s earlier steps of its own chain,
        which is exactly what the cached path attends over while drafting.
        """
        layer, attn = self.layer, self.layer.self_attn
        t, h, kvh, hd, g = hidden.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.group_size
        cos, sin = rope[0][:, None], rope[1][:, None]
        keys: list[Tensor] = []    # per step [kvh, T, hd]
        values: list[Tensor] = []
        outs: list[Tensor] = []
        h_in = hidden
        for s in range(num_steps):
            x = self.fuse(h_in, embeds)
            qkv = attn.project(layer.input_layernorm(x))
            qk = apply_rope(qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd), cos, sin)
            keys.append(qk[:, h:].transpose(0, 1))
            values.append(qkv[:, (h + kvh) * hd:].view(t, kvh, hd).transpose(0, 1))
            q = qk[:, :h].permute(1, 0, 2).reshape(kvh, g * t, hd)  # rows (query head in group, position)
            mask = chain_mask(t, s, x.device).repeat(g, 1)
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 1), torch.cat(values, 1), attn_mask=mask)
            x = x + attn.o_proj(o.view(h, t, hd).transpose(0, 1).reshape(t, h * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            out = self.out_norm(x)
            outs.append(out)
            # Step s+1 at position p continues the chain whose step s ran at position p - 1.
            h_in = torch.cat((torch.zeros_like(out[:1]), out[:-1]))
        return outs

    @classmethod
    def load(cls, path: str | Path, target_cfg: ModelConfig, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> "MTPModule":
        """Load `path/mtp.safetensors` + `mtp.json`; ValueError if made for another target shape
        or if the weights file is not an MTP head's (truncated, other tensors)."""
        problem = weights_problem(path, target_cfg)
        if problem:
            raise ValueError(problem)
        weights = Path(path).expanduser() / WEIGHTS_FILE
        state = read_safetensors_file(weights)
        try:
            module = cls(target_cfg, state["draft_vocab"])
            module.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                                   strict=True)
        except (KeyError, ValueError, RuntimeError) as exc:  # tensors missing, unexpected or misshapen
            raise ValueError(f"{weights}: not the weights of an MTP head for this model "
                             f"({type(exc).__name__}: {str(exc)[:300]})") from None
        return module.to(device).eval()

    def save(self, path: str | Path, meta: dict) -> None:
        """Write fp16 weights and a JSON with the target config plus `meta` (recipe, figures).
        Each file is written whole, then renamed over the old one: a run killed while saving
        leaves the last complete files, never a cut one."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: (v.half() if v.is_floating_point() else v.to(torch.int32)).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, path / f".{WEIGHTS_FILE}.part", metadata={"format": "pt"})
        full = {"target_config": asdict(self.cfg), "draft_vocab_size": int(self.draft_vocab.numel()), **meta}
        (path / f".{META_FILE}.part").write_text(json.dumps(full, indent=2) + "\n")
        for name in (WEIGHTS_FILE, META_FILE):
            os.replace(path / f".{name}.part", path / name)


class Target(Protocol):
    """What the drafter reads of the target model (`LlamaModel` or `NativeLlamaModel`)."""

    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device

    def embed(self, tokens: Tensor) -> Tensor: ...

    def head_rows(self, ids: Tensor) -> Tensor: ...

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class Draft:
    """One slot's chained draft: full-vocab ids and the head's max probability at each."""

    tokens: tuple[int, ...]
    confidences: tuple[float, ...]


class MTPDrafter:
    """Per-slot MTP state for the engine: observe accepted positions, propose greedy drafts.

    Protocol (slots are the engine's own ids in [0, max_slots)):
      add(slot) when a request starts; remove(slot) when it ends; forget(slot) drops its queue.
      observe(slot, hidden [n, d], next_tokens [n]) for every newly accepted target position,
        in order from position 0 (prompt included): the target's final-normed hidden state and
        the token that followed it (for the last position: the bonus token). Only queued;
        observe_rows queues a step's rows of several slots at once.
      propose(slots, num_draft) flushes the queue of those slots in one packed forward and
        chains greedy drafts batched across slots.
    Chained positions are scratch beyond the slot's length, so rejections need no rollback.
    """

    def __init__(self, module: MTPModule, target: Target, max_slots: int, max_seq_len: int) -> None:
        cfg = target.cfg
        if module.cfg.hidden_size != cfg.hidden_size or module.cfg.vocab_size != cfg.vocab_size:
            raise ValueError("MTP module and target disagree on hidden_size / vocab_size")
        self.module, self.target = module.eval(), target
        self._hidden_size = cfg.hidden_size
        self._runner = _runner_for(module, target, max_slots, max_seq_len)
        self._cache = self._runner.cache
        self._cache_slot: dict[int, int] = {}           # engine slot -> head cache slot
        self._pending: dict[int, list[tuple[Tensor, list[int]]]] = {}  # rows [n, d], the n ids after them
        self._queued: dict[int, int] = {}  # positions in _pending[slot], counted as they come
        self._tail: dict[int, tuple[Tensor, int, float]] = {}  # h'_last [d], first draft id, its prob

    @classmethod
    def load(cls, target: Target, max_slots: int, max_seq_len: int,
             path: str | Path = DEFAULT_WEIGHTS_DIR) -> "MTPDrafter":
        """A drafter with the committed weights for the default model (or those at `path`)."""
        module = MTPModule.load(path, target.cfg, dtype=target.dtype, device=target.device)
        return cls(module, target, max_slots, max_seq_len)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.module.draft_vocab.numel())

    def add(self, slot: int) -> None:
        if slot in self._cache_slot:
            raise ValueError(f"MTP slot {slot} is already added")
        self._cache_slot[slot] = self._cache.allocate()
        self._pending[slot], self._queued[slot] = [], 0

    def remove(self, slot: int) -> None:
        self._cache.free(self._cache_slot.pop(self._require(slot)))
        del self._pending[slot], self._queued[slot]
        self._tail.pop(slot, None)

    def observe(self, slot: int, hidden: Tensor, next_tokens: Tensor) -> None:
        """Queue accepted positions: hidden [n, d], next_tokens [n] int. The rows are copied: a
        verify step's rows view the whole step's hidden states (every request's drafts), which
        the queue would otherwise keep alive until the slot's next draft."""
        self.observe_rows([slot], [hidden.clone()], [next_tokens.tolist()])

    def observe_rows(self, slots: Sequence[int], hiddens: Sequence[Tensor], next_tokens: Sequence[list[int]]) -> None:
        """`observe` for several slots at once: slot i's rows hiddens[i] [n_i, d] and the token
        ids next_tokens[i] (n_i ints) that followed them. The rows are queued as they are, not
        copied: pass views of one gather of just the rows queued (a step's kept rows), which
        then lives while any slot queues a row of it. Nothing is queued unless every slot can
        take its rows."""
        for slot, hidden, tokens in zip(slots, hiddens, next_tokens, strict=True):
            if hidden.dim() != 2 or hidden.shape[1] != self._hidden_size:
                raise ValueError(f"hidden must be [n, {self._hidden_size}], got {tuple(hidden.shape)}")
            if len(tokens) != hidden.shape[0]:
                raise ValueError(f"next_tokens must hold {hidden.shape[0]} ids, got {len(tokens)}")
            if self._cache.lengths[self._cache_slot[self._require(slot)]] + self._queued[slot] + len(tokens) \
                    > self._cache.max_seq_len:
                raise ValueError(f"MTP slot {slot}: more than max_seq_len={self._cache.max_seq_len} positions")
        for slot, hidden, tokens in zip(slots, hiddens, next_tokens):
            if tokens:
                self._pending[slot].append((hidden, list(tokens)))
                self._queued[slot] += len(tokens)

    def queued(self, slot: int) -> int:
        """Positions observed since the slot's last draft: the next one runs the head over them."""
        return self._queued[self._require(slot)]

    def forget(self, slot: int, keep: int = 0) -> None:
        """Drop all but the last `keep` of the slot's queued positions unseen, with its pending
        first draft: the head goes on as if they followed the last position it ran over. For a
        request whose asks do not pay, so that its next ask (a probe) does not catch the head up
        on a whole prompt or hundreds of SA-copied positions, nor the queue hold them (2.3 KB
        each) meanwhile; its drafts are still only proposals."""
        drop = self._queued[self._require(slot)] - keep
        if drop <= 0:
            return
        kept, rows = [], 0
        for hidden, tokens in reversed(self._pending[slot]):
            if rows == keep:
                break
            cut = max(0, len(tokens) - (keep - rows))  # only the oldest kept entry is cut
            kept.append((hidden[cut:], tokens[cut:]) if cut else (hidden, tokens))
            rows += len(tokens) - cut
        kept.reverse()
        # only the kept rows are copied, into a tensor of their own
        self._pending[slot] = [(torch.cat([h for h, _ in kept]), [t for _, ts in kept for t in ts])] if kept else []
        self._queued[slot] = keep
        self._tail.pop(slot, None)  # its first draft follows a position the head no longer goes on from

    def propose(self, slots: Sequence[int], num_draft: Sequence[int], min_confidence: float = 0.0) -> list[list[int]]:
        """Greedy drafts (full-vocab ids) for each slot; a draft stops before any token whose
        head probability is below `min_confidence` (0 keeps all `num_draft`)."""
        return [list(d.tokens) for d in self.draft(slots, num_draft, min_confidence)]

    @torch.inference_mode()
    def draft(self, slots: Sequence[int], num_draft: Sequence[int], min_confidence: float = 0.0) -> list[Draft]:
        """`propose` with the per-token confidences (max softmax probability over the draft vocab)."""
        if len(slots) != len(num_draft):
            raise ValueError(f"slots ({len(slots)}) and num_draft ({len(num_draft)}) differ in length")
        if len(set(slots)) != len(slots):
            raise ValueError("slots: each slot at most once per call")
        for slot in slots:
            self._require(slot)
        want = dict(zip(slots, num_draft))
        self._flush([s for s in slots if self._pending[s]])
        tokens: dict[int, list[int]] = {s: [] for s in slots}
        probs: dict[int, list[float]] = {s: [] for s in slots}
        live = []  # (slot, h'_prev, previous draft id)
        for slot, k in zip(slots, num_draft):
            if k < 1 or slot not in self._tail:
                continue
            h_last, first, conf = self._tail[slot]
            if conf < min_confidence:
                continue
            tokens[slot].append(first)
            probs[slot].append(conf)
            live.append((slot, h_last))
        step = 1
        while True:
            live = [(s, h) for s, h in live if len(tokens[s]) < want[s]
                    and self._cache.lengths[self._cache_slot[s]] + step <= self._cache.max_seq_len]
            if not live:
                break
            # Chained position n+step of each slot (n = its last observed position), scratch.
            spans = [SeqSpan(self._cache_slot[s], self._cache.lengths[self._cache_slot[s]] + step - 1, 1) for s, _ in live]
            hidden = torch.stack([h for _, h in live])
            prev = torch.tensor([tokens[s][-1] for s, _ in live], dtype=torch.int64, device=hidden.device)
            h_new = self._step(hidden, prev, spans)
            ids, conf = self._greedy(h_new)
            nxt = []
            for i, (slot, _) in enumerate(live):
                if conf[i] < min_confidence:
                    continue
                tokens[slot].append(ids[i])
                probs[slot].append(conf[i])
                nxt.append((slot, h_new[i]))
            live, step = nxt, step + 1
        return [Draft(tuple(tokens[s]), tuple(probs[s])) for s in slots]

    def _flush(self, slots: list[int]) -> None:
        """One packed head forward over every queued position of `slots`; refresh their tails."""
        if not slots:
            return
        hiddens, nexts, spans = [], [], []
        for slot in slots:
            h = torch.cat([h for h, _ in self._pending[slot]])
            hiddens.append(h)
            nexts += [t for _, ts in self._pending[slot] for t in ts]
            cs = self._cache_slot[slot]
            spans.append(SeqSpan(cs, self._cache.lengths[cs], h.shape[0]))
            self._pending[slot], self._queued[slot] = [], 0
        dtype, device = self.target.dtype, self.target.device
        h_out = self._step(torch.cat(hiddens).to(dtype), torch.tensor(nexts, dtype=torch.int64, device=device), spans)
        last_rows = torch.tensor([s.length for s in spans]).cumsum(0) - 1
        for span in spans:
            self._cache.lengths[span.slot] = span.start + span.length
        tails = h_out[last_rows.to(h_out.device)]
        ids, conf = self._greedy(tails)
        for i, slot in enumerate(slots):
            self._tail[slot] = (tails[i], ids[i], conf[i])

    def _step(self, hidden: Tensor, tokens: Tensor, spans: list[SeqSpan]) -> Tensor:
        return self._runner.step(hidden, self.target.embed(tokens), spans)

    def _greedy(self, h: Tensor) -> tuple[list[int], list[float]]:
        logits = self._runner.logits(h)                        # [B, N]
        conf, idx = logits.softmax(dim=-1).max(dim=-1)
        return self.module.draft_vocab[idx].tolist(), conf.tolist()

    def _require(self, slot: int) -> int:
        if slot not in self._cache_slot:
            raise ValueError(f"MTP slot {slot} was not added")
        return slot


class TorchHeadRunner:
    """The head's cached step in torch (the CUDA target, and training's reference)."""

    def __init__(self, module: MTPModule, target: Target, max_slots: int, max_seq_len: int) -> None:
        cfg = target.cfg
        self.module, self.target = module, target
        self.head = target.head_rows(module.draft_vocab).to(target.dtype).contiguous()  # [N, d] reduced lm_head
        self.cache = KVCache(1, max_slots, max_seq_len, cfg.num_kv_heads, cfg.head_dim, dtype=target.dtype,
                             device=target.device)

    def step(self, hidden: Tensor, embeds: Tensor, spans: list[SeqSpan]) -> Tensor:
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in spans]).to(hidden.device)
        return self.module.step(hidden, embeds, self.target.rope(positions), spans, self.cache.k[0], self.cache.v[0])

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(h, self.head).float()


def _runner_for(module: MTPModule, target: Target, max_slots: int, max_seq_len: int):
    from replicas.torch_engine.native_model import NativeLlamaModel, NativeMtpHead

    if isinstance(target, NativeLlamaModel):
        return NativeMtpHead(module, target, max_slots, max_seq_len)
    return TorchHeadRunner(module, target, max_slots, max_seq_len)


def chain_mask(num_positions: int, step: int, device: torch.device | str = "cpu") -> Tensor:
    """[T, (step+1)*T] bool: which keys step `step` of the chain at row p attends to.

    Block 0 holds step-0 keys (the observed positions): causal up to p - step, the chain's
    anchor. Block i (1..step) holds step-i keys: only position p - (step - i), the same chain.
    """
    t = num_positions
    ones = torch.ones(t, t, dtype=torch.bool, device=device)
    blocks = [ones.tril(-step)] + [ones.tril(-(step - i)).triu(-(step - i)) for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)
