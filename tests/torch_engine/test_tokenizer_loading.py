"""load_tokenizer: the default checkpoint's tokenizer loads through its own fast class, the
same tokenizer AutoTokenizer gives, without the model config's ~700 imports; a checkpoint that
names another class still goes through AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import transformers

from replicas.torch_engine.loader import load_tokenizer, portable_tokenizer_config, resolve_model_dir

CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Grüße! What is 2 + 2? 東京"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir()


def test_the_default_loads_the_tokenizer_autotokenizer_gives(model_dir):
    ours, auto = load_tokenizer(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.special_tokens_map == auto.special_tokens_map and ours.eos_token_id == auto.eos_token_id
    text = "def f(x):\n    return {'ключ': x}  # 👩‍💻 <|im_end|>"
    assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    for prompt in (True, False):
        assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
                == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt))


def test_loading_the_default_imports_no_model_config(model_dir):
    """In a fresh interpreter, as a Replica starts: what AutoTokenizer would import is absent."""
    code = ("import sys, transformers\n"
            "from replicas.torch_engine.loader import load_tokenizer\n"
            f"load_tokenizer({str(model_dir)!r})\n"
            "print(sorted(m for m in ('accelerate', 'sympy', 'transformers.models.llama.configuration_llama')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stderr


def test_a_checkpoint_naming_another_class_goes_through_autotokenizer(model_dir, tmp_path, monkeypatch):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: calls.append(path) or real(path, **kw))
    load_tokenizer(tmp_path)
    assert calls == []
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizerFast"}))
    tokenizer = load_tokenizer(tmp_path)
    assert calls == [tmp_path]
    assert tokenizer.encode("hello world") == load_tokenizer(model_dir).encode("hello world")


def test_the_converted_tokenizer_config_names_a_class_other_transformers_have(model_dir, tmp_path):
    """transformers 5 names its own class (`TokenizersBackend`), which 4.x (a load generator's
    venv, pointed at this directory) cannot load (found by QA): the copy names the class both
    have, and the model's window as its length (was 1e30); a copy converted before is mended."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    window = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    assert {k: json.loads((model_dir / "tokenizer_config.json").read_text())[k]
            for k in ("tokenizer_class", "model_max_length")} == {"tokenizer_class": "PreTrainedTokenizerFast",
                                                                   "model_max_length": window}
    old = {**json.loads((tmp_path / "tokenizer_config.json").read_text()), "tokenizer_class": "TokenizersBackend",
           "model_max_length": 10 ** 30}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(old))
    portable_tokenizer_config(tmp_path)
    mended = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert mended == {**old, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": window}
    assert load_tokenizer(tmp_path).encode("hello world") == load_tokenizer(model_dir).encode("hello world")


def test_a_read_only_copy_is_served_as_it_is(model_dir, tmp_path, monkeypatch, caplog):
    """A cache mounted read-only (a volume), or a copy whose configs cannot be read, is not mended:
    it loads as it is, said in the log."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "TokenizersBackend"}))

    def read_only(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    portable_tokenizer_config(tmp_path)
    monkeypatch.undo()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert "Read-only file system" in caplog.text
    assert load_tokenizer(tmp_path).encode("hello world") == load_tokenizer(model_dir).encode("hello world")
    (tmp_path / "config.json").write_text("{not json")  # nor one it cannot read, and no file left behind
    portable_tokenizer_config(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]


def test_the_models_eos_ids_are_its_generation_configs_or_else_its_configs(model_dir, tmp_path):
    """As transformers takes them: a config.json listing several EOS ids without a
    generation_config.json stopped at the tokenizer's alone (QA)."""
    from replicas.torch_engine.engine import _eos_token_ids

    tokenizer = load_tokenizer(model_dir)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert _eos_token_ids(tmp_path, tokenizer) == sorted({tokenizer.eos_token_id, 2, 7})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert _eos_token_ids(tmp_path, tokenizer) == sorted({tokenizer.eos_token_id, 5})


def test_a_tokenizer_larger_than_the_models_vocabulary_stops_the_engine_naming_both(model_dir, tmp_path):
    """Its last ids would index past the embedding: refused before the weights load (was
    llguidance's "vocab size too small; 1024 vs 49152", naming nothing: QA)."""
    import asyncio

    from transformers import LlamaConfig, LlamaForCausalLM

    from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig

    LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=512)).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    engine = TorchEngine(TorchEngineConfig(model=str(tmp_path), max_seq_len=256, mtp_weights=None,
                                           prefix_cache_bytes=0))
    with pytest.raises(ValueError, match=r"model: its tokenizer has 49152 tokens, more than the model's vocab_size "
                                         r"\(1024\)"):
        asyncio.run(engine.start())


def test_ids_of_a_vocabulary_padded_past_the_tokenizer_are_never_sampled(model_dir, tmp_path):
    """A checkpoint's vocabulary larger than its tokenizer (Qwen2.5's 151,936 over 151,665):
    its extra ids have no text and were sampled (then sent as '', QA); here their head rows
    outweigh every other, yet neither greedy nor sampled output nor a top logprob holds one."""
    import asyncio

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
    from tests.torch_engine.engine_util import collect_logprobs, request

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=49160, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False))
    with torch.no_grad():
        hf.lm_head.weight[49152:] = 10 * hf.lm_head.weight[:8].sign()  # (the norm's output: about +-1 a dim)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    engine = TorchEngine(TorchEngineConfig(model=str(tmp_path), max_seq_len=256, mtp_weights=None,
                                           prefix_cache_bytes=0))

    async def run():
        await engine.start()
        try:
            return [await collect_logprobs(engine, request("Hello there", max_tokens=12, mode="off", logprobs=5,
                                                           ignore_eos=True, **kw))
                    for kw in ({}, {"temperature": 1.0, "seed": 3})]
        finally:
            await engine.shutdown()

    for tokens, _, logprobs, _ in asyncio.run(run()):
        assert len(tokens) == 12 and max(tokens) < 49152
        assert all(t < 49152 for step in logprobs for t, _ in step.top)
