"""Frames the per-token path writes itself: the bytes websockets would have
written for the same message, in the same order with its own frames."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from tokenwire.runtime.ws import data_frame, write_messages


def websockets_frame(message: str | bytes) -> bytes:
    if isinstance(message, bytes):
        return Frame(Opcode.BINARY, message).serialize(mask=False)
    return Frame(Opcode.TEXT, message.encode()).serialize(mask=False)


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 70000])
@pytest.mark.parametrize("binary", [False, True])
def test_same_bytes_as_websockets(size: int, binary: bool) -> None:
    message: str | bytes = b"\x93" * size if binary else "é" * (size // 2) + "x" * (size % 2)
    assert data_frame(message) == websockets_frame(message)


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, chunks: Any) -> None:
        self.written.append(b"".join(chunks))


class _Connection:
    def __init__(self, extensions: list[Any] | None = None) -> None:
        self.protocol = ServerProtocol()
        self.protocol.state = State.OPEN
        self.protocol.extensions = extensions or []
        self.transport = _Transport()


def test_writes_in_order_after_what_websockets_holds() -> None:
    ws = _Connection()
    ws.protocol.send_ping(b"p")  # a frame of websockets' own, not flushed yet
    write_messages(ws, ["a", b"b"])  # type: ignore[arg-type]
    ping = Frame(Opcode.PING, b"p").serialize(mask=False)
    assert b"".join(ws.transport.written) == ping + data_frame("a") + data_frame(b"b")
    assert ws.protocol.data_to_send() == []


def test_a_negotiated_extension_frames_through_websockets() -> None:
    deflate = PerMessageDeflate(False, False, 15, 15)
    ws, plain = _Connection([deflate]), _Connection([PerMessageDeflate(False, False, 15, 15)])
    write_messages(ws, ["hello hello hello"])  # type: ignore[arg-type]
    plain.protocol.send_text(b"hello hello hello")
    assert ws.transport.written == [b"".join(plain.protocol.data_to_send())]
    assert ws.transport.written[0] != data_frame("hello hello hello")  # compressed
