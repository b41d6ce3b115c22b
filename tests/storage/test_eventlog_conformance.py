"""The EventLog interface's conformance suite: memory and Redis (a real
redis-server, started by the tests) behind the same checks, plus what only
a durable log promises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from tokenwire.storage.eventlog import EventLog, Fenced, LogState, MemoryLog
from tokenwire.storage.redis import Meta, RedisStore, unpack
from tokenwire.storage.redis_log import RedisLog
from tokenwire.wire.codec import decode_frame, encode_json

from ..conftest import RedisServer

_ids = iter(range(1_000_000))


def event(seq: int) -> dict[str, Any]:
    return {"type": "response.output_text.delta", "delta": f" t{seq}", "seq": seq}


def as_event(frame: str | bytes) -> Any:
    return decode_frame(frame)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    made = RedisStore(redis_server.url, ttl_s=60, maxlen=10_000, lease_s=5)
    yield made
    await made.redis.aclose()


@pytest.fixture(params=["memory", "redis"])
async def log(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[EventLog]:
    if request.param == "memory":
        yield MemoryLog(1 << 20)
        return
    made = RedisStore(redis_server.url, ttl_s=60, maxlen=10_000, lease_s=5)
    yield RedisLog(made, f"sess_conf_{next(_ids)}")
    await made.redis.aclose()


async def write(log: EventLog, seqs: range, snapshot: dict[str, Any] | None = None) -> None:
    for seq in seqs:
        log.append(seq, event(seq), encode_json(event(seq)))
    await log.flush(LogState(snapshot, {}, len(seqs)))


async def test_reads_back_in_order(log: EventLog) -> None:
    await write(log, range(1, 6))
    got = await log.read(0)
    assert [seq for seq, _ in got] == [1, 2, 3, 4, 5]
    assert [as_event(frame) for _, frame in got] == [event(s) for s in range(1, 6)]
    assert [seq for seq, _ in await log.read(3)] == [4, 5]
    assert await log.read(5) == []


async def test_bounds(log: EventLog) -> None:
    assert await log.bounds() is None
    await write(log, range(1, 4))
    assert await log.bounds() == (1, 3)
    await write(log, range(4, 6))
    assert await log.bounds() == (1, 5)


async def test_frames_are_json_or_msgpack_of_the_internal_event(log: EventLog) -> None:
    await write(log, range(1, 2))
    ((_, frame),) = await log.read(0)
    assert isinstance(frame, str | bytes)
    if isinstance(frame, bytes):
        assert msgpack.unpackb(frame) == event(1)
    else:
        assert frame == encode_json(event(1))


async def test_durable_logs_are_read_by_another_instance(store: RedisStore) -> None:
    sid = f"sess_conf_{next(_ids)}"
    owner = RedisLog(store, sid)
    assert owner.durable
    owner.append(1, event(1), "")
    assert await RedisLog(store, sid).read(0) == []  # appended, not flushed: not logged
    await owner.flush(LogState({"id": sid}, {"r": [1, 0, [7]]}, 1))
    other = RedisLog(store, sid, last_seq=1)
    assert [(s, unpack(f)) for s, f in await other.read(0)] == [(1, event(1))]
    state, entries = await store.load(sid)
    assert state == {"seq": 1, "session": {"id": sid}}
    assert entries == []  # nothing after the snapshot


async def test_a_retried_write_logs_the_snapshot_as_it_was_taken(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot holds the session's live items: packed again at a retry,
    it held text generated during the back-off, which a takeover then
    replayed on top of it ("Hello world world")."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    sid = f"sess_conf_{next(_ids)}"
    log = RedisLog(store, sid)
    real, failed = store._append, asyncio.Event()

    async def down_once(**kwargs: Any) -> Any:
        if not failed.is_set():
            failed.set()
            raise RedisConnectionError("down")
        return await real(**kwargs)

    monkeypatch.setattr(store, "_append", down_once)
    item = {"id": "item_1", "content": "Hello"}
    log.append(1, event(1), "")
    flushing = asyncio.create_task(log.flush(LogState({"items": [item]}, {}, 1)))
    await failed.wait()
    item["content"] += " world"  # the next delta, while the write backs off
    await flushing
    state, _ = await store.load(sid)
    assert state["session"] == {"items": [{"id": "item_1", "content": "Hello"}]}


async def test_a_snapshot_alone_marks_the_end_of_the_log(store: RedisStore) -> None:
    sid = f"sess_conf_{next(_ids)}"
    log = RedisLog(store, sid)
    await write(log, range(1, 4), snapshot={"at": 3})
    await log.flush(LogState({"final": True}, {}, 0))  # nothing pending: the snapshot alone
    state, entries = await store.load(sid)
    assert state == {"seq": 3, "session": {"final": True}}
    assert entries == []


async def taken_over(store: RedisStore, url: str) -> tuple[str, RedisStore]:
    """A session of `store`'s, then claimed by another instance (its lease ran out)."""
    sid = f"sess_conf_{next(_ids)}"
    await store.register(sid, None)
    other = RedisStore(url, ttl_s=60, maxlen=10_000, lease_s=5)
    assert await other.claim(sid, store.instance_id)
    return sid, other


