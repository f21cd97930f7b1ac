"""MTP head and drafter: the cached drafting path against the unrolled training path, lazy
against eager observation, batched against per-slot drafting (on a tiny random Llama), and
the shipped weights on the real model (load, draft, acceptance above a measured floor)."""

from __future__ import annotations

import weakref

import pytest
import torch

from replicas.torch_engine.model import LlamaModel, SeqSpan
from replicas.torch_engine.model_config import ModelConfig
from replicas.torch_engine.mtp import MTPDrafter, MTPModule, chain_mask

TINY = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny():
    """(target, module, tokens [T], hidden [T, d]): random weights, one random sequence."""
    torch.manual_seed(0)
    target = LlamaModel(TINY).eval()
    draft_vocab = torch.randperm(TINY.vocab_size)[:64]  # a permuted subset: tests the id mapping
    module = MTPModule(TINY, draft_vocab).eval()
    tokens = torch.randint(0, TINY.vocab_size, (40,))
    return target, module, tokens, _target_hidden(target, tokens)


def _target_hidden(target: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    cache = target.make_cache(1, tokens.numel())
    slot = cache.allocate()
    return target(tokens, [SeqSpan(slot, 0, tokens.numel())], cache)


def test_module_shapes(tiny):
    target, module, tokens, hidden = tiny
    t = 12
    embeds = target.embed_tokens(tokens[1:t + 1])
    rope = target.rope(torch.arange(t))
    outs = module.unrolled(hidden[:t], embeds, rope, num_steps=3)
    assert len(outs) == 3 and all(o.shape == (t, TINY.hidden_size) for o in outs)
    assert module.fuse(hidden[:t], embeds).shape == (t, TINY.hidden_size)
    assert sum(p.numel() for p in module.parameters()) > 0
    with pytest.raises(ValueError):
        MTPModule(TINY, torch.tensor([0, TINY.vocab_size]))


def test_a_save_killed_halfway_leaves_the_last_whole_head(tmp_path, monkeypatch):
    """Training writes its head twice (before and after evaluating); a run killed while writing
    left a cut mtp.safetensors that every replica then failed to load."""
    import safetensors.torch

    MTPModule(TINY, torch.arange(64)).save(tmp_path, {"run": 1})
    whole = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def killed(state, filename, metadata=None):
        with open(filename, "wb") as out:
            out.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        MTPModule(TINY, torch.arange(32)).save(tmp_path, {"run": 2})
    assert {name: (tmp_path / name).read_bytes() for name in whole} == whole
    assert MTPModule.load(tmp_path, TINY).draft_vocab.numel() == 64


def test_chain_mask_sees_anchor_prefix_and_own_chain():
    mask = chain_mask(6, 2)  # step 2: row p anchored at p - 2
    assert mask.shape == (6, 18)
    p = 5
    assert mask[p, :6].nonzero().flatten().tolist() == [0, 1, 2, 3]   # observed keys <= anchor 3
    assert mask[p, 6:12].nonzero().flatten().tolist() == [4]           # step 1 of this chain
    assert mask[p, 12:].nonzero().flatten().tolist() == [5]            # itself


def _unrolled_drafts(target, module, tokens, hidden, anchor, drafts):
    """Run the training path on tokens[:anchor+2] + drafts[:-1]; read the chain of `anchor`."""
    k = len(drafts)
    seq = torch.cat((tokens[: anchor + 2], torch.tensor(drafts[:-1], dtype=torch.int64)))
    t = anchor + k  # positions 0 .. anchor+k-1
    h = torch.cat((hidden[: anchor + 1], torch.zeros(k - 1, hidden.shape[1])))[:t]
    with torch.no_grad():
        outs = module.unrolled(h, target.embed_tokens(seq[1:t + 1]), target.rope(torch.arange(t)), k)
        head = target.lm_head.weight[module.draft_vocab]
        ids, confs = [], []
        for s in range(k):
            probs = (outs[s][anchor + s] @ head.T).softmax(-1)
            confs.append(float(probs.max()))
            ids.append(int(module.draft_vocab[probs.argmax()]))
    return ids, confs


@pytest.mark.parametrize("anchor", [0, 7, 30])
def test_training_path_equals_cached_path(tiny, anchor):
    target, module, tokens, hidden = tiny
    drafter = MTPDrafter(module, target, max_slots=2, max_seq_len=64)
    drafter.add(1)
    drafter.observe(1, hidden[: anchor + 1], tokens[1: anchor + 2])
    (draft,) = drafter.draft([1], [4])
    assert len(draft.tokens) == 4
    ids, confs = _unrolled_drafts(target, module, tokens, hidden, anchor, list(draft.tokens))
    assert ids == list(draft.tokens)
    assert confs == pytest.approx(list(draft.confidences), rel=1e-4, abs=1e-5)


def test_lazy_observe_equals_eager(tiny):
    target, module, tokens, hidden = tiny
    eager = MTPDrafter(module, target, max_slots=1, max_seq_len=64)
    lazy = MTPDrafter(module, target, max_slots=1, max_seq_len=64)
    eager.add(0)
    lazy.add(0)
    n = 25
    for j in range(n):  # eager: one position at a time, a (discarded) chain after each
        eager.observe(0, hidden[j:j + 1], tokens[j + 1:j + 2])
        eager.draft([0], [3])
    for a, b in ((0, 10), (10, 11), (11, n)):  # lazy: three uneven batches, one flush
        lazy.observe(0, hidden[a:b], tokens[a + 1:b + 1])
    (de,), (dl,) = eager.draft([0], [5]), lazy.draft([0], [5])
    assert de.tokens == dl.tokens
    assert de.confidences == pytest.approx(dl.confidences, rel=1e-4, abs=1e-5)


def _two_drafters(tiny, seen: int) -> tuple[MTPDrafter, MTPDrafter]:
    """Two one-slot drafters, each shown the first `seen` positions."""
    target, module, tokens, hidden = tiny
    drafters = MTPDrafter(module, target, max_slots=1, max_seq_len=64), MTPDrafter(module, target, max_slots=1,
                                                                                  max_seq_len=64)
    for d in drafters:
        d.add(0)
        d.observe(0, hidden[:seen], tokens[1:seen + 1])
    return drafters


def test_queue_keeps_its_rows_not_the_step(tiny):
    """A verify step's accepted rows view the whole step's hidden states: the queue copies
    them, so it neither keeps that tensor alive nor sees it change."""
    _, _, tokens, hidden = tiny
    pristine, queued = _two_drafters(tiny, 10)
    pristine.observe(0, hidden[10:12].clone(), tokens[11:13])
    step = hidden[10:27].clone()  # a 17-row step, 2 rows accepted
    alive = weakref.ref(step)
    queued.observe(0, step[:2], tokens[11:13])
    step.fill_(1e4)  # whatever the step's buffer holds afterwards
    del step
    assert alive() is None
    assert queued.propose([0], [4]) == pristine.propose([0], [4])


def test_forget_keeps_the_last_positions_as_if_they_followed_the_last_one_seen(tiny):
    """forget(slot, keep) drops all but the queue's last `keep` positions unseen: the head then
    runs over those as it would had they been observed right after the positions it had seen,
    and a queue forgotten whole drafts nothing until it is shown a position again."""
    _, _, tokens, hidden = tiny
    cut, gapless = _two_drafters(tiny, 8)
    for d in (cut, gapless):
        d.propose([0], [2])  # the head runs over positions 0-7
    cut.observe(0, hidden[8:20], tokens[9:21])
    cut.observe(0, hidden[20:30], tokens[21:31])
    assert cut.queued(0) == 22
    cut.forget(0, keep=6)
    assert cut.queued(0) == 6
    gapless.observe(0, hidden[24:30], tokens[25:31])
    assert cut.propose([0], [4]) == gapless.propose([0], [4])
    cut.forget(0)  # nothing queued: the pending draft still follows the last position
    assert len(cut.propose([0], [3])[0]) == 3
    cut.observe(0, hidden[30:32], tokens[31:33])
    cut.forget(0)
    assert cut.queued(0) == 0 and cut.propose([0], [3]) == [[]]
    cut.observe(0, hidden[32:34], tokens[33:35])
    assert len(cut.propose([0], [3])[0]) == 3


def test_batched_propose_equals_per_slot(tiny):
    target, module, tokens, hidden = tiny
    lengths, num_draft = {3: 9, 0: 20, 5: 33}, {3: 4, 0: 1, 5: 3}
    batched = MTPDrafter(module, target, max_slots=6, max_seq_len=64)
    for slot, n in lengths.items():
        batched.add(slot)
        batched.observe(slot, hidden[:n], tokens[1:n + 1])
    together = batched.propose(list(lengths), [num_draft[s] for s in lengths])
    for (slot, n), got in zip(lengths.items(), together):
        single = MTPDrafter(module, target, max_slots=6, max_seq_len=64)
        single.add(slot)
        single.observe(slot, hidden[:n], tokens[1:n + 1])
        assert single.propose([slot], [num_draft[slot]]) == [got]
        assert len(got) == num_draft[slot]


def test_rows_of_several_slots_queue_at_once_as_one_slot_at_a_time(tiny):
    """observe_rows queues views of one gather (what a step keeps of every request) and drafts
    as observe, a slot at a time, does; a slot that cannot take its rows, or rows of the wrong
    shape, raise ValueError before any slot is queued."""
    target, module, tokens, hidden = tiny
    at_once, one_by_one = (MTPDrafter(module, target, max_slots=3, max_seq_len=32) for _ in range(2))
    spans = {2: (0, 9), 0: (9, 20), 1: (20, 32)}
    for d in (at_once, one_by_one):
        for slot, (a, b) in spans.items():
            d.add(slot)
            d.observe(slot, hidden[a:a + 4], tokens[a + 1:a + 5])
    gather = hidden[[i for a, b in spans.values() for i in range(a + 4, b)]]
    at_once.observe_rows(list(spans), list(gather.split([b - a - 4 for a, b in spans.values()])),
                         [tokens[a + 5:b + 1].tolist() for a, b in spans.values()])
    for slot, (a, b) in spans.items():
        one_by_one.observe(slot, hidden[a + 4:b], tokens[a + 5:b + 1])
    assert [at_once.queued(s) for s in spans] == [9, 11, 12]
    assert at_once.propose(list(spans), [3, 3, 3]) == one_by_one.propose(list(spans), [3, 3, 3])

    for slot in spans:
        at_once.observe_rows([slot], [hidden[:2]], [[5, 6]])
    with pytest.raises(ValueError, match="max_seq_len"):  # slot 1 holds 14 of 32 positions: 19 more is one too many
        at_once.observe_rows([0, 1], [hidden[:1], hidden[:19]], [[1], [1] * 19])
    with pytest.raises(ValueError, match="next_tokens"):
        at_once.observe_rows([0, 1], [hidden[:1], hidden[:2]], [[1], [1]])
    with pytest.raises(ValueError, match="hidden"):
        at_once.observe_rows([0], [hidden[:2, :8]], [[1, 2]])
    assert [at_once.queued(s) for s in spans] == [2, 2, 2]


def _policy_asks(tiny, ask_s: float, engine_seen_unsure: int, steps: int, batch: int = 1):
    """(steps at which a fresh request asked the head, the request, the policy): every step
    planned for MTP (as the core runs them) in a batch of `batch`, every ask unsure, with
    plain steps of 10 ms, asks of `ask_s` and an engine that has seen `engine_seen_unsure`
    unsure asks before."""
    from replicas.engine import RequestSpeculation, SamplingParams
    from replicas.torch_engine.draft_policy import DraftPolicy
    from replicas.torch_engine.sequence import Sequence

    target, module, tokens, hidden = tiny
    drafter = MTPDrafter(module, target, max_slots=1, max_seq_len=64)
    drafter.add(0)
    drafter.observe(0, hidden[:8], tokens[1:9])
    policy = DraftPolicy(drafter)
    for _ in range(20):
        policy.costs.observe_step(batch, batch, 0.010)
        policy.costs.observe_ask(batch, 1, 1, ask_s)
    for _ in range(engine_seen_unsure):
        policy.mtp_yield["hybrid"].add(0, 0)
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(max_tokens=4096), RequestSpeculation(), None, frozenset(), slot=0)
    asked = []
    for step in range(steps):
        if seq.mtp_skip:
            seq.mtp_skip -= 1
        elif policy.ask_mtp(seq, "hybrid", batch):
            asked.append(step)
            policy.mtp_outcome(seq, "hybrid", 0, 0)
    return asked, seq, policy


