"""The encoders on the per-token path (msgspec) give what the protocol always
had: msgpack byte for byte as msgpack-python packs it, JSON byte for byte as
json.dumps(ensure_ascii=False, separators=(",", ":")) writes it, floats aside
(their exponent may be spelled differently; the number is the same)."""

from __future__ import annotations

import json
import math

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwire.wire.codec import encode_json, encode_msgpack, msgpack_encoder

# What events hold: strings (any text, non-ASCII and control characters too),
# 64-bit integers, booleans, null, lists and maps with string keys.
_SCALARS = (
    st.text()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.booleans()
    | st.none()
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)


def _json_reference(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), _VALUES, max_size=6))
def test_same_bytes_as_before(event: dict) -> None:
    assert encode_json(event) == _json_reference(event)
    assert encode_msgpack(event) == msgpack.packb(event, use_bin_type=True)
    assert msgpack_encoder()(event) == encode_msgpack(event)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FLOATS, max_size=8))
def test_floats_are_the_same_numbers(values: list[float]) -> None:
    assert encode_msgpack(values) == msgpack.packb(values, use_bin_type=True)
    decoded = json.loads(encode_json({"v": values}))["v"]
    assert decoded == values
    signs = [math.copysign(1, v) for v in values]
    assert [math.copysign(1, v) for v in decoded] == signs  # -0.0 stays -0.0


def test_a_delta_as_the_socket_gets_it() -> None:
    delta = {
        "type": "response.output_text.delta",
        "response_id": "resp_1",
        "item_id": "item_1",
        "delta": " héllo ✓\n\u2028\x00",
        "seq": 42,
    }
    assert encode_json(delta) == _json_reference(delta)
    assert encode_msgpack(delta) == msgpack.packb(delta, use_bin_type=True)
