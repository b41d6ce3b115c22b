"""Resume after disconnect (single instance, in-memory event log)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.runtime.session_runtime import RuntimeState, SessionRuntime
from tokenwire.server import TokenwireServer

from ..conftest import RunningServer
from ..helpers.wait import until
from ..helpers.wire import Wire, expected, resume, start_stream


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    config = ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=2000,
        resume_grace_s=2.0,
        max_events_per_s=0,
    )
    srv = TokenwireServer(config, ScriptedEngine(tokens_per_s=2000))
    await srv.start()
    yield RunningServer(srv)
    await srv.close()


def patient(server: RunningServer) -> None:
    """Only the grace test needs its grace short. On a loaded machine a drop
    and its resume can be more than 2 s apart, with more of the stream made
    meanwhile than the default log keeps (seen once: the resume refused, and
    the socket's own session's seq 2 came next)."""
    server.server.config.resume_grace_s = 60.0
    server.server.config.resume_log_bytes = 4 << 20  # the whole stream


async def test_resume_replays_then_continues(server: RunningServer) -> None:
    patient(server)
    n = 3000
    wire, sid = await start_stream(server.url, n)
    text, seqs = "", [1]  # start_stream read session.created
    while len(seqs) < 200:
        event = await wire.recv()
        seqs.append(event["seq"])
        text += event.get("delta", "")
    wire.ws.transport.abort()  # the network drops
    await asyncio.sleep(0.2)  # generation goes on meanwhile
    wire, _ = await resume(server.url, sid, seqs[-1], protocol="msgpack")
    resumed = None
    while True:
        event = await wire.recv()
        if event["type"] == "session.resumed":
            resumed = event
        seqs.append(event["seq"])
        text += event.get("delta", "")
        if event["type"] == "response.done":
            break
    assert resumed is not None and resumed["session"]["id"] == sid
    assert resumed["last_seq"] == 200
    # Replayed events come first, then session.resumed, then what was never sent.
    assert resumed["seq"] == 200 + resumed["replayed"] + 1
    assert resumed["session"]["subprotocol"] == "tokenwire.v1.msgpack"
    assert resumed["client_events"] == 1  # the response.create
    assert seqs == list(range(1, len(seqs) + 1))  # no gap, no duplicate
    assert text == expected(n)
    assert event["response"]["status"] == "completed"
    await wire.ws.close()


async def test_hundred_random_disconnects(server: RunningServer) -> None:
    patient(server)
    rng = random.Random(20261122)
    n = 6000
    wire, sid = await start_stream(server.url, n)
    text, last_seq, done, drops = "", 1, None, 0  # start_stream read seq 1
    while done is None:
        budget = rng.randint(0, 60) if drops < 100 else 10**9
        try:
            for _ in range(budget):
                event = await wire.recv()
                assert event["seq"] == last_seq + 1, (event["seq"], last_seq)
                last_seq = event["seq"]
                text += event.get("delta", "")
                if event["type"] == "response.done":
                    done = event["response"]
                    break
        finally:
            if done is None:
                wire.ws.transport.abort()
        if done is None:
            drops += 1
            wire, _ = await resume(server.url, sid, last_seq, rng.choice(["json", "msgpack"]))
    assert drops == 100
    assert done["status"] == "completed"
    assert text == expected(n)
    await wire.ws.close()


async def test_unknown_session(server: RunningServer) -> None:
    wire, _ = await resume(server.url, "sess_nope", 3)
    error = await wire.recv()
    assert error["type"] == "error" and error["error"]["code"] == "session_not_found"
    assert error["error"]["event_id"] == "r"
    # The socket carries on with its own new session.
    await wire.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "hi"},
        }
    )
    assert (await wire.recv())["type"] == "conversation.item.created"


async def test_resume_from_the_future_is_refused(server: RunningServer) -> None:
    wire, sid = await start_stream(server.url, 10)
    while (await wire.recv())["type"] != "response.done":
        pass
    wire.ws.transport.abort()
    await asyncio.sleep(0.05)
    wire, _ = await resume(server.url, sid, 10_000)
    error = await wire.recv()
    assert error["error"]["code"] == "resume_not_possible"


async def test_grace_period_ends_the_session(server: RunningServer) -> None:
    wire, sid = await start_stream(server.url, 10**7)
    await wire.recv()
    wire.ws.transport.abort()
    await asyncio.sleep(0.3)
    assert sid in server.server.sessions  # held for a resume...
    for _ in range(100):  # ...until the 2 s grace period is over
        if sid not in server.server.sessions:
            break
        await asyncio.sleep(0.05)
    assert sid not in server.server.sessions
    assert server.server.engine.load().running == 0
    wire, _ = await resume(server.url, sid, 1)
    assert (await wire.recv())["error"]["code"] == "session_not_found"


async def test_an_openai_client_that_drops_ends_its_session_at_once(
    server: RunningServer,
) -> None:
    """GA has no session.resume: a session kept for the grace period would
    only run its generation for no one."""
    patient(server)  # a 60 s grace: what ends it is not the grace running out
    ws = await websockets.connect(server.url, subprotocols=["realtime"])
    created = json.loads(await ws.recv())
    sid = created["session"]["id"]
    response = {"ignore_eos": True, "max_output_tokens": 10**7}
    await ws.send(json.dumps({"type": "response.create", "response": response}))
    while json.loads(await ws.recv())["type"] != "response.output_text.delta":
        pass
    assert server.server.engine.load().running == 1
    ws.transport.abort()  # the network drops
    await until(lambda: sid not in server.server.sessions, what="the session ended")
    await until(lambda: server.server.engine.load().running == 0, what="generation stopped")


async def test_clean_close_ends_at_once(server: RunningServer) -> None:
    wire, sid = await start_stream(server.url, 10**7)
    await wire.recv()
    await wire.ws.close()  # 1000: the client means it
    for _ in range(50):
        if sid not in server.server.sessions:
            break
        await asyncio.sleep(0.02)
    assert sid not in server.server.sessions
    assert server.server.engine.load().running == 0


async def test_resume_while_the_old_socket_looks_alive(server: RunningServer) -> None:
    """A half-open old socket is taken over: the new one wins."""
    wire, sid = await start_stream(server.url, 4000)
    last = 0
    for _ in range(50):
        last = (await wire.recv())["seq"]
    new, _ = await resume(server.url, sid, last)  # the old socket was never closed
    text_seqs = []
    while True:
        event = await new.recv()
        text_seqs.append(event["seq"])
        if event["type"] == "response.done":
            break
    assert text_seqs == list(range(last + 1, last + 1 + len(text_seqs)))
    await new.ws.close()


async def test_two_resumes_at_once_attach_one_socket(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both resumes drop the half-open old socket and wait for it to detach;
    the first to take the session wins, the other is closed: one socket per
    session, always."""
    patient(server)
    wire, sid = await start_stream(server.url, 10**6)
    last = 0
    for _ in range(5):
        last = (await wire.recv())["seq"]
    target = server.server.sessions[sid]
    gate = asyncio.Event()
    detach = SessionRuntime.detach

    async def held_detach(self: SessionRuntime, outcome: object) -> None:
        if self is target:
            await gate.wait()  # the old socket's detach waits until both resumes do
        await detach(self, outcome)

    monkeypatch.setattr(SessionRuntime, "detach", held_detach)
    (b, _), (c, _) = await asyncio.gather(
        resume(server.url, sid, last), resume(server.url, sid, last)
    )
    await until(lambda: len(target.detached._waiters) == 2, "both resumes wait")  # type: ignore[attr-defined]
    gate.set()

    async def outcome(w: Wire) -> str:
        try:
            while (await w.recv())["type"] != "session.resumed":
                pass
        except ConnectionClosed as exc:
            assert exc.rcvd is not None
            return f"{exc.rcvd.code} {exc.rcvd.reason}"
        return "resumed"

    results = await asyncio.gather(outcome(b), outcome(c))
    assert sorted(results) == ["1011 the session was resumed on another connection", "resumed"]
    winner = b if results[0] == "resumed" else c
    assert target.state is RuntimeState.ATTACHED
    # The session goes on, on the winner's socket only.
    seq = (await winner.recv())["seq"]
    assert seq > last
    assert target.ws is not None and target.ws.remote_address[1] == winner.ws.local_address[1]
    winner.ws.transport.abort()
