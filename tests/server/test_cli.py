"""`tokenwire serve` refuses what it would otherwise ignore or trip over
later: a TOKENWIRE_* variable with a value its flag would refuse, and a flag
for another engine. Each exits 2 before anything starts."""

from __future__ import annotations

import pytest

from tokenwire import cli


@pytest.mark.parametrize(
    ("var", "value", "said"),
    [
        ("TOKENWIRE_ENGINE", "bogus", "expected one of vllm, remote, scripted"),
        ("TOKENWIRE_LOG_LEVEL", "verbose", "expected one of debug, info, warning, error"),
        ("TOKENWIRE_PORT", "abc", "expected an integer"),
        ("TOKENWIRE_STALL_S", "soon", "expected a number"),
        ("TOKENWIRE_RESPONSE_CACHE", "enabled", "expected one of 1, true, yes, on or 0"),
    ],
)
def test_a_bad_environment_value_exits_2_and_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    var: str,
    value: str,
    said: str,
) -> None:
    monkeypatch.setenv(var, value)
    assert cli.main(["serve", "--engine", "scripted"]) == 2
    err = capsys.readouterr().err
    assert f"{var}={value!r}" in err and said in err


@pytest.mark.parametrize("word", ["0", "off", "No", ""])
def test_false_words_read_as_false(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("TOKENWIRE_RESPONSE_CACHE", word)
    assert cli.build_parser().parse_args(["serve"]).response_cache is False
    monkeypatch.setenv("TOKENWIRE_RESPONSE_CACHE", "On")
    assert cli.build_parser().parse_args(["serve"]).response_cache is True


@pytest.mark.parametrize(
    ("engine", "flag", "applies"),
    [
        ("scripted", ["--dtype", "float16"], "vllm"),
        ("scripted", ["--tool-parser", "hermes"], "vllm or remote"),
        ("remote", ["--max-model-len", "2048"], "vllm"),
        ("remote", ["--kv-cache-gib=4"], "vllm"),
        ("vllm", ["--scripted-tokens-per-s", "5"], "scripted"),
        ("vllm", ["--no-remote-priority"], "remote"),
    ],
)
def test_a_flag_for_another_engine_exits_2(
    capsys: pytest.CaptureFixture[str], engine: str, flag: list[str], applies: str
) -> None:
    assert cli.main(["serve", "--engine", engine, *flag]) == 2
    name = flag[0].split("=")[0].replace("--no-", "--")
    assert f"error: {name} applies to --engine {applies}" in capsys.readouterr().err


def test_an_environment_variable_for_another_engine_is_ignored(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shared environment (the Docker image sets TOKENWIRE_KV_CACHE_GIB) may
    run any engine: no refusal, no noise; the start goes on (here to the next
    refusal). Choice values are read in any case, as logging names levels."""
    monkeypatch.setenv("TOKENWIRE_KV_CACHE_GIB", "0")
    monkeypatch.setenv("TOKENWIRE_LOG_LEVEL", "INFO")
    assert cli.main(["serve", "--engine", "scripted", "--remote-url", "http://x"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --remote-url needs --engine remote\n"


def test_kv_cache_size_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--kv-cache-gib", "0"]) == 2
    assert "--kv-cache-gib must be above 0" in capsys.readouterr().err
