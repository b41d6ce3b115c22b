"""In-process servers whose Redis goes away or comes and goes: nothing of a
connection leaks, its client learns why, and a drain still ends on time and
hands over every session it can."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import structlog
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.server import TokenwireServer
from tokenwire.wire.close_codes import CLOSE_SERVICE_RESTART, STORE_UNAVAILABLE

from ..conftest import RedisServer, RunningServer, free_port, start_redis
from ..helpers.wait import until
from ..helpers.wire import closed_with


class OwnRedis:
    """A redis-server of one test's own, to stop and start again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = start_redis(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def start(self) -> None:
        if self.proc is None:
            self.proc = start_redis(self.port)


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    redis = OwnRedis()
    try:
        yield redis
    finally:
        redis.stop()


@asynccontextmanager
async def serving(url: str, **settings: object) -> AsyncIterator[RunningServer]:
    config = ServerConfig(
        engine="scripted",
        port=0,
        redis_url=url,
        lease_s=5,
        max_events_per_s=0,
        **settings,  # type: ignore[arg-type]
    )
    server = TokenwireServer(config, ScriptedEngine(tokens_per_s=config.scripted_tokens_per_s))
    await server.start()
    try:
        yield RunningServer(server)
    finally:
        await asyncio.wait_for(server.close(), 30)


async def open_ws(url: str) -> ClientConnection:
    return await ws_connect(url, subprotocols=["tokenwire.v1.json"])


async def recv(ws: ClientConnection) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 10))


async def detached_session(running: RunningServer) -> str:
    """A session on `running` whose socket dropped: its id."""
    ws = await open_ws(running.url)
    sid = (await recv(ws))["session"]["id"]
    ws.transport.abort()
    await until(lambda: running.server.sessions[sid].state == "detached", "the socket dropped")
    return sid


async def test_a_redis_outage_at_connect_leaks_no_slot(own_redis: OwnRedis) -> None:
    async with serving(own_redis.url, max_connections_per_key=2) as running:
        server = running.server
        own_redis.stop()
        for _ in range(3):  # more than the key's slots: each must be given back
            ws = await open_ws(running.url)
            assert await closed_with(ws) == (1013, STORE_UNAVAILABLE)  # no session.created
        await until(lambda: not server.admission.limiter.keys, "the key's usage record is gone")
        assert not server.sessions
        assert server.health()["connections"] == 0
        own_redis.start()
        ws = await open_ws(running.url)
        assert (await recv(ws))["type"] == "session.created"
        await ws.close()


async def test_a_redis_outage_during_a_resume_ends_the_fresh_session(
    own_redis: OwnRedis,
) -> None:
    async with serving(own_redis.url, resume_grace_s=60) as running:
        server = running.server
        ws = await open_ws(running.url)
        fresh = (await recv(ws))["session"]["id"]
        own_redis.stop()
        await ws.send(
            json.dumps({"type": "session.resume", "session_id": "sess_gone", "last_seq": 0})
        )
        # Not an error event: a client retries the resume on a close.
        assert await closed_with(ws) == (1013, STORE_UNAVAILABLE)
        # Its client never used it: it ends now, not after the 60 s grace period.
        await until(lambda: fresh not in server.sessions, "the fresh session ended")
        await until(lambda: not server.admission.limiter.keys, "the key's usage record is gone")
        assert server.health()["connections"] == 0


async def test_a_drain_ends_on_time_when_redis_is_gone(own_redis: OwnRedis) -> None:
    async with serving(own_redis.url, drain_timeout_s=0.5) as running:
        server = running.server
        ws = await open_ws(running.url)
        sid = (await recv(ws))["session"]["id"]
        own_redis.stop()
        # The hand-over cannot finish; the drain gives up on it after its timeout.
        await asyncio.wait_for(server.drain(), 30)
        code, reason = await closed_with(ws)
        assert (code, reason) == (CLOSE_SERVICE_RESTART, "draining; resume the session")
        assert sid not in server.sessions
        await until(lambda: not server.admission.limiter.keys, "the key's usage record is gone")


