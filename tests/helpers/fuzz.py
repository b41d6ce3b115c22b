"""What the fuzzers share: their hypothesis settings, the session they feed,
and the checks every server event must pass."""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings

from tokenwire.core.errors import ErrorCode, ProtocolError
from tokenwire.core.events import Action
from tokenwire.core.schema import CLIENT_EVENT_TYPES, parse_client_event
from tokenwire.core.session import Session, SessionLimits
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.wire.tokenwire_v1 import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK
from tokenwire.wire.tokenwire_v1 import TokenwireV1 as Codec

from .session import Event, drive

CODES = {c.value for c in ErrorCode}
JSON_CODEC = Codec(SUBPROTOCOL_JSON)
MSGPACK_CODEC = Codec(SUBPROTOCOL_MSGPACK)
# Reproducible by default: the same examples on every run. For a longer,
# randomised hunt: TOKENWIRE_FUZZ_EXAMPLES=5000 pytest \
#   tests/wire/test_fuzz_decode.py tests/core/test_fuzz_session.py
LONG_RUN = int(os.environ.get("TOKENWIRE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    deadline=None,
    max_examples=LONG_RUN or 200,
    derandomize=not LONG_RUN,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def assert_wire_safe(event: Any) -> None:
    """A server event: a map with a string `type` that the server's own codecs
    turn into a frame: UTF-8 text that strict JSON parsers read (no NaN or
    Infinity: browsers' JSON.parse rejects them), and msgpack."""
    assert isinstance(event, dict), event
    assert isinstance(event.get("type"), str), event
    try:
        text = JSON_CODEC.encode(event)
        assert isinstance(text, str)
        json.loads(text.encode("utf-8"), parse_constant=_no_constants)
        msgpack.unpackb(MSGPACK_CODEC.encode(event))
    except (ValueError, TypeError, OverflowError) as exc:
        raise AssertionError(
            f"server event cannot be sent: {type(exc).__name__}: {exc}; event={event!r:.400}"
        ) from exc
    if event["type"] == "error":
        error = event["error"]
        assert error["code"] in CODES, error
        assert error["type"] in ("invalid_request_error", "server_error"), error
        assert isinstance(error["message"], str), error


# Client event types, and values that look like them.
TYPE_NAMES = [
    *sorted(CLIENT_EVENT_TYPES),
    "message",
    "function_call_output",
    "function_call",
    "function",
    "error",
    "response.done",
    "user",
    "assistant",
    "system",
    "auto",
    "none",
    "required",
]


def new_session(clock: Callable[[], float] = time.monotonic) -> Session:
    return Session(
        limits=SessionLimits(
            max_active_responses=3, max_conversation_bytes=8192, tool_timeout_s=5.0
        ),
        clock=clock,
        preflight=ScriptedEngine(max_context_tokens=512).preflight,
    )


def assert_event(event: Any) -> None:
    """The least any server event must be: a JSON-serialisable map with a string
    `type`; an error carries a stable code."""
    assert isinstance(event, dict), event
    assert isinstance(event.get("type"), str), event
    json.dumps(event)
    if event["type"] == "error":
        assert event["error"]["code"] in CODES, event


def feed_client_event(
    session: Session, obj: Any, *, wire: bool = True
) -> tuple[list[Action], list[Event]]:
    """One client event into the session (drive); checks the error rules and
    returns the actions and events out. `wire`: obj came from decode_frame, so
    the replies must also be sendable (assert_wire_safe)."""
    try:
        parse_client_event(copy.deepcopy(obj))
        invalid: ProtocolError | None = None
    except ProtocolError as err:
        invalid = err
    actions, events = drive(session, obj, actions=True)
    for event in events:
        assert_event(event)
        if wire:
            assert_wire_safe(event)
    errors = [e for e in events if e["type"] == "error"]
    if invalid is not None:
        assert [e["type"] for e in events] == ["error"], (obj, events)
    assert len(errors) <= 1, (obj, events)
    for error in errors:
        raw_id = obj.get("event_id") if isinstance(obj, dict) else None
        if "event_id" in error["error"]:
            assert error["error"]["event_id"] == raw_id
    return actions, events
