"""A session runtime's socket without a network: a websockets server protocol
in the OPEN state over a transport that takes every write at once; `close`
records its code."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from websockets.protocol import State
from websockets.server import ServerProtocol


class RecordingTransport:
    """Takes everything at once (its write buffer stays empty); `written`
    holds each frame written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, data: list[bytes]) -> None:
        self.written.extend(data)

    def abort(self) -> None:
        self.aborted = True


def open_socket() -> Any:
    """What `SessionRuntime.attach` takes of a websockets ServerConnection."""
    ws = SimpleNamespace(
        protocol=ServerProtocol(), transport=RecordingTransport(), remote_address=None
    )
    ws.protocol.state = State.OPEN
    ws.close_code = None

    async def close(code: int = 1000, reason: str = "") -> None:
        ws.close_code = code
        ws.protocol.state = State.CLOSED

    ws.close = close
    return ws


def sent_events(ws: Any) -> list[dict[str, Any]]:
    """The events written to an `open_socket()`: each write is whole
    unmasked text frames, as `runtime.ws.data_frame` makes them."""
    data = b"".join(ws.transport.written)
    events, i = [], 0
    while i < len(data):
        n, i = data[i + 1] & 0x7F, i + 2
        if n >= 126:
            size = 2 if n == 126 else 8
            n, i = int.from_bytes(data[i : i + size], "big"), i + size
        events.append(json.loads(data[i : i + n]))
        i += n
    return events


def types_sent(ws: Any) -> list[str]:
    return [e["type"] for e in sent_events(ws)]
