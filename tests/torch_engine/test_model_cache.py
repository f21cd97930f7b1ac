"""The converted model cache (`loader.resolve_model_dir`): one process converts while the others
wait for its copy, a killed conversion's leftovers and an incomplete copy are cleaned up, the
files are readable by others as the umask allows, and a cache that cannot be written is named
at once (all found by QA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replicas.engine import DEFAULT_MODEL
from replicas.torch_engine.loader import CONVERTED, default_cache_dir, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]
RESOLVE = "from replicas.torch_engine.loader import resolve_model_dir; print(resolve_model_dir(weights=False))"


def _resolving(cache: Path) -> subprocess.Popen:
    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_processes_converting_at_once_make_one_copy_and_all_read_it(tmp_path):
    """Three Replicas starting on one node with an empty cache: each converted, and each
    replaced the copy the others were reading (a crash, or a tokenizer 'not loadable')."""
    runs = [_resolving(tmp_path) for _ in range(3)]
    outs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outs]
    target = tmp_path / "models" / DEFAULT_MODEL
    assert {out.strip().splitlines()[-1] for out, _ in outs} == {str(target)}
    assert sum(out.count("[specserve] first run: converting") for out, _ in outs) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".convert.lock", DEFAULT_MODEL]


def test_an_incomplete_copy_and_a_killed_conversions_leftovers_are_converted_and_cleaned(tmp_path):
    models = tmp_path / "models"
    for killed in (f".{DEFAULT_MODEL}.converting4242", f"{DEFAULT_MODEL}.tmp4243"):  # (500 MB each; an older one's)
        (models / killed).mkdir(parents=True)
        (models / killed / "model.safetensors").write_bytes(b"\0" * 1000)
    (models / DEFAULT_MODEL).mkdir()
    (models / DEFAULT_MODEL / "tokenizer.json").write_text("{")  # no marker: never finished
    target = resolve_model_dir(cache_dir=tmp_path, weights=False)
    assert sorted(p.name for p in models.iterdir()) == [".convert.lock", DEFAULT_MODEL]
    assert json.loads((target / CONVERTED).read_text())["weights"] is False
    mask = os.umask(0o022)
    os.umask(mask)
    assert {oct(p.stat().st_mode & 0o777) for p in target.iterdir()} == {oct(0o666 & ~mask)}  # was 0600


def test_a_copy_without_weights_gets_them_when_a_cuda_forward_needs_them(tmp_path):
    target = resolve_model_dir(cache_dir=tmp_path, weights=False)
    assert not (target / "model.safetensors").exists()
    tokenizer = (target / "tokenizer.json").read_bytes()
    assert resolve_model_dir(cache_dir=tmp_path) == target
    assert (target / "model.safetensors").stat().st_size > 500e6  # fp32, as the CUDA forward reads it
    assert json.loads((target / CONVERTED).read_text())["weights"] is True
    assert (target / "tokenizer.json").read_bytes() == tokenizer  # the copy's other files kept as they were


@pytest.mark.parametrize("where", ["a file", "an unwritable directory"])
def test_a_cache_that_cannot_be_written_is_named_before_any_conversion(tmp_path, where):
    if os.geteuid() == 0 and where != "a file":
        pytest.skip("root writes anywhere")
    cache = tmp_path / "cache"
    if where == "a file":
        cache.write_text("")
    else:
        cache.mkdir(mode=0o555)
    with pytest.raises(OSError, match=f"model cache: cannot write {cache}/models .*set SPECSERVE_CACHE_DIR"):
        resolve_model_dir(cache_dir=cache, weights=False)


def test_an_empty_cache_variable_is_the_default(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", "")  # was the working directory
    assert default_cache_dir() == Path.home() / ".cache" / "specserve"


def test_a_copy_broken_after_its_conversion_says_how_to_mend_it(tmp_path):
    from replicas.torch_engine.loader import load_tokenizer

    target = resolve_model_dir(cache_dir=tmp_path, weights=False)
    (target / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match=f"no tokenizer transformers can load .*; delete {target} to convert"):
        load_tokenizer(target)


def test_a_replaced_gguf_is_converted_anew_and_its_old_copy_dropped(tmp_path):
    """A file written over at the same path (the same size and modification time too) is
    another model: converted again, and the old conversion removed (it stayed: QA)."""
    import shutil

    from replicas.torch_engine.loader import packaged_gguf_path

    gguf = tmp_path / "mine.gguf"
    shutil.copy2(packaged_gguf_path(), gguf)
    first = resolve_model_dir(str(gguf), cache_dir=tmp_path / "cache", weights=False)
    assert resolve_model_dir(str(gguf), cache_dir=tmp_path / "cache", weights=False) == first  # read, not converted
    gguf.unlink()
    shutil.copy2(packaged_gguf_path(), gguf)  # (copy2 keeps the modification time)
    second = resolve_model_dir(str(gguf), cache_dir=tmp_path / "cache", weights=False)
    assert second != first and [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == [second]
    link = tmp_path / "served.gguf"  # a symlink pointed at another file: the same (QA)
    link.symlink_to(gguf)
    third = resolve_model_dir(str(link), cache_dir=tmp_path / "cache", weights=False)
    shutil.copy2(packaged_gguf_path(), tmp_path / "other.gguf")
    link.unlink()
    link.symlink_to(tmp_path / "other.gguf")
    fourth = resolve_model_dir(str(link), cache_dir=tmp_path / "cache", weights=False)
    assert fourth != third and not third.exists() and second.exists()
