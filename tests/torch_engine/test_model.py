"""The lean forward against Hugging Face's, and against itself under every way of feeding it.

Oracle: `transformers.AutoModelForCausalLM` on the same converted checkpoint. Our forward
must give the same logits for a prefill, for incremental decoding (1 and 5 tokens a step),
for a packed batch of sequences, after a rollback, and the same greedy tokens as
`generate`. Both models load once per module (~2 s each).
"""

from __future__ import annotations

import json

import pytest
import torch

from replicas.torch_engine.kv_cache import KVCache
from replicas.torch_engine.loader import resolve_model_dir
from replicas.torch_engine.model import DecoderLayer, LlamaModel, SeqSpan
from replicas.torch_engine.model_config import ModelConfig
from replicas.torch_engine.native_model import NativeLlamaModel

pytestmark = pytest.mark.slow

FP32_EPS = torch.finfo(torch.float32).eps


def fp32_atol(expected: torch.Tensor, reduction_len: int) -> float:
    """How far apart two fp32 evaluations of the same forward may be, on any CPU.

    The summation order depends on the CPU (MKL's AVX2 or AVX-512 sgemm, oneDNN's
    AVX2/AVX-512/AMX blocking, ATen's vector width), on the row count (ours: MKL up to 3
    rows, oneDNN above) and on the library (HF vs ours). The outputs compared here come out
    of fp32 dot products over K = the hidden size (the logits' reduction; the layer test's
    |y| is its residual stream). One such sum has |err| <= gamma_K * sum|w_i h_i| ~= K *
    eps/2 * |y| (Higham, Accuracy and Stability, 3.1), so two independently rounded
    evaluations differ by at most K * eps * |y|, |y| the tensor's largest magnitude. That
    is the last reduction's worst case; errors carried in from earlier layers are random-
    signed and grow like sqrt(K), so on every kernel set tried (AVX-512; AVX2-only oneDNN,
    ATen and MKL; SSE4.1 oneDNN; MKL's compatible mode) the measured differences sit >= 10x
    under it: e.g. SmolLM2 logits (|y| ~36, K = 576) bound 2.4e-3, measured <= 1.4e-4.
    """
    return reduction_len * FP32_EPS * float(expected.abs().max())


PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhy is the sky blue? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine's 2 cores are shared; 2 spinning OpenMP threads on a busy machine
    # run ~10x slower than 1 (see benchmarks/forward.py). Results do not depend on it.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir()