def test_probes_that_fail_wait_twice_as_long_each_time(tiny):
    """Where the head's asks do not pay, a request asks it only in probes: the first after
    MTP_MAX_BACKOFF planned steps, each later one after twice the gap before it, at most
    MTP_MAX_PROBE_GAP; an accepted draft ends the probing (the next failure backs off 1 step)."""
    from replicas.speculation.hybrid import MTP_MAX_BACKOFF
    from replicas.torch_engine.draft_policy import MTP_MAX_PROBE_GAP, MTP_OWN_ASKS

    asked, seq, policy = _policy_asks(tiny, ask_s=0.050, engine_seen_unsure=0, steps=600)  # an ask: 5 steps
    probes = asked[MTP_OWN_ASKS:]
    # after the last own ask: its backoff (2 steps), a step that stands the head down, then the wait
    assert MTP_OWN_ASKS == 2 and asked[:2] == [0, 2] and probes[0] == 2 + 2 + 1 + MTP_MAX_BACKOFF + 1
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == [2 * MTP_MAX_BACKOFF, 4 * MTP_MAX_BACKOFF, MTP_MAX_PROBE_GAP, MTP_MAX_PROBE_GAP,
                        MTP_MAX_PROBE_GAP] == [32, 64, 128, 128, 128]
    seq.mtp_skip = 0
    assert policy.ask_mtp(seq, "hybrid", 1)  # a probe, whose draft is accepted
    policy.mtp_outcome(seq, "hybrid", 2, 1)
    assert (seq.mtp_backoff, seq.mtp_skip, seq.mtp_probe_gap) == (0, 0, 0)
    policy.mtp_outcome(seq, "hybrid", 2, 0)
    assert (seq.mtp_backoff, seq.mtp_skip) == (1, 1)


