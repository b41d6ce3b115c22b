"""Fuzzing the whole server over real sockets (the in-process `scripted` server).

Hand-built RFC 6455 frames: garbage instead of a handshake, garbage after one,
truncated and fragmented frames, invalid UTF-8, unmasked frames and floods. A
healthy session beside the fuzzer must get its answers, the server must never
fail a connection with 1011 (internal error), and afterwards it must still
accept sessions and answer /healthz.

All randomness is seeded and every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from tokenwire.client import Client, TokenwireError, connect
from tokenwire.wire.tokenwire_v1 import SUBPROTOCOL_JSON

from ..conftest import RunningServer, http_json
from ..helpers.fuzz import TYPE_NAMES, assert_wire_safe

SEED = 20240611
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
# Close codes a fuzzed connection may get: normal, going away, protocol error,
# invalid payload (bad UTF-8), policy, too big, try again later, idle, slow client.
ALLOWED_CLOSE = {1000, 1001, 1002, 1007, 1008, 1009, 1013, 4000, 4008}
STREAM_TOKENS = 400


def ws_frame(
    opcode: int,
    payload: bytes = b"",
    *,
    rng: random.Random,
    fin: bool = True,
    masked: bool = True,
    rsv: int = 0,
    declared: int | None = None,
) -> bytes:
    """One RFC 6455 frame as a client sends it. `declared` lies about the length."""
    n = len(payload) if declared is None else declared
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([mask_bit | n])
    elif n < 1 << 16:
        head += bytes([mask_bit | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([mask_bit | 127]) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    key = rng.randbytes(4)
    stream = (key * (len(payload) // 4 + 1))[: len(payload)]
    body = (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(
        len(payload), "big"
    )
    return head + key + body


def client_close_codes(data: bytes) -> set[int]:
    """Close codes inside the client frames that `data` parses into, if any."""
    codes: set[int] = set()
    pos = 0
    while pos + 2 <= len(data):
        b0, b1 = data[pos], data[pos + 1]
        n, pos = b1 & 0x7F, pos + 2
        if n >= 126:
            size = 2 if n == 126 else 8
            n, pos = int.from_bytes(data[pos : pos + size], "big"), pos + size
        key = data[pos : pos + 4] if b1 & 0x80 else b"\0\0\0\0"
        pos += 4 if b1 & 0x80 else 0
        body = data[pos : pos + n]
        if b0 & 0x0F == OP_CLOSE and len(body) >= 2 and len(key) == 4:
            codes.add(((body[0] ^ key[0]) << 8) | (body[1] ^ key[1]))
        pos += n
    return codes


def text_event(event: dict[str, Any], rng: random.Random, **kw: Any) -> bytes:
    return ws_frame(OP_TEXT, json.dumps(event).encode(), rng=rng, **kw)


@dataclass
class Transcript:
    """What the server sent on one raw connection."""

    events: list[dict[str, Any]] = field(default_factory=list)
    pongs: list[bytes] = field(default_factory=list)
    close_code: int | None = None
    eof: bool = False
    http_status: int | None = None
    # Close codes the fuzzer itself sent in a close frame: the server echoes them.
    echoed: set[int] = field(default_factory=set)

    def check(self) -> None:
        """Server frames decode; `seq` has no gaps; errors carry stable codes;
        and no close says the server failed (1011)."""
        if self.close_code not in self.echoed:
            assert self.close_code != 1011, "the server failed the connection (1011)"
            assert self.close_code is None or self.close_code in ALLOWED_CLOSE, self.close_code
        seqs = [e["seq"] for e in self.events]
        assert seqs == list(range(1, len(seqs) + 1)), seqs[:50]
        if self.events:
            assert self.events[0]["type"] == "session.created"
        for event in self.events:
            assert_wire_safe(event)

    def errors_for(self, event_id: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["type"] == "error" and e["error"].get("event_id") == event_id
        ]


class RawWS:
    """A hand-rolled WebSocket client that can say anything."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.rng = rng
        self.transcript = Transcript()
        # The frame being read. Never cancelled mid-frame (that would lose the
        # bytes read so far); a read that times out leaves it for the next.
        self._reading: asyncio.Task[tuple[int, bytes]] | None = None

    @classmethod
    async def open(
        cls, server: RunningServer, rng: random.Random, *, handshake: bool = True
    ) -> RawWS:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", server.server.port), 5
        )
        ws = cls(reader, writer, rng)
        if handshake:
            writer.write(ws.handshake_request(server))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 101"), head
            ws.transcript.http_status = 101
        return ws

    def handshake_request(self, server: RunningServer, subprotocol: str | None = None) -> bytes:
        key = base64.b64encode(self.rng.randbytes(16)).decode()
        lines = [
            "GET /v1/realtime HTTP/1.1",
            f"Host: 127.0.0.1:{server.server.port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            f"Sec-WebSocket-Protocol: {subprotocol or SUBPROTOCOL_JSON}",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def send(self, data: bytes) -> bool:
        """Write; False once the server has gone."""
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), 5)
            return True
        except (ConnectionError, TimeoutError):
            return False

    async def _frame(self) -> tuple[int, bytes]:
        b0, b1 = await self.reader.readexactly(2)
        assert not b1 & 0x80, "server frames must not be masked"
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(await self.reader.readexactly(2), "big")
        elif n == 127:
            n = int.from_bytes(await self.reader.readexactly(8), "big")
        assert b0 & 0x80, "the server does not fragment"
        return b0 & 0x0F, await self.reader.readexactly(n)

    async def read(
        self,
        timeout: float,
        until: Callable[[Transcript], bool] | None = None,
        idle: float | None = None,
    ) -> Transcript:
        """Read server frames until `until` holds, the connection ends, nothing
        comes for `idle` seconds, or `timeout` passes."""
        t = self.transcript
        deadline = time.monotonic() + timeout
        while not t.eof and not (until is not None and until(t)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._frame())
            done, _ = await asyncio.wait({self._reading}, timeout=min(left, idle or left))
            if not done:
                break
            task, self._reading = self._reading, None
            try:
                opcode, payload = task.result()
            except (asyncio.IncompleteReadError, ConnectionError):
                t.eof = True
                break
            if opcode == OP_TEXT:
                t.events.append(json.loads(payload))
            elif opcode == OP_BINARY:
                t.events.append(msgpack.unpackb(payload))
            elif opcode == OP_PONG:
                t.pongs.append(payload)
            elif opcode == OP_CLOSE:
                t.close_code = int.from_bytes(payload[:2], "big") if payload else 1005
                # Answer the close handshake so the server need not wait for us.
                await self.send(ws_frame(OP_CLOSE, payload[:2], rng=self.rng))
                self.abort()
                t.eof = True
        return t

    def abort(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        with contextlib.suppress(Exception):
            self.writer.transport.abort()

    async def probe(self, timeout: float = 5) -> dict[str, Any]:
        """Ask something and return the reply: the connection still answers."""
        event_id = f"probe-{self.rng.randrange(1 << 30)}"
        await self.send(
            text_event(
                {"type": "conversation.item.retrieve", "item_id": "no-such", "event_id": event_id},
                self.rng,
            )
        )
        t = await self.read(timeout, until=lambda t: bool(t.errors_for(event_id)))
        replies = t.errors_for(event_id)
        assert replies, f"no reply to the probe; close={t.close_code} eof={t.eof}"
        return replies[0]


@dataclass
class Healthy:
    """A well-behaved client beside the fuzzer."""

    tw: Client
    answers: int = 0
    longest_ask_s: float = 0.0


@contextlib.asynccontextmanager
async def healthy_beside(server: RunningServer) -> AsyncIterator[Healthy]:
    """A session streams a long answer and keeps asking while the fuzzer runs;
    every answer must be complete and exact."""
    tw = await asyncio.wait_for(connect(server.url, protocol="json"), 5)
    healthy = Healthy(tw)
    side = await tw.create_response(
        conversation="none",
        input=[{"type": "message", "role": "user", "content": "stream"}],
        ignore_eos=True,
        max_output_tokens=STREAM_TOKENS,
    )
    stop = asyncio.Event()

    async def ask_loop() -> None:
        # One ask in the conversation, then out-of-band questions, so the
        # conversation never outgrows the fixture's 512-token context.
        assert await asyncio.wait_for(tw.ask("hello"), 10) == "You said: hello"
        healthy.answers += 1
        i = 0
        while not stop.is_set() or healthy.answers < 2:
            started = time.monotonic()
            response = await asyncio.wait_for(
                tw.create_response(
                    conversation="none",
                    input=[{"type": "message", "role": "user", "content": f"hello {i}"}],
                ),
                10,
            )
            assert await asyncio.wait_for(response.text(), 10) == f"You said: hello {i}"
            healthy.longest_ask_s = max(healthy.longest_ask_s, time.monotonic() - started)
            healthy.answers += 1
            i += 1
            await asyncio.sleep(0.05)  # well under the server's per-connection event rate

    asker = asyncio.create_task(ask_loop())
    try:
        yield healthy
        stop.set()
        await asyncio.wait_for(asker, 20)
        text = await asyncio.wait_for(side.text(), 20)
        assert text == "".join(f" t{i}" for i in range(STREAM_TOKENS))
        assert (await side.done())["status"] == "completed"
    finally:
        asker.cancel()
        with contextlib.suppress(BaseException):
            await asker
        await tw.close()


async def assert_server_healthy(server: RunningServer) -> None:
    """After fuzzing: /healthz answers, a new session works, nothing leaked."""
    status, body = await asyncio.to_thread(http_json, server.http + "/healthz")
    assert status == 200 and body["status"] == "ok"
    async with await asyncio.wait_for(connect(server.url), 5) as tw:
        assert await asyncio.wait_for(tw.ask("hello"), 10) == "You said: hello"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not server.server.connections and server.server.engine.load().running == 0:
            break
        await asyncio.sleep(0.05)
    assert not server.server.connections, "connections were left open after the fuzzers went"
    assert server.server.engine.load().running == 0, "generations were left running"


async def fuzz_beside(server: RunningServer, fuzz: Callable[[], Awaitable[Any]]) -> Healthy:
    async with healthy_beside(server) as healthy:
        await asyncio.wait_for(fuzz(), 60)
    # Answers take ~10 ms; seconds would mean the fuzzer stalled the server
    # (a busy machine adds a second or two at most).
    assert healthy.longest_ask_s < 5, f"an answer beside the fuzzer took {healthy.longest_ask_s} s"
    await assert_server_healthy(server)
    return healthy


def budget(count: int, seconds: float) -> Callable[[], bool]:
    """True while both the iteration count and the time budget last."""
    deadline = time.monotonic() + seconds
    left = [count]

    def more() -> bool:
        left[0] -= 1
        return left[0] >= 0 and time.monotonic() < deadline

    return more


# -- (a) garbage instead of, or inside, the handshake ---------------------------


async def test_socket_garbage_instead_of_handshake(scripted: RunningServer) -> None:
    kinds = ["random", "before", "prefix", "headers", "truncated", "binary_line"]

    async def one(i: int) -> None:
        rng = random.Random(SEED * 1000 + i)
        raw = await RawWS.open(scripted, rng, handshake=False)
        valid = raw.handshake_request(scripted)
        kind = kinds[i % len(kinds)]
        if kind == "random":
            data = rng.randbytes(rng.randrange(1, 2048))
        elif kind == "before":
            data = rng.randbytes(rng.randrange(1, 256)) + valid
        elif kind == "prefix":
            data = b"GET /v1/realtime HTTP/1.1\r\n" + rng.randbytes(rng.randrange(1, 512))
        elif kind == "headers":
            cut = rng.randrange(len(valid))
            data = valid[:cut] + rng.randbytes(rng.randrange(1, 64)) + valid[cut:]
        elif kind == "truncated":
            data = valid[: rng.randrange(len(valid))]
        else:
            data = b"GET /" + rng.randbytes(rng.randrange(1, 64)) + b" HTTP/1.1\r\n\r\n"
        await raw.send(data)
        if kind == "truncated":
            with contextlib.suppress(OSError):
                raw.writer.write_eof()
        try:
            head = await asyncio.wait_for(raw.reader.read(4096), 2)
        except (TimeoutError, ConnectionError):
            head = b""  # still waiting for the end of the request, or reset: both fine
        raw.abort()
        if head:
            status = head.split(b"\r\n", 1)[0]
            # Refused (4xx), or upgraded if the mutation left the request valid;
            # never a crash (5xx).
            assert status[:9] == b"HTTP/1.1 " and status[9:10] in (b"1", b"4"), (
                kind,
                data[:80],
                status,
            )

    await fuzz_beside(scripted, lambda: asyncio.gather(*(one(i) for i in range(60))))


async def test_socket_http_paths_never_500(scripted: RunningServer) -> None:
    """Fuzzed request paths get 404, not an exception from a static route."""
    rng = random.Random(SEED)
    paths = [
        b"/static/\x00x",
        b"/static/" + b"a" * 300,
        b"/vendor/msgpack/" + b"b" * 300,
        b"/static/../../etc/passwd",
        b"/client/%00",
        b"/healthz?" + b"q" * 2000,
    ]
    for path in paths:
        raw = await RawWS.open(scripted, rng, handshake=False)
        await raw.send(b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await asyncio.wait_for(raw.reader.read(4096), 5)
        raw.abort()
        status = head.split(b"\r\n", 1)[0]
        assert not status.startswith(b"HTTP/1.1 5"), (path[:40], status)
    await assert_server_healthy(scripted)


# -- (b) a valid handshake, then random bytes ----------------------------------------


async def test_socket_random_bytes_after_handshake(scripted: RunningServer) -> None:
    async def one(i: int) -> None:
        rng = random.Random(SEED * 1000 + 100 + i)
        raw = await RawWS.open(scripted, rng)
        if i % 2:
            # Raw noise: reserved bits, bad opcodes, lengths that lie.
            data = rng.randbytes(rng.randrange(1, 4096))
        else:
            # Well-formed masked frames whose payloads are noise: bytes in
            # binary frames, UTF-8 text (JSON-ish characters) in text frames.
            frames = []
            for _ in range(rng.randrange(1, 8)):
                if rng.random() < 0.5:
                    payload = rng.randbytes(rng.randrange(300))
                    frames.append(ws_frame(OP_BINARY, payload, rng=rng))
                else:
                    text = "".join(
                        rng.choice('{}[]":,0123456789.eE-+ tfnrulasé😀\\')
                        for _ in range(rng.randrange(300))
                    )
                    frames.append(ws_frame(OP_TEXT, text.encode(), rng=rng))
            data = b"".join(frames)
        raw.transcript.echoed = client_close_codes(data)
        await raw.send(data)
        t = await raw.read(1.5)
        t.check()
        if i % 2 == 0:
            # Noise inside valid frames: one error per frame, and still open.
            assert not t.eof and t.close_code is None, (t.close_code, data[:40])
            await raw.probe()
            t.check()
        raw.abort()

    await fuzz_beside(scripted, lambda: asyncio.gather(*(one(i) for i in range(40))))


async def test_socket_noise_payloads_get_errors_and_keep_the_connection(
    scripted: RunningServer,
) -> None:
    """Binary noise inside valid frames is malformed_frame (or a bad event), one
    error each, and the connection stays open."""
    rng = random.Random(SEED + 2)

    async def fuzz() -> None:
        raw = await RawWS.open(scripted, rng)
        frames = [msgpack.packb(rng.randbytes(8))[:-1]] + [
            rng.randbytes(rng.randrange(1, 200)) for _ in range(30)
        ]
        for payload in frames:
            await raw.send(ws_frame(OP_BINARY, payload, rng=rng))
        t = await raw.read(5, until=lambda t: len(t.events) >= 1 + len(frames))
        t.check()
        assert t.close_code is None and not t.eof
        assert len(t.events) == 1 + len(frames), [e["type"] for e in t.events]
        assert all(e["type"] == "error" for e in t.events[1:])
        await raw.probe()
        raw.abort()

    await fuzz_beside(scripted, fuzz)


# -- (c) truncated frames ---------------------------------------------------------


async def test_socket_truncated_frames(scripted: RunningServer) -> None:
    """The header announces N bytes, fewer come, then the client half-closes or
    vanishes. The server drops the connection and nothing is left behind."""

    async def one(i: int) -> None:
        rng = random.Random(SEED * 1000 + 200 + i)
        raw = await RawWS.open(scripted, rng)
        payload = json.dumps({"type": "session.update", "session": {}}).encode()
        payload += b" " * rng.choice([0, 10, 200, 5000, 70_000])
        frame = ws_frame(
            rng.choice([OP_TEXT, OP_BINARY, OP_PING]),
            payload[:125] if i % 5 == 0 else payload,
            rng=rng,
        )
        await raw.send(frame[: rng.randrange(1, len(frame))])
        if i % 2:
            with contextlib.suppress(OSError):
                raw.writer.write_eof()
            t = await raw.read(5)
            t.check()
            assert t.eof, "the server kept a half-closed, truncated connection open"
        raw.abort()

    await fuzz_beside(scripted, lambda: asyncio.gather(*(one(i) for i in range(40))))


def fragments(payload: bytes, rng: random.Random, pieces: int) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(payload)), min(pieces - 1, len(payload) - 1)))
    return [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]


