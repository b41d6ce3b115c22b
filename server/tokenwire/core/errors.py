"""Stable error codes, and the error a client event is answered with."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    """Stable error codes; clients may switch on these."""

    MALFORMED_FRAME = "malformed_frame"
    INVALID_EVENT = "invalid_event"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    UNKNOWN_FIELD = "unknown_field"
    UNKNOWN_RESPONSE = "unknown_response"
    RESPONSE_NOT_ACTIVE = "response_not_active"
    CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE = "conversation_already_has_active_response"
    TOO_MANY_RESPONSES = "too_many_responses"
    UNKNOWN_ITEM = "unknown_item"
    DUPLICATE_ITEM_ID = "duplicate_item_id"
    UNKNOWN_CALL_ID = "unknown_call_id"
    DUPLICATE_CALL_OUTPUT = "duplicate_call_output"
    INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"
    INVALID_STATE = "invalid_state"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONVERSATION_TOO_LARGE = "conversation_too_large"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    PRIORITY_NOT_ALLOWED = "priority_not_allowed"
    SESSION_NOT_FOUND = "session_not_found"
    RESUME_NOT_POSSIBLE = "resume_not_possible"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    ENGINE_ERROR = "engine_error"
    SERVER_ERROR = "server_error"


# Errors caused by the client's input; everything else is the server's fault.
SERVER_SIDE = frozenset(
    {
        ErrorCode.ENGINE_UNAVAILABLE,
        ErrorCode.ENGINE_ERROR,
        ErrorCode.SERVER_ERROR,
        ErrorCode.INVALID_TOOL_ARGUMENTS,  # the model's output, not the client's input
    }
)


def error_type(code: str) -> str:
    """`server_error` for the server's (or the model's) fault, else
    `invalid_request_error`; an unknown code is the server's."""
    known = code in ErrorCode.__members__.values()
    return (
        "server_error" if not known or ErrorCode(code) in SERVER_SIDE else "invalid_request_error"
    )


class ProtocolError(Exception):
    """A client mistake, reported as an `error` event; the connection stays open."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        event_id: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id
        self.param = param

    def to_event(self) -> dict[str, Any]:
        return error_event(self.code, self.message, event_id=self.event_id, param=self.param)


def error_event(
    code: ErrorCode,
    message: str,
    *,
    event_id: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The `error` server event."""
    error: dict[str, Any] = {
        "type": error_type(code),
        "code": str(code),
        "message": message,
    }
    if event_id is not None:
        error["event_id"] = event_id
    if param is not None:
        error["param"] = param
    return {"type": "error", "error": error}
