"""The server process's memory allocator: mimalloc where it is installed.

After a wave of sessions ends, Python's own allocator (pymalloc) keeps most of
the memory the wave grew: it frees a 1 MiB arena only once every object in it
is gone, and a few survivors pin most of them (1.4x the idle RSS after 10k
sessions). glibc's malloc under `PYTHONMALLOC=malloc` keeps pages with a live
chunk (1.17x). mimalloc frees by 64 KiB page: `Reclaimer` has it hand every
free page back (`Mimalloc.purge`).

mimalloc purges a freed page (gives its memory back) only after a delay, so
that a page freed and soon reused costs no page faults: 10k sessions in
lockstep free and retake pages by the thousand, and with the delay at 0 they
deliver ~3% fewer tokens/s. But mimalloc 2.0 purges a segment's expired
pages only when it next takes a page from that segment; `mi_collect(force)`
does not, so an idle server would keep a wave's memory (3.4x). Hence the
sweep in `Mimalloc.purge`.

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
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass

CHOICES = ("auto", "mimalloc", "pymalloc", "malloc")
LIBRARY = "libmimalloc.so.2"  # Debian and Ubuntu: package libmimalloc2.0
INSTALL_HINT = "apt-get install libmimalloc2.0"
LIBRARY_ENV = "TOKENWIRE_MIMALLOC_LIBRARY"
# Set on the one re-execution: its settings to take out again, and a guard
# against executing a second time if the preload failed.
MARK = "_TOKENWIRE_ALLOCATOR"
MIMALLOC_SETTINGS = {
    # 2.0's default, the same for every version (2.1 and 3.x wait longer):
    # long enough to spare the page faults of a page freed and reused, and
    # `Mimalloc.purge` purges what it still holds. 2.0 says decommit, 2.1 purge.
    "MIMALLOC_DECOMMIT_DELAY": "25",
    "MIMALLOC_PURGE_DELAY": "25",
}
# mimalloc.h's mi_option_t, the same number since 2.0: decommit_delay, then purge_delay.
OPTION_PURGE_DELAY = 15
SWEEP_BLOCK = 16 * 1024  # mimalloc's largest small size: a 64 KiB page holds 4
SWEEP_BATCH = 64  # blocks between looks at the address space


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
    if chosen.allocator == "mimalloc" and Mimalloc.load() is None:
        # The loader printed why; pymalloc's objects are on glibc now.
        if choice == "mimalloc":
            raise AllocatorError(f"{LIBRARY} could not be preloaded; {INSTALL_HINT}")
        return Plan("malloc", note=f"{LIBRARY} could not be preloaded")
    return chosen


class Mimalloc:
    """mimalloc's controls, when it is this process's malloc: the purge
    delay (as configured while sessions run, 0 while the server is idle) and
    `purge`, which hands every free page to the OS now."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.delay = lib.mi_option_get(OPTION_PURGE_DELAY)
        self.idle = False
        self.swept = 0  # blocks the last purge's sweep took

    @classmethod
    def load(cls) -> Mimalloc | None:
        try:
            lib = ctypes.CDLL(None)
            lib.mi_collect.argtypes = [ctypes.c_bool]
        except (AttributeError, OSError):
            return None
        lib.mi_collect.restype = None
        lib.mi_malloc.argtypes, lib.mi_malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
        lib.mi_free.argtypes, lib.mi_free.restype = [ctypes.c_void_p], None
        lib.mi_option_get.argtypes, lib.mi_option_get.restype = [ctypes.c_int], ctypes.c_long
        lib.mi_option_set.argtypes = [ctypes.c_int, ctypes.c_long]
        lib.mi_option_set.restype = None
        lib.mi_process_info.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 8
        lib.mi_process_info.restype = None
        return cls(lib)

    def purge(self) -> int:
        """`purging` all at once; returns the blocks its sweep took."""
        for _ in self.purging():
            pass
        return self.swept

    def purging(self) -> Iterator[None]:
        """A wave is over: purge the free pages the delay still holds, then
        `mi_collect(force)`, and purge each page as it is freed until `busy`.
        It yields between steps of at most a few ms, so that a caller on the
        event loop can run the sessions still open between them; the blocks
        the sweep took are in `swept`.

        mimalloc 2.0 purges a segment's expired pages when it takes a new page
        from that segment. So, with the delay at 0: fresh pages of 16 KiB
        blocks, taken until mimalloc maps a new segment (none is left with
        room, so each gave one), then freed, which purges them too. At most
        twice as many bytes as it ever had committed: no more room is there.
        ~80 ms at 10k sessions' peak, half of it in the first `mi_collect`."""
        lib, taken = self._lib, []
        self.idle = True
        self.swept = 0
        if lib.mi_option_get(OPTION_PURGE_DELAY) > 0:
            lib.mi_collect(True)  # cached whole segments first: the next is mapped anew
            yield
            info = [ctypes.c_size_t() for _ in range(8)]
            lib.mi_process_info(*map(ctypes.byref, info))
            most = 2 * info[6].value // SWEEP_BLOCK  # peak commit
            malloc, start = lib.mi_malloc, _mapped_pages()
            lib.mi_option_set(OPTION_PURGE_DELAY, 0)
            try:
                while len(taken) < most:
                    taken += [malloc(SWEEP_BLOCK) for _ in range(SWEEP_BATCH)]
                    if _mapped_pages() > start:
                        break
                    yield
                self.swept = len(taken)
                while taken:  # newest first, as they were taken
                    for _ in range(min(len(taken), SWEEP_BATCH * 16)):
                        lib.mi_free(taken.pop())
                    yield
            finally:  # closed halfway: no block is kept
                while taken:
                    lib.mi_free(taken.pop())
        lib.mi_collect(True)  # and the pages it retired rather than freed

    def busy(self) -> None:
        """Sessions again: a freed page waits the delay before it is purged."""
        if self.idle:
            self.idle = False
            self._lib.mi_option_set(OPTION_PURGE_DELAY, self.delay)


def _mapped_pages() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[0])