async def test_an_owner_that_lost_the_session_is_fenced(
    store: RedisStore, redis_server: RedisServer
) -> None:
    sid = f"sess_conf_{next(_ids)}"
    await store.register(sid, None)
    old = RedisLog(store, sid)
    await write(old, range(1, 4))
    other = RedisStore(redis_server.url, ttl_s=60, maxlen=10_000, lease_s=5)
    try:
        assert await other.claim(sid, store.instance_id)
        new = RedisLog(other, sid, last_seq=3)
        await write(new, range(4, 6))
        for seq in (4, 6):  # an id taken, or one past the new owner's: fenced either way
            old.append(seq, event(seq), "")
            with pytest.raises(Fenced):
                await old.flush(LogState(None, {}, 4))
        assert [s for s, _ in await new.read(0)] == [1, 2, 3, 4, 5]
    finally:
        await other.redis.aclose()


async def test_a_batch_of_an_owner_that_lost_the_session_lands_not_at_all(
    store: RedisStore, redis_server: RedisServer
) -> None:
    """Events and snapshot of a stale owner: none of it (it was half applied)."""
    sid, other = await taken_over(store, redis_server.url)
    try:
        entries = [(seq, msgpack.packb(event(seq))) for seq in range(1, 6)]
        await other.append(sid, entries, None, (5, {"by": "new"}))
        stale = [(seq, msgpack.packb(event(seq))) for seq in range(6, 10)]
        with pytest.raises(Fenced):
            await store.append(sid, stale, None, (9, {"by": "old"}))
        with pytest.raises(Fenced):  # a snapshot alone (a drain's) too
            await store.append(sid, [], None, (5, {"by": "old"}))
        assert await other.bounds(sid) == (1, 5)
        loaded = await other.load(sid)
        assert loaded is not None and loaded[0]["session"] == {"by": "new"}
        # Ended at the old owner (its grace ran out): the new owner's keys stay.
        await store.drop(sid)
        assert await other.meta(sid) is not None and await other.bounds(sid) == (1, 5)
        await other.drop(sid)
        assert await other.meta(sid) is None and await other.bounds(sid) is None
    finally:
        await other.redis.aclose()


async def test_the_same_write_again_is_done_not_fenced(store: RedisStore) -> None:
    """redis-py resends a command whose reply was lost (and the log retries a
    flush): an entry or batch already there is no fence; another one is."""
    sid = f"sess_conf_{next(_ids)}"
    await store.register(sid, None)
    batch = [(seq, msgpack.packb(event(seq))) for seq in range(1, 4)]
    for _ in range(2):
        await store.append(sid, batch, None, (3, {"n": 3}))
    lone = [(4, msgpack.packb(event(4)))]
    for _ in range(2):
        await store.append(sid, lone, None, None, refresh_ttl=False)
    assert [e.seq for e in await store.read(sid, 0)] == [1, 2, 3, 4]
    other = [(4, msgpack.packb(event(40)))]
    with pytest.raises(Fenced):
        await store.append(sid, other, None, None, refresh_ttl=False)
    with pytest.raises(Fenced):
        await store.append(sid, [(3, msgpack.packb(event(30))), *lone], None, None)


async def test_memory_log_is_not_durable_and_bounded() -> None:
    log = MemoryLog(max_bytes=100)
    assert not log.durable
    for seq in range(1, 50):
        log.append(seq, event(seq), encode_json(event(seq)))
    oldest, newest = await log.bounds()  # type: ignore[misc]
    assert newest == 49 and oldest > 1  # the oldest frames made room
    assert sum(len(f) for _, f in await log.read(0)) <= 100
    log.clear()
    assert await log.bounds() is None