async def test_socket_fragmented_messages_reassemble(scripted: RunningServer) -> None:
    """Fragmented text (split inside multi-byte characters) and binary messages,
    with pings between the fragments, are reassembled and answered."""
    rng = random.Random(SEED + 4)

    async def fuzz() -> None:
        raw = await RawWS.open(scripted, rng)
        expected: list[str] = []
        pings: list[bytes] = []
        more = budget(25, 10)
        i = 0
        while more():
            event_id = f"frag-{i}"
            content = f"héllo 😀 wörld {i} " + "ü" * rng.randrange(0, 50)
            event = {
                "type": "conversation.item.create",
                "event_id": event_id,
                "item": {"type": "message", "role": "user", "content": content},
            }
            binary = rng.random() < 0.5
            payload = (
                msgpack.packb(event) if binary else json.dumps(event, ensure_ascii=False).encode()
            )
            parts = fragments(payload, rng, rng.randrange(2, 12))
            out = []
            for n, part in enumerate(parts):
                opcode = (OP_BINARY if binary else OP_TEXT) if n == 0 else OP_CONT
                out.append(ws_frame(opcode, part, rng=rng, fin=n == len(parts) - 1))
                if rng.random() < 0.3 and n < len(parts) - 1:
                    ping = rng.randbytes(rng.randrange(0, 125))
                    pings.append(ping)
                    out.append(ws_frame(OP_PING, ping, rng=rng))
            await raw.send(b"".join(out))
            expected.append(event_id)
            i += 1
        t = await raw.read(
            10,
            until=lambda t: (
                {e.get("event_id") for e in t.events} >= set(expected)
                and len(t.pongs) >= len(pings)
            ),
        )
        t.check()
        created = [e for e in t.events if e["type"] == "conversation.item.created"]
        assert [e["event_id"] for e in created] == expected
        assert all("héllo 😀 wörld" in e["item"]["content"] for e in created)
        assert t.pongs == pings
        raw.abort()

    await fuzz_beside(scripted, fuzz)


