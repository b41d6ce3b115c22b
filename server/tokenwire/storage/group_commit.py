"""Group commit: the lone XADDs of every session (a delta each), sent to Redis
together, one script call per loop turn rather than a round trip per session
and delta. Each session still waits for its own entry, and learns its own error
(a fenced owner's XADD fails alone).

One script call, not a pipeline of XADDs: redis-py reads and checks each reply
of a pipeline in Python, and that was most of what a pipeline cost per delta
(measured: 10-20 µs of client CPU per XADD in a pipeline, 3-9 in the script)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

if TYPE_CHECKING:
    import redis.asyncio as redis

# KEYS: the streams. ARGV: the MAXLEN, then per stream its entry id, its
# number of fields and the fields. Returns per stream 1, or XADD's error.
_XADDS = """
local out, at = {}, 2
for i = 1, #KEYS do
  local n = tonumber(ARGV[at + 1])
  local r = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', ARGV[1], ARGV[at],
                        unpack(ARGV, at + 2, at + 1 + 2 * n))
  at = at + 2 + 2 * n
  if type(r) == 'table' and r.err then out[i] = r.err else out[i] = 1 end
end
return out
"""

_Queued = tuple[str, str, dict[str, bytes], "asyncio.Future[None]"]

# Entries per script call: Redis runs a script whole, so a call is kept
# short (about a millisecond) for the other instances' commands.
MAX_PER_CALL = 256


class GroupCommit:
    def __init__(self, client: redis.Redis, maxlen: int) -> None:
        self._xadds = client.register_script(_XADDS)
        self._maxlen = maxlen
        self._queued: list[_Queued] = []
        self._task: asyncio.Task[None] | None = None

    async def load(self) -> None:
        """Load the script into Redis (a call loads it again if Redis forgot it)."""
        await self._xadds.registered_client.script_load(_XADDS)

    async def xadd(self, key: str, entry_id: str, fields: dict[str, bytes]) -> None:
        """XADD (MAXLEN ~ maxlen), with whatever else is queued in this loop turn."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((key, entry_id, fields, done))
        if self._task is None:
            self._task = asyncio.create_task(self._commit())
        await done

    async def _commit(self) -> None:
        batch: list[_Queued] = []
        try:
            while self._queued:  # what queued during a commit goes in the next
                batch, self._queued = self._queued[:MAX_PER_CALL], self._queued[MAX_PER_CALL:]
                keys, args = [], [self._maxlen]
                for key, entry_id, fields, _ in batch:
                    keys.append(key)
                    args += (entry_id, len(fields))
                    for item in fields.items():
                        args += item
                try:
                    results: list[object] = await self._xadds(keys=keys, args=args)
                except Exception as exc:  # the connection: every caller retries
                    results = [exc] * len(batch)
                for (*_, done), result in zip(batch, results, strict=True):
                    if done.done():
                        continue  # its caller was cancelled
                    if isinstance(result, bytes):
                        done.set_exception(ResponseError(result.decode(errors="replace")))
                    elif isinstance(result, Exception):
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
