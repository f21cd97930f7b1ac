"""The native forward on the real model: bitwise row invariance, and closeness to fp32.

Row invariance is what makes speculation exact: every row of a step must compute the same
bits as that token decoded alone, whatever else the step holds (a K-row verify, other
requests, a prefill chunk) and however many threads run it. Compared with `torch.equal`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import platform
import threading

import numpy as np
import pytest
import torch

from replicas.torch_engine import native_model
from replicas.torch_engine.kv_cache import KVCacheFull
from replicas.torch_engine.loader import packaged_gguf_path, resolve_model_dir
from replicas.torch_engine.model import SeqSpan
from replicas.torch_engine.native_model import NativeLlamaModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model() -> NativeLlamaModel:
    return NativeLlamaModel.load(packaged_gguf_path(), num_threads=2)


@pytest.fixture(scope="module")
def model_1t() -> NativeLlamaModel:
    return NativeLlamaModel.load(packaged_gguf_path(), num_threads=1)


def random_ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def logits_of(model: NativeLlamaModel, ids: torch.Tensor, spans: list[SeqSpan], cache) -> torch.Tensor:
    return model.logits(model(ids, spans, cache))


def prefilled(model: NativeLlamaModel, prompt: torch.Tensor, slots: int = 1, max_seq_len: int = 320):
    cache = model.make_cache(slots, max_seq_len)
    slot = cache.allocate()
    model(prompt, [SeqSpan(slot, 0, len(prompt))], cache)
    return cache, slot


def verify_and_decodes(model: NativeLlamaModel, ids: torch.Tensor, prompt_len: int,
                       max_seq_len: int = 320) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ids[prompt_len:] after the prompt: verified in one step, then decoded one
    row at a time on the same cache (also run on emulated CPUs: forward_probe.py)."""
    k = len(ids) - prompt_len
    cache, slot = prefilled(model, ids[:prompt_len], max_seq_len=max_seq_len)
    verify = logits_of(model, ids[prompt_len:], [SeqSpan(slot, prompt_len, k)], cache)
    cache.truncate(slot, prompt_len)
    decodes = torch.cat([logits_of(model, ids[prompt_len + i:prompt_len + i + 1], [SeqSpan(slot, prompt_len + i, 1)], cache)
                         for i in range(k)])
    return verify, decodes


@pytest.mark.parametrize("seed, prompt_len, k", [(0, 5, 2), (1, 40, 9), (2, 31, 17), (3, 100, 17), (4, 64, 5),
                                                 (5, 300, 9)])
def test_verify_rows_equal_one_row_decodes(model, seed, prompt_len, k):
    assert torch.equal(*verify_and_decodes(model, random_ids(seed, prompt_len + k), prompt_len))


def test_packed_step_equals_each_request_alone(model):
    # Three requests in one step: a 1-token decode, a 7-token verify, a 12-token prefill.
    prompts = [random_ids(10, 20), random_ids(11, 45), random_ids(12, 12)]
    news = [random_ids(13, 1), random_ids(14, 7), prompts[2]]
    cache = model.make_cache(3, 128)
    slots = [cache.allocate() for _ in range(3)]
    for slot, prompt in zip(slots[:2], prompts[:2]):
        model(prompt, [SeqSpan(slot, 0, len(prompt))], cache)
    spans = [SeqSpan(slots[0], 20, 1), SeqSpan(slots[1], 45, 7), SeqSpan(slots[2], 0, 12)]
    packed = logits_of(model, torch.cat(news), spans, cache)
    alone = []
    for prompt, new, span in zip(prompts, news, spans):
        one, slot = prefilled(model, prompt[:span.start], max_seq_len=128) if span.start else (model.make_cache(1, 128), None)
        slot = one.allocate() if slot is None else slot
        alone.append(logits_of(model, new, [SeqSpan(slot, span.start, span.length)], one))
    assert torch.equal(packed, torch.cat(alone))


def test_thread_count_does_not_change_a_bit(model, model_1t):
    # Three chunks of 128 positions: 2 threads cut the verify's attention into chunk tasks, 1
    # thread runs each KV head's chunks in one task.
    ids = random_ids(20, 310)
    results = []
    for m in (model, model_1t):
        cache, slot = prefilled(m, ids[:300])
        results.append(logits_of(m, ids[300:], [SeqSpan(slot, 300, 10)], cache))
    assert torch.equal(*results)