@pytest.mark.parametrize(
    "case",
    ["continuation_without_start", "data_frame_inside_fragmented", "fragmented_ping", "long_ping"],
)
async def test_socket_bad_fragmentation_is_a_protocol_error(
    scripted: RunningServer, case: str
) -> None:
    rng = random.Random(SEED + 5)

    async def fuzz() -> None:
        raw = await RawWS.open(scripted, rng)
        if case == "continuation_without_start":
            data = ws_frame(OP_CONT, b'{"type": "x"}', rng=rng)
        elif case == "data_frame_inside_fragmented":
            data = ws_frame(OP_TEXT, b'{"type": ', rng=rng, fin=False) + ws_frame(
                OP_TEXT, b'"x"}', rng=rng
            )
        elif case == "fragmented_ping":
            data = ws_frame(OP_PING, b"abc", rng=rng, fin=False)
        else:
            data = ws_frame(OP_PING, b"p" * 126, rng=rng)  # control frames are <= 125
        await raw.send(data)
        t = await raw.read(5)
        t.check()
        assert t.close_code == 1002, t.close_code
        assert [e["type"] for e in t.events] == ["session.created"]

    await fuzz_beside(scripted, fuzz)


# -- (e) invalid UTF-8 ------------------------------------------------------------------

INVALID_UTF8 = [
    b"\xff",
    b"\xc0\xaf",  # overlong
    b"\xed\xa0\x80",  # an encoded surrogate
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xe2\x82",  # truncated sequence
]


