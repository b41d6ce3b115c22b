"""Group commit: the lone XADDs of every session (a delta each), sent to Redis
together, one pipeline per loop turn rather than a round trip per session and
delta. Each session still waits for its own entry, and learns its own error
(a fenced owner's XADD fails alone)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis.asyncio as redis

_Queued = tuple[str, dict[str, bytes], dict[str, Any], "asyncio.Future[None]"]


class GroupCommit:
    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._queued: list[_Queued] = []
        self._task: asyncio.Task[None] | None = None

    async def xadd(self, key: str, fields: dict[str, bytes], **options: Any) -> None:
        """XADD, with whatever else is queued in this loop turn."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((key, fields, options, done))
        if self._task is None:
            self._task = asyncio.create_task(self._commit())
        await done

    async def _commit(self) -> None:
        batch: list[_Queued] = []
        try:
            while self._queued:  # what queued during a commit goes in the next
                batch, self._queued = self._queued, []
                pipe = self._redis.pipeline(transaction=False)
                for key, fields, options, _ in batch:
                    pipe.xadd(key, fields, **options)
                try:
                    results = await pipe.execute(raise_on_error=False)
                except Exception as exc:  # the connection: every caller retries
                    results = [exc] * len(batch)
                for (*_, done), result in zip(batch, results, strict=True):
                    if done.done():
                        continue  # its caller was cancelled
                    if isinstance(result, Exception):
                        done.set_exception(result)
                    else:
                        done.set_result(None)
                batch = []
        finally:
            self._task = None
            for *_, done in batch + self._queued:
                done.cancel()  # cancelled itself (shutdown): nobody waits forever
            self._queued = []

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