async def test_a_socket_lost_during_a_drain_is_handed_over(redis_server: RedisServer) -> None:
    settings = {"drain_timeout_s": 1.0, "scripted_tokens_per_s": 50}
    async with (
        serving(redis_server.url, **settings) as a,
        serving(redis_server.url, **settings) as b,
    ):
        ws = await open_ws(a.url)
        sid = (await recv(ws))["session"]["id"]
        await ws.send(
            json.dumps(
                {
                    "type": "response.create",
                    "response": {"ignore_eos": True, "max_output_tokens": 200},
                }
            )
        )
        while (await recv(ws))["type"] != "response.output_text.delta":
            pass
        # A response runs: the drain waits for it, and sees the drop meanwhile.
        drain = asyncio.create_task(a.server.drain())
        while (event := await recv(ws))["type"] != "session.going_away":
            pass
        last = event["seq"]
        ws.transport.abort()  # the client's network drops while A drains
        await asyncio.wait_for(drain, 30)
        assert await a.server.store.meta(sid) is not None  # type: ignore[union-attr]
        ws = await open_ws(b.url)
        await recv(ws)  # its own session.created
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": last}))
        while (event := await recv(ws))["type"] != "response.done":
            assert event["type"] != "error", event
        assert event["response"]["status"] == "completed"
        assert event["response"]["usage"]["output_tokens"] == 200
        await ws.close()


async def test_a_redis_failure_during_a_replay_keeps_the_session_being_resumed(
    own_redis: OwnRedis,
) -> None:
    """Redis fails while the log is read for a replay: the client is told to
    retry (1013), and the session it resumes stays for that retry, even one
    whose client never sent an event (it was ended and dropped)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tokenwire.runtime.session_runtime import RuntimeState

    async with serving(own_redis.url, resume_grace_s=60) as running:
        server = running.server
        first = await open_ws(running.url)
        sid = (await recv(first))["session"]["id"]
        first.transport.abort()  # its network drops; its client sent nothing
        runtime = server.sessions[sid]
        await until(lambda: runtime.state is RuntimeState.DETACHED, "the socket detached")
        log = runtime.delivery.log
        read = log.read

        async def failing(after: int) -> list:
            raise RedisConnectionError("injected: Redis went away mid-replay")

        log.read = failing  # type: ignore[method-assign]
        ws = await open_ws(running.url)
        await recv(ws)  # its own session.created
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 0}))
        assert await closed_with(ws) == (1013, STORE_UNAVAILABLE)
        await until(lambda: server.health()["connections"] == 0, "the socket is gone")
        assert server.sessions.get(sid) is runtime
        assert runtime.state is RuntimeState.DETACHED
        assert await server.store.meta(sid) is not None  # type: ignore[union-attr]
        # Redis is back: the client's retry resumes it.
        log.read = read  # type: ignore[method-assign]
        ws = await open_ws(running.url)
        await recv(ws)
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 0}))
        events = [await recv(ws)]
        while events[-1]["type"] != "session.resumed":
            events.append(await recv(ws))
        assert events[0]["type"] == "session.created" and events[0]["session"]["id"] == sid
        await ws.close()


async def test_two_resumes_at_once_take_a_dead_owners_session_over_once(
    redis_server: RedisServer,
) -> None:
    """Two sockets resume the same session on B at the same moment, its owner
    A gone: one takeover (there were two runtimes, logging the same seqs)."""
    async with (
        serving(redis_server.url, resume_grace_s=60) as a,
        serving(redis_server.url, resume_grace_s=60) as b,
    ):
        sid = await detached_session(a)
        await a.server.store.release()  # A's lease is gone: as if it died
        store = b.server.store
        assert store is not None
        loads = 0
        load = store.load

        async def counted(session_id: str):  # type: ignore[no-untyped-def]
            nonlocal loads
            loads += 1
            await asyncio.sleep(0.5)  # a slow Redis: the second resume comes meanwhile
            return await load(session_id)

        store.load = counted  # type: ignore[method-assign]
        sockets = [await open_ws(b.url) for _ in range(2)]
        for s in sockets:
            await recv(s)  # its own session.created
        resume = json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 1})
        await sockets[0].send(resume)
        await until(lambda: loads == 1, "the first takeover is loading the session")
        await sockets[1].send(resume)  # B owns it in Redis now, but has no runtime yet
        await until(lambda: sid in b.server.sessions, "B took the session over")
        await asyncio.sleep(1.0)  # a second takeover would have loaded by now
        assert loads == 1
        runtime = b.server.sessions[sid]
        await until(lambda: runtime.state == "attached", "one socket holds it")
        assert (await store.meta(sid)).owner == store.instance_id  # type: ignore[union-attr]
        for s in sockets:
            s.transport.abort()


async def test_a_resume_while_redis_is_slow_sends_session_resumed_after_the_replay(
    redis_server: RedisServer,
) -> None:
    """Events of a batch Redis had not yet acknowledged when the replay read
    the log go out with the replay: `session.resumed` comes right after them
    and counts them, and what follows it continues the seqs (they came after
    it, uncounted)."""
    async with serving(
        redis_server.url, resume_grace_s=60, scripted_tokens_per_s=200, drain_timeout_s=0.5
    ) as running:
        store = running.server.store
        assert store is not None
        append = store.append

        async def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.15)  # a batch in Redis's hands for a while
            return await append(*args, **kwargs)

        store.append = slow  # type: ignore[method-assign]
        ws = await open_ws(running.url)
        sid = (await recv(ws))["session"]["id"]
        request = {"response": {"ignore_eos": True, "max_output_tokens": 600}}
        await ws.send(json.dumps({"type": "response.create", **request}))
        while (event := await recv(ws))["type"] != "response.output_text.delta":
            pass
        last = event["seq"]
        ws.transport.abort()
        await asyncio.sleep(0.5)  # it generates on, into the log
        ws = await open_ws(running.url)
        await recv(ws)
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": last}))
        seqs = []
        while (event := await recv(ws))["type"] != "session.resumed":
            seqs.append(event["seq"])
        assert seqs == list(range(last + 1, last + 1 + len(seqs)))
        assert event["replayed"] == len(seqs)
        after = await recv(ws)
        assert after["seq"] == last + len(seqs) + 2  # session.resumed took its own seq
        store.append = append  # type: ignore[method-assign]
        await ws.send(json.dumps({"type": "response.cancel"}))
        while (await recv(ws))["type"] != "response.done":
            pass
        await ws.close()


async def test_a_follower_sees_the_end_of_a_session_whose_drop_failed(
    redis_server: RedisServer,
) -> None:
    """A ends a session its client follows from B, but Redis fails the drop:
    its keys still name A. B's follower, pinging A, sees the end (1011) at
    once, not after the keys' TTL (an hour)."""
    async with (
        serving(redis_server.url, resume_grace_s=60) as a,
        serving(redis_server.url, resume_grace_s=60) as b,
    ):
        sid = await detached_session(a)
        follower = await open_ws(b.url)
        await recv(follower)  # its own session.created
        await follower.send(
            json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 1})
        )
        await until(lambda: a.server.sessions[sid].state == "remote", "B follows A's session")
        store = a.server.store
        assert store is not None
        drop = store.drop

        async def failing(session_id: str) -> bool:
            return False  # what drop() says when Redis failed it

        store.drop = failing  # type: ignore[method-assign]
        await a.server.registry.end_session(a.server.sessions[sid])
        store.drop = drop  # type: ignore[method-assign]
        assert sid not in a.server.sessions
        assert (await store.meta(sid)).owner == store.instance_id  # type: ignore[union-attr]
        code, reason = await closed_with(follower)
        assert (code, reason) == (1011, "the session ended")
        assert await store.meta(sid) is None


