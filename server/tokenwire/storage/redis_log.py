"""One session's event log in Redis Streams (see storage.redis for the keys)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import RedisError

from ..logs import get_logger
from .eventlog import Frame, LogState
from .redis import RedisStore, pack, pack_snapshot

log = get_logger("tokenwire.redis")

# A session's keys get their TTL back at most this often: their expiry runs
# from the last write to within this, and a delta is one command, not six
# (MULTI, XADD, 3 PEXPIREs, EXEC).
TTL_REFRESH_S = 1.0


class RedisLog:
    durable = True

    def __init__(self, store: RedisStore, session_id: str, last_seq: int = 0) -> None:
        self.store = store
        self.session_id = session_id
        self._pending: list[tuple[int, bytes]] = []
        self._last_seq = last_seq
        self._refreshed = -TTL_REFRESH_S  # the first flush sets the TTLs
        self._stopped = False  # the session stopped here: a failing flush retries no more

    def append(self, seq: int, event: dict[str, Any], frame: Frame) -> None:
        # Packed now: the event may change once handed on (its items move on).
        self._pending.append((seq, pack(event)))
        self._last_seq = seq

    async def flush(self, state: LogState) -> None:
        entries = self._pending
        if not entries and state.snapshot is None:
            return
        # A snapshot goes with the last event; alone, it describes the log's end.
        # Packed now, not at each retry: generation goes on changing its items.
        snapshot = None if state.snapshot is None else pack_snapshot(self._last_seq, state.snapshot)
        progress = state.progress if entries else None
        client_events = state.client_events if entries else None
        now = time.monotonic()
        refresh = now - self._refreshed >= TTL_REFRESH_S
        delay = 0.1
        while not self._stopped:
            try:
                await self.store.append(
                    self.session_id, entries, progress, snapshot, client_events, refresh
                )
                break
            except RedisError as exc:
                # Nothing goes out unlogged; generation pauses at the hard cap meanwhile.
                log.warning("redis_append_failed", error=str(exc), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self._pending = []
        if refresh:
            self._refreshed = now

    async def read(self, after: int) -> list[tuple[int, Frame]]:
        return [(e.seq, e.event) for e in await self.store.read(self.session_id, after)]

    async def bounds(self) -> tuple[int, int] | None:
        return await self.store.bounds(self.session_id)

    def clear(self) -> None:
        self._pending = []
        self._stopped = True
