"""The server process's memory allocator: mimalloc where it is installed.

After a wave of sessions ends, Python's own allocator (pymalloc) keeps most of
the memory the wave grew: it frees a 1 MiB arena only once every object in it
is gone, and a few survivors pin most of them (1.4x the idle RSS after 10k
sessions). glibc's malloc under `PYTHONMALLOC=malloc` keeps pages with a live
chunk (1.17x). mimalloc frees by 64 KiB page and, with its decommit delay at
0, hands freed pages back when `Reclaimer` calls `mi_collect` (1.13x). The
delay must stay 0: at mimalloc 2.0's default (25 ms) `mi_collect(force)` gives
nothing back (3.4x). The price is throughput at the extreme: 10k sessions
flat out deliver about 7% fewer tokens/s than on pymalloc.

An allocator is chosen before the interpreter starts, so `serve` executes
itself once more with `LD_PRELOAD` and `PYTHONMALLOC` set (`plan`), then puts
its environment back as the user gave it (`settle`), so the programs it starts
run as they would have. `auto` takes mimalloc when the library is found and
the user set neither `PYTHONMALLOC` nor a preloaded allocator of their own,
and otherwise keeps pymalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

CHOICES = ("auto", "mimalloc", "pymalloc", "malloc")
LIBRARY = "libmimalloc.so.2"  # Debian and Ubuntu: package libmimalloc2.0
INSTALL_HINT = "apt-get install libmimalloc2.0"
LIBRARY_ENV = "TOKENWIRE_MIMALLOC_LIBRARY"
# Set on the one re-execution: its settings to take out again, and a guard
# against executing a second time if the preload failed.
MARK = "_TOKENWIRE_ALLOCATOR"
MIMALLOC_SETTINGS = {
    # Freed pages go back at once, not 25 ms later on some later allocation
    # that an idle server never makes. 2.0 calls it decommit, 2.1 purge.
    "MIMALLOC_DECOMMIT_DELAY": "0",
    "MIMALLOC_PURGE_DELAY": "0",
}


class AllocatorError(Exception):
    """A choice that cannot be honoured, with what to do about it."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What `serve` runs on: `env` is set only if it must execute again."""

    allocator: str
    env: dict[str, str] | None = None
    note: str | None = None  # why auto did not take mimalloc


def find_mimalloc() -> str | None:
    """The library for LD_PRELOAD: the file LIBRARY_ENV names, or the name
    the dynamic loader knows it by."""
    if LIBRARY_ENV in os.environ:  # built from source, say, outside the loader's paths
        path = os.environ[LIBRARY_ENV]
        return path if os.path.isfile(path) else None
    if not sys.platform.startswith("linux"):
        return None
    found = ctypes.util.find_library("mimalloc")
    return found if found and found.startswith("libmimalloc.so") else None


def plan(choice: str, environ: Mapping[str, str], library: str | None) -> Plan:
    """The allocator for `choice`, and the environment to execute again with."""
    if choice not in CHOICES:
        raise AllocatorError(f"unknown allocator {choice!r}: one of {', '.join(CHOICES)}")
    if MARK in environ:  # this is the re-execution
        return Plan(json.loads(environ[MARK])["allocator"])
    own = environ.get("PYTHONMALLOC")
    preload = environ.get("LD_PRELOAD", "")
    if choice == "auto":
        if own:
            return Plan(own, note=f"PYTHONMALLOC={own} is set")
        if other := _preloaded_allocator(preload):
            return Plan("pymalloc", note=f"LD_PRELOAD names an allocator ({other})")
        if library is None:
            return Plan("pymalloc", note=f"{LIBRARY} not found ({INSTALL_HINT})")
        choice = "mimalloc"
    if choice == "pymalloc":
        if own and own != "pymalloc":
            return _again("pymalloc", environ, {"PYTHONMALLOC": "pymalloc"})
        return Plan("pymalloc")
    if choice == "malloc":
        if own == "malloc":
            return Plan("malloc")
        return _again("malloc", environ, {"PYTHONMALLOC": "malloc"})
    if library is None:
        raise AllocatorError(
            f"--allocator mimalloc: {LIBRARY} not found; {INSTALL_HINT}, "
            f"or name the file in {LIBRARY_ENV}"
        )
    tuning = {k: v for k, v in MIMALLOC_SETTINGS.items() if k not in environ}  # the user's win
    preload = f"{library}:{preload}" if preload else library
    return _again("mimalloc", environ, {"PYTHONMALLOC": "malloc", "LD_PRELOAD": preload, **tuning})


def _preloaded_allocator(preload: str) -> str | None:
    """A malloc the user preloads (tcmalloc, jemalloc, ...): theirs to keep.
    Other libraries (vLLM's CPU docs preload libgomp, say) stay beside mimalloc."""
    for entry in preload.replace(" ", ":").split(":"):
        if "malloc" in os.path.basename(entry):
            return entry
    return None


def _again(allocator: str, environ: Mapping[str, str], settings: dict[str, str]) -> Plan:
    mark = {"allocator": allocator, "restore": {k: environ.get(k) for k in settings}}
    return Plan(allocator, env={**environ, **settings, MARK: json.dumps(mark)})


def settle(environ: MutableMapping[str, str]) -> None:
    """In the re-executed process: put back what `plan` changed, so the
    programs this one starts (vLLM's engine core among them) get the
    environment the user gave."""
    mark = environ.pop(MARK, None)
    if mark is None:
        return
    for name, value in json.loads(mark)["restore"].items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def apply(choice: str) -> Plan:
    """Execute again with the chosen allocator if needed (does not return
    then); otherwise what this process runs on."""
    chosen = plan(choice, os.environ, find_mimalloc())
    if chosen.env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], chosen.env)
    settle(os.environ)
    if chosen.allocator == "mimalloc" and mimalloc_collect() is None:
        # The loader printed why; pymalloc's objects are on glibc now.
        if choice == "mimalloc":
            raise AllocatorError(f"{LIBRARY} could not be preloaded; {INSTALL_HINT}")
        return Plan("malloc", note=f"{LIBRARY} could not be preloaded")
    return chosen


def mimalloc_collect() -> Callable[[], Any] | None:
    """mimalloc's `mi_collect(force)`, if mimalloc is this process's malloc."""
    try:
        collect = ctypes.CDLL(None).mi_collect
    except (AttributeError, OSError):
        return None
    collect.argtypes = [ctypes.c_bool]
    collect.restype = None
    return lambda: collect(True)
