"""Frames in and out: JSON text frames and msgpack binary frames."""

from __future__ import annotations

import json
from collections.abc import Callable
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


def msgpack_encoder() -> Callable[[dict[str, Any]], bytes]:
    """One reusable packer's bound `pack`: msgpack's own buffer, not a new one
    per event, and no Python frame around it on the per-token path."""
    return msgpack.Packer(use_bin_type=True).pack
