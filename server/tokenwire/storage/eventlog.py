"""A session's event log, keyed by `seq`: what a resume replays.

Two implementations sit behind `EventLog`:
- `MemoryLog`, the default: a byte-bounded ring of the frames this process
  wrote to the session's sockets. Not durable: it dies with the process and
  no other instance can read it.
- `RedisLog` (storage.redis_log), with `--redis-url`: Redis Streams. Durable:
  every event is logged *before* it reaches a socket, and any instance can
  read, follow or take over the session from it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

Frame = str | bytes


class Fenced(Exception):
    """Another instance owns the session now: this one may log nothing more."""


@dataclass(frozen=True, slots=True)
class LogState:
    """What a durable log keeps beside a batch of events: a snapshot of the
    session when its structure changed, the generations' progress (token ids
    the events omit), and the client frames the session had taken."""

    snapshot: dict[str, Any] | None
    progress: dict[str, list[Any]]
    client_events: int


class EventLog(Protocol):
    # True: events must be flushed to the log before they are sent, and the
    # log outlives this process. False: appends are kept at once, in memory.
    durable: bool

    def append(self, seq: int, event: dict[str, Any], frame: Frame) -> None:
        """Take one numbered event and the frame it is sent as (in order)."""
        ...

    async def flush(self, state: LogState) -> None:
        """Make everything appended durable, with `state`; retries until it
        is, and raises Fenced if another instance owns the
        session now. Nothing to do for a log that is not durable."""
        ...

    async def read(self, after: int) -> list[tuple[int, Frame]]:
        """Logged events after `after`, in order, as JSON text or msgpack
        bytes of the internal event (what a dialect's `from_logged` takes).
        May return only a first part: read again after the last seq."""
        ...

    async def bounds(self) -> tuple[int, int] | None:
        """The oldest and newest seq still logged, or None if none is."""
        ...

    def clear(self) -> None: ...


class MemoryLog:
    """The last `max_bytes` of encoded frames, in seq order."""

    durable = False

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Frames, not dicts: a third of the memory.
        self._frames: deque[tuple[int, Frame]] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def append(self, seq: int, event: dict[str, Any], frame: Frame) -> None:
        self._frames.append((seq, frame))
        self._bytes += len(frame)
        while self._bytes > self.max_bytes and len(self._frames) > 1:
            self._bytes -= len(self._frames.popleft()[1])

    async def flush(self, state: LogState) -> None:
        return None

    async def read(self, after: int) -> list[tuple[int, Frame]]:
        return [(seq, frame) for seq, frame in self._frames if seq > after]

    async def bounds(self) -> tuple[int, int] | None:
        if not self._frames:
            return None
        return self._frames[0][0], self._frames[-1][0]

    def clear(self) -> None:
        self._frames.clear()
        self._bytes = 0


def resume_problem(last_seq: int, oldest: int, last_logged: int) -> str | None:
    """Why events after `last_seq` cannot be replayed from a log that holds
    `oldest`..`last_logged`, or None."""
    if last_seq > last_logged:
        return f"last_seq {last_seq} is past the last event sent ({last_logged})"
    if last_seq + 1 < oldest:
        return (
            f"events after {last_seq} are no longer kept (the oldest is {oldest}); "
            "start a new session"
        )
    return None
