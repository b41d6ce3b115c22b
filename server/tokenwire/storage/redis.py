"""Shared state for several instances, in Redis: the session directory
(meta, claim, lease, inbox) and the raw operations of the per-session log
(storage.redis_log puts the EventLog interface on them).

Per session:
- `tw:{sid}:log`, a stream of its events with entry id `0-<seq>`, written
  before the events reach the socket (so a client never holds an event the
  log lacks). XADD with approximate MAXLEN; a TTL refreshed with the writes,
  at most once a second (storage.redis_log), so it runs from the last write
  to within a second.
  An entry's `e` is the event (msgpack); the last entry of a batch may carry
  `p`, the generations' progress (output tokens, token ids) the events omit,
  and carries `c`, the client frames the session had taken (for a resume's
  `client_events` after a takeover).
- `tw:{sid}:state`, the session snapshot at seq `n`, rewritten whenever the
  conversation's structure changes; text after it is in the log's deltas.
- `tw:{sid}:meta`, a hash: the owning instance, the API key id, and
  `left:{follower id}` for each follower the owner replaced while it still
  served the client (it closes its socket when it reads that; its detach
  has the owner delete the field).

Per client secret (an `ek_` key minted at /v1/realtime/client_secrets):
- `tw:ek:{sha256 of the key}`, the minting key id, expiry and session
  settings, with the secret's TTL as Redis expiry. The key itself is never stored.

Per response cache entry (stages.cache, `--response-cache`):
- `tw:rc:{sha256 of model, prompt, sampling params, tools, tenant}`, the
  generation's deltas (msgpack), with the cache's TTL as Redis expiry.

Per instance:
- `tw:inst:{iid}`, a lease kept alive by a heartbeat. Once it is gone the
  owner is dead (or drained) and another instance may take its sessions over.
- `tw:inst:{iid}:inbox`, a stream of client events forwarded to the owner by
  an instance that follows one of its sessions.

Every write is fenced by the meta's owner, in the script that writes: an
instance that lost its session to a takeover fails its next write and stops,
and a batch (events with their snapshot) lands whole or not at all. Explicit
stream ids fence too (an id no longer the greatest fails), except that the
very same entry again (a command resent after a lost reply) counts as done.
A session's keys are dropped only by their owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from ..logs import get_logger, redact_url
from . import redis_client
from .eventlog import Fenced
from .group_commit import GroupCommit

log = get_logger("tokenwire.redis")

# Hand the session to `new` only if `old` still owns it.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2])
  return 1
end
return 0
"""

# A field of the meta, only while the session exists (a late write must
# not bring back a meta, without an owner, that the owner dropped).
_MARK = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], '1')
  return 1
end
return 0
"""

# A batch of entries, and the snapshot it goes with, all or nothing: only
# while this instance (ARGV[1]) owns the session and the stream ends before
# the batch. KEYS: log, state, meta. ARGV: owner, MAXLEN, TTL in ms, 1 to
# refresh the TTLs, the snapshot (empty: none), the number of entries, then
# per entry its id, its seq, its number of fields and the fields ("e" first).
_APPEND = """
local owner = redis.call('HGET', KEYS[3], 'owner')
if owner and owner ~= ARGV[1] then return redis.error_reply('FENCED another instance owns it') end
local count, at = tonumber(ARGV[6]), 7
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if count > 0 and #last == 1 then
  local newest = tonumber(string.match(last[1][1], '%-(%d+)$'))
  if newest >= tonumber(ARGV[at + 1]) then
    -- The same batch again (resent after a lost reply) is done; else fenced.
    local seen = redis.call('XRANGE', KEYS[1], ARGV[at], ARGV[at])
    if #seen == 1 and seen[1][2][2] == ARGV[at + 4] then return 0 end
    return redis.error_reply('FENCED the log is ahead of this batch')
  end