def test_in_a_batch_asks_that_cannot_pay_wait_as_many_times_longer(tiny):
    """An ask holds up every request of the step: in a batch of 4, a request whose asks cannot
    pay stands the head down at once (its own first asks go only where an unmeasured head's
    would pay), waits 4 x MTP_MAX_BACKOFF steps before its first probe and twice that between
    probes, at most MTP_MAX_PROBE_GAP; alone, even a head the engine has seen unsure is asked
    MTP_OWN_ASKS times first."""
    from replicas.speculation.hybrid import MTP_MAX_BACKOFF
    from replicas.torch_engine.draft_policy import MTP_MAX_PROBE_GAP

    asked, _, _ = _policy_asks(tiny, ask_s=0.050, engine_seen_unsure=0, steps=600, batch=4)
    assert asked[0] == 4 * MTP_MAX_BACKOFF + 1
    assert {b - a - 1 for a, b in zip(asked, asked[1:])} == {MTP_MAX_PROBE_GAP} and len(asked) == 5
    alone, _, _ = _policy_asks(tiny, ask_s=0.001, engine_seen_unsure=40, steps=30)
    assert alone == [0, 2, 2 + 2 + 1 + MTP_MAX_BACKOFF + 1]


def test_drafter_slot_lifecycle_and_confidence_cut(tiny):
    target, module, tokens, hidden = tiny
    drafter = MTPDrafter(module, target, max_slots=1, max_seq_len=16)
    drafter.add(0)
    assert drafter.propose([0], [3]) == [[]]  # nothing observed yet
    with pytest.raises(ValueError):
        drafter.add(0)
    with pytest.raises(ValueError):
        drafter.observe(0, hidden[:20], tokens[1:21])  # past max_seq_len
    drafter.observe(0, hidden[:15], tokens[1:16])
    assert len(drafter.propose([0], [5])) == 1
    # 15 observed positions, capacity 16: one scratch position, so d1 plus one chained draft.
    assert len(drafter.propose([0], [5])[0]) == 2
    full = drafter.draft([0], [1])[0]
    assert drafter.propose([0], [1], min_confidence=full.confidences[0] + 1e-6) == [[]]
    drafter.remove(0)
    with pytest.raises(ValueError):
        drafter.propose([0], [1])
    drafter.add(0)  # the freed cache slot is reusable, with nothing queued
    drafter.observe(0, hidden[:10], tokens[1:11])
    drafter.observe(0, hidden[10:15], tokens[11:16])  # queued, not yet run: 15 of 16
    with pytest.raises(ValueError, match="max_seq_len"):
        drafter.observe(0, hidden[15:17], tokens[16:18])


