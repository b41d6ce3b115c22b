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

# KEYS: per session its stream and its meta hash. ARGV: the MAXLEN, the
# writing instance, the keys' TTL in ms, then per stream its entry id, its
# number of fields and the fields ("e", the event, first). Returns per stream
# 1, or the error. A stream whose meta is gone (the session dropped while this
# entry was on its way) gets the TTL: it would otherwise stay forever.
_XADDS = """
local out, at = {}, 4
for i = 1, #KEYS, 2 do
  local n = tonumber(ARGV[at + 1])
  local owner = redis.call('HGET', KEYS[i + 1], 'owner')
  if owner and owner ~= ARGV[2] then
    out[#out + 1] = 'FENCED another instance owns the session'
  else
    local r = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', ARGV[1], ARGV[at],
                          unpack(ARGV, at + 2, at + 1 + 2 * n))
    if type(r) == 'table' and r.err then
      -- The same entry again (a command resent after a lost reply) is done.
      local got = redis.call('XRANGE', KEYS[i], ARGV[at], ARGV[at])
      if #got == 1 and got[1][2][2] == ARGV[at + 3] then r = 1 else r = r.err end
    else
      r = 1
      if not owner then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
    end
    out[#out + 1] = r
  end
  at = at + 2 + 2 * n
end
return out
"""

_Queued = tuple[str, str, str, dict[str, bytes], "asyncio.Future[None]"]

# Entries per script call: Redis runs a script whole, so a call is kept
# short (about a millisecond) for the other instances' commands.
MAX_PER_CALL = 256


class GroupCommit:
    def __init__(self, client: redis.Redis, maxlen: int, owner: str, ttl_ms: int) -> None:
        self._xadds = client.register_script(_XADDS)
        self._maxlen = maxlen
        self._owner = owner
        self._ttl_ms = ttl_ms
        self._queued: list[_Queued] = []
        self._task: asyncio.Task[None] | None = None

    async def load(self) -> None:
        """Load the script into Redis (a call loads it again if Redis forgot it)."""
        await self._xadds.registered_client.script_load(_XADDS)

    async def xadd(self, key: str, meta: str, entry_id: str, fields: dict[str, bytes]) -> None:
        """XADD (MAXLEN ~ maxlen) unless another instance owns the session (its
        `meta` says), with whatever else is queued in this loop turn."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((key, meta, entry_id, fields, done))
        if self._task is None:
            self._task = asyncio.create_task(self._commit())
        await done

    async def _commit(self) -> None:
        batch: list[_Queued] = []
        try:
            while self._queued:  # what queued during a commit goes in the next
                batch, self._queued = self._queued[:MAX_PER_CALL], self._queued[MAX_PER_CALL:]
                keys, args = [], [self._maxlen, self._owner, self._ttl_ms]
                for key, meta, entry_id, fields, _ in batch:
                    keys += (key, meta)
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
