"""Train the MTP draft head by self-distillation: `python -m training.mtp_train --out DIR`.

1. Data: real text from packaged corpora (ShareGPT chats and Spec-Bench prompts through the
   chat template, HumanEval, psf/requests code edits with the prefilled answer) plus the
   target's own greedy answers to training chat prompts, run once through the target to
   cache (h_j, t_{j+1}, greedy_j) per position. Labels are the
   target's own greedy predictions, not the corpus text: the head must imitate the target.
   Every corpus has a fixed held-out split (`corpora._is_held_out`) that is never trained on.
2. Train the head unrolled `--steps` deep (EAGLE-3 training-time test: chained steps read
   the head's own h' and attend exactly as the cached drafter will), AdamW, cross-entropy
   over the draft vocabulary, bounded by `--minutes`.
3. Evaluate on text the target itself generated greedily from held-out prompts, so "the
   draft equals the label" is "the engine accepts it": chained acceptance per draft
   position, per draft-vocabulary size, confidence calibration, and draft-step cost.
4. Save fp16 weights + a JSON with config, draft vocabulary, recipe and figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from replicas.engine import DEFAULT_MODEL
from replicas.torch_engine.loader import packaged_gguf_path, resolve_model_dir
from replicas.torch_engine.model import LlamaModel, SeqSpan
from replicas.torch_engine.mtp import MTPModule
from replicas.torch_engine.native_model import NativeLlamaModel
from training import mtp_eval
from training.corpora import Corpus

# Source -> share of the training-token budget. Chat is the hard, common case and gets the
# largest share; "self_chat" is the target's own greedy answers to training-split chat
# prompts, i.e. the text the head drafts at serving time (a first run trained on corpus
# text alone reached 0.67 top-1 on training text but 0.27 on the target's own chat).
MIX = {"sharegpt": 0.20, "self_chat": 0.40, "spec_bench": 0.05, "humaneval": 0.10, "code_edits": 0.25}
SELF_CHAT_BATCH = 16
SELF_CHAT_NEW_TOKENS = 192


@dataclass
class Sample:
    """One target pass: tokens [L], hidden [L, d] fp16 (final-normed), greedy [L] (argmax at j)."""

    source: str
    tokens: torch.Tensor
    hidden: torch.Tensor
    greedy: torch.Tensor
    prompt_len: int = 0  # eval samples: positions before this are the prompt


# --- the target pass -------------------------------------------------------------------

@torch.inference_mode()
def run_target(target: LlamaModel, tokens: list[int], source: str, prompt_len: int = 0) -> Sample:
    """One teacher-forced target pass over `tokens`: hidden states and greedy predictions."""
    ids = torch.tensor(tokens, dtype=torch.int64)
    cache = target.make_cache(1, len(tokens))
    hidden = target(ids, [SeqSpan(cache.allocate(), 0, len(tokens))], cache)
    greedy = torch.cat([target.logits(h).argmax(-1) for h in hidden.split(256)])
    return Sample(source, ids, hidden.half(), greedy, prompt_len)


def pack(docs: Iterator[list[int]], max_tokens: int) -> Iterator[list[int]]:
    """Concatenate short documents up to `max_tokens` per sequence; cut long ones."""
    buf: list[int] = []
    for doc in docs:
        doc = doc[:max_tokens]
        if buf and len(buf) + len(doc) > max_tokens:
            yield buf
            buf = []
        buf = buf + doc
    if buf:
        yield buf


def build_train_data(target: LlamaModel, corpus: Corpus, max_tokens: int, seq_tokens: int,
                     budget_s: float, eos_id: int) -> list[Sample]:
    """Run the target over the mix until `max_tokens` or `budget_s`, keeping the shares in MIX."""
    streams = {name: target_passes(target, docs, name, seq_tokens) for name, docs in corpus.train_docs().items()}
    streams["self_chat"] = self_chat(target, corpus, eos_id)
    done = {name: 0 for name in streams}
    samples: list[Sample] = []
    started = time.monotonic()
    bar = tqdm(total=max_tokens, desc="target pass", unit="tok", file=sys.stdout)
    while streams and sum(done.values()) < max_tokens and time.monotonic() - started < budget_s:
        name = min(streams, key=lambda n: done[n] / MIX[n])  # the source furthest behind its share
        sample = next(streams[name], None)
        if sample is None or done[name] >= MIX[name] * max_tokens:
            del streams[name]
            continue
        samples.append(sample)
        done[name] += len(sample.tokens)
        bar.update(len(sample.tokens))
        bar.set_postfix({k: v for k, v in done.items()})
    bar.close()
    return samples


def target_passes(target: LlamaModel, docs: Iterator[list[int]], source: str, seq_tokens: int) -> Iterator[Sample]:
    for seq in pack(docs, seq_tokens):
        yield run_target(target, seq, source)


def self_chat(target: LlamaModel, corpus: Corpus, eos_id: int) -> Iterator[Sample]:
    """The target's greedy answers to training-split chat prompts, generated in batches."""
    prompts = corpus.self_chat_prompts()
    while batch := list(itertools.islice(prompts, SELF_CHAT_BATCH)):
        for prompt, (gen, hidden, greedy) in zip(batch, mtp_eval.generate_greedy(target, batch, SELF_CHAT_NEW_TOKENS, eos_id)):
            yield Sample("self_chat", torch.tensor(prompt + gen[:-1], dtype=torch.int64), hidden, greedy)