@pytest.fixture(scope="module")
def ours(model_dir):
    return LlamaModel.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[torch.Tensor]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [torch.tensor(tok.encode(p).ids, dtype=torch.int64) for p in PROMPTS]


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def run_alone(model: LlamaModel, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Logits of every token of `ids`, fed `chunk` tokens per forward into a fresh slot."""
    cache = model.make_cache(max_slots=1, max_seq_len=ids.shape[0])
    slot = cache.allocate()
    out = []
    for start in range(0, ids.shape[0], chunk):
        piece = ids[start:start + chunk]
        out.append(model.logits(model(piece, [SeqSpan(slot, start, piece.shape[0])], cache)))
        assert cache.lengths[slot] == start + piece.shape[0]
    return torch.cat(out)


def test_prefill_matches_hf(ours, hf, prompts):
    for ids in prompts:
        expected, got = hf_logits(hf, ids), run_alone(ours, ids, chunk=ids.shape[0])
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=fp32_atol(expected, ours.cfg.hidden_size), rtol=0)
        # Exact: these prompts' smallest top-1/top-2 gap is 0.09; a flip needs errors ~20x the tolerance.
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("chunk", [1, 5])
def test_incremental_decoding_equals_prefill(ours, hf, prompts, chunk):
    ids = prompts[1]
    full = run_alone(ours, ids, chunk=ids.shape[0])
    stepped = run_alone(ours, ids, chunk=chunk)
    # Not bitwise: 1-row steps run MKL, 5-row steps and the prefill oneDNN.
    torch.testing.assert_close(stepped, full, atol=fp32_atol(full, ours.cfg.hidden_size), rtol=0)
    expected = hf_logits(hf, ids)
    torch.testing.assert_close(stepped, expected, atol=fp32_atol(expected, ours.cfg.hidden_size), rtol=0)


def test_packed_batch_equals_each_alone(ours, prompts):
    # Three sequences already holding different prefixes, then one packed forward that
    # continues each by a different number of tokens (1, 4, 7).
    cache = ours.make_cache(max_slots=4, max_seq_len=64)
    cache.allocate()  # slot 0 unused: spans need not start at slot 0 or be contiguous
    slots = [cache.allocate() for _ in prompts]
    prefix_lens, new_lens = (3, 1, 9), (1, 4, 7)
    for slot, ids, n in zip(slots, prompts, prefix_lens):
        ours(ids[:n], [SeqSpan(slot, 0, n)], cache)
    spans = [SeqSpan(slot, n, t) for slot, n, t in zip(slots, prefix_lens, new_lens)]
    packed_ids = torch.cat([ids[n:n + t] for ids, n, t in zip(prompts, prefix_lens, new_lens)])
    packed = ours.logits(ours(packed_ids, spans, cache))
    assert [cache.lengths[s] for s in slots] == [n + t for n, t in zip(prefix_lens, new_lens)]
    row = 0
    for ids, n, t in zip(prompts, prefix_lens, new_lens):
        alone = run_alone(ours, ids[:n + t], chunk=n + t)[n:]
        torch.testing.assert_close(packed[row:row + t], alone, atol=fp32_atol(alone, ours.cfg.hidden_size), rtol=0)
        row += t


def test_rollback_equals_never_written(ours, prompts):
    ids = prompts[2][:20]
    cache = ours.make_cache(max_slots=1, max_seq_len=32)
    slot = cache.allocate()
    ours(ids[:12], [SeqSpan(slot, 0, 12)], cache)
    wrong = torch.flip(ids[12:20], dims=[0]) + 1  # a rejected draft
    ours(wrong, [SeqSpan(slot, 12, 8)], cache)
    cache.truncate(slot, 12)
    assert cache.lengths[slot] == 12
    after_rollback = ours.logits(ours(ids[12:20], [SeqSpan(slot, 12, 8)], cache))
    expected = run_alone(ours, ids, chunk=20)[12:]
    torch.testing.assert_close(after_rollback, expected, atol=fp32_atol(expected, ours.cfg.hidden_size), rtol=0)


def test_greedy_generation_matches_hf_generate(ours, hf, prompts):
    ids, new_tokens = prompts[2], 30
    with torch.inference_mode():
        expected = hf.generate(ids[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=hf.config.eos_token_id)[0, ids.shape[0]:]
    cache = ours.make_cache(max_slots=1, max_seq_len=ids.shape[0] + new_tokens)
    slot = cache.allocate()
    hidden = ours(ids, [SeqSpan(slot, 0, ids.shape[0])], cache)
    got = []
    for _ in range(new_tokens):
        token = ours.logits(hidden[-1:]).argmax(-1)
        got.append(int(token))
        hidden = ours(token, [SeqSpan(slot, cache.lengths[slot], 1)], cache)
    assert got == expected.tolist()


def test_decoder_layer_alone_with_its_own_cache(ours, hf, prompts):
    # The MTP head's usage: one DecoderLayer, a 1-layer KVCache, fed in two chunks.
    layer: DecoderLayer = ours.layers[0]
    ids = prompts[0]
    n = ids.shape[0]
    cache = KVCache(1, 2, n, ours.cfg.num_kv_heads, ours.cfg.head_dim)
    slot = cache.allocate()
    with torch.inference_mode():
        x = ours.embed_tokens(ids)
        first = layer(x[:3], ours.rope(torch.arange(0, 3)), [SeqSpan(slot, 0, 3)], cache.k[0], cache.v[0])
        rest = layer(x[3:], ours.rope(torch.arange(3, n)), [SeqSpan(slot, 3, n - 3)], cache.k[0], cache.v[0])
        expected = hf(ids[None], output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(torch.cat([first, rest]), expected, atol=fp32_atol(expected, ours.cfg.hidden_size), rtol=0)


def test_bad_spans_raise(ours):
    cache = ours.make_cache(max_slots=2, max_seq_len=8)
    slot = cache.allocate()
    ids = torch.tensor([1, 2, 3])
    bad = [
        ([SeqSpan(2, 0, 3)], "out of range"),
        ([SeqSpan(-1, 0, 3)], "out of range"),
        ([SeqSpan(1, 0, 3)], "not allocated"),
        ([SeqSpan(slot, 1, 3)], "cached"),        # starts after what the slot holds
        ([SeqSpan(slot, 0, 2)], "cover"),         # spans cover 2 of 3 tokens
        ([SeqSpan(slot, 0, 0), SeqSpan(slot, 0, 3)], "length"),
        ([], "at least one"),
    ]
    for spans, message in bad:
        with pytest.raises(ValueError, match=message):
            ours(ids, spans, cache)
    with pytest.raises(ValueError, match="1-D"):
        ours(ids[None], [SeqSpan(slot, 0, 3)], cache)
    with pytest.raises(ValueError, match="capacity"):
        ours(torch.arange(1, 10), [SeqSpan(slot, 0, 9)], cache)
    assert cache.lengths[slot] == 0  # a rejected call changes nothing
    ours(torch.arange(1, 9), [SeqSpan(slot, 0, 8)], cache)  # exactly full is fine
    with pytest.raises(ValueError, match="capacity"):
        ours(ids[:1], [SeqSpan(slot, 8, 1)], cache)


def test_kv_cache_slots():
    cache = KVCache(num_layers=2, max_slots=2, max_seq_len=4, num_kv_heads=1, head_dim=2)
    assert cache.k.shape == (2, 2, 1, 4, 2) and cache.num_free == 2
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free == 0
    with pytest.raises(ValueError, match="full"):
        cache.allocate()
    cache.lengths[a] = 3
    cache.truncate(a, 1)
    assert cache.lengths[a] == 1
    with pytest.raises(ValueError):
        cache.truncate(a, 2)  # cannot grow by truncating
    cache.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(a)
    with pytest.raises(ValueError, match="out of range"):
        cache.truncate(5, 0)
    assert cache.allocate() == a and cache.lengths[a] == 0


def test_config_from_checkpoint(model_dir):
    cfg = ModelConfig.from_hf_dir(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    assert cfg.rope_theta == raw["rope_parameters"]["rope_theta"]
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (
        raw["num_hidden_layers"], raw["num_key_value_heads"], raw["vocab_size"])
    assert cfg.tie_word_embeddings is True


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "architecture"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "rope scaling 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic'"),
    # beside a default rope_parameters, which transformers reads under it (passed, found by QA)
    ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope_scaling: rope scaling 'longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling.low_freq_factor: a positive number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, r"rope_scaling.factor: a positive number"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0},
      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "name different RoPE scalings"),
    # a GPT-2 has no Llama sizes: its architecture is named, not the keys it lacks
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "hidden_size": None}, "architecture.*gpt2"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 4}, "multiple"),
])
def test_config_rejects_what_the_forward_cannot_compute(model_dir, change, message):
    raw = {key: value for key, value in (json.loads((model_dir / "config.json").read_text()) | change).items()
           if value is not None or key.startswith("rope")}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(raw)


def test_a_config_short_of_a_size_or_not_an_object_is_a_value_error_naming_it(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("hidden_size")
    with pytest.raises(ValueError, match="config.json: hidden_size missing"):
        ModelConfig.from_hf_dict(raw)
    with pytest.raises(ValueError, match="an object expected, got list"):
        ModelConfig.from_hf_dict([raw])


def test_config_accepts_transformers4_rope_theta(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("rope_parameters")
    raw["rope_theta"] = 500000.0
    assert ModelConfig.from_hf_dict(raw).rope_theta == 500000.0


def _tiny_hf_llama(tmp_path, tie: bool, shard: bool, **settings):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, **settings)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    return model


@pytest.mark.parametrize("tie, shard", [(False, True), (True, False)])
def test_loads_other_llama_checkpoints(tmp_path, tie, shard):
    hf_tiny = _tiny_hf_llama(tmp_path, tie, shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    ours_tiny = LlamaModel.from_pretrained(tmp_path)
    assert ours_tiny.cfg.tie_word_embeddings == tie
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf_tiny, ids)
    torch.testing.assert_close(run_alone(ours_tiny, ids, chunk=4), expected,
                               atol=fp32_atol(expected, ours_tiny.cfg.hidden_size), rtol=0)


# Llama 3.1's kind (low frequencies / factor, high ones kept, a blend between; a short original
# context so that a 40-token prompt meets every kind), and a linear one
@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
])
def test_a_scaled_rope_checkpoint_computes_as_transformers_does(tmp_path, scaling):
    """It was refused; now its frequencies are divided as transformers' are (and llama.cpp's
    from a GGUF's rope_freqs), and a config given beside a checkpoint (a GGUF's, whose
    config.json lacks them) brings them."""
    hf_tiny = _tiny_hf_llama(tmp_path, tie=False, shard=False, rope_parameters=scaling)
    ours_tiny = LlamaModel.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2))
    expected, got = hf_logits(hf_tiny, ids), run_alone(ours_tiny, ids, chunk=8)
    atol = fp32_atol(expected, ours_tiny.cfg.hidden_size)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = LlamaModel.from_pretrained(tmp_path)
    assert (run_alone(plain, ids, chunk=8) - expected).abs().max() > 100 * atol  # the scaling matters here
    assert torch.equal(run_alone(LlamaModel.from_pretrained(tmp_path, cfg=ours_tiny.cfg), ids, chunk=8), got)


def test_checkpoint_key_mismatch_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _tiny_hf_llama(tmp_path, tie=False, shard=False)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(1)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*unexpected \['model.layers.1.mlp.extra.weight'\]"):
        LlamaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("name, value, says", [
    ("model.layers.0.self_attn.k_proj.weight", torch.zeros(12, 32), r"k_proj.weight has shape \[12, 32\], config.json gives \[16, 32\]"),
    ("model.layers.1.mlp.down_proj.weight", None, "down_proj.weight holds a NaN or an infinite value"),
    ("model.norm.weight", torch.full((32,), float("inf")), "norm.weight holds a NaN or an infinite value"),
])
def test_a_tensor_of_the_wrong_shape_or_not_finite_is_named(tmp_path, name, value, says):
    """Each tensor is checked, not the fused ones alone (a k_proj short by what v_proj had too
    many loaded), and a NaN weight is a load error (it made every logit NaN: QA)."""
    from safetensors.torch import load_file, save_file

    _tiny_hf_llama(tmp_path, tie=False, shard=False)
    state = load_file(tmp_path / "model.safetensors")
    if value is None:
        value = state[name].clone()
        value[3, 5] = float("nan")
    state[name] = value
    if "k_proj" in name:  # the fused QKV keeps its row count: only the part's shape tells
        state[name.replace("k_proj", "v_proj")] = torch.zeros(20, 32)
    save_file(state, tmp_path / "model.safetensors")
    for load in (LlamaModel.from_pretrained, NativeLlamaModel.load):
        with pytest.raises(ValueError, match=says):
            load(tmp_path)


def test_a_pickled_checkpoint_is_named_as_one_not_read(tmp_path):
    model = _tiny_hf_llama(tmp_path, tie=True, shard=False)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin is a pickle, which is not read: save the model with "
                                         "safetensors"):
        LlamaModel.from_pretrained(tmp_path)


def test_a_broken_checkpoint_is_a_value_error_naming_its_file(tmp_path):
    """Not a JSON config.json, a truncated safetensors file or index, no tokenizer: each named
    (they were JSONDecodeError, SafetensorError, KeyError and transformers' own words; found by QA)."""
    from replicas.torch_engine.loader import load_tokenizer

    _tiny_hf_llama(tmp_path, tie=True, shard=False)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        LlamaModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model: .* has no tokenizer transformers can load"):
        load_tokenizer(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index\.json: not a safetensors index"):
        LlamaModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{'vocab_size': 97}")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON document"):
        ModelConfig.from_hf_dir(tmp_path)


def test_prepacked_and_plain_weights_agree(tmp_path):
    # from_pretrained prepacks for oneDNN; `.float()` drops the packed copies (plain MKL path).
    _tiny_hf_llama(tmp_path, tie=True, shard=False)
    model = LlamaModel.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2))
    packed = run_alone(model, ids, chunk=9)
    had_packed = model.layers[0].mlp.gate_up_proj.packed is not None
    model.float()
    assert model.layers[0].mlp.gate_up_proj.packed is None
    torch.testing.assert_close(run_alone(model, ids, chunk=9), packed, atol=fp32_atol(packed, model.cfg.hidden_size), rtol=0)
    assert had_packed == torch.backends.mkldnn.is_available()


def test_bfloat16_runs_close_to_float32(ours, prompts):
    from replicas.torch_engine.loader import resolve_model_dir

    bf16 = LlamaModel.from_pretrained(resolve_model_dir(), dtype=torch.bfloat16)
    ids = prompts[1]
    got, expected = run_alone(bf16, ids, chunk=5), run_alone(ours, ids, chunk=ids.shape[0])
    assert got.dtype == torch.float32
    # bf16 keeps ~3 significant digits: the top token of most positions survives.
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
