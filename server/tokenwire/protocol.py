"""Protocol v1: event validation, error codes and the JSON/msgpack codec.

No I/O here. The transport hands frames in; `decode_frame` and
`parse_client_event` turn them into typed client events or raise
`ProtocolError` with a stable code.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

import msgpack
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

SUBPROTOCOL_JSON = "tokenwire.v1.json"
SUBPROTOCOL_MSGPACK = "tokenwire.v1.msgpack"
SUBPROTOCOLS = (SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON)

# Close codes (see docs/protocol.md).
CLOSE_IDLE = 4000  # no client frame and no active response for --idle-timeout-s
CLOSE_SLOW_CLIENT = 4008  # the client stopped reading its stream
CLOSE_TRY_AGAIN_LATER = 1013  # connection limit reached after the handshake
CLOSE_SERVICE_RESTART = 1012  # drained: resume the session, on another instance


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
    SESSION_NOT_FOUND = "session_not_found"
    RESUME_NOT_POSSIBLE = "resume_not_possible"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    ENGINE_ERROR = "engine_error"
    SERVER_ERROR = "server_error"


# Errors caused by the client's input; everything else is the server's fault.
_SERVER_SIDE = {
    ErrorCode.ENGINE_UNAVAILABLE,
    ErrorCode.ENGINE_ERROR,
    ErrorCode.SERVER_ERROR,
    ErrorCode.INVALID_TOOL_ARGUMENTS,  # the model's output, not the client's input
}


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
    error: dict[str, Any] = {
        "type": "server_error" if code in _SERVER_SIDE else "invalid_request_error",
        "code": str(code),
        "message": message,
    }
    if event_id is not None:
        error["event_id"] = event_id
    if param is not None:
        error["param"] = param
    return {"type": "error", "error": error}


# ---------------------------------------------------------------------------
# Codec


INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry back


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_values(obj: Any) -> None:
    """Refuse what could not be sent back: lone surrogates (JSON \\u escapes allow
    them), integers beyond 64 bits, NaN and infinities. Iterative, so deep
    nesting cannot blow the stack."""
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate") from None
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                raise ValueError("an integer does not fit in 64 bits")
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError("NaN and infinities are not JSON")
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


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


class Codec:
    """Encodes server events for one negotiated subprotocol."""

    def __init__(self, subprotocol: str | None) -> None:
        self.subprotocol = subprotocol or SUBPROTOCOL_JSON
        self.binary = self.subprotocol == SUBPROTOCOL_MSGPACK
        self._packer = msgpack.Packer(use_bin_type=True)

    def encode(self, event: dict[str, Any]) -> str | bytes:
        if self.binary:
            return self._packer.pack(event)
        return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------
# Client events

_STRICT = ConfigDict(strict=True, extra="forbid")
ItemId = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
MaxTokens = Annotated[int, Field(ge=1, le=(1 << 31) - 1)]


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"]
    role: Literal["user", "system", "assistant"]
    content: str
    id: ItemId | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    output: str
    id: ItemId | None = None


Item = Annotated[MessageItem | FunctionCallOutputItem, Field(discriminator="type")]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    name: Annotated[
        str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    ]
    description: str | None = None
    parameters: dict[str, JsonValue] = Field(default_factory=lambda: {"type": "object"})


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class SessionConfig(BaseModel):
    """Fields of `session.update`; all optional, None means 'leave as is'."""

    model_config = _STRICT
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Temperature | None = None
    max_output_tokens: MaxTokens | None = None
    # How long a response waits in requires_action for tool outputs.
    tool_timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None


class ResponseParams(BaseModel):
    model_config = _STRICT
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Temperature | None = None
    max_output_tokens: MaxTokens | None = None
    conversation: Literal["auto", "none"] = "auto"
    # Items used instead of the conversation when conversation is "none".
    input: list[Item] | None = None
    metadata: dict[str, str] | None = None
    # Generate exactly max_output_tokens; for benchmarks.
    ignore_eos: bool = False


class _ClientEvent(BaseModel):
    model_config = _STRICT
    event_id: Annotated[str, StringConstraints(max_length=128)] | None = None


class SessionUpdate(_ClientEvent):
    type: Literal["session.update"]
    session: SessionConfig


class ConversationItemCreate(_ClientEvent):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: str | None = None


class ConversationItemTruncate(_ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: str
    text_end: Annotated[int, Field(ge=0)]


class ConversationItemRetrieve(_ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseCreate(_ClientEvent):
    type: Literal["response.create"]
    response: ResponseParams = Field(default_factory=ResponseParams)


class ResponseCancel(_ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


class ResponseSteer(_ClientEvent):
    type: Literal["response.steer"]
    response_id: str | None = None
    input: Annotated[str, StringConstraints(min_length=1)]


class SessionResume(_ClientEvent):
    type: Literal["session.resume"]
    session_id: Annotated[str, Field(min_length=1, max_length=128)]  # also a Redis key part
    last_seq: Annotated[int, Field(ge=0)]


ClientEvent = (
    SessionUpdate
    | ConversationItemCreate
    | ConversationItemTruncate
    | ConversationItemRetrieve
    | ResponseCreate
    | ResponseCancel
    | ResponseSteer
    | SessionResume
)

_EVENT_TYPES: dict[str, TypeAdapter[Any]] = {
    cls.model_fields["type"].annotation.__args__[0]: TypeAdapter(cls)  # type: ignore[union-attr]
    for cls in ClientEvent.__args__  # type: ignore[attr-defined]
}
CLIENT_EVENT_TYPES = frozenset(_EVENT_TYPES)

_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TAGS = {"message", "function_call_output"}

_PYDANTIC_CODES = {
    "missing": ErrorCode.MISSING_FIELD,
    "extra_forbidden": ErrorCode.UNKNOWN_FIELD,
}


def parse_client_event(obj: Any) -> ClientEvent:
    """Validate one decoded frame; raise ProtocolError with a stable code."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.INVALID_EVENT, f"an event must be a map, got {type(obj).__name__}"
        )
    raw_id = obj.get("event_id")
    event_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= 128 else None
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(
            ErrorCode.INVALID_EVENT,
            "an event needs a string 'type'",
            event_id=event_id,
            param="type",
        )
    adapter = _EVENT_TYPES.get(kind)
    if adapter is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_EVENT_TYPE,
            f"unknown event type {kind[:64]!r}; expected one of {sorted(CLIENT_EVENT_TYPES)}",
            event_id=event_id,
            param="type",
        )
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        # Keep field names and list indexes; drop the union and tag labels
        # pydantic adds to the location (e.g. "literal['auto','none']").
        loc = [
            str(part)
            for part in first["loc"]
            if isinstance(part, int) or (_FIELD_NAME.match(part) and part not in _TAGS)
        ]
        param = ".".join(loc)
        code = _PYDANTIC_CODES.get(first["type"], ErrorCode.INVALID_FIELD)
        raise ProtocolError(
            code, f"{param or 'event'}: {first['msg']}", event_id=event_id, param=param
        ) from None