end
for _ = 1, count do
  local n = tonumber(ARGV[at + 2])
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], ARGV[at],
             unpack(ARGV, at + 3, at + 2 + 2 * n))
  at = at + 3 + 2 * n
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[3]) end
if ARGV[4] == '1' then
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
elseif not owner then  -- dropped meanwhile: what this wrote must not stay forever
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
"""

# The session's keys go only while this instance (ARGV[1]) owns it: one that
# lost it meanwhile (cut off longer than the lease) leaves the new owner's.
_DROP = """
local owner = redis.call('HGET', KEYS[3], 'owner')
if owner and owner ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
"""


class RedisUnavailable(Exception):
    """Redis cannot serve this instance: unreachable, the login refused, or
    the user may not run the commands tokenwire needs."""


def _what_to_do(exc: Exception) -> str:
    if isinstance(exc, AuthenticationError):
        return "check the user and password in --redis-url"
    if isinstance(exc, NoPermissionError):
        return (
            "the Redis user needs the string, hash, stream, key and scripting commands "
            "(SET, GET, HSET, HGETALL, XADD, XRANGE, XREAD, PEXPIRE, DEL, EVALSHA, SCRIPT LOAD)"
        )
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return "is redis-server running, and reachable at that address? Check --redis-url"
    return "check --redis-url"


def _key(*parts: str) -> str:
    """tw:{sid}:log|state|meta, tw:inst:{iid}, tw:inst:{iid}:inbox, tw:ek:{digest},
    tw:rc:{digest}."""
    return ":".join(("tw", *parts))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def pack_snapshot(seq: int, session: dict[str, Any]) -> bytes:
    """A snapshot as the state key holds it. Packed when it is taken: the
    session's items are live objects that go on changing."""
    return pack({"seq": seq, "session": session})


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1])


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    event: bytes  # msgpack
    progress: dict[str, list[Any]] | None
    client_events: int | None = None

    @property
    def decoded(self) -> dict[str, Any]:
        return unpack(self.event)


@dataclass(frozen=True, slots=True)
class Meta:
    owner: str
    key_id: str | None
    let_go: bool = False  # the follower asked about is marked