async def test_socket_invalid_utf8_text_frames(scripted: RunningServer) -> None:
    """A text frame that is not UTF-8 closes with 1007 (or gets malformed_frame);
    never a server failure. The same bytes in a binary frame are malformed msgpack
    strings: an error, and the connection stays open."""
    rng = random.Random(SEED + 6)

    async def fuzz() -> None:
        for bad in INVALID_UTF8:
            raw = await RawWS.open(scripted, rng)
            payload = b'{"type": "session.update", "event_id": "' + bad + b'"}'
            if rng.random() < 0.5:
                # Split so the bad bytes straddle a fragment boundary.
                cut = payload.index(bad) + 1
                data = ws_frame(OP_TEXT, payload[:cut], rng=rng, fin=False) + ws_frame(
                    OP_CONT, payload[cut:], rng=rng
                )
            else:
                data = ws_frame(OP_TEXT, payload, rng=rng)
            await raw.send(data)
            t = await raw.read(5, until=lambda t: len(t.events) > 1)
            t.check()
            assert t.close_code == 1007 or [e["error"]["code"] for e in t.events[1:]] == [
                "malformed_frame"
            ], (bad, t.close_code, t.events)
            raw.abort()

            raw = await RawWS.open(scripted, rng)
            fixstr = bytes([0xA0 | len(bad)]) + bad  # a msgpack str holding the bad bytes
            await raw.send(ws_frame(OP_BINARY, b"\x81\xa4type" + fixstr, rng=rng))  # {"type": …}
            await raw.send(ws_frame(OP_BINARY, fixstr, rng=rng))
            t = await raw.read(5, until=lambda t: len(t.events) >= 3)
            t.check()
            assert [e["error"]["code"] for e in t.events[1:]] == ["malformed_frame"] * 2
            await raw.probe()
            raw.abort()

    await fuzz_beside(scripted, fuzz)


