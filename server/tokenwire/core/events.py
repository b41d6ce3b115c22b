"""The core's event vocabulary: type names, and the actions it asks for.

The core speaks one internal event schema (docs/protocol.md, tokenwire v1,
is its wire form). Dialects translate to and from it at the edge; type names
are spelled here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engines.base import GenerationRequest

# Client events.
SESSION_UPDATE = "session.update"
SESSION_RESUME = "session.resume"
CONVERSATION_ITEM_CREATE = "conversation.item.create"
CONVERSATION_ITEM_RETRIEVE = "conversation.item.retrieve"
CONVERSATION_ITEM_TRUNCATE = "conversation.item.truncate"
CONVERSATION_ITEM_DELETE = "conversation.item.delete"
RESPONSE_CREATE = "response.create"
RESPONSE_CANCEL = "response.cancel"
RESPONSE_STEER = "response.steer"

# Server events.
SESSION_CREATED = "session.created"
SESSION_UPDATED = "session.updated"
SESSION_RESUMED = "session.resumed"
SESSION_GOING_AWAY = "session.going_away"
CONVERSATION_ITEM_CREATED = "conversation.item.created"
CONVERSATION_ITEM_RETRIEVED = "conversation.item.retrieved"
CONVERSATION_ITEM_TRUNCATED = "conversation.item.truncated"
CONVERSATION_ITEM_DELETED = "conversation.item.deleted"
RESPONSE_CREATED = "response.created"
RESPONSE_OUTPUT_TEXT_DELTA = "response.output_text.delta"
RESPONSE_OUTPUT_TEXT_DONE = "response.output_text.done"
RESPONSE_FUNCTION_CALL_ARGUMENTS_DELTA = "response.function_call_arguments.delta"
RESPONSE_FUNCTION_CALL_ARGUMENTS_DONE = "response.function_call_arguments.done"
RESPONSE_REQUIRES_ACTION = "response.requires_action"
RESPONSE_STEERED = "response.steered"
RESPONSE_DONE = "response.done"
ERROR = "error"

# Deltas carry text produced after the last snapshot; nothing else is in them.
DELTAS = frozenset({RESPONSE_OUTPUT_TEXT_DELTA, RESPONSE_FUNCTION_CALL_ARGUMENTS_DELTA})


# ---------------------------------------------------------------------------
# Actions: what the session asks its runtime to do


@dataclass(frozen=True, slots=True)
class StartGeneration:
    response_id: str
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class AbortGeneration:
    response_id: str
    request_id: str
    cancel: bool = False  # for a client's response.cancel (the cancel latency it times)


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Call `receive_timeout(response_id, token)` after `delay_s`."""

    response_id: str
    token: int
    delay_s: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    """The wait `StartTimer` timed is over: drop its timer (it may run an hour)."""

    response_id: str


Action = StartGeneration | AbortGeneration | StartTimer | CancelTimer


class Outputs:
    """What the session produced that its runtime has not taken yet.

    `events` stays the same list object for the session's life (the per-token
    path holds it): taking copies it out and clears it."""

    __slots__ = ("actions", "events")

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.actions: list[Action] = []

    def emit(self, event: dict[str, Any], event_id: str | None = None) -> None:
        if event_id is not None:
            event["event_id"] = event_id
        self.events.append(event)

    def perform(self, action: Action) -> None:
        self.actions.append(action)

    def take_events(self) -> list[dict[str, Any]]:
        events = self.events
        if not events:
            return []
        taken = events.copy()
        events.clear()
        return taken

    def take_actions(self) -> list[Action]:
        actions = self.actions
        if not actions:
            return _NONE  # per token: no list made when there is nothing
        self.actions = []
        return actions


# What take_actions returns when there is nothing: one shared list, which
# callers only read.
_NONE: list[Any] = []