@contextlib.contextmanager
def rounding_toward_zero():
    """This thread's floating-point rounding set toward zero (C's fesetround), as a library
    loaded into the process may leave it; restored after."""
    toward_zero = {"x86_64": 0xC00, "aarch64": 0xC00000}.get(platform.machine())
    if toward_zero is None:
        pytest.skip(f"FE_TOWARDZERO of {platform.machine()} is not known here")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    before = libm.fegetround()
    assert libm.fesetround(toward_zero) == 0
    try:
        yield libm
    finally:
        libm.fesetround(before)


def test_the_callers_floating_point_environment_does_not_change_a_bit(model, monkeypatch):
    # Rounding toward zero in the calling thread only: its chunks of each loop and its workers'
    # once disagreed, and a 5-row verify moved its logits by up to 3 from the 1-row decodes.
    ids = random_ids(7, 13)
    canonical = verify_and_decodes(model, ids, 8, max_seq_len=64)
    with rounding_toward_zero() as libm:
        mode = libm.fegetround()
        verify, decodes = verify_and_decodes(model, ids, 8, max_seq_len=64)
        assert libm.fegetround() == mode  # the caller's environment is given back
    assert torch.equal(verify, canonical[0]) and torch.equal(decodes, canonical[1])
    # The workers take nothing from the thread that started them either (only the native
    # forward, and so its pool, is made under the mode: torch's rope tables would follow it).
    native_forward = native_model._cpu_forward.LlamaForward

    def made_toward_zero(*args):
        with rounding_toward_zero():
            return native_forward(*args)

    monkeypatch.setattr(native_model._cpu_forward, "LlamaForward", made_toward_zero)
    model_of_workers = NativeLlamaModel.load(packaged_gguf_path(), num_threads=2)
    assert all(map(torch.equal, verify_and_decodes(model_of_workers, ids, 8, max_seq_len=64), canonical))


def test_prefill_in_chunks_equals_one_chunk(model, monkeypatch):
    # Whole, each (tile, KV head) runs its chunks of 128 positions in one task; in calls of 16
    # rows they are separate tasks whose states are merged afterwards.
    ids = random_ids(30, 300)
    cache, slot = prefilled(model, ids)
    whole = model(ids, [SeqSpan(slot, 0, 300)], cache)
    chunked = [model(ids[i:i + 16], [SeqSpan(slot, i, len(ids[i:i + 16]))], cache) for i in range(0, 300, 16)]
    assert torch.equal(whole, torch.cat(chunked))
    monkeypatch.setattr(native_model, "MAX_CHUNK_TOKENS", 9)  # the face's own split of a long step
    assert torch.equal(whole, model(ids, [SeqSpan(slot, 0, 300)], cache))


def test_scalar_path_equals_the_best_path():
    best = NativeLlamaModel.load(packaged_gguf_path(), num_threads=1)
    if best.isa == "scalar":
        pytest.skip("this CPU runs only the scalar path")
    scalar = NativeLlamaModel.load(packaged_gguf_path(), num_threads=2, isa="scalar")
    ids = random_ids(40, 40)  # amx: two tiles of 16 rows and 8 rows on avx512's kernels
    got = []
    for m in (best, scalar):
        cache = m.make_cache(1, 64)
        got.append(logits_of(m, ids, [SeqSpan(cache.allocate(), 0, 40)], cache))
    assert torch.equal(*got)


AGREEMENT_PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Why is the sky blue? Answer in one sentence.", "import numpy as np\n\ndef normalize(x):\n",
    "Write a haiku about autumn leaves.", "List three uses of a hash map.",
    "class Stack:\n    def __init__(self):\n", "The quick brown fox jumps over the lazy dog. The quick",
    "Translate 'good morning' into Spanish.", "SELECT name, count(*) FROM users GROUP BY",
    "Explain recursion to a child.", "for i in range(10):\n    print(",
    "What is the boiling point of water at sea level?", "Once upon a time, in a small village,",
    "The three primary colors are", "<html>\n<head>\n<title>",
    "Summarize the plot of Romeo and Juliet.", "def is_prime(n: int) -> bool:\n",
    "The derivative of x squared is", "Give me a recipe for pancakes.",
]