@pytest.mark.parametrize(
    "frame",
    [
        # A lone surrogate as a JSON escape: valid UTF-8 on the wire, not valid text.
        '{"type": "no.such.type", "event_id": "\\ud800"}',
        '{"type": "conversation.item.create", "item": '
        '{"type": "message", "role": "user", "content": "\\udfff"}}',
        '{"type": "session.update", "session": {"instructions": "\\ud83d"}}',
    ],
    ids=["echoed_event_id", "item_content", "echoed_instructions"],
)
async def test_socket_json_lone_surrogate_keeps_connection(
    scripted: RunningServer, frame: str
) -> None:
    """docs/protocol.md §9: bad input gets an error and the connection stays open."""
    rng = random.Random(SEED + 7)

    async def fuzz() -> None:
        raw = await RawWS.open(scripted, rng)
        await raw.send(ws_frame(OP_TEXT, frame.encode(), rng=rng))
        t = await raw.read(2, until=lambda t: len(t.events) > 1)
        t.check()
        assert t.close_code is None and not t.eof, f"closed with {t.close_code}"
        await raw.probe()
        raw.abort()

    await fuzz_beside(scripted, fuzz)


# -- (f) masking -----------------------------------------------------------------------


async def test_socket_unmasked_and_reserved_bits(scripted: RunningServer) -> None:
    """Client frames must be masked (RFC 6455 §5.1); RSV bits need an extension."""
    rng = random.Random(SEED + 8)

    async def fuzz() -> None:
        event = {"type": "conversation.item.retrieve", "item_id": "x", "event_id": "m"}
        cases = [
            text_event(event, rng, masked=False),
            ws_frame(OP_BINARY, msgpack.packb(event), rng=rng, masked=False),
            ws_frame(OP_PING, b"unmasked", rng=rng, masked=False),
            text_event(event, rng, fin=False) + text_event(event, rng, masked=False),
            text_event(event, rng, rsv=rng.choice([1, 2, 4])),
            ws_frame(rng.choice([3, 4, 5, 6, 7, 11, 15]), b"x", rng=rng),
        ]
        for data in cases:
            raw = await RawWS.open(scripted, rng)
            await raw.send(data)
            t = await raw.read(5)
            t.check()
            assert t.close_code == 1002, (data[:20], t.close_code)
            assert not t.errors_for("m"), "an unmasked frame was processed"

        # A masked frame with an all-zero key is still masked: it is answered.
        raw = await RawWS.open(scripted, rng)
        await raw.send(bytes([0x81, 0x80 | 17]) + b"\x00\x00\x00\x00" + b'{"type": "nope"} ')
        t = await raw.read(5, until=lambda t: len(t.events) > 1)
        t.check()
        assert t.events[1]["error"]["code"] == "unknown_event_type"
        raw.abort()

    await fuzz_beside(scripted, fuzz)


