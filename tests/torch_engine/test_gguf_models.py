"""A Llama GGUF file of the user's as `engine.model` (as llama.cpp serves them): its weights
read from the file itself, its tokenizer converted once into the cache; and the GGUFs the
forward would compute wrong, or that are broken, refused naming why."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
from replicas.torch_engine.loader import model_config, packaged_gguf_path
from tests.torch_engine.engine_util import chat_prompt, collect, request
from tests.torch_engine.gguf_files import llama_gguf


def _greedy(model: str, prompts: list[str]) -> list[list[int]]:
    engine = TorchEngine(TorchEngineConfig(model=model, max_batch_size=2, max_seq_len=512, mtp_weights=None,
                                           prefix_cache_bytes=0))

    async def run():
        await engine.start()
        try:
            return [(await collect(engine, request(chat_prompt(engine, p), max_tokens=24, mode="sa")))[0]
                    for p in prompts]
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_a_gguf_path_serves_its_weights_as_the_default_does(tmp_path, monkeypatch):
    """The packaged GGUF named by its path is a user's GGUF: the same tokens, bitwise (the same
    blocks through the same kernels), and its cached copy holds no weights (the CPU forward
    reads the file)."""
    prompts = ["Name three colours.", "Write a Python function that reverses a string."]
    expected = _greedy("smollm2-135m-instruct", prompts)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    assert _greedy(str(packaged_gguf_path()), prompts) == expected
    (converted,) = (p for p in (tmp_path / "models").iterdir() if p.is_dir())
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert (converted / "tokenizer.json").is_file() and not (converted / "model.safetensors").exists()


def test_a_plain_llama_gguf_in_another_format_is_quantised_at_load(tmp_path):
    """Its shape from the header; F32 (or F16, Q6_K, ...) tensors quantised to Q8_0 as they load."""
    import torch

    from replicas.torch_engine.model import SeqSpan
    from replicas.torch_engine.native_model import NativeLlamaModel

    llama_gguf(tmp_path / "plain.gguf")
    cfg = model_config(str(tmp_path / "plain.gguf"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (96, 64, 4, 2, 16)
    model = NativeLlamaModel.load(tmp_path / "plain.gguf", num_threads=1)
    cache = model.make_cache(1, 64)
    logits = model.logits(model(torch.arange(10), [SeqSpan(cache.allocate(), 0, 10)], cache))
    assert logits.shape == (10, 96) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("fields, tensors, says", [
    ({"llama.rope.scaling.type": "yarn"}, {}, r"RoPE scaling 'yarn' \(llama.rope.scaling.type\)"),
    ({"llama.expert_count": 8}, {}, r"experts \(llama.expert_count\)"),
    ({"llama.rope.dimension_count": 8}, {}, r"RoPE on 8 of 16 dims"),
    ({}, {"blk.0.attn_q.bias": (64,)}, r"tensors a plain Llama has not: \['blk.0.attn_q.bias'\]"),
])
def test_a_gguf_the_forward_would_compute_wrong_is_refused_naming_why(tmp_path, fields, tensors, says):
    llama_gguf(tmp_path / "odd.gguf", fields, tensors)
    with pytest.raises(ValueError, match=f"odd.gguf: the forward computes a plain Llama, not {says}"):
        model_config(str(tmp_path / "odd.gguf"))


@pytest.mark.parametrize("fields, tensors, says", [
    ({"llama.block_count": None}, {}, "its header lacks llama.block_count"),
    ({}, {"blk.0.ffn_norm.weight": None}, "it lacks the tensor blk.0.ffn_norm.weight"),
    ({"llama.attention.head_count_kv": 4}, {}, r"blk.0.attn_k.weight is \[32, 64\], its header \(llama.\*\) "
                                                 r"gives \[64, 64\]"),
    ({"llama.vocab_size": 100}, {}, r"token_embd.weight is \[96, 64\], its header \(llama.\*\) gives \[100, 64\]"),
    ({}, {"rope_freqs.weight": (4,)}, r"rope_freqs.weight holds 4 factors, not 8 positive ones"),
    ({"llama.rope.scaling.type": "linear"}, {}, "its header lacks llama.rope.scaling.factor"),
    ({"llama.rope.scale_linear": -2.0}, {}, r"a linear RoPE scaling factor of -2.0 \(llama.rope.scale_linear\)"),
    ({"llama.rope.scaling.factor": "4"}, {}, r"llama.rope.scaling.factor is the string '4', not a number"),
    ({"llama.block_count": "1"}, {}, r"llama.block_count is the string '1', not a number"),
])
def test_a_gguf_whose_header_and_tensors_disagree_is_named(tmp_path, fields, tensors, says):
    """Each was a TypeError, a KeyError, an IndexError deep in numpy, a kernel's byte count, or
    (a vocabulary larger than the embedding) sampled ids past it (QA)."""
    llama_gguf(tmp_path / "odd.gguf", fields, tensors)
    with pytest.raises(ValueError, match=f"odd.gguf: {says}"):
        model_config(str(tmp_path / "odd.gguf"))


def test_a_gguf_with_a_scaled_rope_divides_its_frequencies(tmp_path):
    """Llama 3's rope_freqs (llama.cpp's converter writes them) and a linear scaling
    (llama.rope.scaling.factor, or older files' llama.rope.scale_linear) were refused; each
    divides the RoPE frequencies as llama.cpp does, both together too (a factor without a
    type was ignored, where llama.cpp scales by it: QA)."""
    import torch
    from gguf import GGMLQuantizationType as T

    from replicas.torch_engine.model import SeqSpan
    from replicas.torch_engine.native_model import NativeLlamaModel

    freqs = np.linspace(1.0, 4.0, 8, dtype=np.float32)
    files = {"plain": ({}, {}), "freqs": ({}, {"rope_freqs.weight": (T.F32, freqs)}),
             "linear": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.5}, {}),
             "old_linear": ({"llama.rope.scale_linear": 2.5}, {}),
             "untyped": ({"llama.rope.scaling.factor": 2.5}, {}),  # llama.cpp takes an absent type for linear
             "none": ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 2.5}, {}),
             "zero": ({"llama.rope.scaling.factor": 0.0}, {}),  # (llama.cpp's unset)
             "both": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
                      {"rope_freqs.weight": (T.F32, np.full(8, 1.25, np.float32))})}
    for name, (fields, tensors) in files.items():
        llama_gguf(tmp_path / f"{name}.gguf", fields, tensors)  # the same random weights in each
    factors = {name: model_config(str(tmp_path / f"{name}.gguf")).rope_freq_factors for name in files}
    assert factors == {"plain": (), "freqs": tuple(freqs.tolist()), "linear": (2.5,) * 8, "old_linear": (2.5,) * 8,
                       "untyped": (2.5,) * 8, "none": (), "zero": (), "both": (2.5,) * 8}

    def logits(name):
        model = NativeLlamaModel.load(tmp_path / f"{name}.gguf", num_threads=1)
        cache = model.make_cache(1, 64)
        return model.logits(model(torch.arange(40) % 96, [SeqSpan(cache.allocate(), 0, 40)], cache))

    scaled = logits("linear")
    assert torch.equal(logits("both"), scaled) and not torch.equal(logits("plain"), scaled)
    assert not torch.equal(logits("freqs"), logits("plain"))


def test_a_ggufs_generation_ends_where_llama_cpps_does(tmp_path):
    """A GGUF has no generation_config.json: its EOS, EOT and EOM ids end a generation, and so
    does a control token that ends a turn (a Qwen2.5's <|endoftext|> beside its EOS <|im_end|>
    ran to max_tokens: QA); the same text as a normal token does not."""
    from replicas.torch_engine.gguf_weights import GgufWeights

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "<|eot_id|>", "<tool_call>", "b"]
    llama_gguf(tmp_path / "tok.gguf", fields={"tokenizer.ggml.tokens": tokens,
                                              "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 4, 1],
                                              "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eom_token_id": 6})
    assert GgufWeights(tmp_path / "tok.gguf").end_of_generation_ids() == {0, 2, 6}
    assert GgufWeights(packaged_gguf_path()).end_of_generation_ids() == {0, 2}  # SmolLM2's as llama.cpp's


def test_a_broken_gguf_is_named_and_a_bf16_norm_is_read(tmp_path):
    """A NaN (a value, or a block's scale) served token 0 for ever; a file cut short failed in
    gguf-py's reshape; a BF16 norm's bytes were read as floats (QA)."""
    from gguf import GGMLQuantizationType as T

    from replicas.torch_engine.native_model import NativeLlamaModel

    nan = np.ones((32, 64), np.float32)
    nan[3, 5] = np.nan
    llama_gguf(tmp_path / "nan.gguf", tensors={"blk.0.attn_v.weight": (T.F16, nan)})
    scale = tmp_path / "scale.gguf"
    llama_gguf(scale, tensors={"blk.0.attn_v.weight": (T.Q8_0, np.ones((32, 64), np.float32))})
    raw = bytearray(scale.read_bytes())
    at = raw.rindex(bytes(np.float16(1 / 127).tobytes() + bytes([127]) * 32))  # a block of ones: scale 1/127, then 127s
    raw[at:at + 2] = np.float16(np.nan).tobytes()
    scale.write_bytes(bytes(raw))
    for path in (tmp_path / "nan.gguf", scale):
        with pytest.raises(ValueError, match=f"{path.name}: blk.0.attn_v.weight holds a NaN or an infinite value"):
            NativeLlamaModel.load(path, num_threads=1)
    llama_gguf(tmp_path / "whole.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:20000])
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        model_config(str(tmp_path / "cut.gguf"))
    llama_gguf(tmp_path / "bf16.gguf", tensors={"output_norm.weight": (T.BF16, np.full(64, 0.5, np.float32))})
    assert NativeLlamaModel.load(tmp_path / "bf16.gguf", num_threads=1).cfg.hidden_size == 64


def test_a_gguf_path_that_is_no_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="model: no GGUF file at"):
        model_config(str(tmp_path / "missing.gguf"))