# --- the shipped weights on the real model -------------------------------------------------

@pytest.fixture(scope="module")
def served():
    """(target, drafter) with the committed weights on the native forward the CPU engine
    serves (the head runs natively too, Q8_0)."""
    from replicas.torch_engine.loader import packaged_gguf_path
    from replicas.torch_engine.native_model import NativeLlamaModel

    target = NativeLlamaModel.load(packaged_gguf_path(), num_threads=2)
    return target, MTPDrafter.load(target, max_slots=2, max_seq_len=512)


@pytest.fixture(scope="module", params=["native", "fp32"])
def real(request, served):
    """The same on the served target, and on the fp32 torch forward (the head in torch)."""
    from replicas.torch_engine.loader import resolve_model_dir

    if request.param == "native":
        return served
    target = LlamaModel.from_pretrained(resolve_model_dir())
    return target, MTPDrafter.load(target, max_slots=2, max_seq_len=512)


@pytest.mark.slow
def test_shipped_weights_load_and_draft(real):
    import json

    from replicas.torch_engine.mtp import DEFAULT_WEIGHTS_DIR, META_FILE, WEIGHTS_FILE

    target, drafter = real
    assert (DEFAULT_WEIGHTS_DIR / WEIGHTS_FILE).stat().st_size <= 20 * 2**20
    meta = json.loads((DEFAULT_WEIGHTS_DIR / META_FILE).read_text())
    assert drafter.draft_vocab_size == meta["draft_vocab_size"]
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 314, 2])
    hidden = _target_hidden(target, ids)
    drafter.add(0)
    try:
        drafter.observe(0, hidden[:-1], ids[1:])
        (draft,) = drafter.draft([0], [4])
    finally:
        drafter.remove(0)
    assert len(draft.tokens) == 4
    assert set(draft.tokens) <= set(drafter.module.draft_vocab.tolist())
    assert all(0.0 < c <= 1.0 for c in draft.confidences)