# -- (g) floods -------------------------------------------------------------------------


def flood_event(rng: random.Random, i: int) -> bytes:
    choice = rng.randrange(8)
    event: Any
    if choice == 0:
        event = {"type": "conversation.item.retrieve", "item_id": f"i{i}", "event_id": f"f{i}"}
    elif choice == 1:
        event = {"type": "session.update", "session": {"temperature": 0.5}, "event_id": f"f{i}"}
    elif choice == 2:
        event = {
            "type": "response.create",
            "event_id": f"f{i}",
            "response": {
                "conversation": "none",
                "input": [{"type": "message", "role": "user", "content": "x"}],
                "max_output_tokens": 3,
                "ignore_eos": True,
            },
        }
    elif choice == 3:
        event = {"type": "response.cancel", "event_id": f"f{i}"}
    elif choice == 4:
        event = {"type": rng.choice(TYPE_NAMES), "event_id": f"f{i}", "junk": i}
    elif choice == 5:
        return ws_frame(OP_TEXT, b"{not json", rng=rng)
    elif choice == 6:
        return ws_frame(OP_BINARY, rng.randbytes(rng.randrange(1, 16)), rng=rng)
    else:
        event = [i]
    return text_event(event, rng)


async def test_socket_flood_without_reading(scripted: RunningServer) -> None:
    """Thousands of small valid and invalid events, sent without reading. The
    healthy session keeps its answers; the flooder's stream, once read, is
    complete (seq without gaps) or ends with a slow-client close."""
    rng = random.Random(SEED + 9)

    async def fuzz() -> None:
        raws = [await RawWS.open(scripted, rng) for _ in range(3)]
        sent = [0] * len(raws)
        more = budget(600, 15)  # batches of 10 events; time for a busy machine
        i = 0
        while more():
            k = i % len(raws)
            batch = b"".join(flood_event(rng, i * 10 + j) for j in range(10))
            try:
                raws[k].writer.write(batch)
                await asyncio.wait_for(raws[k].writer.drain(), 0.5)
            except TimeoutError:
                pass  # the server stopped reading: upstream backpressure at work
            except ConnectionError:
                break
            sent[k] += 10
            i += 1
        assert sum(sent) >= 1000, f"only {sum(sent)} events sent"
        for raw in raws:
            t = await raw.read(10, idle=0.5)
            t.check()
            assert len(t.events) > 1, "the flooder got no reply at all"
            if t.close_code is None:
                # In order after the whole flood: its reply means every frame
                # sent was read and answered, with seq still gapless.
                await raw.probe(timeout=10)
                t.check()
            else:
                assert t.close_code in (1008, 4008), t.close_code  # policy / slow client
            raw.abort()

    healthy = await fuzz_beside(scripted, fuzz)
    assert healthy.answers >= 2


