"""A session's event log, keyed by `seq`: what a resume replays.

The embedded default is `MemoryLog`, a byte-bounded ring of the frames one
process wrote. With `--redis-url` the log lives in Redis Streams instead
(`redisstore.RedisStore`), where any instance can read it.
"""

from __future__ import annotations

from collections import deque


class MemoryLog:
    """The last `max_bytes` of encoded frames, in seq order."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Frames, not dicts: a third of the memory.
        self._frames: deque[tuple[int, str | bytes]] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def append(self, seq: int, frame: str | bytes) -> None:
        self._frames.append((seq, frame))
        self._bytes += len(frame)
        while self._bytes > self.max_bytes and len(self._frames) > 1:
            self._bytes -= len(self._frames.popleft()[1])

    def after(self, last_seq: int) -> list[tuple[int, str | bytes]]:
        return [(seq, frame) for seq, frame in self._frames if seq > last_seq]

    def clear(self) -> None:
        self._frames.clear()
        self._bytes = 0

    def check(self, last_seq: int, last_logged: int) -> str | None:
        """Why a resume from `last_seq` is impossible, or None."""
        oldest = self._frames[0][0] if self._frames else last_logged + 1
        return resume_problem(last_seq, oldest, last_logged)


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