def test_simulated_serving_emits_every_generated_token(tiny):
    from types import SimpleNamespace

    from training.mtp_eval import simulate_greedy

    target, module, tokens, hidden = tiny
    drafter = MTPDrafter(module, target, max_slots=1, max_seq_len=64)
    greedy = target.logits(hidden).argmax(-1)
    sample = SimpleNamespace(tokens=tokens, hidden=hidden, greedy=greedy, prompt_len=10)
    steps, emitted = simulate_greedy(drafter, sample, num_draft=3)
    assert emitted == len(tokens) - 1 - sample.prompt_len  # positions prompt_len .. L-2 each emitted once
    assert 1 <= steps <= emitted


# Held-out by the corpora split (Spec-Bench turn 39 is every-10th; HumanEval/140 is in the
# last 20%): never trained on. The target continues each greedily; the drafter replays it.
_CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nCome up with a proposal to convince the deforesters to stop cutting you down "
                "and other trees.<|im_end|>\n<|im_start|>assistant\n")
# Measured with the shipped weights on the native target (what the CPU engine serves): 1.41
# (chat) and 1.48 (code) tokens per verify step at K=4 on these two prompts, with the head in
# torch or native alike (on the fp32 torch target it measured 1.59 and 1.48: the head was
# trained on that target's states). The floors sit below that and above the 1.0 of no drafting.
_FLOORS = {"chat": 1.3, "code": 1.35}


