"""The socket seam: a `ClientSocket` drives any `SocketOwner`. Tested with a
recording owner over real websockets connections, so no test needs the
session runtime's internals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tokenwire.config import ServerConfig
from tokenwire.core.schema import SessionResume, parse_client_event
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.runtime.session_runtime import RuntimeState, SessionRuntime
from tokenwire.runtime.socket import ClientSocket, Handoff, SocketOwner, SocketState
from tokenwire.wire import Dialect, dialect_for
from tokenwire.wire.close_codes import CLOSE_IDLE


class RecordingOwner:
    """A SocketOwner that writes down what the socket asked of it."""

    def __init__(self, *, busy: bool = False, resolves_to: Any = None) -> None:
        self.calls: list[Any] = []
        self.drained = asyncio.Event()
        self.drained.set()
        self.busy = busy
        self.closed_for: str | None = None
        self.resolves_to = resolves_to
        self.log = self  # a logger that records too
        self.frames: list[Any] = []
        self._got = asyncio.Event()

    async def wait_frames(self, n: int) -> None:
        while len(self.frames) < n:
            self._got.clear()
            await asyncio.wait_for(self._got.wait(), 5)

    def info(self, event: str, **kw: Any) -> None:
        self.calls.append(("log", event))

    def attach(self, ws: ServerConnection, dialect: Dialect) -> None:
        self.calls.append(("attach", dialect.subprotocol))

    async def replay(self, last_seq: int) -> None:
        self.calls.append(("replay", last_seq))

    def go_live(self) -> None:
        self.calls.append(("go_live",))

    def receive(self, frame: str | bytes, *, first: bool) -> SessionResume | None:
        obj = json.loads(frame)
        self.frames.append((obj, first))
        self._got.set()
        if first and obj.get("type") == "session.resume":
            return parse_client_event(obj)  # type: ignore[return-value]
        return None

    async def resolve(self, resume: SessionResume) -> Any | None:
        self.calls.append(("resolve", resume.session_id))
        return self.resolves_to

    async def detach(self, outcome: Any) -> None:
        self.calls.append(("detach", outcome))


class Harness:
    def __init__(self, owner: RecordingOwner, idle_timeout_s: float = 60.0) -> None:
        self.owner = owner
        self.idle_timeout_s = idle_timeout_s
        self.outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.socket: ClientSocket | None = None
        self.resume_from: int | None = None

    async def handler(self, ws: ServerConnection) -> None:
        self.socket = ClientSocket(ws, dialect_for(ws.subprotocol), self.idle_timeout_s)
        self.outcome.set_result(await self.socket.serve(self.owner, self.resume_from))


async def served(harness: Harness) -> AsyncIterator[str]:
    async with serve(harness.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}"


@pytest.fixture
async def url_and_harness(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Harness]]:
    harness = Harness(RecordingOwner(**getattr(request, "param", {})))
    async for url in served(harness):
        yield url, harness


def test_the_session_runtime_is_a_socket_owner() -> None:
    runtime = SessionRuntime(ScriptedEngine(), ServerConfig(engine="scripted"))
    members = {
        name for name in dir(SocketOwner) if not name.startswith("_") and name not in dir(object)
    } | set(SocketOwner.__annotations__)
    assert members >= {"attach", "replay", "go_live", "receive", "resolve", "detach", "busy"}
    missing = [name for name in members if not hasattr(runtime, name)]
    assert missing == []
    assert isinstance(runtime.drained, asyncio.Event) and runtime.busy is False
    assert runtime.state is RuntimeState.NEW and runtime.closed_for is None


async def test_new_socket_goes_live_and_feeds_frames(url_and_harness: tuple[str, Harness]) -> None:
    url, harness = url_and_harness
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "a"}))
        await ws.send(json.dumps({"type": "b"}))
        await harness.owner.wait_frames(2)
        assert harness.socket is not None and harness.socket.state is SocketState.LIVE
    assert await harness.outcome == "ended"  # the client closed cleanly
    owner = harness.owner
    assert owner.calls[:2] == [("attach", "realtime"), ("go_live",)]  # no subprotocol: OpenAI's
    assert owner.calls[-1] == ("detach", "ended")
    assert owner.frames == [({"type": "a"}, True), ({"type": "b"}, False)]
    assert harness.socket.state is SocketState.CLOSED


async def test_resumed_socket_replays_and_resumes_nothing_else(
    url_and_harness: tuple[str, Harness],
) -> None:
    url, harness = url_and_harness
    harness.resume_from = 7
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": "s", "last_seq": 0}))
        await harness.owner.wait_frames(1)
    await harness.outcome
    assert harness.owner.calls[1] == ("replay", 7)
    assert harness.owner.frames[0][1] is False  # not a first frame: no resume
    assert ("resolve", "s") not in harness.owner.calls


@pytest.mark.parametrize("url_and_harness", [{"resolves_to": "other"}], indirect=True)
async def test_first_frame_resume_hands_the_socket_on(
    url_and_harness: tuple[str, Harness],
) -> None:
    url, harness = url_and_harness
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": "s1", "last_seq": 4}))
        outcome = await asyncio.wait_for(harness.outcome, 5)
    assert outcome == Handoff("other", 4)
    assert ("resolve", "s1") in harness.owner.calls
    assert harness.owner.calls[-1] == ("detach", outcome)


async def test_no_reading_while_the_owner_is_not_drained(
    url_and_harness: tuple[str, Harness],
) -> None:
    url, harness = url_and_harness
    owner = harness.owner
    async with connect(url) as ws:
        owner.drained.clear()
        await ws.send(json.dumps({"type": "one"}))
        await ws.send(json.dumps({"type": "two"}))
        await asyncio.sleep(0.3)
        assert [f[0]["type"] for f in owner.frames] == ["one"]  # read, then it waits
        owner.drained.set()
        await owner.wait_frames(2)


@pytest.mark.parametrize("busy", [False, True])
async def test_idle_socket_is_closed_unless_busy(busy: bool) -> None:
    harness = Harness(RecordingOwner(busy=busy), idle_timeout_s=0.3)
    async for url in served(harness):
        async with connect(url) as ws:
            if busy:
                await asyncio.sleep(1.0)
                assert not harness.outcome.done()
                return
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == CLOSE_IDLE
        assert await harness.outcome == "ended"
        assert harness.socket is not None and harness.socket.closed_for == "idle"
        assert ("log", "idle_closed") in harness.owner.calls
