"""Frames in and out: JSON text frames and msgpack binary frames."""

from __future__ import annotations

import json
from typing import Any

import msgpack

from ..core.errors import ErrorCode, ProtocolError
from ..core.schema import check_values


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_frame(data: str | bytes) -> Any:
    """Text frames are JSON and binary frames msgpack, whatever was negotiated."""
    try:
        if isinstance(data, str):
            obj = json.loads(data, parse_constant=_reject_constant)
        else:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        check_values(obj)
        return obj
    except (
        ValueError,
        TypeError,
        RecursionError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        kind = "JSON" if isinstance(data, str) else "msgpack"
        raise ProtocolError(
            ErrorCode.MALFORMED_FRAME, f"the frame is not valid {kind}: {exc}"
        ) from None


def encode_json(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


class MsgpackEncoder:
    """One reusable packer: msgpack's own buffer, not a new one per event."""

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)

    def __call__(self, event: dict[str, Any]) -> bytes:
        return self._packer.pack(event)
