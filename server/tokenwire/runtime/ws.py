"""Waits on a websockets connection that the socket and delivery share, and
the server's data frames, framed here for the per-token path."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Sequence
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedError
from websockets.protocol import State

from .. import metrics
from ..core.errors import ErrorCode, error_event
from ..core.limits import TokenBucket
from ..wire import Dialect, Frame


async def unless_closed(ws: ServerConnection, awaitable: Awaitable[Any]) -> None:
    """Await `awaitable`, but stop waiting if the socket goes away."""
    waiter = asyncio.ensure_future(awaitable)
    closed = asyncio.ensure_future(ws.wait_closed())
    try:
        await asyncio.wait({waiter, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        closed.cancel()
    if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
        raise ConnectionClosedError(None, None) from waiter.exception()


# What a frame is charged at least: a flood of tiny frames costs the loop per
# frame (websockets, decoding, the session's dispatch: ~20 us), not per byte.
FRAME_MIN_CHARGE = 1024


def inbound_budget(bytes_per_s: float, max_message_bytes: int) -> TokenBucket | None:
    """A connection's budget of client bytes: `bytes_per_s`, in bursts of twice
    that or of one largest message, whichever is more; None: unlimited."""
    if bytes_per_s <= 0:
        return None
    return TokenBucket(bytes_per_s, max(2 * bytes_per_s, max_message_bytes))


async def pace_reading(ws: ServerConnection, budget: TokenBucket | None, frame: Frame) -> None:
    """Charge a client frame (characters of text, bytes of binary, at least
    FRAME_MIN_CHARGE) to its connection's budget; over it, read nothing more
    until the budget is paid back. Decoding and checking a frame cost the event
    loop up to ~0.15 s per MiB, so this bounds what one connection takes of it.
    Nothing is dropped: websockets stops reading the socket and TCP slows the
    client."""
    if budget is None:
        return
    budget.debit(max(len(frame), FRAME_MIN_CHARGE))
    if not budget.ready():
        metrics.INBOUND_PAUSES.inc()
        await unless_closed(ws, asyncio.sleep(budget.retry_after_s()))


async def wait_buffer_below(ws: ServerConnection, low: int) -> None:
    """Wait, without polling, until the socket's write buffer is at most `low`;
    ConnectionClosedError if the socket went away instead (an aborted socket
    empties its buffer too: that is no client that read it)."""
    transport = ws.transport
    if transport is not None and transport.get_write_buffer_size() > low:
        # Lowering the transport's limits pauses the protocol now and resumes
        # it once the buffer falls to `low`; websockets' drain() waits for that.
        limits = transport.get_write_buffer_limits()  # (low, high)
        transport.set_write_buffer_limits(high=low, low=low)
        try:
            await unless_closed(ws, ws.drain())
        finally:
            if not transport.is_closing():
                transport.set_write_buffer_limits(high=limits[1], low=limits[0])
    if transport is None or transport.is_closing() or ws.protocol.state is not State.OPEN:
        raise ConnectionClosedError(None, None)


def set_sndbuf(ws: ServerConnection, size: int) -> None:
    """The kernel's send buffer for this socket (small: backpressure shows sooner)."""
    sock = ws.transport.get_extra_info("socket") if ws.transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


async def close_or_abort(ws: ServerConnection, code: int, reason: str) -> None:
    """Close with a code the client can act on; drop the socket if the client
    does not answer within a second (often one that stopped reading)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code, reason), 1)
    if ws.transport is not None:
        ws.transport.abort()


# RFC 6455 section 5.2: FIN set, opcode text (1) or binary (2); a server's
# frames are not masked. Headers of payloads under 126 bytes (every delta),
# made once.
_TEXT = [bytes((0x81, n)) for n in range(126)]
_BINARY = [bytes((0x82, n)) for n in range(126)]


def data_frame(message: str | bytes) -> bytes:
    """One unfragmented, unmasked data frame: text for a str, binary for bytes,
    as websockets' `Protocol.send_text` and `send_binary` serialize it when no
    extension is negotiated, for about a sixth of their cost (a Frame object,
    its checks and a BytesIO per frame)."""
    if isinstance(message, bytes):
        payload, short, opcode = message, _BINARY, 0x82
    else:
        payload, short, opcode = message.encode(), _TEXT, 0x81
    n = len(payload)
    if n < 126:
        return short[n] + payload
    if n < 65536:
        return struct.pack("!BBH", opcode, 126, n) + payload
    return struct.pack("!BBQ", opcode, 127, n) + payload


def write_messages(ws: ServerConnection, messages: Sequence[Frame]) -> None:
    """Write whole messages to an open connection at once, in one write: what
    `ws.send` writes for each, without its wait for the buffer to drain."""
    transport, protocol = ws.transport, ws.protocol
    if protocol.extensions:  # one (compression) transforms frames: websockets frames them
        for message in messages:
            if isinstance(message, bytes):
                protocol.send_binary(message)
            else:
                protocol.send_text(message.encode())
        transport.writelines(protocol.data_to_send())
        return
    if protocol.writes:  # websockets writes its own frames at once: never, in practice
        transport.writelines(protocol.data_to_send())
    if len(messages) == 1:
        transport.write(data_frame(messages[0]))
    else:
        transport.writelines([data_frame(m) for m in messages])


async def fell_behind_the_log(ws: ServerConnection, dialect: Dialect, sent: int, got: int) -> None:
    """The log was trimmed past what this client was sent (`sent`; the oldest
    left is `got`): say which events are lost, with the seq the client
    expected, and close. A client cannot resume past a gap."""
    event = error_event(
        ErrorCode.RESUME_NOT_POSSIBLE,
        f"events {sent + 1}..{got - 1} are no longer kept; start a new session",
    )
    event["seq"] = sent + 1
    with contextlib.suppress(ConnectionClosed):
        for frame in dialect.frames(event):
            await ws.send(frame)
        await ws.close(1011, "fell behind the session's log")