async def test_a_replay_the_log_was_trimmed_past_says_so_and_closes(
    redis_server: RedisServer,
) -> None:
    """A client resumes and reads nothing while the session logs on: Redis
    trims (MAXLEN) what the replay had not sent yet. The client gets every
    event up to the gap, then resume_not_possible with the seq it expected,
    then 1011: never a silent jump in seq."""
    from ..helpers.wire import raw_client

    async with serving(
        redis_server.url,
        resume_grace_s=60,
        redis_maxlen=100,
        sndbuf=4608,
        outbound_high_water=1024,
        stall_s=60,  # the generation goes on while the replay waits
        slow_client_timeout_s=120,
        scripted_tokens_per_s=100,
    ) as a:
        ws = await open_ws(a.url)
        sid = (await recv(ws))["session"]["id"]
        item = {"type": "message", "role": "user", "content": "go"}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        long = {"max_output_tokens": 5000, "ignore_eos": True}
        await ws.send(json.dumps({"type": "response.create", "response": long}))
        last = 0
        while last < 6:
            last = (await recv(ws))["seq"]
        ws.transport.abort()
        # About 100 events logged meanwhile, more than the socket's buffers
        # take; fewer than 200, past which Redis trims (MAXLEN ~ 100).
        await asyncio.sleep(1.0)
        slow = await raw_client(a.url)
        await slow.recv()  # its own session.created
        await slow.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": last}))
        await asyncio.sleep(4)  # the replay waits on the full buffers; 400 more logged
        seqs: list[int] = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                event = json.loads(await asyncio.wait_for(slow.recv(), 10))
                seqs.append(event["seq"])
                if event["type"] == "error":
                    error = event["error"]
        assert seqs == list(range(last + 1, last + 1 + len(seqs)))
        assert error["code"] == "resume_not_possible" and "no longer kept" in error["message"]
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (
            1011,
            "fell behind the session's log",
        )


