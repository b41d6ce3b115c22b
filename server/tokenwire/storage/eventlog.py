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

from array import array
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
        is (or until `clear`), and raises Fenced if another instance owns the
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

    def clear(self) -> None:
        """The session stopped here: drop what is pending, log nothing more."""
        ...


class MemoryLog:
    """The last `max_bytes` of encoded frames, in seq order.

    Packed: one buffer of frames (text as UTF-8) and two arrays, 16 bytes a
    frame beyond its own; a frame object and a (seq, frame) tuple each took
    about 120. Frames dropped from the front leave the buffer in batches."""

    __slots__ = ("_bytes", "_data", "_dead", "_head", "_seqs", "_sizes", "max_bytes")
    durable = False

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data = bytearray()
        self._seqs = array("q")
        self._sizes = array("q")  # a frame's bytes times 2, plus 1 for text
        self._head = 0  # index of the oldest frame kept; those before it are dropped
        self._dead = 0  # bytes of dropped frames still at the front of _data
        self._bytes = 0  # bytes of the frames kept

    def __len__(self) -> int:
        return len(self._seqs) - self._head

    def append(self, seq: int, event: dict[str, Any], frame: Frame) -> None:
        if isinstance(frame, str):
            frame = frame.encode()
            self._sizes.append(len(frame) << 1 | 1)
        else:
            self._sizes.append(len(frame) << 1)
        self._data += frame
        self._seqs.append(seq)
        self._bytes += len(frame)
        if self._bytes > self.max_bytes:
            self._drop()

    def _drop(self) -> None:
        sizes = self._sizes
        while self._bytes > self.max_bytes and len(self) > 1:
            size = sizes[self._head] >> 1
            self._bytes -= size
            self._dead += size
            self._head += 1
        if self._head >= 64 or self._dead >= 16384:
            del self._data[: self._dead]  # from the front: no copy (bytearray)
            del self._seqs[: self._head], sizes[: self._head]
            self._head = self._dead = 0

    async def flush(self, state: LogState) -> None:
        return None

    async def read(self, after: int) -> list[tuple[int, Frame]]:
        out: list[tuple[int, Frame]] = []
        at = self._dead
        with memoryview(self._data) as data:
            for i in range(self._head, len(self._seqs)):
                size = self._sizes[i]
                end = at + (size >> 1)
                if self._seqs[i] > after:
                    frame = bytes(data[at:end])
                    out.append((self._seqs[i], frame.decode() if size & 1 else frame))
                at = end
        return out

    async def bounds(self) -> tuple[int, int] | None:
        if not len(self):
            return None
        return self._seqs[self._head], self._seqs[-1]

    def clear(self) -> None:
        self._data, self._seqs, self._sizes = bytearray(), array("q"), array("q")
        self._head = self._dead = self._bytes = 0


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
