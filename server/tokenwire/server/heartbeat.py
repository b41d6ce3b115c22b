"""Keepalive pings for every connection, from one timer.

websockets' keepalive is a task per connection that sleeps between pings:
about 1.6 KiB a connection, busy or idle, and three entries in the event
loop's tables of tasks and timers. `Heartbeat` keeps the connections in one
set per tick of the ping interval instead. Each tick pings the connections
of its set (pings are spread over the interval, not all sent after a burst
of connects) and closes with 1011, as websockets does, a connection whose
ping has waited `timeout_s` for its pong; at most a tick late. As in
websockets, that wait starts once the ping is written. A ping that cannot
be written (the socket's buffer is over websockets' write limit, below the
slow-client clock's high water) closes the connection too if not one byte of
that buffer left in `timeout_s`: a peer that went away would else hold its
slot until the idle timeout.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Coroutine
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from ..runtime.ws import close_or_abort

TIMEOUT_REASON = "keepalive ping timeout"


class Heartbeat:
    def __init__(self, interval_s: float, timeout_s: float, tick_s: float = 1.0) -> None:
        slots = max(1, math.ceil(interval_s / tick_s))
        self.tick_s = interval_s / slots
        self.timeout_s = timeout_s
        self.slots: list[set[ServerConnection]] = [set() for _ in range(slots)]
        self._turn = 0  # the slot the next tick pings
        self._joining = 0  # the slot the next connection joins
        # Connections whose ping has no pong yet, and when it was written.
        self._sent: dict[ServerConnection, float] = {}
        # Those whose ping waits for the socket's buffer: since when, and
        # how many bytes were buffered then.
        self._writing: dict[ServerConnection, tuple[float, int]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # pings being written, closes
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in self._tasks:
            task.cancel()

    def add(self, ws: ServerConnection) -> None:
        # In turn: a burst of connections is pinged over the interval.
        self.slots[self._joining].add(ws)
        self._joining = (self._joining + 1) % len(self.slots)

    def discard(self, ws: ServerConnection) -> None:
        for slot in self.slots:
            slot.discard(ws)
        self._sent.pop(ws, None)
        self._writing.pop(ws, None)

    def __len__(self) -> int:
        return sum(len(slot) for slot in self.slots)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.tick_s, self._tick)
        now = loop.time()
        for ws, sent in list(self._sent.items()):
            if now - sent >= self.timeout_s:
                del self._sent[ws]
                self._close(ws)
        for ws, (since, buffered) in list(self._writing.items()):
            if now - since < self.timeout_s:
                continue
            left = _buffered(ws)
            if left < buffered:  # a client that reads, however slowly
                self._writing[ws] = (now, left)
            else:
                del self._writing[ws]
                self._close(ws)
        slot = self.slots[self._turn]
        self._turn = (self._turn + 1) % len(self.slots)
        for ws in slot:
            # Else its last ping still waits for a pong, or to be written.
            if ws not in self._sent and ws not in self._writing:
                self._writing[ws] = (now, _buffered(ws))
                self._spawn(self._ping(ws))

    async def _ping(self, ws: ServerConnection) -> None:
        try:
            pong = await ws.ping()  # once written: it waits while the buffer is full
        except ConnectionClosed:
            self._writing.pop(ws, None)
            return
        if self._writing.pop(ws, None) is not None:  # not discarded meanwhile
            self._sent[ws] = asyncio.get_running_loop().time()
            pong.add_done_callback(functools.partial(self._ponged, ws))

    def _close(self, ws: ServerConnection) -> None:
        # Bounded: a close frame waits for the same buffer the ping did.
        self._spawn(close_or_abort(ws, CloseCode.INTERNAL_ERROR, TIMEOUT_REASON))

    def _ponged(self, ws: ServerConnection, _: asyncio.Future[float]) -> None:
        self._sent.pop(ws, None)  # a pong, or the connection closed

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _buffered(ws: ServerConnection) -> int:
    return ws.transport.get_write_buffer_size() if ws.transport is not None else 0