def build_eval_data(target: LlamaModel, corpus: Corpus, per_source: int, new_tokens: int, eos_id: int,
                    max_prompt_tokens: int = 1536) -> list[Sample]:
    """Held-out prompts continued greedily by the target, with the states it produced on the way."""
    samples = []
    for domain, prompts in corpus.eval_prompts(per_source, max_prompt_tokens).items():
        for prompt, (gen, hidden, greedy) in zip(prompts, mtp_eval.generate_greedy(target, prompts, new_tokens, eos_id)):
            # The last generated token was never fed back (no state): it survives as greedy[-1].
            tokens = torch.tensor(prompt + gen[:-1], dtype=torch.int64)
            samples.append(Sample(domain, tokens, hidden, greedy, prompt_len=len(prompt)))
    return samples


def describe_data(train: list[Sample], held_out: list[Sample], seconds: float) -> dict:
    tokens: dict[str, int] = {}
    for s in train:
        tokens[s.source] = tokens.get(s.source, 0) + len(s.tokens)
    evals: dict[str, int] = {}
    for s in held_out:
        evals[s.source] = evals.get(s.source, 0) + len(s.tokens) - s.prompt_len
    return {"train_tokens": sum(tokens.values()), "train_tokens_by_source": tokens, "mix": MIX,
            "sequences": len(train), "eval_generated_tokens_by_domain": evals,
            "held_out": "every 10th ShareGPT chat and Spec-Bench turn; last 20% of HumanEval tasks and code edits",
            "self_chat": f"target greedy answers (<= {SELF_CHAT_NEW_TOKENS} tokens) to training-split chat prompts",
            "target_pass_and_eval_generation_minutes": round(seconds / 60, 1)}


# --- training ---------------------------------------------------------------------------

