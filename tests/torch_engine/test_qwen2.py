"""Qwen2 models (a Llama whose q, k and v projections have biases): a checkpoint directory and
a qwen2 GGUF, against transformers' own Qwen2 forward, and row-invariant like a Llama."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from replicas.torch_engine.model import LlamaModel, SeqSpan
from replicas.torch_engine.model_config import ModelConfig
from replicas.torch_engine.native_model import NativeLlamaModel
from tests.torch_engine.test_model import fp32_atol, hf_logits, run_alone

VOCAB = 104


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A random tiny Qwen2 checkpoint, biases included (transformers initialises them to zero);
    7 query heads a KV head, as Qwen2.5-0.5B's and -7B's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=224, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(torch.randn_like(param))
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path)
    return path, hf


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_qwen2_config_is_a_llama_with_qkv_biases(qwen2_dir):
    path, _ = qwen2_dir
    raw = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.qkv_bias and cfg.rope_theta == 1e6 and cfg.tie_word_embeddings
    assert not ModelConfig.from_hf_dict({**raw, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}).qkv_bias
    # a window on no layer (transformers' layer_types: every one full) is no window
    assert ModelConfig.from_hf_dict({**raw, "use_sliding_window": True, "layer_types": ["full_attention"] * 2}).qkv_bias
    for change, says in [({"use_sliding_window": True, "layer_types": None}, "use_sliding_window: sliding-window"),
                         ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types: only full attention"),
                         ({"architectures": ["Qwen2ForCausalLM", "LlamaForCausalLM"]}, "only \\['Qwen2ForCausalLM'\\]"),
                         ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "only Llama's and Qwen2's")]:
        with pytest.raises(ValueError, match=says):
            ModelConfig.from_hf_dict({**raw, **change})


def test_the_fp32_forward_computes_qwen2_as_transformers_does(qwen2_dir):
    path, hf = qwen2_dir
    ours = LlamaModel.from_pretrained(path)
    ids = _ids(30)
    expected = hf_logits(hf, ids)
    atol = fp32_atol(expected, ours.cfg.hidden_size)
    torch.testing.assert_close(run_alone(ours, ids, chunk=7), expected, atol=atol, rtol=0)
    with torch.no_grad():
        for layer in ours.layers:
            layer.self_attn.qkv_bias.zero_()
    assert (run_alone(ours, ids, chunk=7) - expected).abs().max() > 100 * atol  # the biases matter here


def _native_logits(model: NativeLlamaModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ids in one step, and of its last 5 tokens decoded one at a time on that cache."""
    cache = model.make_cache(1, 64)
    slot = cache.allocate()
    whole = model.logits(model(ids, [SeqSpan(slot, 0, len(ids))], cache))
    cache.truncate(slot, len(ids) - 5)
    decodes = torch.cat([model.logits(model(ids[i:i + 1], [SeqSpan(slot, i, 1)], cache))
                         for i in range(len(ids) - 5, len(ids))])
    return whole, decodes


def _qwen2_gguf(path, hf) -> None:
    """The checkpoint as llama.cpp's converter writes a Qwen2 (F32): q and k rows in
    transformers' order (its NEOX RoPE; a Llama's are permuted), biases as their own tensors."""
    from gguf import GGUFWriter

    c = hf.config
    writer = GGUFWriter(str(path), "qwen2")
    for key, value in {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
                       "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
                       "attention.head_count": c.num_attention_heads,
                       "attention.head_count_kv": c.num_key_value_heads}.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(c.num_hidden_layers):
        for hf_name, ours in [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                              ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                              ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                              ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]:
            names[f"model.layers.{i}.{hf_name}.weight"] = f"blk.{i}.{ours}.weight"
            names[f"model.layers.{i}.{hf_name}.bias"] = f"blk.{i}.{ours}.bias"
    for hf_name, tensor in hf.state_dict().items():
        if hf_name in names:
            writer.add_tensor(names[hf_name], tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_native_forward_computes_qwen2_row_invariantly_from_a_checkpoint_and_a_gguf(qwen2_dir, tmp_path):
    """Close to transformers (Q8_0 weights and activations), a row's bits the same decoded
    alone; a qwen2 GGUF of the same weights gives the checkpoint's bits (the same Q8_0 blocks,
    its q and k rows taken as they are)."""
    path, hf = qwen2_dir
    ids = _ids(24, seed=1)
    model = NativeLlamaModel.load(path, num_threads=2)
    whole, decodes = _native_logits(model, ids)
    expected = hf_logits(hf, ids)
    assert (whole - expected).abs().max() <= 0.05 * expected.abs().max()
    assert torch.equal(decodes, whole[-5:])
    _qwen2_gguf(tmp_path / "qwen2.gguf", hf)
    from_gguf = NativeLlamaModel.load(tmp_path / "qwen2.gguf", num_threads=1)
    assert from_gguf.cfg.qkv_bias and torch.equal(_native_logits(from_gguf, ids)[0], whole)


def test_a_qwen2_gguf_without_its_biases_or_with_other_tensors_is_named(qwen2_dir, tmp_path):
    from gguf import GGUFReader, GGUFWriter

    from replicas.torch_engine.gguf_weights import GgufWeights

    _, hf = qwen2_dir
    _qwen2_gguf(tmp_path / "whole.gguf", hf)
    reader = GGUFReader(tmp_path / "whole.gguf")
    for dropped, says in [("blk.1.attn_k.bias", "it lacks the tensor blk.1.attn_k.bias"),
                          (None, r"tensors a plain Qwen2 has not: \['blk.0.attn_output.bias'\]")]:
        writer = GGUFWriter(str(tmp_path / "odd.gguf"), "qwen2")
        for field in reader.fields.values():
            if field.name.startswith("qwen2."):
                value = field.parts[field.data[0]][0]
                (writer.add_uint32 if value.dtype == np.uint32 else writer.add_float32)(field.name, value.item())
        for tensor in reader.tensors:
            if tensor.name != dropped:
                writer.add_tensor(tensor.name, np.array(tensor.data))
        if dropped is None:
            writer.add_tensor("blk.0.attn_output.bias", np.zeros(224, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=f"odd.gguf: .*{says}"):
            GgufWeights(tmp_path / "odd.gguf")