def test_greedy_tokens_agree_with_the_dequantised_fp32_reference(model):
    """Teacher-forced argmax of the quantized forward against the fp32 forward of the same
    (dequantised) weights, on 20 prompts. Activation quantisation may flip near-ties, so
    this is a rate, reported, with a floor far below what any CPU gives (0.93-0.95)."""
    from transformers import AutoTokenizer

    from replicas.torch_engine.model import LlamaModel

    model_dir = resolve_model_dir()
    fp32 = LlamaModel.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    agree = total = 0
    for text in AGREEMENT_PROMPTS:
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
        got = []
        for m in (model, fp32):
            cache = m.make_cache(1, len(ids))
            got.append(m.logits(m(ids, [SeqSpan(cache.allocate(), 0, len(ids))], cache)).argmax(-1))
        agree += int((got[0] == got[1]).sum())
        total += len(ids)
    rate = agree / total
    print(f"greedy agreement with the fp32 reference: {rate:.3f} over {total} positions")
    assert rate >= 0.85


def test_embedding_and_head_rows_are_the_gguf_values(model):
    from gguf import GGUFReader, quants

    reader = GGUFReader(packaged_gguf_path())
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ids = torch.tensor([0, 1, 7, 4095, 49151])
    expected = torch.from_numpy(quants.dequantize(embedding.data[ids.numpy()], embedding.tensor_type))
    assert torch.equal(model.embed(ids), expected)
    assert torch.equal(model.head_rows(ids), expected)  # tied
    assert model.weight_bytes < 120e6  # the GGUF's blocks, no fp32 copy


def tiny_llama_dir(tmp_path, vocab_size=104):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    return hf


