"""Memory back to the OS after sessions end.

A session and its socket are reference cycles: they wait for a full garbage
collection, which the thresholds `collector.Collector` sets make rare and an
idle server never reaches. What they free then stays in the process: the
allocator keeps freed pages for reuse until asked to return them
(`allocator.Mimalloc.purge`, glibc's `malloc_trim`), and pymalloc returns a
1 MiB arena only once every object in it is gone, which a few objects that
outlive a wave (free lists, caches) prevent for most of them; `reclaim`
clears the caches and swaps the event loop's free lists for new blocks
(`cycle_free_lists`).
The server runs on mimalloc where it is installed (`allocator.py`).

`Reclaimer` collects and trims once a wave of sessions has ended: at least
`MIN_ENDED` sessions, and twice as many as are still open (which bounds the
collection's cost per ended session). It waits until sessions stop ending for
`QUIET_S` (at most `MAX_WAIT_S`), so a wave is reclaimed once, and reclaims
again when the last of a wave ends. It also shrinks the server's tables of
sessions and connections: a dict or set keeps the table it grew to after its
entries are gone. mimalloc's purge runs in slices of `SLICE_S` between the
loop's other callbacks: whole, it held the sessions still open for 100-365 ms
after a wave of 200-800 MB.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..allocator import Mimalloc
from ..logs import get_logger

log = get_logger("tokenwire.memory")

MIN_ENDED = 256  # sessions; fewer are not worth a full collection
QUIET_S = 0.25  # no session ended for this long: the wave is over
MAX_WAIT_S = 2.0  # a wave that goes on is reclaimed this long after it started
SLICE_S = 0.005  # of the purge, between the loop's other callbacks


def _malloc_trim() -> Callable[[], Any] | None:
    """glibc's `malloc_trim`, or None (musl, macOS)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # no such confstr name: not glibc
        return None
    malloc_trim = ctypes.CDLL(None).malloc_trim
    return lambda: malloc_trim(0)


FREE_LIST_CYCLE = 600  # over twice the longest free list below (uvloop 250, _asyncio 255)


def _noop() -> None:
    pass


def cycle_free_lists(loop: asyncio.AbstractEventLoop) -> None:
    """Swap what the event loop's free lists hold for new blocks: uvloop's
    Handle and TimerHandle, _asyncio's future iterators. After a wave they
    hold its last objects, scattered over the arenas it grew, and pin them.
    Taking FREE_LIST_CYCLE of each at once empties a list and allocates the
    rest anew; releasing them newest first refills the list with new blocks,
    and the wave's are freed. Public calls only: if a list works otherwise,
    this costs 1,800 small allocations and changes nothing."""
    timers = [loop.call_later(3600, _noop) for _ in range(FREE_LIST_CYCLE)]
    for timer in timers:
        timer.cancel()
    future = loop.create_future()
    iterators = [future.__await__() for _ in range(FREE_LIST_CYCLE)]
    while iterators:
        iterators.pop()
    while timers:
        timers.pop()
    del future
    handles = [loop.call_soon(_noop) for _ in range(FREE_LIST_CYCLE)]

    def release() -> None:  # once the loop has run them
        while handles:
            handles.pop()

    loop.call_soon(release)


class Reclaimer:
    def __init__(self, trim: Callable[[], Any] | None = None) -> None:
        # What hands freed pages to the OS: mimalloc's purge when it is the
        # process's malloc (`allocator.py`), else glibc's `malloc_trim`.
        self._mimalloc = Mimalloc.load() if trim is None else None
        if self._mimalloc is not None:
            trim = self._mimalloc.purge
        self._trim = trim if trim is not None else _malloc_trim()
        self.ended = 0  # sessions ended since the last reclaim
        self.reclaims = 0
        self.tables: list[dict[Any, Any] | set[Any]] = []  # to shrink (see the module doc)
        self._open = 0  # sessions open at the last end
        self._tail = False  # the last reclaim left sessions of its wave open
        self._first = self._last = 0.0  # the wave's first and last end since the trigger
        self._pending: asyncio.TimerHandle | None = None
        self._purge: Iterator[None] | None = None  # mimalloc's, in slices
        self._slice: asyncio.Handle | None = None

    def session_started(self) -> None:
        if self._mimalloc is not None:
            self._mimalloc.busy()

    def session_ended(self, still_open: int) -> None:
        self.ended += 1
        self._open = still_open
        loop = asyncio.get_running_loop()
        if self._pending is not None:
            self._last = loop.time()
        elif self.ended >= max(MIN_ENDED, 2 * still_open) or (self._tail and not still_open):
            self._first = self._last = loop.time()
            self._pending = loop.call_later(QUIET_S, self._check)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._last < QUIET_S and now - self._first < MAX_WAIT_S:
            self._pending = loop.call_later(QUIET_S - (now - self._last), self._check)
            return
        self._pending = None
        self._first = self._last = 0.0  # not floats made during the wave (see reclaim)
        self._tail = self._open > 0
        self.reclaim()

    def reclaim(self) -> None:
        started, ended = time.perf_counter(), self.ended
        self.ended = 0
        self.reclaims += 1
        for table in self.tables:
            kept = table.copy()
            table.clear()  # frees the table, even an empty one
            table.update(kept)  # type: ignore[arg-type]
        # The type attribute cache keeps each name it was looked up with, and C
        # code can make a new name string per call (datetime's "utcoffset"
        # does): small strings made during the wave, each able to keep one of
        # pymalloc's arenas.
        sys._clear_type_cache()
        freed = gc.collect()
        try:
            cycle_free_lists(asyncio.get_running_loop())
        except RuntimeError:  # no loop: a caller outside the server
            pass
        if self._mimalloc is not None:
            if self._purge is None:  # else the last one is still at it
                self._purge = self._mimalloc.purging()
                self._purge_slice()  # its first slice; the rest between other callbacks
        elif self._trim is not None:
            self._trim()
        pause_ms = round((time.perf_counter() - started) * 1000, 1)
        log.info("memory_reclaimed", sessions_ended=ended, objects_freed=freed, pause_ms=pause_ms)

    def _purge_slice(self) -> None:
        assert self._purge is not None
        deadline = time.perf_counter() + SLICE_S
        for _ in self._purge:
            if time.perf_counter() >= deadline:
                try:
                    self._slice = asyncio.get_running_loop().call_soon(self._purge_slice)
                    return
                except RuntimeError:  # no loop: a caller outside the server
                    pass
        self._purge = self._slice = None

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._slice is not None:
            self._slice.cancel()
        if self._purge is not None:
            self._purge.close()  # frees what its sweep holds
        self._purge = self._slice = None
