"""vLLM's engine flags after `--`: parsed by vLLM's own parser, tokenwire's
shortcuts and forced settings on top, and clear exits on bad flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenwire.engines.vllm import rank_of


@pytest.fixture(scope="module")
def model() -> str:
    """The bundled model, prepared by `make test`: vLLM checks what it is given."""
    from tokenwire.models import resolve_model

    return str(resolve_model(None))


def settings(argv: list[str], **kw: object):  # type: ignore[no-untyped-def]
    from tokenwire.engines.vllm_args import engine_args
    from tokenwire.models import resolve_model

    fields = {"model": str(resolve_model(None)), "dtype": None, "max_model_len": None, **kw}
    return engine_args(argv, **fields)  # type: ignore[arg-type]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenwire", "serve", *args]


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(serve_command(*args), capture_output=True, text=True, timeout=120)


# Starts refused once vLLM's parser has read the flags: each takes ~15 s to
# import vLLM, so they run side by side, once for the module.
REFUSED = {
    "unknown": ("--engine", "vllm", "--", "--tensor-parallel-sise", "2"),
    "invalid": ("--engine", "vllm", "--", "--max-num-seqs", "many"),
}


@pytest.fixture(scope="module")
def refused() -> dict[str, subprocess.CompletedProcess[str]]:
    procs = {
        name: subprocess.Popen(
            serve_command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in REFUSED.items()
    }
    runs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        runs[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return runs


def test_any_engine_flag_passes_through(model: str) -> None:
    got = settings(
        ["--max-num-seqs", "3", "--scheduling-policy", "priority", "-dp", "2", "--seed", "7"]
    ).args
    assert (got.max_num_seqs, got.scheduling_policy, got.data_parallel_size, got.seed) == (
        3,
        "priority",
        2,
        7,
    )
    assert got.model == model


def test_vllm_defaults_are_kept_and_only_two_settings_forced() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    made = settings(["--no-enable-prefix-caching", "--disable-log-stats"])
    got = made.args
    assert got.enable_prefix_caching is True and got.disable_log_stats is False
    assert any("--enable-prefix-caching is forced" in n for n in made.notes)
    # CUDA graphs stay vLLM's call: tokenwire no longer forces eager mode.
    assert got.enforce_eager == AsyncEngineArgs.enforce_eager
    assert got.max_num_seqs == AsyncEngineArgs.max_num_seqs


def test_config_file(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("max-num-seqs: 5\nscheduling-policy: priority\n")
    got = settings(["--config", str(config)]).args
    assert got.max_num_seqs == 5 and got.scheduling_policy == "priority"


def test_shortcuts_apply_unless_vllm_sets_the_same() -> None:
    got = settings([], dtype="bfloat16", max_model_len=1024).args
    assert (got.dtype, got.max_model_len) == ("bfloat16", 1024)
    made = settings(
        ["--dtype", "float16", "--max-model-len", "512"],
        dtype="bfloat16",
        max_model_len=1024,
        shortcuts_given=("dtype",),
    )
    assert (made.args.dtype, made.args.max_model_len) == ("float16", 512)
    # The user set --dtype on both sides: a note says which won.
    assert [n for n in made.notes if "--dtype" in n] == [
        "--dtype is set on both sides; vLLM's 'float16' wins over tokenwire's 'bfloat16'"
    ]
    assert not [n for n in made.notes if "max-model-len" in n]  # only vLLM's side was given


def test_unset_dtype_is_float32_on_this_cpu() -> None:
    made = settings([])
    assert made.args.dtype == "float32"
    assert any("float32" in n for n in made.notes)
    assert settings(["--dtype", "auto"]).args.dtype == "auto"


def test_unknown_flag_exits_2_and_names_it(
    refused: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = refused["unknown"]
    assert run.returncode == 2
    assert "--tensor-parallel-sise" in run.stderr
    assert "Traceback" not in run.stderr
    assert len(run.stderr.splitlines()) < 10  # a message, not vLLM's whole usage


def test_invalid_value_exits_2_and_names_the_flag(
    refused: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = refused["invalid"]
    assert run.returncode == 2
    assert "--max-num-seqs" in run.stderr and "many" in run.stderr
    assert "Traceback" not in run.stderr


def test_engine_flags_need_the_vllm_engine() -> None:
    run = serve("--engine", "scripted", "--", "--max-num-seqs", "2")
    assert run.returncode == 2 and "--engine scripted takes none" in run.stderr


def test_help_says_what_is_forced_and_why() -> None:
    run = serve("--help")
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    assert "--enable-prefix-caching" in text and "prefix cache makes that cheap" in text
    assert "stats on" in text and "--tensor-parallel-size" in text
    assert "the vLLM flag wins" in text


@pytest.mark.parametrize("ranks", [2, 3])
def test_sessions_pin_to_a_stable_rank(ranks: int) -> None:
    ids = [f"sess_{i:04x}" for i in range(300)]
    chosen = [rank_of(s, ranks) for s in ids]
    assert chosen == [rank_of(s, ranks) for s in ids]  # stable
    assert set(chosen) == set(range(ranks))  # spread
    assert min(chosen.count(r) for r in range(ranks)) > 300 / ranks / 2
    assert rank_of("sess_0001", 1) is None and rank_of(None, 2) is None
    assert rank_of("sess_abc", 2) == 0  # crc32: the same on every instance, every run


def test_only_local_ranks_are_named_under_external_or_hybrid_balancing() -> None:
    """`-- --data-parallel-size 2 --data-parallel-rank 1` (one process per rank
    behind a balancer): vLLM accepts ranks below data_parallel_size_local
    only; naming rank 1 would fail half the sessions."""
    from vllm.config import ParallelConfig

    from tokenwire.engines.vllm import dp_ranks

    external = ParallelConfig(
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_rank=1,
        data_parallel_external_lb=True,
    )
    hybrid = ParallelConfig(
        data_parallel_size=4, data_parallel_size_local=2, data_parallel_hybrid_lb=True
    )
    internal = ParallelConfig(data_parallel_size=2)
    assert [dp_ranks(p) for p in (external, hybrid, internal)] == [1, 2, 2]


def test_vllm_is_not_imported_for_the_scripted_engine() -> None:
    """vLLM's argument module takes seconds to import: only `--engine vllm` pays."""
    code = (
        "import sys; from tokenwire import cli; "
        "cli.build_parser().parse_args(['serve', '--engine', 'scripted']); "
        "import tokenwire.server, tokenwire.engines.scripted; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_kv_cache_gib_is_a_shortcut_for_kv_cache_memory_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fraction works (vLLM's legacy VLLM_CPU_KVCACHE_SPACE takes whole GiB
    only), and vLLM's own flag wins over it, as for the other shortcuts."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert settings([], kv_cache_gib=0.5).args.kv_cache_memory_bytes == 2**29
    made = settings(
        ["--kv-cache-memory-bytes", "2G"], kv_cache_gib=0.5, shortcuts_given=("kv_cache_gib",)
    )
    assert made.args.kv_cache_memory_bytes == 2**31
    assert any("vLLM's --kv-cache-memory-bytes" in n and "wins" in n for n in made.notes)
    # The legacy variable, if the user set it, is what vLLM reads: a note says so.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert any("VLLM_CPU_KVCACHE_SPACE=3" in n for n in settings([], kv_cache_gib=1.0).notes)


@pytest.mark.parametrize(
    ("shortcut", "said"),
    [
        ({"dtype": "fp32"}, "--dtype 'fp32': vLLM takes one of auto"),
        ({"tool_parser": "hermez"}, "--tool-parser 'hermez' is not one of vLLM's tool parsers"),
    ],
)
def test_a_bad_shortcut_value_exits_2_before_the_engine_starts(
    capsys: pytest.CaptureFixture[str], shortcut: dict[str, str], said: str
) -> None:
    from tokenwire.engines.vllm_args import check_or_exit

    with pytest.raises(SystemExit) as exited:
        check_or_exit([], **shortcut)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    check_or_exit([], dtype="float16", tool_parser="hermes")  # good values pass
