"""Bare WebSocket clients: what a test reads off one session, event by event."""

from __future__ import annotations

import asyncio
import json
import socket

import msgpack
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed


class Wire:
    """A bare client that speaks either subprotocol."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.binary = ws.subprotocol == "tokenwire.v1.msgpack"

    @classmethod
    async def open(cls, url: str, protocol: str = "json") -> Wire:
        return cls(await ws_connect(url, subprotocols=[f"tokenwire.v1.{protocol}"]))  # type: ignore[list-item]

    async def send(self, event: dict) -> None:
        await self.ws.send(msgpack.packb(event) if self.binary else json.dumps(event))

    async def recv(self) -> dict:
        frame = await asyncio.wait_for(self.ws.recv(), 10)
        return msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)


def expected(n: int) -> str:
    """What the scripted engine says in `n` tokens."""
    return "".join(f" t{i}" for i in range(n))


async def start_stream(url: str, tokens: int) -> tuple[Wire, str]:
    wire = await Wire.open(url)
    created = await wire.recv()
    await wire.send(
        {"type": "response.create", "response": {"ignore_eos": True, "max_output_tokens": tokens}}
    )
    return wire, created["session"]["id"]


async def resume(
    url: str, session_id: str, last_seq: int, protocol: str = "json"
) -> tuple[Wire, dict]:
    wire = await Wire.open(url, protocol)
    fresh = await wire.recv()  # the new socket's own session, dropped by the resume
    assert fresh["type"] == "session.created" and fresh["session"]["id"] != session_id
    await wire.send(
        {"type": "session.resume", "session_id": session_id, "last_seq": last_seq, "event_id": "r"}
    )
    return wire, fresh


async def closed_with(ws: ClientConnection) -> tuple[int, str]:
    """The close code and reason the server sent, reading past any events."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 10)
    except ConnectionClosed as closed:
        assert closed.rcvd is not None, "the server dropped the socket without a close frame"
        return closed.rcvd.code, closed.rcvd.reason


async def raw_client(url: str) -> ClientConnection:
    """A JSON client with a tiny receive buffer that reads only when told to."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    # No pings of its own: once it stops reading, it would see no pong and close.
    return await ws_connect(
        url, sock=sock, max_queue=1, ping_interval=None, subprotocols=["tokenwire.v1.json"]
    )


class Reader:
    """Reads one session's events across sockets, checking seq as it goes."""

    def __init__(self, wire: Wire, last_seq: int) -> None:
        self.wire = wire
        self.last_seq = last_seq
        self.text = ""
        self.events: list[dict] = []

    async def next(self) -> dict:
        event = await self.wire.recv()
        assert event["seq"] == self.last_seq + 1, (event, self.last_seq)  # no gap, no duplicate
        self.last_seq = event["seq"]
        self.text += event.get("delta", "")
        self.events.append(event)
        return event

    async def until(self, kind: str) -> dict:
        while (event := await self.next())["type"] != kind:
            pass
        return event

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


async def until_done_across_moves(reader: Reader, url: str, sid: str) -> dict:
    """Reads to `response.done`. A follower whose owner died closes with 1012
    (frames it forwarded may be lost); the client resumes again, as ours do,
    and that resume takes the session over."""
    while True:
        try:
            return await reader.until("response.done")
        except ConnectionClosed as exc:
            assert exc.rcvd is not None and exc.rcvd.code == 1012, exc
            assert exc.rcvd.reason == "session moved"
            reader.wire, _ = await resume(url, sid, reader.last_seq)
