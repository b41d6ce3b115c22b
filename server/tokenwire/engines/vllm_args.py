"""vLLM's own engine flags, passed through: `tokenwire serve ... -- FLAGS`.

Everything after `--` is parsed by vLLM's parser (`AsyncEngineArgs.add_cli_args`,
`--config FILE.yaml` included), so every engine flag works as it does for
`vllm serve`, with vLLM's defaults for the platform. tokenwire forces only
what it needs (FORCED). Its own `--model`, `--dtype` and `--max-model-len` are
shortcuts: when the vLLM side sets the same setting, the vLLM flag wins.

Importing vLLM's argument module takes seconds, so this module is imported
only for `--engine vllm`.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

# (setting, value, what --help calls it, why tokenwire needs it)
FORCED: tuple[tuple[str, Any, str, str], ...] = (
    (
        "enable_prefix_caching",
        True,
        "--enable-prefix-caching",
        "steer, tool continuations, resume and slow-client pauses resubmit the "
        "conversation; the prefix cache makes that cheap",
    ),
    (
        "disable_log_stats",
        False,
        "stats on",
        "the load tracker behind /healthz, /metrics and response timings reads "
        "the scheduler's stats",
    ),
)
SHORTCUTS = ("model", "dtype", "max_model_len")
# vLLM's CPU platform reads this legacy variable over --kv-cache-memory-bytes.
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# On CPUs, float32 is faster than the bfloat16 most checkpoints declare,
# unless the CPU has AVX512-BF16 (measured: ~20 vs ~15-17 tokens/s here).
CPU_DTYPE = "float32"


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def forced_help() -> str:
    """The forced settings and their reasons, for `tokenwire serve --help`."""
    return "\n".join(
        textwrap.fill(f"{label}: {why}.", 80, initial_indent="  - ", subsequent_indent="    ")
        for _, _, label, why in FORCED
    )


def parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            # One line that names the flag, not vLLM's 300-flag usage.
            self.exit(
                2,
                f"error: vLLM engine flags (after --): {message}\n"
                "`tokenwire serve -- --help` lists them\n",
            )

    made = Parser(prog="tokenwire serve [tokenwire flags] --")
    AsyncEngineArgs.add_cli_args(made)
    # To tell a setting the user gave from vLLM's default.
    made.set_defaults(**dict.fromkeys(SHORTCUTS, UNSET))
    return made


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """vLLM's flags, checked by vLLM's parser: an unknown flag or a bad value
    exits with code 2 and a message that names it, as argparse does."""
    return parser().parse_args(list(argv))


def given_by_vllm(argv: Sequence[str], name: str) -> bool:
    """The vLLM side sets `name` (on the command line or in its --config)."""
    return getattr(parse(argv), name, UNSET) is not UNSET


@dataclass
class EngineSettings:
    """The engine arguments, and what was decided on the user's behalf."""

    args: Any  # vllm.engine.arg_utils.AsyncEngineArgs
    notes: list[str] = field(default_factory=list)


def engine_args(
    argv: Sequence[str],
    *,
    model: str | None,
    dtype: str | None,
    max_model_len: int | None,
    kv_cache_gib: float | None = None,
    shortcuts_given: Sequence[str] = (),
) -> EngineSettings:
    """AsyncEngineArgs from vLLM's flags, tokenwire's shortcuts and FORCED.

    `model` is the resolved model directory (None when the vLLM side names
    one); `shortcuts_given` names the
    shortcuts the user set on tokenwire's side (for the precedence note)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    ns = parse(argv)
    notes: list[str] = []
    ours = {"model": model, "dtype": dtype, "max_model_len": max_model_len}
    for name in SHORTCUTS:
        theirs = getattr(ns, name, UNSET)
        if theirs is not UNSET:
            if name in shortcuts_given:
                notes.append(
                    f"--{name.replace('_', '-')} is set on both sides; vLLM's {theirs!r} wins "
                    f"over tokenwire's {ours[name]!r}"
                )
            continue
        if ours[name] is not None:
            setattr(ns, name, ours[name])
        else:
            delattr(ns, name)  # vLLM's own default
    on_cpu = _on_cpu()
    if not hasattr(ns, "dtype") and on_cpu:
        ns.dtype = CPU_DTYPE
        notes.append(f"dtype {CPU_DTYPE} on this CPU (pass --dtype to choose another)")
    _kv_cache(ns, kv_cache_gib, "kv_cache_gib" in shortcuts_given, on_cpu, notes)
    for name, value, _, why in FORCED:
        if getattr(ns, name, value) not in (value, None):
            notes.append(f"--{name.replace('_', '-')} is forced to {value}: {why}")
        setattr(ns, name, value)
    return EngineSettings(AsyncEngineArgs.from_cli_args(ns), notes)


def _kv_cache(
    ns: argparse.Namespace, gib: float | None, given: bool, on_cpu: bool, notes: list[str]
) -> None:
    """--kv-cache-gib as vLLM's --kv-cache-memory-bytes: on CPUs always (its
    default, 1 GiB, suits a small model), elsewhere only when given (GPUs
    size the cache by --gpu-memory-utilization)."""
    if ns.kv_cache_memory_bytes is not None:
        if given:
            notes.append(
                f"the KV cache is set on both sides; vLLM's --kv-cache-memory-bytes "
                f"{ns.kv_cache_memory_bytes} wins over tokenwire's --kv-cache-gib {gib:g}"
            )
    elif gib is not None and (given or on_cpu):
        ns.kv_cache_memory_bytes = int(gib * 2**30)
    legacy = os.environ.get(KV_CACHE_ENV, "")
    if on_cpu and legacy:
        # vLLM reads it over --kv-cache-memory-bytes, whoever set that.
        notes.append(f"{KV_CACHE_ENV}={legacy} in the environment sets the KV cache: {legacy} GiB")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check_or_exit(
    argv: Sequence[str], *, dtype: str | None = None, tool_parser: str | None = None
) -> None:
    """Fail fast, before anything starts: vLLM's parser exits 2 on a bad flag,
    and tokenwire's shortcuts get the same checks."""
    try:
        made = parser()
        made.parse_args(list(argv))
    except SystemExit:
        raise
    except Exception as exc:  # a plugin or a config file that cannot be read
        print(f"error: vLLM engine flags: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    choices = next((a.choices for a in made._actions if a.dest == "dtype"), None)
    if dtype is not None and choices is not None and dtype not in choices:
        print(f"error: --dtype {dtype!r}: vLLM takes one of {', '.join(choices)}", file=sys.stderr)
        raise SystemExit(2)
    from .base import EngineUnavailable
    from .toolcalls import import_vllm_side

    try:
        import_vllm_side(tool_parser)
    except EngineUnavailable as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
