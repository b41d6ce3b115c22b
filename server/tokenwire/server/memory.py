"""Memory back to the OS after sessions end.

A session and its socket are reference cycles: they wait for a full garbage
collection, which the thresholds `app._freeze_heap` sets make rare, and which
an idle server never reaches. What they freed then stays in the process:
glibc keeps freed pages for reuse until `malloc_trim` returns them. So once
enough sessions have ended (at least `MIN_ENDED`, and twice as many as are
still open, which bounds the collection's cost per ended session),
`Reclaimer` collects and trims, a moment later so the sockets' teardown is
done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable

from ..logs import get_logger

log = get_logger("tokenwire.memory")

MIN_ENDED = 256  # sessions; fewer are not worth a full collection
DELAY_S = 0.25  # after the trigger: the last sockets finish closing


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


class Reclaimer:
    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self.ended = 0  # sessions ended since the last reclaim
        self.reclaims = 0
        self._pending: asyncio.TimerHandle | None = None

    def session_ended(self, still_open: int) -> None:
        self.ended += 1
        if self._pending is None and self.ended >= max(MIN_ENDED, 2 * still_open):
            self._pending = asyncio.get_running_loop().call_later(DELAY_S, self.reclaim)

    def reclaim(self) -> None:
        self._pending = None
        started, ended = time.perf_counter(), self.ended
        self.ended = 0
        self.reclaims += 1
        freed = gc.collect()
        if self._trim is not None:
            self._trim(0)
        log.info(
            "memory_reclaimed",
            sessions_ended=ended,
            objects_freed=freed,
            pause_ms=round((time.perf_counter() - started) * 1000, 1),
        )

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