async def test_socket_flood_of_pings_and_oversized_frames(scripted: RunningServer) -> None:
    """Control-frame floods and messages over max_message_bytes: pings are
    answered, oversized messages close with 1009, the server stays up."""
    rng = random.Random(SEED + 10)

    async def fuzz() -> None:
        raw = await RawWS.open(scripted, rng)
        pings = [rng.randbytes(8) for _ in range(2000)]
        await raw.send(b"".join(ws_frame(OP_PING, p, rng=rng) for p in pings))
        t = await raw.read(10, until=lambda t: len(t.pongs) >= len(pings))
        t.check()
        assert t.pongs == pings
        await raw.probe()
        raw.abort()

        limit = 64 * 1024
        for size in (limit + 1, 1 << 20, 1 << 62):
            raw = await RawWS.open(scripted, rng)
            head = ws_frame(OP_TEXT, b"", rng=rng, declared=size)
            await raw.send(head + b"x" * min(size, 128 * 1024))
            t = await raw.read(5)
            t.check()
            assert t.close_code == 1009, (size, t.close_code)
        # The same limit split over fragments.
        raw = await RawWS.open(scripted, rng)
        chunk = b"y" * 16 * 1024
        data = ws_frame(OP_TEXT, chunk, rng=rng, fin=False) + b"".join(
            ws_frame(OP_CONT, chunk, rng=rng, fin=False) for _ in range(5)
        )
        await raw.send(data)
        t = await raw.read(5)
        t.check()
        assert t.close_code == 1009, t.close_code

    await fuzz_beside(scripted, fuzz)


