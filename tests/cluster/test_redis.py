"""Several instances sharing a real redis-server: resume on another instance,
follow the owner's live tail, SIGTERM drain with handover, kill -9 takeover."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import redis
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tokenwire.client import Reconnect, connect

from ..conftest import ARTIFACTS, RedisServer, Spawned, http_json, spawn_server
from ..helpers.proxy import Proxy
from ..helpers.wait import until
from ..helpers.wire import (
    Reader,
    closed_with,
    expected,
    resume,
    start_stream,
    until_done_across_moves,
)


@contextmanager
def instances(
    redis_server: RedisServer,
    *extra: str,
    rate: int = 200,
    n: int = 2,
    name: str = "redis",
    only: dict[int, tuple[str, ...]] | None = None,
) -> Iterator[list[Spawned]]:
    """N `tokenwire serve` processes (scripted engine) sharing one Redis;
    `only` adds flags to the instance of that index. The lease and the grace
    are long enough that a machine busy with other tests stalls no owner out
    of its session; a test that needs a lapse passes `--lease-s 1` (the last
    flag wins)."""
    ARTIFACTS.mkdir(exist_ok=True)
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                spawn_server(
                    "--engine",
                    "scripted",
                    "--scripted-tokens-per-s",
                    str(rate),
                    "--redis-url",
                    redis_server.url,
                    "--lease-s",
                    "5",
                    "--resume-grace-s",
                    "60",
                    "--max-events-per-s",
                    "0",
                    *extra,
                    *(only or {}).get(i, ()),
                    log_path=ARTIFACTS / f"{name}-{chr(97 + i)}.log",
                )
            )
            for i in range(n)
        ]


def keys_of(redis_server: RedisServer, sid: str) -> list[bytes]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        return client.keys(f"tw:{sid}:*")
    finally:
        client.close()


async def test_resume_on_another_instance_follows_the_owner(redis_server: RedisServer) -> None:
    # Budgets of 20 kB/s, bursts of 40 kB: what the client sends below fits.
    budget = ("--max-inbound-bytes-per-s", "20000", "--max-message-bytes", "20000")
    with instances(redis_server, *budget, rate=100, name="follow") as (a, b):
        wire, sid = await start_stream(a.url, 150)
        reader = Reader(wire, 1)
        while reader.last_seq < 20:
            await reader.next()
        wire.ws.transport.abort()  # the network drops; the client comes back elsewhere
        wire, _ = await resume(b.url, sid, reader.last_seq, protocol="msgpack")
        reader.wire = wire
        done = await reader.until("response.done")
        assert reader.text == expected(150)
        assert done["response"]["status"] == "completed"
        [resumed] = reader.of("session.resumed")
        assert resumed["session"]["id"] == sid and resumed["last_seq"] == 20
        assert resumed["client_events"] == 1  # counted by the owner: the response.create
        # The session still lives on A; what the client sends through B runs there.
        await wire.send(
            {
                "type": "conversation.item.create",
                "event_id": "c1",
                "item": {"type": "message", "role": "user", "content": "hello there"},
            }
        )
        created = await reader.until("conversation.item.created")
        assert created["event_id"] == "c1"
        await wire.send({"type": "response.create", "event_id": "c2"})
        reader.text = ""
        done = await reader.until("response.done")
        assert reader.text == "You said: hello there"
        # Bad input through the follower gets the owner's error, with its event_id.
        await wire.send({"type": "response.cancel", "event_id": "c3"})
        error = await reader.until("error")
        assert error["error"]["code"] == "response_not_active"
        assert error["error"]["event_id"] == "c3"
        # The follower reads at the connection's byte budget, as an owner does:
        # 60 frames charged 1 KiB each, the 60th read 1 s after the first at least.
        started = time.monotonic()
        for i in range(60):
            await wire.send(
                {"type": "conversation.item.retrieve", "item_id": "x", "event_id": f"r{i}"}
            )
        for i in range(60):
            error = await reader.until("error")
            assert (error["error"]["code"], error["error"]["event_id"]) == ("unknown_item", f"r{i}")
        assert time.monotonic() - started >= 0.95  # (59 x 1024 - 40 kB) / 20 kB/s
        assert http_json(a.http + "/healthz")[1]["sessions"] == 1
        assert http_json(b.http + "/healthz")[1]["sessions"] == 0  # B only follows
        assert keys_of(redis_server, sid)
        await wire.ws.close()  # a clean close ends the session on its owner...
        # ...and its log:
        await until(lambda: not keys_of(redis_server, sid), "the log deleted", every=0.05)


async def test_hundred_random_disconnects_across_instances(redis_server: RedisServer) -> None:
    rng = random.Random(20261122)
    n = 1500
    with instances(redis_server, rate=400, name="random") as servers:
        wire, sid = await start_stream(servers[0].url, n)
        reader = Reader(wire, 1)
        done, drops, unplanned = None, 0, 0
        while done is None:
            budget = rng.randint(0, 12) if drops < 100 else 10**9
            try:
                for _ in range(budget):
                    event = await reader.next()
                    if event["type"] == "response.done":
                        done = event["response"]
                        break
                else:
                    drops += 1
            except ConnectionClosed:
                # A follower's late attach on the owner may close a socket
                # the client had already moved to the owner: resume again.
                unplanned += 1
            if done is None:
                reader.wire.ws.transport.abort()
                reader.wire, _ = await resume(
                    rng.choice(servers).url, sid, reader.last_seq, rng.choice(["json", "msgpack"])
                )
        assert drops >= 100
        assert unplanned <= 5
        assert done["status"] == "completed"
        assert reader.text == expected(n)  # identical to an uninterrupted run
        await reader.wire.ws.close()


async def test_resume_of_unknown_or_foreign_sessions(redis_server: RedisServer) -> None:
    with instances(redis_server, "--api-keys", "key-one,key-two", name="keys") as (a, b):
        one = await ws_connect(
            a.url,
            additional_headers={"Authorization": "Bearer key-one"},
            subprotocols=["tokenwire.v1.json"],  # type: ignore[list-item]
        )
        sid = json.loads(await one.recv())["session"]["id"]
        for key, session_id in (("key-two", sid), ("key-one", "sess_unknown")):
            other = await ws_connect(
                b.url,
                additional_headers={"Authorization": f"Bearer {key}"},
                subprotocols=["tokenwire.v1.json"],  # type: ignore[list-item]
            )
            await other.recv()
            await other.send(
                json.dumps(
                    {
                        "type": "session.resume",
                        "session_id": session_id,
                        "last_seq": 1,
                        "event_id": "r",
                    }
                )
            )
            error = json.loads(await other.recv())
            assert error["error"]["code"] == "session_not_found", error
            await other.close()
        await one.close()


async def test_sigterm_drain_hands_running_responses_over(redis_server: RedisServer) -> None:
    n = 200
    with instances(redis_server, "--drain-timeout-s", "0.5", rate=50, name="drain") as (a, b):
        wire, sid = await start_stream(a.url, n)
        reader = Reader(wire, 1)
        while reader.last_seq < 10:
            await reader.next()
        a.proc.send_signal(signal.SIGTERM)
        going = await reader.until("session.going_away")
        assert going["reason"] == "shutdown" and going["retry_after_ms"] == 0
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await reader.next()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
        assert not reader.of("response.done")  # not cancelled: handed over
        assert a.proc.wait(timeout=30) == 0
        wire, _ = await resume(b.url, sid, reader.last_seq)
        reader.wire = wire
        done = await reader.until("response.done")
        assert done["response"]["status"] == "completed"
        assert reader.text == expected(n)
        assert done["response"]["usage"]["output_tokens"] == n
        await wire.ws.close()


async def test_the_python_client_follows_a_drain_by_itself(redis_server: RedisServer) -> None:
    """Behind a balancer (the proxy), the client resumes on the other
    instance after the 1012, and the same response goes on to its end."""
    n = 200
    with instances(redis_server, "--drain-timeout-s", "0.5", rate=50, name="client") as (a, b):
        async with Proxy(a.port) as balancer:
            policy = Reconnect(initial_delay_s=0.05, max_delay_s=0.2)
            async with await connect(balancer.url(), reconnect=policy) as tw:
                sid = tw.session_id
                response = await tw.create_response(ignore_eos=True, max_output_tokens=n)
                deltas: list[str] = []
                async for event in response:
                    if event["type"] == "response.output_text.delta":
                        deltas.append(event["delta"])
                        if len(deltas) == 10:
                            balancer.target = ("127.0.0.1", b.port)  # A leaves the pool
                            a.proc.send_signal(signal.SIGTERM)
                assert event["response"]["status"] == "completed"
                assert "".join(deltas) == expected(n)
                assert tw.reconnects == 1 and tw.session_id == sid
                assert a.proc.wait(timeout=30) == 0
                assert await tw.ask("on B") == "You said: on B"
                assert http_json(b.http + "/healthz")[1]["sessions"] == 1


async def test_sigterm_drain_lets_short_responses_finish(redis_server: RedisServer) -> None:
    with instances(redis_server, "--drain-timeout-s", "20", rate=20, n=1, name="drain-short") as (
        a,
    ):
        wire, sid = await start_stream(a.url, 30)  # 1.5 s at 20 tokens/s
        reader = Reader(wire, 1)
        await reader.until("response.output_text.delta")
        a.proc.send_signal(signal.SIGTERM)
        await reader.until("session.going_away")
        # Draining: not ready, and no new connections.
        assert http_json(a.http + "/readyz")[0] == 503
        with pytest.raises(Exception, match="503"):
            await ws_connect(a.url)
        done = await reader.until("response.done")
        assert done["response"]["status"] == "completed"
        assert reader.text == expected(30)
        with pytest.raises(ConnectionClosed):
            await reader.next()
        assert a.proc.wait(timeout=30) == 0
        assert keys_of(redis_server, sid)  # resumable elsewhere, conversation and all


async def test_kill_9_takeover(redis_server: RedisServer) -> None:
    n = 150
    with instances(redis_server, "--lease-s", "1", rate=50, name="kill") as (a, b):
        wire, sid = await start_stream(a.url, n)
        reader = Reader(wire, 1)
        while reader.last_seq < 15:
            await reader.next()
        # A frame answered only by an error: no snapshot follows it.
        await wire.send({"type": "response.cancel", "response_id": "nope", "event_id": "bad"})
        assert (await reader.until("error"))["error"]["event_id"] == "bad"
        a.proc.kill()  # SIGKILL: no drain, no goodbye
        a.proc.wait()
        # B first follows (the lease still looks alive), then closes with
        # 1012 once it lapsed; the next resume takes the session over.
        wire, _ = await resume(b.url, sid, reader.last_seq, protocol="msgpack")
        reader.wire = wire
        done = await until_done_across_moves(reader, b.url, sid)
        assert done["response"]["status"] == "completed"
        assert reader.text == expected(n)  # one complete answer
        assert len(reader.of("response.created")) == 1  # the same response, continued
        # The count came with the log, not only the snapshot: the
        # response.create and the bad cancel were taken.
        assert [r["client_events"] for r in reader.of("session.resumed")][-1:] == [2]
        with urllib.request.urlopen(b.http + "/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "tokenwire_session_takeovers_total 1.0" in text
        # Counted on B from the takeover: its response.done brings it to 0, not -1.
        assert "tokenwire_active_responses 0.0" in text
        await reader.wire.ws.close()


async def test_grace_period_ends_the_session_and_its_log(redis_server: RedisServer) -> None:
    with instances(redis_server, "--resume-grace-s", "1", n=1, rate=50, name="grace") as (a,):
        wire, sid = await start_stream(a.url, 10**6)
        await Reader(wire, 1).until("response.output_text.delta")
        wire.ws.transport.abort()
        assert keys_of(redis_server, sid)  # kept, and still being written, for a resume...
        # ...until the grace ends:
        await until(lambda: not keys_of(redis_server, sid), "the log deleted", every=0.05)
        health = http_json(a.http + "/healthz")[1]
        assert health["sessions"] == 0 and health["engine_load"]["running"] == 0
        wire, _ = await resume(a.url, sid, 2)
        assert (await wire.recv())["error"]["code"] == "session_not_found"


async def test_draining_a_follower_instance_keeps_the_session(redis_server: RedisServer) -> None:
    n = 200
    with instances(redis_server, "--drain-timeout-s", "0.5", rate=50, name="drain-follower") as (
        a,
        b,
    ):
        wire, sid = await start_stream(a.url, n)
        reader = Reader(wire, 1)
        await reader.until("response.output_text.delta")
        wire.ws.transport.abort()
        reader.wire, _ = await resume(b.url, sid, reader.last_seq)  # B follows A's session
        while reader.last_seq < 20:
            await reader.next()
        b.proc.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await reader.next()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
        assert b.proc.wait(timeout=30) == 0
        reader.wire, _ = await resume(a.url, sid, reader.last_seq)  # back to the owner
        done = await reader.until("response.done")
        assert done["response"]["status"] == "completed"
        assert reader.text == expected(n)


async def test_a_follower_the_client_left_cannot_detach_it(redis_server: RedisServer) -> None:
    """The client follows on B, B's socket goes silent (half-open), the client
    resumes on C. B notices only at its keepalive timeout, long after, and
    tells the owner A it lost the client: A must not listen to B any more."""
    name = "stale"
    only_b = {1: ("--ping-interval-s", "0.5")}  # A and C ping the test's sockets as usual
    with instances(redis_server, n=3, rate=50, name=name, only=only_b) as (a, b, c):
        wire, sid = await start_stream(a.url, 30)
        reader = Reader(wire, 1)
        while reader.last_seq < 5:
            await reader.next()
        wire.ws.transport.abort()
        async with Proxy(b.port) as path:
            reader.wire, _ = await resume(path.url(), sid, reader.last_seq)
            while reader.last_seq < 10:
                await reader.next()
            path.drop_upstream = path.drop_downstream = True  # B hears nothing more
            reader.wire, _ = await resume(c.url, sid, reader.last_seq)
            await reader.until("response.done")
            b_log = ARTIFACTS / f"{name}-b.log"
            await until(lambda: '"unfollowing"' in b_log.read_text(), "B unfollowing", every=0.05)
        await asyncio.sleep(0.5)  # B's detach reaches A through its inbox
        await reader.wire.send(
            {
                "type": "conversation.item.create",
                "event_id": "after",
                "item": {"type": "message", "role": "user", "content": "still there?"},
            }
        )
        created = await asyncio.wait_for(reader.until("conversation.item.created"), 10)
        assert created["event_id"] == "after"
        await reader.wire.ws.close()


async def test_a_later_resume_closes_the_socket_a_follower_served(
    redis_server: RedisServer,
) -> None:
    """One socket per session across instances: the client resumes on C while
    its socket on follower B is still open, then on the owner A while C's is.
    Each older socket is closed with 1011, and the last one reads it all."""
    moved = (1011, "the session was resumed on another connection")
    with instances(redis_server, n=3, rate=50, name="moved") as (a, b, c):
        wire, sid = await start_stream(a.url, 150)
        reader = Reader(wire, 1)
        while reader.last_seq < 5:
            await reader.next()
        wire.ws.transport.abort()
        reader.wire, _ = await resume(b.url, sid, reader.last_seq)
        while reader.last_seq < 10:
            await reader.next()
        on_b = reader.wire
        reader.wire, _ = await resume(c.url, sid, reader.last_seq)
        assert await closed_with(on_b.ws) == moved
        while reader.last_seq < 20:
            await reader.next()
        on_c = reader.wire
        reader.wire, _ = await resume(a.url, sid, reader.last_seq)
        assert await closed_with(on_c.ws) == moved
        await reader.until("response.done")
        assert reader.text == expected(150)
        # Both let go and detached: their marks are gone from the meta.
        meta = redis.Redis.from_url(redis_server.url)
        try:
            await until(
                lambda: not [k for k in meta.hkeys(f"tw:{sid}:meta") if k.startswith(b"left:")],
                "the marks dropped",
                every=0.05,
            )
        finally:
            meta.close()
        await reader.wire.ws.close()


async def test_a_stalled_owner_is_fenced_after_a_takeover(redis_server: RedisServer) -> None:
    n = 200
    with instances(redis_server, "--lease-s", "1", rate=50, name="fence") as (a, b):
        wire, sid = await start_stream(a.url, n)
        reader = Reader(wire, 1)
        while reader.last_seq < 10:
            await reader.next()
        wire.ws.transport.abort()
        a.proc.send_signal(signal.SIGSTOP)  # frozen, not dead: its lease lapses
        try:
            reader.wire, _ = await resume(b.url, sid, reader.last_seq)
            while reader.last_seq < 20:  # B took over and generates
                try:
                    await reader.next()
                except ConnectionClosed as exc:  # B followed until A's lease lapsed
                    assert exc.rcvd is not None and exc.rcvd.code == 1012
                    reader.wire, _ = await resume(b.url, sid, reader.last_seq)
        finally:
            a.proc.send_signal(signal.SIGCONT)
        # A wakes up, fails its next write to the log and lets the session go.
        await until(
            lambda: http_json(a.http + "/healthz")[1]["sessions"] == 0, "A let go", every=0.05
        )
        done = await reader.until("response.done")
        assert done["response"]["status"] == "completed"
        assert reader.text == expected(n)
        assert http_json(b.http + "/healthz")[1]["sessions"] == 1
        # A no longer counts the response it let go; B counted it once taken.
        for instance in (a, b):
            with urllib.request.urlopen(instance.http + "/metrics", timeout=5) as r:
                assert "tokenwire_active_responses 0.0" in r.read().decode()


async def test_hostile_resumes_get_errors_and_harm_nothing(redis_server: RedisServer) -> None:
    with instances(redis_server, n=1, rate=100, name="hostile") as (a,):
        wire, sid = await start_stream(a.url, 100)
        reader = Reader(wire, 1)
        cases = [
            ("tw:*", 1, "session_not_found"),  # a glob is just a name
            ("x" * 200, 1, "invalid_field"),
            (sid, 2**64 - 1, "resume_not_possible"),  # past the end of the log
        ]
        for session_id, last_seq, code in cases:
            other, _ = await resume(a.url, session_id, last_seq)
            error = await other.recv()
            assert error["error"]["code"] == code, error
            await other.ws.close()
        # The session under attack streams on, whole.
        await reader.until("response.done")
        assert reader.text == expected(100)