def select_draft_vocab(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent greedy predictions (ties by id): FR-Spec's reduced head."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s.greedy, minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[:size], dtype=torch.int64)


def init_module(target: LlamaModel, draft_vocab: torch.Tensor, seed: int) -> MTPModule:
    torch.manual_seed(seed)
    module = MTPModule(target.cfg, draft_vocab)
    for name, p in module.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    # out_norm keeps its ones: starting at the target's final-norm scale (~1.8) makes random
    # initial logits so confident that the first minutes go to undoing it (measured).
    return module


def windows(samples: list[Sample], window: int, min_len: int = 16) -> list[tuple[int, int, int]]:
    """(sample, start, end) covering positions [0, L-1) of every sample (the last position
    has no following token); tails shorter than `min_len` are dropped."""
    out = []
    for i, s in enumerate(samples):
        for a in range(0, len(s.tokens) - 1, window):
            b = min(a + window, len(s.tokens) - 1)
            if b - a >= min_len:
                out.append((i, a, b))
    return out


def window_inputs(target: LlamaModel, s: Sample, a: int, b: int):
    """hidden [T, d], embeds [T, d] of the following tokens, rope, greedy labels [T] (full ids)."""
    with torch.no_grad():
        embeds = target.embed_tokens(s.tokens[a + 1:b + 1])
        rope = target.rope(torch.arange(a, b))
    return s.hidden[a:b].float(), embeds, rope, s.greedy[a + 1:b + 1]


def train(module: MTPModule, target: LlamaModel, samples: list[Sample], args) -> dict:
    head = target.lm_head.weight.detach()[module.draft_vocab]           # [N, d], frozen
    to_draft = torch.full((target.cfg.vocab_size,), -100, dtype=torch.int64)
    to_draft[module.draft_vocab] = torch.arange(module.draft_vocab.numel())
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step_weights = [0.8 ** s for s in range(args.steps)]
    wins = windows(samples, args.window)
    rng = random.Random(args.seed)
    budget_s = args.minutes * 60
    started = time.monotonic()
    ema_loss, ema_acc = None, [0.0] * args.steps
    step, epoch, tokens_seen = 0, 0, 0
    bar = tqdm(total=int(budget_s), desc="train", unit="s", file=sys.stdout)
    module.train()
    token_budget = args.max_train_tokens or math.inf
    while time.monotonic() - started < budget_s and tokens_seen < token_budget:
        rng.shuffle(wins)
        for i, a, b in wins:
            elapsed = time.monotonic() - started
            if elapsed >= budget_s or tokens_seen >= token_budget:
                break
            # warmup, then cosine to 10% over the time budget (the run is bounded by time)
            lr = args.lr * min(1.0, (step + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * elapsed / budget_s)))
            for group in opt.param_groups:
                group["lr"] = lr
            hidden, embeds, rope, greedy = window_inputs(target, samples[i], a, b)
            labels = to_draft[greedy]
            # Row p predicts t_{p+2}, as the target's h_{p+1} does: that state is the feature
            # target and its (draft-vocab) distribution the soft label, for every step.
            h_next = samples[i].hidden[a + 1:b + 1].float()
            with torch.no_grad():
                teacher = (h_next @ head.T).softmax(-1) if args.soft_labels else None
            outs = module.unrolled(hidden, embeds, rope, args.steps)
            loss = torch.zeros(())
            for s, out in enumerate(outs):
                valid = labels[s:] >= 0  # rows p >= s (a chain exists) whose label is in the draft vocab
                if not bool(valid.any()):
                    continue
                logits = out[s:][valid] @ head.T
                if teacher is None:
                    ce = F.cross_entropy(logits, labels[s:][valid])
                else:
                    ce = -(teacher[s:][valid] * logits.log_softmax(-1)).sum(-1).mean()
                feat = F.smooth_l1_loss(out[s:], h_next[s:]) if args.feature_loss else 0.0
                loss = loss + step_weights[s] * (ce + args.feature_loss * feat)
                acc = (logits.argmax(-1) == labels[s:][valid]).float().mean().item()
                ema_acc[s] = acc if step == 0 else 0.95 * ema_acc[s] + 0.05 * acc
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
            step, tokens_seen = step + 1, tokens_seen + (b - a)
            bar.update(int(time.monotonic() - started) - bar.n)
            bar.set_postfix(step=step, loss=f"{ema_loss:.3f}", acc="/".join(f"{x:.2f}" for x in ema_acc), lr=f"{lr:.1e}")
        epoch += 1
    bar.close()
    module.eval()
    return {"optimizer_steps": step, "epochs": round(tokens_seen / max(1, sum(b - a for _, a, b in wins)), 2),
            "train_minutes": round((time.monotonic() - started) / 60, 1), "final_loss_ema": round(ema_loss or 0, 4),
            "final_train_top1_ema_per_step": [round(x, 3) for x in ema_acc]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for mtp.safetensors + mtp.json")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--minutes", type=float, default=15.0, help="training time budget")
    p.add_argument("--data-minutes", type=float, default=12.0, help="time budget of the target pass")
    p.add_argument("--max-tokens", type=int, default=200_000, help="training tokens to generate at most")
    p.add_argument("--seq-tokens", type=int, default=2048, help="longest target-pass sequence")
    p.add_argument("--window", type=int, default=256, help="training window (positions per step)")
    p.add_argument("--steps", type=int, default=3, help="chained steps unrolled in training")
    p.add_argument("--train-vocab", type=int, default=8192, help="draft vocabulary size trained on")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft vocabulary size shipped (<= train); 0: the smallest measured size >= 4096 "
                        "within half a point of the best chained acceptance")
    p.add_argument("--max-train-tokens", type=int, default=0, help="also stop after this many window tokens (0: time only)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--soft-labels", action=argparse.BooleanOptionalAction, default=True,
                   help="cross-entropy against the target's whole distribution (else its argmax)")
    p.add_argument("--feature-loss", type=float, default=1.0,
                   help="weight of smooth-L1 between h' and the target's next hidden state (EAGLE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts per source")
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--target", choices=("native", "fp32"), default="native",
                   help="forward whose hidden states and greedy labels the head learns from: the native "
                        "quantized one the CPU engine serves with, or the fp32 torch one (CUDA)")
    p.add_argument("--data-cache", type=Path, default=None,
                   help="reuse/keep the target pass here (.pt); for iterating on training only")
    args = p.parse_args(argv)
    if not 0 <= args.draft_vocab <= args.train_vocab:
        p.error("--draft-vocab must be in [0, --train-vocab]")
    torch.set_num_threads(args.threads)
    wall = time.monotonic()
    model_dir = resolve_model_dir(args.model)
    target = LlamaModel.from_pretrained(model_dir)
    for param in target.parameters():
        param.requires_grad_(False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = Corpus(tokenizer)

    if args.data_cache and args.data_cache.is_file():
        data = torch.load(args.data_cache)
        train_samples, eval_samples = [Sample(**d) for d in data["train"]], [Sample(**d) for d in data["eval"]]
        data_s = data["seconds"]
    else:
        t0 = time.monotonic()
        # The head is trained (and evaluated) through the fp32 model's embedding and head,
        # which are the GGUF's values dequantised, on the states of the forward it will serve.
        data_target = target
        if args.target == "native":
            weights = packaged_gguf_path() if args.model == DEFAULT_MODEL else model_dir
            data_target = NativeLlamaModel.load(weights, num_threads=args.threads)
        train_samples = build_train_data(data_target, corpus, args.max_tokens, args.seq_tokens, args.data_minutes * 60,
                                         tokenizer.eos_token_id)
        eval_samples = build_eval_data(data_target, corpus, args.eval_prompts, args.eval_new_tokens,
                                                tokenizer.eos_token_id)
        data_s = time.monotonic() - t0
        if args.data_cache:  # written whole, then renamed: a killed run leaves no cut file to reuse
            part = args.data_cache.with_name(f".{args.data_cache.name}.part")
            torch.save({"train": [vars(s) for s in train_samples], "eval": [vars(s) for s in eval_samples],
                        "seconds": data_s}, part)
            os.replace(part, args.data_cache)
    recipe = describe_data(train_samples, eval_samples, data_s)
    print(json.dumps(recipe, indent=1), flush=True)

    vocab = select_draft_vocab(train_samples, args.train_vocab, target.cfg.vocab_size)
    module = init_module(target, vocab, args.seed)
    training = train(module, target, train_samples, args)
    meta = {"command": "python -m training.mtp_train " + " ".join(argv if argv is not None else sys.argv[1:]),
            "data": recipe, "training": {**training, "lr": args.lr, "unrolled_steps": args.steps, "window": args.window,
                                         "train_vocab": args.train_vocab, "init": "matrices normal(0.02), norms ones"}}
    module.save(args.out, meta)  # a checkpoint before the (slow) evaluation; replaced below
    sizes = sorted({n for n in (2048, 4096, 8192, 16384) if n <= args.train_vocab} | {args.draft_vocab or args.train_vocab})
    figures = mtp_eval.evaluate(module, target, eval_samples, vocab_sizes=sizes, shipped_vocab=args.draft_vocab or sizes[-1])
    shipped = args.draft_vocab or mtp_eval.smallest_good_vocab(figures["acceptance_by_vocab"], [n for n in sizes if n >= 4096])
    if shipped != (args.draft_vocab or sizes[-1]):  # calibrate the size actually shipped
        figures["calibration"] = mtp_eval.evaluate(module, target, eval_samples, [shipped], shipped, simulate_per_domain=0)["calibration"]
    figures["shipped_draft_vocab"] = shipped
    module.draft_vocab = vocab[:shipped].clone()  # ship the measured prefix
    figures["draft_cost"] = mtp_eval.time_drafting(module, target)
    meta["eval"] = figures
    meta["wall_minutes"] = round((time.monotonic() - wall) / 60, 1)
    module.save(args.out, meta)
    print(json.dumps(figures, indent=1))
    print(f"saved {args.out} in {meta['wall_minutes']} min")


if __name__ == "__main__":
    main()