@pytest.mark.slow
def test_shipped_weights_accept_on_held_out_text(served):
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from replicas.torch_engine.loader import resolve_model_dir
    from training.corpora import humaneval_tasks
    from training.mtp_eval import generate_greedy, simulate_greedy

    target, drafter = served
    tok = Tokenizer.from_file(str(resolve_model_dir() / "tokenizer.json"))
    prompts = {"chat": tok.encode(_CHAT_PROMPT, add_special_tokens=False).ids,
               "code": tok.encode(humaneval_tasks()[140]["prompt"], add_special_tokens=False).ids}
    generated = generate_greedy(target, list(prompts.values()), new_tokens=64, eos_id=2)
    for (domain, prompt), (gen, hidden, greedy) in zip(prompts.items(), generated):
        assert len(gen) > 16
        sample = SimpleNamespace(tokens=torch.tensor(prompt + gen[:-1]), hidden=hidden, greedy=greedy,
                                 prompt_len=len(prompt))
        steps, emitted = simulate_greedy(drafter, sample, num_draft=4)
        assert emitted / steps >= _FLOORS[domain], (domain, emitted / steps)


@pytest.mark.slow
def test_native_head_matches_the_torch_head(served):
    """The native head (Q8_0 weights and activations) computes what the trained torch head
    does, to quantisation error: the same greedy draft ids on nearly every position."""
    from replicas.torch_engine.mtp import TorchHeadRunner
    from replicas.torch_engine.native_model import NativeMtpHead

    target, drafter = served
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(3))
    hidden = _target_hidden(target, ids)
    runners = [cls(drafter.module, target, 1, 64) for cls in (NativeMtpHead, TorchHeadRunner)]
    outs = []
    for runner in runners:
        slot = runner.cache.allocate()
        h = runner.step(hidden[:-1], target.embed(ids[1:]), [SeqSpan(slot, 0, 47)])
        outs.append((h, runner.logits(h)))
    (h_native, l_native), (h_torch, l_torch) = outs
    assert (h_native - h_torch).abs().max() <= 0.05 * h_torch.abs().max()
    assert (l_native.argmax(-1) == l_torch.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_native_head_in_calls_of_few_rows_gives_the_same_bits(served, monkeypatch):
    """A long queue (a whole prompt's positions) runs in calls of MAX_CHUNK_TOKENS rows, which
    bounds the step's scratch memory and changes no bit."""
    from replicas.torch_engine import native_model
    from replicas.torch_engine.native_model import NativeMtpHead

    target, drafter = served
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(4))
    hidden, embeds = _target_hidden(target, ids)[:-1], target.embed(ids[1:])
    outs = []
    for rows in (256, 9):
        monkeypatch.setattr(native_model, "MAX_CHUNK_TOKENS", rows)
        head = NativeMtpHead(drafter.module, target, 1, 64)
        outs.append(head.step(hidden, embeds, [SeqSpan(head.cache.allocate(), 0, 47)]))
    assert torch.equal(*outs)