# -- bugs the fuzzers led to, as end-to-end checks --------------------------------------


async def test_socket_bigint_echo_keeps_msgpack_connection(scripted: RunningServer) -> None:
    """A JSON text frame may carry integers msgpack cannot hold. On a msgpack
    connection the echo (`session.updated`) must not kill the writer: the
    connection must still answer."""
    async with await connect(scripted.url, protocol="msgpack") as tw:
        await tw.send_raw(
            json.dumps(
                {"type": "session.update", "session": {"max_output_tokens": 2**70}, "event_id": "b"}
            )
        )
        try:
            answer = await asyncio.wait_for(tw.ask("still here"), 3)
        except TimeoutError:
            pytest.fail("no reply in 3 s: the connection stopped sending after the echo")
        assert answer == "You said: still here"


async def test_socket_unresolvable_schema_ref_does_not_hang_response(
    scripted: RunningServer,
) -> None:
    """A tool whose `parameters` has an unresolvable $ref: the forced call must
    end the response (failed, invalid_tool_arguments), not leave it in_progress
    forever with the conversation blocked."""
    async with await connect(scripted.url) as tw:
        try:
            await tw.update_session(
                tools=[{"name": "f", "parameters": {"$ref": "#/definitions/missing"}}]
            )
        except TokenwireError as exc:  # refusing the schema up front is a fix too
            assert exc.code == "invalid_field"
            assert await asyncio.wait_for(tw.ask("after"), 5) == "You said: after"
            return
        await tw.add_message("call it")
        response = await tw.create_response(tool_choice="required")
        try:
            done = await asyncio.wait_for(response.done(), 3)
        except TimeoutError:
            pytest.fail("the response never ended: it is stuck in_progress")
        assert done["status"] == "failed"
        assert done["status_details"]["error"]["code"] == "invalid_tool_arguments"
        assert await asyncio.wait_for(tw.ask("after"), 5) == "You said: after"


async def test_socket_tool_schema_pattern_cannot_stall_the_server(
    scripted: RunningServer,
) -> None:
    """A client's tool schema with a backtracking `pattern` must not block the
    event loop: the argument check runs inline, and `^(a+)+$` on 'aaa…b' is
    exponential. Another session's stream must keep flowing (gap < 3 s)."""
    n = 28  # ~8-20 s of backtracking here; each extra 'a' doubles it
    async with healthy_beside(scripted), await connect(scripted.url) as bad:
        try:
            await bad.update_session(
                tools=[
                    {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"q": {"type": "string", "pattern": "^(a+)+$"}},
                        },
                    }
                ]
            )
        except TokenwireError as exc:  # refusing such patterns up front is a fix too
            assert exc.code == "invalid_field"
            return
        await bad.add_message("a" * n + "b")
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async def checked() -> str:
            # The call is checked once generated: it fails the response, or (if
            # the pattern is not enforced here) the response waits for its output.
            async for event in response:
                if event["type"] in ("response.requires_action", "response.done"):
                    return event["type"]
            return "closed"

        tick = asyncio.create_task(ticker())
        try:
            response = await bad.create_response(tool_choice="required")
            outcome = await asyncio.wait_for(checked(), 30)
        finally:
            tick.cancel()
        assert outcome in ("response.requires_action", "response.done")
        assert max(gaps) < 3.0, f"the event loop was blocked for {max(gaps):.1f} s"
        await asyncio.wait_for(response.cancel(), 5)