# 101: a vocabulary of no whole groups of 8 (Llama's 32000 and one added token), padded
@pytest.mark.parametrize("vocab_size", [104, 101])
def test_hf_checkpoint_loads_quantised_and_stays_row_invariant(tmp_path, vocab_size):
    hf = tiny_llama_dir(tmp_path, vocab_size)
    model = NativeLlamaModel.load(tmp_path, num_threads=2)
    ids = torch.randint(0, vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    cache = model.make_cache(1, 64)
    slot = cache.allocate()
    got = logits_of(model, ids, [SeqSpan(slot, 0, 24)], cache)
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
    assert got.shape == expected.shape == (24, vocab_size)
    # Q8_0 weights and activations: about 1% relative error per matmul.
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
    cache.truncate(slot, 20)
    decodes = torch.cat([logits_of(model, ids[i:i + 1], [SeqSpan(slot, i, 1)], cache) for i in range(20, 24)])
    assert torch.equal(decodes, got[20:])


def _forward_through(model: NativeLlamaModel, table: np.ndarray, num_pages: int, ids: torch.Tensor,
                     steps: list[tuple[int, int]]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Steps (start, length) of one slot run natively through `table` [1, blocks]: each step's
    hidden rows, and the K and V pools."""
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, 32, cfg.head_dim)
    k, v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
    out = []
    for start, length in steps:
        hidden = np.empty((length, cfg.hidden_size), np.float32)
        model._forward.forward(ids[start:start + length].to(torch.int32).numpy(),
                               np.array([[0, start, length]], np.int32), k, v, table, hidden)
        out.append(hidden)
    return out, k, v


def test_any_page_table_gives_the_same_bits(model):
    # One sequence through pages in order, and through a random permutation of a larger pool:
    # every step's rows and every position's K and V are bitwise the same.
    blocks, pool = 6, 11
    ids = random_ids(60, blocks * 32)
    steps = [(0, 70), (70, 1), (71, 9), (80, 100), (180, 12)]
    ordered = np.arange(blocks, dtype=np.int32)[None]
    scattered = np.random.default_rng(0).permutation(pool)[:blocks].astype(np.int32)[None]
    got, k, v = _forward_through(model, scattered, pool, ids, steps)
    want, k0, v0 = _forward_through(model, ordered, blocks, ids, steps)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    assert np.array_equal(k[:, :, scattered[0]], k0) and np.array_equal(v[:, :, scattered[0]], v0)


def test_bad_page_tables_are_value_errors(model):
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, 4, 32, cfg.head_dim)
    k, v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
    ids, hidden = np.zeros(40, np.int32), np.empty((40, cfg.hidden_size), np.float32)
    with pytest.raises(ValueError, match="slot 0 block 1 names no page"):
        model._forward.forward(ids, np.array([[0, 0, 40]], np.int32), k, v, np.array([[0, -1]], np.int32), hidden)
    with pytest.raises(ValueError, match="slot 1 block 0 names no page"):
        model._forward.forward(ids[:1], np.array([[1, 0, 1]], np.int32), k, v, np.array([[0, 1], [4, 2]], np.int32),
                               hidden[:1])
    with pytest.raises(ValueError, match="two spans of the step write one page"):
        model._forward.forward(ids[:2], np.array([[0, 0, 1], [1, 0, 1]], np.int32), k, v,
                               np.array([[2, 0], [2, 1]], np.int32), hidden[:2])


def test_spans_past_an_int_are_value_errors(model):
    """A span's end computed in int wrapped negative, passed every check and crashed."""
    cfg = model.cfg
    k = np.zeros((cfg.num_layers, cfg.num_kv_heads, 4, 32, cfg.head_dim), np.float16)
    table, hidden = np.array([[0, 1, 2, 3]], np.int32), np.empty((1, cfg.hidden_size), np.float32)
    for spans in ([[0, 2**31 - 1, 1]], [[0, 2**31 - 32, 64]], [[0, 0, 1], [0, 1, 2**31 - 1]]):
        with pytest.raises(ValueError, match="positions past the cache"):
            model._forward.forward(np.zeros(1, np.int32), np.array(spans, np.int32), k, k.copy(), table, hidden)


def test_two_threads_stepping_one_model_take_turns(model):
    """Steps release the GIL; the model runs one at a time (two at once hung its pool)."""
    hidden = torch.from_numpy(np.random.default_rng(8).standard_normal((3, model.cfg.hidden_size), np.float32))
    want = model.logits(hidden)
    same = []

    def steps() -> None:
        same.extend(torch.equal(model.logits(hidden), want) for _ in range(100))

    threads = [threading.Thread(target=steps, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "stepping from two threads hung"
    assert len(same) == 200 and all(same)


def test_rope_tables_for_the_engines_window_alone_give_the_same_bits(model):
    """An engine builds the RoPE tables for its cache window, not the model's every position
    (Llama 3's 131,072: 190 MB); the same bits inside it, a ValueError past it."""
    short = NativeLlamaModel.load(packaged_gguf_path(), num_threads=2, max_positions=96)
    assert short.rope_cos.shape == (96, 64) and model.rope_cos.shape == (8192, 64)
    ids = random_ids(9, 96)
    got = [logits_of(m, ids, [SeqSpan(cache.allocate(), 0, 96)], cache)
           for m, cache in ((short, short.make_cache(1, 96)), (model, model.make_cache(1, 96)))]
    assert torch.equal(*got)
    wide = short.make_cache(1, 128)
    with pytest.raises(ValueError, match="max_position_embeddings 96"):
        short(random_ids(9, 97), [SeqSpan(wide.allocate(), 0, 97)], wide)


def test_a_pool_too_small_for_a_step_is_kv_cache_full(model):
    cache = model.make_cache(2, 128, num_pages=3)
    a, b = cache.allocate(), cache.allocate()
    model(random_ids(61, 64), [SeqSpan(a, 0, 64)], cache)
    with pytest.raises(KVCacheFull, match=r"positions \[0, 40\) of slot 1 \(1 of 3 pages free\)"):
        model(random_ids(62, 40), [SeqSpan(b, 0, 40)], cache)
    assert cache.pages_of(b) == [] and cache.free_pages == 1  # nothing taken
    model(random_ids(62, 32), [SeqSpan(b, 0, 32)], cache)


def test_bad_steps_are_value_errors(model):
    cache = model.make_cache(1, 32)
    slot = cache.allocate()
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        model(random_ids(50, 40), [SeqSpan(slot, 0, 40)], cache)
    with pytest.raises(ValueError, match="needs a PagedKVCache"):
        from replicas.torch_engine.kv_cache import KVCache

        fp32_cache = KVCache(30, 1, 32, 3, 64)
        model(random_ids(51, 3), [SeqSpan(fp32_cache.allocate(), 0, 3)], fp32_cache)
    with pytest.raises(ValueError, match="spans cover 2 tokens but input_ids has 3"):
        model(random_ids(52, 3), [SeqSpan(slot, 0, 2)], cache)
    with pytest.raises(ValueError, match="tokens: id"):
        model._forward.embed(np.array([49152], dtype=np.int32), np.zeros((1, 576), np.float32))
    # an id out of range anywhere in a step that goes in several native calls: none is made
    ids = random_ids(53, native_model.MAX_CHUNK_TOKENS + 8)
    ids[-1] = model.cfg.vocab_size
    long_cache = model.make_cache(1, 2 * native_model.MAX_CHUNK_TOKENS)
    long_slot, k_before = long_cache.allocate(), long_cache.k.view(torch.int16).clone()  # bits: may hold NaNs
    with pytest.raises(ValueError, match="input_ids: ids must be in"):
        model(ids, [SeqSpan(long_slot, 0, len(ids))], long_cache)
    assert long_cache.pages_of(long_slot) == [] and torch.equal(long_cache.k.view(torch.int16), k_before)