async def test_a_forward_for_a_session_not_held_here_drops_nothing(
    redis_server: RedisServer,
) -> None:
    """A claimed a session but could not load it (Redis failed mid-takeover):
    the meta names A, no runtime. A follower's forward must not end it; a
    later resume may still take it over."""
    async with serving(redis_server.url, resume_grace_s=60) as a:
        store = a.server.store
        assert store is not None
        sid = "sess_claimed_not_loaded"
        await store.register(sid, None)
        await a.server.registry.on_forward(sid, "attach", {"last_seq": 0}, "follower-1")
        assert (await store.meta(sid)).owner == store.instance_id  # type: ignore[union-attr]
        await store.drop(sid)


async def test_a_takeover_that_cannot_rebuild_the_session_drops_it(
    redis_server: RedisServer,
) -> None:
    """B claims a dead owner's session, but its log holds an entry B cannot
    fold in: the resume gets session_not_found, the session is gone from
    Redis (not left claimed by B, which does not run it), and the key's
    response count on B is back to none."""
    from tokenwire.storage.redis import Entry, pack

    async with (
        serving(redis_server.url, resume_grace_s=60, scripted_tokens_per_s=2) as a,
        serving(redis_server.url, resume_grace_s=60) as b,
    ):
        ws = await open_ws(a.url)
        sid = (await recv(ws))["session"]["id"]
        await ws.send(json.dumps({"type": "response.create", "response": {}}))
        rid = ""
        while not rid:
            event = await recv(ws)
            rid = event["response"]["id"] if event["type"] == "response.created" else ""
        ws.transport.abort()
        await until(lambda: a.server.sessions[sid].state == "detached", "the socket dropped")
        await a.server.store.release()  # A's lease is gone: as if it died
        store = b.server.store
        assert store is not None
        load = store.load

        async def corrupt(session_id: str):  # type: ignore[no-untyped-def]
            state, entries = await load(session_id)
            bad = {"type": "response.output_text.delta", "response_id": rid}  # no delta
            return state, [*entries, Entry(10**6, pack(bad), None)]

        store.load = corrupt  # type: ignore[method-assign]
        other = await open_ws(b.url)
        await recv(other)  # its own session.created
        await other.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 1}))
        event = await recv(other)
        assert event["type"] == "error" and event["error"]["code"] == "session_not_found"
        assert await store.meta(sid) is None
        assert sid not in b.server.sessions
        usage = b.server.admission.limiter.keys.get("anonymous")
        assert usage is not None and usage.responses == 0
        await other.close()


async def test_a_follower_whose_client_stops_reading_closes_it(redis_server: RedisServer) -> None:
    """The client follows on B and stops reading while A generates: B's sends
    block, and after --slow-client-timeout-s B closes the socket (4008) and
    the session ends on A, as it would for a client of A's own. Without the
    clock, B's follower waited in a send for good, holding socket and slot."""
    from ..helpers.wire import raw_client

    async with (
        serving(redis_server.url, resume_grace_s=60, scripted_tokens_per_s=4000) as a,
        serving(redis_server.url, slow_client_timeout_s=1, sndbuf=4096) as b,
    ):
        sid = await detached_session(a)
        ws = await raw_client(b.url)
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 1}))
        await until(lambda: b.server.followers, "B follows the session")
        create = {
            "type": "response.create",
            "response": {"ignore_eos": True, "max_output_tokens": 4000},
        }
        with structlog.testing.capture_logs() as logs:
            await ws.send(json.dumps(create))  # and read nothing more
            await until(lambda: not b.server.followers, "B closed the follower", timeout=20)
        await until(lambda: sid not in a.server.sessions, "the session ended on A")
        assert [e["event"] for e in logs if e["event"] == "slow_client_closed"] == [
            "slow_client_closed"
        ]
        ws.transport.abort()


async def test_follower_sockets_count_against_max_connections(redis_server: RedisServer) -> None:
    """A socket following a session owned elsewhere is an open socket like
    any other: with --max-connections 1 on B and one follower there, the
    next handshake is refused; /healthz shows it under `followers`."""
    from websockets.exceptions import InvalidStatus

    async with (
        serving(redis_server.url, resume_grace_s=60) as a,
        serving(redis_server.url, max_connections=1) as b,
    ):
        sid = await detached_session(a)
        ws = await open_ws(b.url)
        await recv(ws)  # its own session.created
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "last_seq": 1}))
        await until(lambda: b.server.followers, "B follows the session")
        health = b.server.health()
        assert (health["connections"], health["followers"]) == (0, 1)
        with pytest.raises(InvalidStatus) as refused:
            await open_ws(b.url)
        assert refused.value.response.status_code == 429
        await ws.close()
