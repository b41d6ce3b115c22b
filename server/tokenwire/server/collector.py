"""When the cyclic garbage collector runs.

CPython starts a young collection once `threshold0` more GC-tracked objects
have been made than freed since the last one, and it walks every one of them
that is still alive. A response in flight holds about 40 (its task,
coroutines, generator, events). When thousands of sessions start responses
together, a burst or sessions in lockstep, those objects are all alive: each
collection walks them, finds nothing to free and promotes them. At 10,000
sessions flat out that was 7 collections of about 28 ms in a 3.5 s run:
0.87-0.89x of bare websockets' tokens/s, against 0.92-0.94x with them held
off (`benchmarks.gateway_ceiling` at e5bb54b).

`Collector` keeps `threshold0` above what the open sessions can hold in flight
at once (`PER_SESSION` each), so young collections run on what was allocated
beyond that: garbage and growth, not work in flight. The garbage it lets wait
is bounded the same way, by a multiple of what the sessions hold anyway; ended
sessions are reference cycles that `memory.Reclaimer` collects after a wave.
The cost: fewer, longer young collections. 10,000 sessions in one process
answering 40 rounds of 2-token responses made 2 of them, 85 and 114 ms,
against 260 (1.98 s in all, the longest 106 ms) with a fixed 50,000. The
bound is about 0.5 us per object alive, 0.3 s at 640,000; full collections
at that size take 0.6-0.8 s already.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

YOUNG_MIN = 50_000
# Tracked objects one session holds with a response in flight, measured: 41
# on the scripted engine, 58 on vLLM (its request state, the input items).
PER_SESSION = 64
# Per-token objects (events, futures, tasks) live for milliseconds; with
# Python's default 700 allocations per young collection many get promoted,
# and full collections of the whole heap (600-800 ms, measured at 10k
# sessions) stall the event loop.
OLDER = (20, 100)


class Collector:
    """The collector's thresholds, for the sessions this process has open."""

    def __init__(self, set_threshold: Callable[..., None] = gc.set_threshold) -> None:
        self._set_threshold = set_threshold
        self.sessions = 0
        self.threshold0 = 0  # 0 until `freeze`: Python's own settings
        self._frozen = False

    def freeze(self) -> None:
        """What is loaded by now (the model, libraries) lives for the whole
        process: keep it out of every later collection, as vLLM's own server
        does."""
        gc.collect()
        gc.freeze()
        self._frozen = True
        self._apply()

    def session_opened(self) -> None:
        self.sessions += 1
        self._apply()

    def session_closed(self) -> None:
        self.sessions -= 1
        self._apply()

    def _apply(self) -> None:
        if not self._frozen:
            return
        threshold0 = max(YOUNG_MIN, PER_SESSION * self.sessions)
        if threshold0 != self.threshold0:
            self.threshold0 = threshold0
            self._set_threshold(threshold0, *OLDER)


# The thresholds are the process's, whichever server or registry opens sessions.
COLLECTOR = Collector()
