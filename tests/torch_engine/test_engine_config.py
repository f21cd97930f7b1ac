"""What the embedded engine refuses when it starts, each line naming the key: an MTP head
that cannot serve the model, and a device this host lacks (config_check runs the same checks
before a deploy; tests/deploy/test_deploy_yaml.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
from replicas.torch_engine.mtp import DEFAULT_WEIGHTS_DIR, META_FILE, MTPModule, setting_problems
from tests.torch_engine.test_mtp import TINY


def test_a_head_that_cannot_serve_the_target_is_named_before_loading(tmp_path):
    """`mtp_weights` pointing nowhere, at a broken mtp.json or at a head of another shape: a
    line naming the setting (before: a FileNotFoundError or KeyError that named nothing)."""
    module = MTPModule(TINY, torch.arange(64))
    module.save(tmp_path / "head", {})
    assert setting_problems(str(tmp_path / "head"), TINY) == [] == setting_problems(None, TINY)
    assert MTPModule.load(tmp_path / "head", TINY).draft_vocab.tolist() == list(range(64))
    (problem,) = setting_problems(str(tmp_path / "nowhere"), TINY)
    assert problem.startswith("mtp_weights: ") and "holds no mtp.json or mtp.safetensors" in problem
    (problem,) = setting_problems(str(tmp_path / "head"), replace(TINY, hidden_size=64, vocab_size=97))
    assert "trained for another target (vocab_size, hidden_size differ)" in problem
    (problem,) = setting_problems("default", TINY)  # the shipped head is the default model's
    assert str(DEFAULT_WEIGHTS_DIR) in problem and "another target" in problem
    (tmp_path / "head" / META_FILE).write_text("{}")
    (problem,) = setting_problems(str(tmp_path / "head"), TINY)
    assert "is not an MTP head's metadata (KeyError" in problem
    with pytest.raises(ValueError, match="not an MTP head's metadata"):
        MTPModule.load(tmp_path / "head", TINY)


def test_a_broken_weights_file_is_named(tmp_path):
    """A truncated mtp.safetensors or one of other tensors: a ValueError naming the file (was
    safetensors' SafetensorError, or torch's RuntimeError, naming nothing)."""
    from safetensors.torch import save_file

    from replicas.torch_engine.mtp import WEIGHTS_FILE

    MTPModule(TINY, torch.arange(64)).save(tmp_path / "head", {})
    weights = tmp_path / "head" / WEIGHTS_FILE
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file"):
        MTPModule.load(tmp_path / "head", TINY)
    save_file({"draft_vocab": torch.arange(64, dtype=torch.int32), "other": torch.zeros(2)}, weights)
    with pytest.raises(ValueError, match=f"{weights}: not the weights of an MTP head for this model"):
        MTPModule.load(tmp_path / "head", TINY)


def _refusal(loop, **config) -> str:
    engine = TorchEngine(TorchEngineConfig(max_batch_size=1, max_seq_len=256, **config))
    try:
        with pytest.raises(ValueError) as refused:
            loop.run_until_complete(engine.start())
    finally:
        loop.run_until_complete(engine.shutdown())
    return str(refused.value)


def test_the_engine_refuses_a_missing_head_before_loading_the_model(loop, tmp_path):
    assert _refusal(loop, mtp_weights=str(tmp_path)).startswith(f"mtp_weights: {str(tmp_path)!r} holds no")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA device")
def test_device_cuda_on_a_host_without_one_names_the_key(loop):
    assert _refusal(loop, device="cuda").startswith("device: cuda, but torch")
