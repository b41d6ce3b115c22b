"""Keepalive pings from one timer (server.heartbeat): every connection is
pinged once an interval, in turn, and one whose pong does not come is closed
with 1011, as websockets' own keepalive does."""

from __future__ import annotations

import asyncio
import base64
import os
import struct

from websockets.asyncio.client import connect as ws_connect

from tokenwire.config import ServerConfig
from tokenwire.server.heartbeat import Heartbeat

from ..conftest import _scripted_server
from ..helpers.wait import until


def config(**overrides: object) -> ServerConfig:
    return ServerConfig(engine="scripted", port=0, **overrides)  # type: ignore[arg-type]


class FakeTransport:
    def __init__(self) -> None:
        self.buffered = 0
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def abort(self) -> None:
        self.aborted = True


class FakeConnection:
    """What the heartbeat uses of a connection: ping(), close() and the
    transport's buffer. `writable` False: a ping waits for the buffer."""

    def __init__(self, answers: bool = True, writable: bool = True) -> None:
        self.answers = answers
        self.writable = writable
        self.pings = 0
        self.closed: tuple[int, str] | None = None
        self.transport = FakeTransport()

    async def ping(self) -> asyncio.Future[float]:
        self.pings += 1
        if not self.writable:
            await asyncio.Event().wait()  # drain() of a buffer nobody reads
        pong = asyncio.get_running_loop().create_future()
        if self.answers:
            asyncio.get_running_loop().call_soon(pong.set_result, 0.001)
        return pong

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


async def tick(beat: Heartbeat) -> None:
    """One tick, by hand (its own timer cancelled: nothing depends on the
    machine's pace), and the pings it started."""
    beat._tick()
    assert beat._timer is not None
    beat._timer.cancel()
    for _ in range(5):
        await asyncio.sleep(0)


async def test_connections_are_pinged_in_turn_and_a_missing_pong_closes() -> None:
    beat = Heartbeat(interval_s=0.8, timeout_s=0.05, tick_s=0.2)
    conns = [FakeConnection(answers=i > 0) for i in range(4)]
    for conn in conns:
        beat.add(conn)  # type: ignore[arg-type]
    assert len(beat) == 4
    try:
        await tick(beat)  # one tick: the first slot only
        assert [c.pings for c in conns] == [1, 0, 0, 0]
        for _ in range(3):  # a whole interval: each once
            await tick(beat)
        assert [c.pings for c in conns] == [1, 1, 1, 1]
        await asyncio.sleep(0.1)  # past the timeout: conns[0] never answered
        for _ in range(4):  # the others are pinged again
            await tick(beat)
        assert conns[0].closed == (1011, "keepalive ping timeout")
        assert [c.closed for c in conns[1:]] == [None, None, None]
        assert [c.pings for c in conns[1:]] == [2, 2, 2]
        beat.discard(conns[0])  # type: ignore[arg-type]
        assert len(beat) == 3
    finally:
        beat.stop()


async def test_a_ping_that_cannot_be_written_closes_a_client_that_reads_nothing() -> None:
    """Above websockets' write limit and below the slow-client high water a
    ping waits for the buffer, and its pong clock never started: a client
    gone with 32-64 KiB unread kept its slot until the idle timeout."""
    beat = Heartbeat(interval_s=0.1, timeout_s=0.05, tick_s=0.1)
    gone, slow = FakeConnection(writable=False), FakeConnection(writable=False)
    for conn in (gone, slow):
        conn.transport.buffered = 40_000
        beat.add(conn)  # type: ignore[arg-type]
    try:
        await tick(beat)
        assert gone.pings == slow.pings == 1
        await asyncio.sleep(0.1)
        slow.transport.buffered = 39_000  # it read a little: still alive
        await tick(beat)
        await until(lambda: gone.closed is not None, "the silent one closed")
        assert gone.closed == (1011, "keepalive ping timeout")
        assert slow.closed is None and slow.pings == 1  # no second ping piled up
        beat.discard(gone)  # as the server does once it is closed
        await asyncio.sleep(0.1)
        await tick(beat)  # and nothing since: closed too, a timeout later
        await until(lambda: slow.closed is not None, "the slow one closed")
    finally:
        beat.stop()


async def test_a_real_client_answers_and_stays() -> None:
    # A pong may take up to the interval: 1 s, for a machine busy with other tests.
    async with _scripted_server(config(ping_interval_s=1.0)) as running:
        assert running.server.heartbeat is not None
        async with ws_connect(running.url) as ws:
            await ws.recv()  # session.created
            [runtime] = running.server.connections
            assert runtime.ws is not None
            await until(lambda: runtime.ws.latency > 0, "a pong came back", every=0.05)
            await asyncio.sleep(1.5)  # and more pings after it
            assert ws.state.name == "OPEN" and runtime.ws is not None
        await asyncio.sleep(0.05)
        assert len(running.server.heartbeat) == 0


async def test_a_client_that_never_answers_pings_is_closed_with_1011() -> None:
    async with _scripted_server(config(ping_interval_s=0.2)) as running:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.server.port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                "GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
        # Read frames (unmasked, short: server to client) until the server closes.
        opcodes, close = [], b""
        async with asyncio.timeout(5):
            while True:
                head = await reader.readexactly(2)
                size = head[1] & 0x7F
                if size == 126:
                    size = struct.unpack("!H", await reader.readexactly(2))[0]
                payload = await reader.readexactly(size)
                opcodes.append(head[0] & 0x0F)
                if head[0] & 0x0F == 0x8:
                    close = payload
                    break
        assert 0x9 in opcodes  # pinged
        assert struct.unpack("!H", close[:2])[0] == 1011
        assert close[2:] == b"keepalive ping timeout"
        writer.close()


async def test_no_interval_no_heartbeat() -> None:
    async with _scripted_server(config(ping_interval_s=0)) as running:
        assert running.server.heartbeat is None
        async with ws_connect(running.url) as ws:
            assert b"session.created" in (await ws.recv()).encode()
