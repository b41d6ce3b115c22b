"""tokenwire protocol v1: the core's internal events, as they are, in JSON
text frames (`tokenwire.v1.json`) or msgpack binary frames
(`tokenwire.v1.msgpack`). docs/protocol.md is its specification."""

from __future__ import annotations

from typing import Any

from .codec import decode_frame, encode_json, msgpack_encoder
from .dialect import Frame, ToolFlow

SUBPROTOCOL_JSON = "tokenwire.v1.json"
SUBPROTOCOL_MSGPACK = "tokenwire.v1.msgpack"
SUBPROTOCOLS = (SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON)


class TokenwireV1:
    """One socket's v1 dialect; JSON unless msgpack was negotiated."""

    name = "tokenwire.v1"
    single_frame = True
    tool_flow = ToolFlow.CONTINUE
    resumable = True

    def __init__(self, subprotocol: str | None = None) -> None:
        self.subprotocol = subprotocol or SUBPROTOCOL_JSON
        self.binary = self.subprotocol == SUBPROTOCOL_MSGPACK
        self.encode = msgpack_encoder() if self.binary else encode_json

    @staticmethod
    def parse(frame: str | bytes) -> Any:
        return decode_frame(frame)

    def frames(self, event: dict[str, Any]) -> list[Frame]:
        return [self.encode(event)]

    def from_logged(self, frame: Frame) -> list[Frame]:
        if isinstance(frame, bytes) == self.binary:
            return [frame]
        return [self.encode(decode_frame(frame))]


class TokenwireV1Family:
    subprotocols = SUBPROTOCOLS

    @staticmethod
    def for_subprotocol(subprotocol: str | None) -> TokenwireV1:
        return TokenwireV1(subprotocol)
