"""Codec and validation: every bad input maps to a stable code."""

from __future__ import annotations

import json

import msgpack
import pytest

from tokenwire.core.errors import ErrorCode, ProtocolError
from tokenwire.core.schema import ResponseCreate, parse_client_event
from tokenwire.wire.codec import decode_frame
from tokenwire.wire.tokenwire_v1 import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK
from tokenwire.wire.tokenwire_v1 import TokenwireV1 as Codec


def code_of(obj: object) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        parse_client_event(obj)
    return info.value.code


def test_codec_roundtrip_both_subprotocols() -> None:
    event = {"type": "response.output_text.delta", "delta": "héllo ✓", "seq": 7}
    for sub, kind in ((SUBPROTOCOL_JSON, str), (SUBPROTOCOL_MSGPACK, bytes)):
        frame = Codec(sub).encode(event)
        assert isinstance(frame, kind)
        assert decode_frame(frame) == event


def test_no_subprotocol_means_json() -> None:
    assert Codec(None).subprotocol == SUBPROTOCOL_JSON
    assert isinstance(Codec(None).encode({"type": "x"}), str)


@pytest.mark.parametrize("frame", ["{nope", "", "[1,", b"\xc1", b"\x92\x01", b"\xa3ab"])
def test_malformed_frames(frame: str | bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame)
    assert info.value.code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "frame", ["[" * 100_000 + "]" * 100_000, b"\x91" * 100_000 + b"\x90"], ids=["json", "msgpack"]
)
def test_deep_nesting_is_malformed_not_a_crash(frame: str | bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame)
    assert info.value.code is ErrorCode.MALFORMED_FRAME
    assert info.value.message.endswith("nested too deeply")


def test_msgpack_bytes_map_keys_and_values_are_malformed() -> None:
    """strict_map_key lets bytes keys through; the protocol's keys are strings,
    and its values JSON's."""
    frame = msgpack.packb({"type": "response.cancel", b"x": 1}, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame)
    assert info.value.code is ErrorCode.MALFORMED_FRAME
    assert "map keys must be strings" in info.value.message
    frame = msgpack.packb({"type": "response.steer", "input": b"hi"}, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame)
    assert "a msgpack bin value is not JSON" in info.value.message
    for value in (msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0)):
        frame = msgpack.packb({"type": "response.steer", "input": value}, use_bin_type=True)
        with pytest.raises(ProtocolError) as info:
            decode_frame(frame)
        assert "is not JSON" in info.value.message
    # Text with bytes 0xc4-0xc6 in it (Polish, Turkish) is still fine.
    ok = {"type": "response.steer", "input": "zażółć gęślą jaźń, İstanbul"}
    assert decode_frame(msgpack.packb(ok, use_bin_type=True)) == ok


def test_msgpack_invalid_utf8_string_is_malformed() -> None:
    with pytest.raises(ProtocolError):
        decode_frame(b"\x81\xa4type\xa2\xff\xfe")


def test_not_a_map() -> None:
    for obj in ([1, 2], "x", 3, None):
        assert code_of(obj) is ErrorCode.INVALID_EVENT


def test_type_missing_or_unknown() -> None:
    assert code_of({"event_id": "e"}) is ErrorCode.INVALID_EVENT
    assert code_of({"type": 5}) is ErrorCode.INVALID_EVENT
    assert code_of({"type": "response.explode"}) is ErrorCode.UNKNOWN_EVENT_TYPE


def test_event_id_is_echoed_on_errors() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_event({"type": "nope", "event_id": "abc"})
    assert info.value.to_event()["error"]["event_id"] == "abc"


def test_missing_wrong_typed_and_unknown_fields() -> None:
    assert code_of({"type": "conversation.item.create"}) is ErrorCode.MISSING_FIELD
    item = {"type": "message", "role": "user", "content": 5}
    assert code_of({"type": "conversation.item.create", "item": item}) is ErrorCode.INVALID_FIELD
    bad_role = {"type": "message", "role": "wizard", "content": "x"}
    assert (
        code_of({"type": "conversation.item.create", "item": bad_role}) is ErrorCode.INVALID_FIELD
    )
    assert code_of({"type": "response.create", "response": {"temperature": "hot"}}) is (
        ErrorCode.INVALID_FIELD
    )
    assert code_of({"type": "response.create", "response": {"temperature": 9}}) is (
        ErrorCode.INVALID_FIELD
    )
    assert code_of({"type": "response.create", "bogus": 1}) is ErrorCode.UNKNOWN_FIELD
    # Strict: no silent coercion of strings into numbers.
    assert code_of({"type": "response.create", "response": {"max_output_tokens": "5"}}) is (
        ErrorCode.INVALID_FIELD
    )


def test_error_param_names_the_field() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_event({"type": "response.create", "response": {"temperature": "x"}})
    assert info.value.param == "response.temperature"


def test_valid_events_parse() -> None:
    ev = parse_client_event(
        {
            "type": "response.create",
            "event_id": "e1",
            "response": {"temperature": 0, "max_output_tokens": 8},
        }
    )
    assert isinstance(ev, ResponseCreate)
    assert ev.response.temperature == 0 and ev.response.conversation == "auto"
    raw = msgpack.packb({"type": "response.cancel"})
    assert parse_client_event(decode_frame(raw)).type == "response.cancel"
    assert parse_client_event(json.loads('{"type":"session.update","session":{}}'))
