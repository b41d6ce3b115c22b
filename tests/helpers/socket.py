"""A session runtime's socket without a network: a websockets server protocol
in the OPEN state over a transport that takes every write at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from websockets.protocol import State
from websockets.server import ServerProtocol


class RecordingTransport:
    """Takes everything at once (its write buffer stays empty); `written`
    holds each frame written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, data: list[bytes]) -> None:
        self.written.extend(data)


def open_socket() -> Any:
    """What `SessionRuntime.attach` takes of a websockets ServerConnection."""
    ws = SimpleNamespace(
        protocol=ServerProtocol(), transport=RecordingTransport(), remote_address=None
    )
    ws.protocol.state = State.OPEN
    return ws