class RedisStore:
    def __init__(
        self, url: str, *, ttl_s: float, maxlen: int, lease_s: float, instance_id: str | None = None
    ) -> None:
        # Above the longest blocking read (a follower's: half the lease).
        self.redis = redis_client.from_url(url, timeout_s=max(10.0, 2 * lease_s))
        self.url = url
        self.ttl_ms = int(ttl_s * 1000)
        self.maxlen = maxlen
        self.lease_ms = int(lease_s * 1000)
        self.instance_id = instance_id or f"inst_{secrets.token_hex(6)}"
        self._claim = self.redis.register_script(_CLAIM)
        self._append = self.redis.register_script(_APPEND)
        self._drop = self.redis.register_script(_DROP)
        self._mark = self.redis.register_script(_MARK)
        self._tasks: list[asyncio.Task[None]] = []
        self._group = GroupCommit(self.redis, maxlen, self.instance_id, self.ttl_ms)

    # -- instance lifecycle -----------------------------------------------------

    async def start(
        self, on_forward: Callable[[str, str, Any, str], Awaitable[None] | None]
    ) -> None:
        """Take the lease, then keep it and read the inbox in the background.
        Fails fast, with what to do, if Redis is unreachable or refuses."""
        try:
            await self.redis.set(_key("inst", self.instance_id), b"1", px=self.lease_ms)
            # Loaded now: a user without scripting fails here, not at the first delta.
            for script in (_CLAIM, _APPEND, _DROP, _MARK):
                await self.redis.script_load(script)
            await self._group.load()
        except redis.RedisError as exc:
            raise RedisUnavailable(
                f"Redis at {redact_url(self.url)}: {exc} ({_what_to_do(exc)})"
            ) from exc
        self._tasks = [
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._read_inbox(on_forward)),
        ]
        log.info("redis_connected", url=redact_url(self.url), instance_id=self.instance_id)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                await self.redis.set(_key("inst", self.instance_id), b"1", px=self.lease_ms)
            except redis.RedisError as exc:
                log.warning("lease_renew_failed", error=str(exc))

    async def _read_inbox(self, on_forward: Callable[[str, str, Any, str], Any]) -> None:
        key = _key("inst", self.instance_id, "inbox")
        last = b"0-0"  # the inbox is this instance's own: all of it is for us
        while True:
            try:
                got = await self.redis.xread({key: last}, block=1000, count=256)
            except redis.RedisError as exc:
                log.warning("inbox_read_failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for _, entries in got:
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        sid, op = fields[b"s"].decode(), fields[b"o"].decode()
                        data = unpack(fields[b"d"]) if b"d" in fields else None
                        follower = fields.get(b"f", b"").decode()
                        result = on_forward(sid, op, data, follower)
                        if asyncio.iscoroutine(result):
                            await result
                    except Exception:
                        log.exception("inbox_entry_failed")

    async def release(self) -> None:
        """Give up the lease at once: our sessions may be taken over now."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: redis-py can miss a cancel that lands as a read returns.
            await asyncio.wait(self._tasks, timeout=2)
        self._tasks = []
        with contextlib.suppress(redis.RedisError):
            await self.redis.delete(_key("inst", self.instance_id))

    async def close(self) -> None:
        await self.release()
        self._group.close()
        await self.redis.aclose()

    async def alive(self, iid: str) -> bool:
        return bool(await self.redis.exists(_key("inst", iid)))

    # -- sessions -------------------------------------------------------------

    async def register(self, sid: str, key_id: str | None) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(_key(sid, "meta"), mapping={"owner": self.instance_id, "key_id": key_id or ""})
        pipe.pexpire(_key(sid, "meta"), self.ttl_ms)
        await pipe.execute()

    async def meta(self, sid: str, follower: str | None = None) -> Meta | None:
        """Owner and key; with `follower`, whether it is marked as let go
        (only its own field is read: a long session may have many)."""
        fields = ["owner", "key_id"] + ([] if follower is None else [f"left:{follower}"])
        owner, key_id, *left = await self.redis.hmget(_key(sid, "meta"), fields)
        if owner is None:
            return None
        marked = bool(left) and left[0] is not None
        return Meta(owner.decode(), (key_id or b"").decode() or None, marked)

    async def let_go(self, sid: str, follower: str) -> None:
        """The owner replaced `follower`, which still served the client: the
        client resumed elsewhere. That follower closes its socket on reading it."""
        await self._mark(keys=[_key(sid, "meta")], args=[f"left:{follower}"])

    async def forget_follower(self, sid: str, follower: str) -> None:
        """A follower let go has detached: its mark is read no more."""
        await self.redis.hdel(_key(sid, "meta"), f"left:{follower}")

    async def claim(self, sid: str, dead_owner: str) -> bool:
        """Take a session over from a dead owner; False if another instance won."""
        return bool(
            await self._claim(keys=[_key(sid, "meta")], args=[dead_owner, self.instance_id])
        )

    async def give_back(self, sid: str, owner: str) -> None:
        """Undo a claim whose takeover could not go on (the load failed): the
        session is `owner`'s again, so the next resume anywhere takes it over
        rather than follow this instance, which does not run it."""
        await self._claim(keys=[_key(sid, "meta")], args=[self.instance_id, owner])

    async def append(
        self,
        sid: str,
        entries: list[tuple[int, bytes]],
        progress: dict[str, list[Any]] | None,
        snapshot: tuple[int, dict[str, Any]] | bytes | None,
        client_events: int | None = None,
        refresh_ttl: bool = True,
    ) -> None:
        """Log a batch (atomically, with the snapshot it goes with: `(seq,
        session)`, or `pack_snapshot`'s bytes). A lone
        entry, the usual batch (one delta), is a lone XADD, committed with
        the other sessions' (measured: a transaction per delta was most of a
        logged token's CPU)."""
        key, meta = _key(sid, "log"), _key(sid, "meta")
        last = len(entries) - 1
        xadds = []
        for i, (seq, event) in enumerate(entries):
            fields: dict[str, bytes] = {"e": event}
            if i == last and progress:
                fields["p"] = pack(progress)
            if i == last and client_events is not None:
                fields["c"] = str(client_events).encode()
            xadds.append((seq, fields))
        try:
            if len(xadds) == 1 and snapshot is None and not refresh_ttl:
                seq, fields = xadds[0]
                await self._group.xadd(key, meta, f"0-{seq}", fields)
                return
            args: list[Any] = [
                self.instance_id,
                self.maxlen,
                self.ttl_ms,
                int(refresh_ttl),
                pack_snapshot(*snapshot) if isinstance(snapshot, tuple) else snapshot or b"",
                len(xadds),
            ]
            for seq, fields in xadds:
                args += (f"0-{seq}", seq, len(fields))
                for item in fields.items():
                    args += item
            await self._append(keys=[key, _key(sid, "state"), meta], args=args)
        except ResponseError as exc:
            if "equal or smaller" in str(exc) or "FENCED" in str(exc):
                raise Fenced(sid) from None
            raise

    async def read(self, sid: str, after: int, count: int = 512) -> list[Entry]:
        got = await self.redis.xrange(_key(sid, "log"), min=f"(0-{after}", count=count)
        return [_entry(i, f) for i, f in got]

    async def follow(self, sid: str, after: int, block_ms: int) -> list[Entry]:
        got = await self.redis.xread({_key(sid, "log"): f"0-{after}"}, block=block_ms, count=512)
        return [_entry(i, f) for _, entries in got for i, f in entries]

    async def bounds(self, sid: str) -> tuple[int, int] | None:
        """The oldest and newest seq still logged."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(_key(sid, "log"), count=1)
        pipe.xrevrange(_key(sid, "log"), count=1)
        first, last = await pipe.execute()
        if not first or not last:
            return None
        return _seq(first[0][0]), _seq(last[0][0])

    async def load(self, sid: str) -> tuple[dict[str, Any], list[Entry]] | None:
        """The last snapshot and every entry logged after it; None if the
        stream was trimmed past the snapshot (the session cannot be rebuilt)."""
        raw = await self.redis.get(_key(sid, "state"))
        if raw is None:
            return None
        state = unpack(raw)
        entries: list[Entry] = []
        after = state["seq"]
        while batch := await self.read(sid, after):
            if batch[0].seq != after + 1:
                log.warning("log_trimmed_past_snapshot", session_id=sid, snapshot_seq=state["seq"])
                return None
            entries.extend(batch)
            after = batch[-1].seq
        return state, entries

    async def forward(
        self, owner: str, sid: str, op: str, data: Any = None, *, follower: str = ""
    ) -> None:
        fields = {"s": sid, "o": op, "f": follower}
        if data is not None:
            fields["d"] = pack(data)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(_key("inst", owner, "inbox"), fields, maxlen=10_000, approximate=True)
        pipe.pexpire(_key("inst", owner, "inbox"), self.ttl_ms)
        await pipe.execute()

    async def drop(self, sid: str) -> bool:
        """The session ended: its log goes with it. False if Redis failed us."""
        try:
            keys = [_key(sid, "log"), _key(sid, "state"), _key(sid, "meta")]
            await self._drop(keys=keys, args=[self.instance_id])
        except redis.RedisError:
            return False
        return True

    # -- client secrets -----------------------------------------------------------

    async def put_secret(self, digest: str, record: list[Any], ttl_s: int) -> None:
        await self.redis.set(_key("ek", digest), pack(record), ex=ttl_s)

    async def secret(self, digest: str) -> list[Any] | None:
        raw = await self.redis.get(_key("ek", digest))
        return None if raw is None else unpack(raw)

    # -- response cache -------------------------------------------------------------

    async def put_response(self, digest: str, data: bytes, ttl_s: float) -> None:
        await self.redis.set(_key("rc", digest), data, px=max(int(ttl_s * 1000), 1))

    async def response(self, digest: str) -> bytes | None:
        return await self.redis.get(_key("rc", digest))


def _entry(entry_id: bytes, fields: dict[bytes, bytes]) -> Entry:
    progress = unpack(fields[b"p"]) if b"p" in fields else None
    client_events = int(fields[b"c"]) if b"c" in fields else None
    return Entry(_seq(entry_id), fields[b"e"], progress, client_events)
