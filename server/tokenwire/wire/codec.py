"""Frames in and out: JSON text frames and msgpack binary frames."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from ..core.errors import ErrorCode, ProtocolError
from ..core.schema import check_values


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf - inf is NaN
        raise ValueError("NaN and infinities are not JSON")  # 1e400 overflows to one
    return value


# One decoder, not json.loads with keywords (a new decoder per call). Floats go
# through _finite: honest frames hold few, and only a float can overflow.
_JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)


def decode_frame(data: str | bytes) -> Any:
    """Text frames are JSON and binary frames msgpack, whatever was negotiated;
    every value is one both can send back (what `check_values` takes)."""
    try:
        if isinstance(data, str):
            obj = _JSON_DECODER.decode(data)
            # The rest of what `check_values` refuses, found in C: msgpack
            # encoding fails on exactly the integers beyond 64 bits and the lone
            # surrogates (JSON's keys are strings). The walk takes ~0.2 s on a
            # frame of 200k tiny values; a regex scan of the text, 75 ms per MiB.
            try:
                _MSGPACK.encode(obj)
            except OverflowError:
                raise ValueError("an integer does not fit in 64 bits") from None
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate") from None
        else:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
            # Only a float (0xca, 0xcb: NaN, infinity), bytes (0xc4-0xc6:
            # strict_map_key lets them be a key) or an ext value (0xc7-0xc9,
            # 0xd4-0xd8: ExtType, Timestamp) can be refused; integers fit 64
            # bits and strings are strict UTF-8. One memchr each, inline.
            if (
                b"\xca" in data
                or b"\xcb" in data
                or b"\xc4" in data
                or b"\xc5" in data
                or b"\xc6" in data
                or b"\xc7" in data
                or b"\xc8" in data
                or b"\xc9" in data
                or b"\xd4" in data
                or b"\xd5" in data
                or b"\xd6" in data
                or b"\xd7" in data
                or b"\xd8" in data
            ):
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
        why = "nested too deeply" if isinstance(exc, msgpack.StackError | RecursionError) else exc
        raise ProtocolError(
            ErrorCode.MALFORMED_FRAME, f"the frame is not valid {kind}: {why}"
        ) from None


# msgspec's encoders: about 5x (msgpack) and 15x (JSON) faster than
# msgpack.Packer and json.dumps on a delta, and the same bytes (msgpack) or
# the same JSON (floats may spell their exponent differently: 1e16, not 1e+16).
# One of each per process: they keep no state between calls.
_JSON = msgspec.json.Encoder()
_MSGPACK = msgspec.msgpack.Encoder()

# The bound methods themselves: no Python frame around them per token.
encode_json_bytes: Callable[[Any], bytes] = _JSON.encode
encode_msgpack: Callable[[Any], bytes] = _MSGPACK.encode


def encode_json(event: dict[str, Any]) -> str:
    """Compact JSON, non-ASCII as is (what json.dumps(ensure_ascii=False,
    separators=(",", ":")) gives)."""
    return _JSON.encode(event).decode()


def msgpack_encoder() -> Callable[[dict[str, Any]], bytes]:
    """The msgpack encoder (bin type for bytes, str for text)."""
    return encode_msgpack