async def test_a_delta_is_one_command_and_the_ttls_are_kept(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per delta a lone XADD; the keys' TTLs are set by the first flush, by
    every snapshot, and refreshed at most once a second."""
    sid = f"sess_conf_{next(_ids)}"
    await store.register(sid, None)
    clock = [1000.0]
    monkeypatch.setattr("tokenwire.storage.redis_log.time.monotonic", lambda: clock[0])

    async def calls() -> dict[str, int]:
        stats = await store.redis.info("commandstats")
        return {
            c: stats.get(f"cmdstat_{c}", {}).get("calls", 0)
            for c in ("xadd", "evalsha", "pexpire", "exec")
        }

    log = RedisLog(store, sid)
    await write(log, range(1, 2), snapshot={"at": 1})  # the first: TTLs set
    for key in ("log", "state", "meta"):
        assert 0 < await store.redis.pttl(f"tw:{sid}:{key}") <= 60_000
    before = await calls()
    for seq in range(2, 12):  # ten deltas within the second
        clock[0] += 0.05
        await write(log, range(seq, seq + 1))
    after = await calls()
    assert after["xadd"] - before["xadd"] == 10
    assert after["evalsha"] - before["evalsha"] == 10  # the group commit's script call
    assert after["pexpire"] == before["pexpire"] and after["exec"] == before["exec"]
    clock[0] += 1.0
    await write(log, range(12, 13))  # a second on: refreshed, in one script call
    final = await calls()
    assert final["pexpire"] - after["pexpire"] == 3 and final["evalsha"] - after["evalsha"] == 1
    assert final["exec"] == after["exec"]
    assert [s for s, _ in await log.read(0)] == list(range(1, 13))


async def test_a_write_that_lands_after_the_drop_expires(store: RedisStore) -> None:
    """An entry on its way while the session ended recreates the stream: with
    the TTL, not forever (a lone delta and a batch alike)."""
    sid = f"sess_conf_{next(_ids)}"
    key = f"tw:{sid}:log"
    await store.register(sid, None)
    await write(RedisLog(store, sid), range(1, 2), snapshot={"at": 1})
    await store.drop(sid)
    assert not await store.redis.exists(key)
    await store.append(sid, [(2, b"late")], None, None, refresh_ttl=False)  # group commit
    assert await store.redis.exists(key) and 0 < await store.redis.pttl(key) <= 60_000
    await store.drop(sid)
    await store.append(sid, [(3, b"late"), (4, b"later")], None, None, refresh_ttl=False)
    assert 0 < await store.redis.pttl(key) <= 60_000


async def test_sessions_deltas_are_committed_together_and_fail_alone(store: RedisStore) -> None:
    """Lone deltas of many sessions in one loop turn share one pipeline; a
    fenced owner among them fails alone."""
    sids = [f"sess_conf_{next(_ids)}" for _ in range(20)]
    logs = [RedisLog(store, sid) for sid in sids]
    await asyncio.gather(*(write(log, range(1, 2)) for log in logs))  # TTLs set
    # Another owner took sids[0] and logged events of its own.
    await store.append(sids[0], [(2, b"theirs"), (3, b"theirs")], None, None)
    trips: list[str] = []  # round trips: a command alone, or a pipeline
    pipeline, command = store.redis.pipeline, store.redis.execute_command
    store.redis.pipeline = lambda **kw: trips.append("pipeline") or pipeline(**kw)  # type: ignore[method-assign]
    store.redis.execute_command = lambda *a, **kw: trips.append(a[0]) or command(*a, **kw)  # type: ignore[method-assign]
    results = await asyncio.gather(
        *(write(log, range(2, 3)) for log in logs), return_exceptions=True
    )
    assert isinstance(results[0], Fenced) and results[1:] == [None] * 19
    assert len(trips) <= 2, trips  # 20 sessions, not 20 round trips
    for sid in sids[1:]:
        assert [s for s, _ in await RedisLog(store, sid).read(0)] == [1, 2]
    # Each entry keeps its own fields: the event, the client frames taken
    # and, where given, the generations' progress.
    progress = {"resp_1": [7, [1, 2, 3]]}
    await asyncio.gather(
        store.append(sids[1], [(3, b"three")], progress, None, 5, refresh_ttl=False),
        store.append(sids[2], [(3, b"other")], None, None, None, refresh_ttl=False),
    )
    one, two = [await store.read(sid, 2) for sid in sids[1:3]]
    assert [(e.seq, e.event, e.progress, e.client_events) for e in one] == [
        (3, b"three", progress, 5)
    ]
    assert [(e.seq, e.event, e.progress, e.client_events) for e in two] == [
        (3, b"other", None, None)
    ]


async def test_a_large_group_is_split_into_short_script_calls(store: RedisStore) -> None:
    """Redis runs a script whole: a group commit of many sessions goes out
    in calls of at most MAX_PER_CALL entries, each entry still logged."""
    from tokenwire.storage.group_commit import MAX_PER_CALL

    n = 2 * MAX_PER_CALL + 10
    sids = [f"sess_conf_{next(_ids)}" for _ in range(n)]
    calls: list[int] = []  # entries per EVALSHA (two keys each: stream and meta)
    command = store.redis.execute_command

    def counted(*args: Any, **kwargs: Any) -> Any:
        if args[0] == "EVALSHA":
            calls.append(args[2] // 2)  # the number of keys
        return command(*args, **kwargs)

    store.redis.execute_command = counted  # type: ignore[method-assign]
    await asyncio.gather(
        *(store.append(sid, [(1, b"e")], None, None, 1, refresh_ttl=False) for sid in sids)
    )
    assert calls == [MAX_PER_CALL, MAX_PER_CALL, 10]
    for sid in (sids[0], sids[MAX_PER_CALL], sids[-1]):
        assert [(e.seq, e.event) for e in await store.read(sid, 0)] == [(1, b"e")]


async def test_the_group_commit_reloads_its_script_after_redis_forgot_it(
    store: RedisStore,
) -> None:
    """A restarted (or flushed) Redis has no scripts: the first call loads it
    again, and the delta is logged."""
    sid = f"sess_conf_{next(_ids)}"
    await store.append(sid, [(1, b"one")], None, None, 1, refresh_ttl=False)
    await store.redis.script_flush()
    await store.append(sid, [(2, b"two")], None, None, 2, refresh_ttl=False)
    assert [(e.seq, e.event) for e in await store.read(sid, 0)] == [(1, b"one"), (2, b"two")]


async def test_a_log_trimmed_past_its_snapshot_cannot_be_taken_over(store: RedisStore) -> None:
    """Deltas after the snapshot went with --redis-maxlen: rebuilding from what
    is left would give a text missing its middle, so there is no session."""
    sid = f"sess_conf_{next(_ids)}"
    await store.register(sid, None)
    entries = [(seq, msgpack.packb(event(seq))) for seq in range(1, 101)]
    await store.append(sid, entries[:1], None, (1, {"at": 1}))
    await store.append(sid, entries[1:], None, None)
    loaded = await store.load(sid)
    assert loaded is not None and [e.seq for e in loaded[1]] == list(range(2, 101))
    await store.redis.xtrim(f"tw:{sid}:log", minid="0-50", approximate=False)
    assert await store.load(sid) is None


async def test_a_follower_let_go_is_marked_only_while_the_session_is(
    store: RedisStore,
) -> None:
    """The owner marks the followers it replaced, each reads its own mark, and
    a detached one's mark goes; after the owner dropped the session, a late
    mark must not bring a meta (without an owner) back."""
    sid = f"sess_conf_{next(_ids)}"
    await store.register(sid, "key_1")
    assert await store.meta(sid, "f1") == Meta(store.instance_id, "key_1", let_go=False)
    await store.let_go(sid, "f1")
    await store.let_go(sid, "f2")
    assert await store.meta(sid, "f1") == Meta(store.instance_id, "key_1", let_go=True)
    assert await store.meta(sid, "f3") == Meta(store.instance_id, "key_1", let_go=False)
    await store.forget_follower(sid, "f1")
    assert await store.meta(sid, "f1") == Meta(store.instance_id, "key_1", let_go=False)
    assert await store.redis.hkeys(f"tw:{sid}:meta") == [b"owner", b"key_id", b"left:f2"]
    assert await store.drop(sid)
    await store.let_go(sid, "f3")
    await store.forget_follower(sid, "f2")
    assert await store.meta(sid, "f3") is None
    assert not await store.redis.exists(f"tw:{sid}:meta")


async def test_a_takeover_whose_load_fails_gives_the_session_back(
    redis_server: RedisServer,
) -> None:
    """The claim went through, the load did not: the session is its dead
    owner's again (the next resume anywhere takes it over), not owned by an
    instance that does not run it, which followers would wait on forever. One
    that cannot be rebuilt (no snapshot) is dropped for everyone."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tokenwire.config import ServerConfig
    from tokenwire.engines.scripted import ScriptedEngine
    from tokenwire.server.admission import Limiter
    from tokenwire.server.registry import Registry

    dead = RedisStore(redis_server.url, ttl_s=60, maxlen=100, lease_s=5, instance_id="inst_dead")
    mine = RedisStore(redis_server.url, ttl_s=60, maxlen=100, lease_s=5, instance_id="inst_mine")
    registry = Registry(ScriptedEngine(), ServerConfig(engine="scripted"), Limiter(4, 0), mine)
    try:
        sid = f"sess_take_{next(_ids)}"
        await dead.register(sid, "k")
        meta = await mine.meta(sid)
        assert meta is not None and meta.owner == "inst_dead"

        async def failing_load(_: str) -> None:
            raise RedisConnectionError("blip")

        real_load, mine.load = mine.load, failing_load  # type: ignore[method-assign]
        with pytest.raises(RedisConnectionError):
            await registry._take_over(sid, meta)
        after = await mine.meta(sid)
        assert after is not None and after.owner == "inst_dead"
        mine.load = real_load  # type: ignore[method-assign]
        # Nothing logged, so no snapshot: it cannot be rebuilt, and goes.
        assert await registry._take_over(sid, meta) is None
        assert await mine.meta(sid) is None
    finally:
        await dead.redis.aclose()
        await mine.redis.aclose()
