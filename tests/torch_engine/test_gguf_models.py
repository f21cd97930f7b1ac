"""A Llama GGUF file of the user's as `engine.model` (as llama.cpp serves them): its weights
read from the file itself, its tokenizer converted once into the cache; and the GGUFs the
forward would compute wrong refused, naming why."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
from replicas.torch_engine.loader import model_config, packaged_gguf_path
from tests.torch_engine.engine_util import chat_prompt, collect, request


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


def _llama_gguf(path, **fields) -> None:
    """A 1-layer llama GGUF of random F32 tensors, with extra header `fields` and tensors
    (`tensor_<name>`)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 96,
                       "attention.layer_norm_rms_epsilon": 1e-5}.items():
        add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
        add(f"llama.{key}", value)
    for key, value in fields.items():
        if not key.startswith("tensor_"):
            writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (96, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
              "blk.0.ffn_norm.weight": (64,), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
              "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128),
              **{key.removeprefix("tensor_"): value for key, value in fields.items() if key.startswith("tensor_")}}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_plain_llama_gguf_in_another_format_is_quantised_at_load(tmp_path):
    """Its shape from the header; F32 (or F16, K-quant, ...) tensors quantised to Q8_0 as they load."""
    import torch

    from replicas.torch_engine.model import SeqSpan
    from replicas.torch_engine.native_model import NativeLlamaModel

    _llama_gguf(tmp_path / "plain.gguf")
    cfg = model_config(str(tmp_path / "plain.gguf"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (96, 64, 4, 2, 16)
    model = NativeLlamaModel.load(tmp_path / "plain.gguf", num_threads=1)
    cache = model.make_cache(1, 64)
    logits = model.logits(model(torch.arange(10), [SeqSpan(cache.allocate(), 0, 10)], cache))
    assert logits.shape == (10, 96) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("fields, says", [
    ({"llama.rope.scaling.type": "linear"}, r"RoPE scaling 'linear' \(llama.rope.scaling.type\)"),
    ({"tensor_rope_freqs.weight": (8,)}, r"Llama 3's scaled RoPE \(rope_freqs.weight\)"),
    ({"llama.expert_count": 8}, r"experts \(llama.expert_count\)"),
    ({"llama.rope.dimension_count": 8}, r"RoPE on 8 of 16 dims"),
    ({"tensor_blk.0.attn_q.bias": (64,)}, r"tensors a plain Llama has not: \['blk.0.attn_q.bias'\]"),
])
def test_a_gguf_the_forward_would_compute_wrong_is_refused_naming_why(tmp_path, fields, says):
    _llama_gguf(tmp_path / "odd.gguf", **fields)
    with pytest.raises(ValueError, match=f"odd.gguf: the forward computes a plain Llama, not {says}"):
        model_config(str(tmp_path / "odd.gguf"))


def test_a_gguf_path_that_is_no_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="model: no GGUF file at"):
        model_config(str(tmp_path / "missing.gguf"))
