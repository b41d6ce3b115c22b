"""Two waits on a websockets connection that the socket and delivery share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosedError


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


async def close_or_abort(ws: ServerConnection, code: int, reason: str) -> None:
    """Close with a code the client can act on; drop the socket if the client
    does not answer within a second (often one that stopped reading)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code, reason), 1)
    if ws.transport is not None:
        ws.transport.abort()
