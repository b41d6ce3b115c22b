"""Driving a `Session` the way the runtime's pump does, without sockets."""

from __future__ import annotations

from typing import Any, Literal, overload

from tokenwire.core.errors import ProtocolError
from tokenwire.core.events import Action, StartGeneration
from tokenwire.core.session import Session
from tokenwire.engines.base import EngineDelta, ToolCallDelta

from .tools import TIME, WEATHER

Event = dict[str, Any]
NOTHING: Any = object()  # no input: None is a client event like any other


@overload
def drive(session: Session, event: Any = ..., *, actions: Literal[False] = ...) -> list[Event]: ...


@overload
def drive(
    session: Session, event: Any = ..., *, actions: Literal[True]
) -> tuple[list[Action], list[Event]]: ...


def drive(
    session: Session, event: Any = NOTHING, *, actions: bool = False
) -> list[Event] | tuple[list[Action], list[Event]]:
    """Hand `event` to the session as the runtime does with a client frame (a
    decoded value to receive_client_event, a ProtocolError from a frame that
    did not decode to receive_protocol_error; nothing, to collect only what
    earlier inputs produced), then take what the session produced: the events
    to send and, with `actions`, the actions first, as the pump performs them."""
    if isinstance(event, ProtocolError):
        session.receive_protocol_error(event)
    elif event is not NOTHING:
        session.receive_client_event(event)
    if not actions:
        return session.events_to_send()
    todo = session.actions_to_perform()
    return todo, session.events_to_send()


def codes(events: list[Event]) -> list[str]:
    """The error codes among `events`."""
    return [e["error"]["code"] for e in events if e["type"] == "error"]


def types(events: list[Event]) -> list[str]:
    return [e["type"] for e in events]


def start(s: Session, text: str = "hi", **params: Any) -> tuple[str, StartGeneration]:
    """A user message, then response.create (event_id "create"): the response id
    and its generation."""
    drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": text},
        },
    )
    events = drive(s, {"type": "response.create", "event_id": "create", "response": params})
    created = events[0]
    assert created["type"] == "response.created" and created["event_id"] == "create"
    (action,) = s.actions_to_perform()
    assert isinstance(action, StartGeneration)
    return created["response"]["id"], action


def begin(s: Session, **params: Any) -> StartGeneration:
    """WEATHER and TIME offered, a question, then response.create (event_id "c")."""
    drive(s, {"type": "session.update", "session": {"tools": [WEATHER, TIME]}})
    drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "Weather and time in Paris?"},
        },
    )
    drive(s, {"type": "response.create", "event_id": "c", "response": params})
    (action,) = s.actions_to_perform()
    assert isinstance(action, StartGeneration)
    return action


def call(
    s: Session, rq: str, index: int, name: str | None, args: str, finish: str | None = None
) -> list[Event]:
    """The engine streams (part of) a tool call for request `rq`."""
    s.receive_engine_output(
        rq, EngineDelta("", 1, finish, tool_calls=[ToolCallDelta(index, name, args)])
    )
    return s.events_to_send()


def output(s: Session, call_id: str, text: str, event_id: str = "o") -> list[Event]:
    """The client sends a tool's output."""
    return drive(
        s,
        {
            "type": "conversation.item.create",
            "event_id": event_id,
            "item": {"type": "function_call_output", "call_id": call_id, "output": text},
        },
    )
