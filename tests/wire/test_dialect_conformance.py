"""The Dialect interface's conformance suite: every dialect passes it
(docs/architecture.md, "Adding a dialect").

Server events come from a real Session driven through a conversation with a
tool call, so every event type the core emits is encoded."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from tokenwire.core.errors import ErrorCode, ProtocolError
from tokenwire.core.schema import parse_client_event
from tokenwire.core.session import Session
from tokenwire.engines.base import EngineDelta, ToolCallDelta
from tokenwire.wire import FAMILIES, dialect_for, select_subprotocol
from tokenwire.wire.codec import encode_json

SUBPROTOCOLS = [(f, s) for f in FAMILIES for s in f.subprotocols]
# Subprotocols, not instances: a dialect instance serves one socket and may keep state.
DIALECTS = [pytest.param(s, id=s) for _, s in SUBPROTOCOLS]

# Client events as each dialect's clients send them (decoded maps).
CLIENT_EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "tokenwire.v1": [
        {"type": "session.update", "session": {"instructions": "Be brief."}},
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "hi"},
        },
        {"type": "response.create", "response": {"max_output_tokens": 5}},
        {"type": "response.cancel"},
        {"type": "response.steer", "input": "shorter"},
        {"type": "conversation.item.truncate", "item_id": "i1", "text_end": 0},
        {"type": "conversation.item.retrieve", "item_id": "i1"},
        {"type": "session.resume", "session_id": "sess_1", "last_seq": 3},
        {"type": "conversation.item.delete", "item_id": "i1"},
    ],
    "openai.realtime": [
        {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}},
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            },
        },
        {"type": "response.create", "response": {"max_output_tokens": "inf"}},
        {"type": "response.cancel"},
        {"type": "conversation.item.retrieve", "item_id": "i1"},
        {"type": "conversation.item.delete", "item_id": "i1"},
    ],
}


def server_events() -> list[dict[str, Any]]:
    """One of each event a session emits, numbered as the outbox would."""
    s = Session()
    events = s.events_to_send()

    def take() -> list[dict[str, Any]]:
        out = s.events_to_send()
        events.extend(out)
        return out

    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    s.receive_client_event({"type": "session.update", "session": {"tools": [tool]}})
    s.receive_client_event(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "Weather in Paris?"},
        }
    )
    s.receive_client_event({"type": "response.create", "event_id": "e1"})
    (start,) = s.actions_to_perform()
    rid = start.request.request_id
    s.receive_engine_output(rid, EngineDelta("Let me check. ", 3, None, 10, 0))
    call = ToolCallDelta(0, "get_weather", '{"city": "Paris"}')
    s.receive_engine_output(rid, EngineDelta("", 5, "stop", tool_calls=[call]))
    s.actions_to_perform()  # the tool timer
    call_id = next(e for e in take() if "call_id" in e)["call_id"]
    s.receive_client_event(
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": call_id, "output": "sunny"},
        }
    )
    (_, start) = s.actions_to_perform()  # the tool timer cancelled, then the continuation
    s.receive_engine_output(start.request.request_id, EngineDelta("Sunny.", 2, None, 20, 8))
    s.receive_client_event({"type": "response.steer", "input": "In French."})
    (_, start) = s.actions_to_perform()
    s.receive_engine_output(start.request.request_id, EngineDelta("Ensoleillé.", 3, "stop"))
    s.receive_client_event({"type": "response.cancel", "event_id": "late"})  # an error
    take()
    for seq, event in enumerate(events, 1):
        event["seq"] = seq
    return events


EVENTS = server_events()


def test_the_examples_cover_every_server_event_type() -> None:
    kinds = {e["type"] for e in EVENTS}
    assert {
        "session.created",
        "response.created",
        "response.output_text.delta",
        "response.output_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.requires_action",
        "conversation.item.created",
        "response.steered",
        "response.done",
        "error",
    } <= kinds


def test_every_family_has_client_examples() -> None:
    for family in FAMILIES:
        assert dialect_for(family.subprotocols[0]).name in CLIENT_EXAMPLES


@pytest.mark.parametrize("subprotocol", DIALECTS)
def test_encodes_every_event_as_frames_of_its_kind(subprotocol: str) -> None:
    dialect = dialect_for(subprotocol)
    sent = 0
    for event in EVENTS:
        logged = dialect.encode(event)
        frames = dialect.frames(event)
        if dialect.single_frame:
            assert frames == [logged], event["type"]
        for frame in frames:
            assert isinstance(frame, bytes) == dialect.binary, event["type"]
            assert len(frame) > 0
        sent += len(frames)
    assert sent >= len(EVENTS) - 1  # at most requires_action may send nothing


@pytest.mark.parametrize("subprotocol", DIALECTS)
def test_replay_sends_what_live_sent(subprotocol: str) -> None:
    """A logged event (JSON or msgpack) replays as the very frames it was sent
    as, through another instance that sees the log from its start."""
    live, from_json, from_msgpack = (dialect_for(subprotocol) for _ in range(3))
    for event in EVENTS:
        frames = list(live.frames(event))
        assert list(from_json.from_logged(encode_json(event))) == frames
        assert list(from_msgpack.from_logged(msgpack.packb(event, use_bin_type=True))) == frames


@pytest.mark.parametrize("subprotocol", DIALECTS)
def test_the_log_keeps_the_internal_event(subprotocol: str) -> None:
    dialect = dialect_for(subprotocol)
    for event in EVENTS:
        logged = dialect.encode(event)
        decoded = msgpack.unpackb(logged) if isinstance(logged, bytes) else json.loads(logged)
        assert decoded == event


@pytest.mark.parametrize("subprotocol", DIALECTS)
def test_client_frames_parse_into_the_internal_schema(subprotocol: str) -> None:
    dialect = dialect_for(subprotocol)
    for example in CLIENT_EXAMPLES[dialect.name]:
        frame: str | bytes = (
            msgpack.packb(example, use_bin_type=True) if dialect.binary else json.dumps(example)
        )
        parsed = dialect.parse(frame)
        assert parse_client_event(parsed).type == example["type"]


@pytest.mark.parametrize("subprotocol", DIALECTS)
@pytest.mark.parametrize("frame", ["{", "[1,", "NaN", b"\xc1", b"\x92\x01", '"\\ud800"'])
def test_malformed_frames_are_a_protocol_error(subprotocol: str, frame: str | bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        dialect_for(subprotocol).parse(frame)
    assert caught.value.code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(("family", "subprotocol"), SUBPROTOCOLS)
def test_negotiation(family: Any, subprotocol: str) -> None:
    assert select_subprotocol(["nonsense", subprotocol]) == subprotocol
    dialect = dialect_for(subprotocol)
    assert dialect.subprotocol == subprotocol
    assert family.for_subprotocol(subprotocol).subprotocol == subprotocol


def test_client_order_wins_and_no_offer_gets_the_default() -> None:
    offered = [s for _, s in SUBPROTOCOLS]
    assert select_subprotocol(offered) == offered[0]
    assert select_subprotocol(list(reversed(offered))) == offered[-1]
    assert select_subprotocol([]) is None
    assert select_subprotocol(["x", "y"]) is None
    assert dialect_for(None).name == "openai.realtime"
    assert dialect_for("tokenwire.auth.x").name == "openai.realtime"
