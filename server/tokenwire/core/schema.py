"""The internal client-event schema: what every dialect parses frames into.

tokenwire v1 speaks it as is on the wire; other dialects translate to it.
Validation is strict and every failure is a `ProtocolError` with a stable
code and the path of the offending field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    TypeAdapter,
    ValidationError,
)

from . import events as ev
from .errors import ErrorCode, ProtocolError

INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry back


def check_values(obj: Any) -> None:
    """Refuse what could not be sent back: lone surrogates (JSON \\u escapes allow
    them), integers beyond 64 bits, NaN and infinities, map keys that are not
    strings, and anything else that is not a JSON value (msgpack's bin and ext
    values, its timestamps). Iterative, so deep nesting cannot blow the stack."""
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
            if value - value != 0.0:  # NaN for NaN and both infinities
                raise ValueError("NaN and infinities are not JSON")
        elif isinstance(value, dict):
            if not all(type(key) is str for key in value):
                raise ValueError("map keys must be strings")
            stack.extend(value.keys())
            stack.extend(value.values())
        elif type(value) is list or type(value) is tuple:
            stack.extend(value)
        elif isinstance(value, bytes):
            raise ValueError("a msgpack bin value is not JSON; send text")
        elif value is not None:  # msgpack's ext types and timestamps
            raise ValueError(f"a msgpack {type(value).__name__} is not JSON")


_STRICT = ConfigDict(strict=True, extra="forbid")
ItemId = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
]
# An id the client names to look something up: echoed in errors, so bounded.
IdRef = Annotated[str, StringConstraints(max_length=128)]
# OpenAI's limits: 128 tools; metadata of 16 pairs, keys of 64 and values of
# 512 characters. Each tool costs validation and prompt work on every response.
MAX_TOOLS = 128
# Items one response.create may carry in `input`: past some thousands a
# frame's validation alone holds the event loop (20,000: 0.44 s).
MAX_INPUT_ITEMS = 1024
Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(max_length=16),
]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
# "inf": no cap of the server's default (OpenAI's spelling); the context still bounds it.
MaxTokens = Annotated[int, Field(ge=1, le=(1 << 31) - 1)] | Literal["inf"]
# vLLM's convention: a lower value is scheduled first.
Priority = Annotated[int, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
MAX_STREAM_INTERVAL = 1 << 16


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


ToolName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    name: ToolName
    description: str | None = None
    # Any, not JsonValue: every value passed check_values (the frame's, or the
    # session's own), and pydantic's walk of a JSON value took ~0.5 s a MiB.
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    name: ToolName


def _choice_kind(value: Any) -> str:
    return "named_choice" if isinstance(value, dict | NamedToolChoice) else "mode"


# By shape: a map's errors are the named choice's (a missing name, a stray key),
# not "should be 'auto', 'none' or 'required'".
ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("mode")]
    | Annotated[NamedToolChoice, Tag("named_choice")],
    Discriminator(_choice_kind),
]


class _Settings(BaseModel):
    """What a session sets for its responses and a response may set for itself;
    None means 'leave as is' (or 'the session's')."""

    model_config = _STRICT
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Temperature | None = None
    max_output_tokens: MaxTokens | None = None
    priority: Priority | None = None

    def given(self) -> dict[str, Any]:
        """The fields given, as a dict. A tool's `parameters` is the frame's own
        dict, not a copy: pydantic's dump of it took ~0.1 s a MiB."""
        out = self.model_dump(exclude_none=True, exclude={"tools"})
        if self.tools is not None:
            out["tools"] = [
                {
                    **t.model_dump(exclude_none=True, exclude={"parameters"}),
                    "parameters": t.parameters,
                }
                for t in self.tools
            ]
        return out


class SessionConfig(_Settings):
    """Fields of `session.update`."""

    # How long a response waits in requires_action for tool outputs.
    tool_timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None


class ResponseParams(_Settings):
    conversation: Literal["auto", "none"] = "auto"
    # Items used instead of the conversation when conversation is "none";
    # with "auto", tokenwire v1 appends them to it and OpenAI's sessions use
    # them instead of it (`[]`: an empty context; None: no input).
    input: Annotated[list[Item], Field(max_length=MAX_INPUT_ITEMS)] | None = None
    metadata: Metadata | None = None
    # Generate exactly max_output_tokens; for benchmarks.
    ignore_eos: bool = False
    # False: the response cache (--response-cache) neither serves nor stores it.
    cache: bool = True
    # The sampler's seed: the same seed gives the same answer at any temperature
    # (and the response cache may serve it).
    seed: Annotated[int, Field(ge=0, le=(1 << 63) - 1)] | None = None
    # Tokens per delta (vLLM's stream_interval): fewer frames and less CPU per
    # token, for clients that need not see each token as it comes.
    stream_interval: Annotated[int, Field(ge=1, le=MAX_STREAM_INTERVAL)] = 1


class _ClientEvent(BaseModel):
    model_config = _STRICT
    event_id: Annotated[str, StringConstraints(max_length=128)] | None = None


class SessionUpdate(_ClientEvent):
    type: Literal[ev.SESSION_UPDATE]
    session: SessionConfig


class ConversationItemCreate(_ClientEvent):
    type: Literal[ev.CONVERSATION_ITEM_CREATE]
    item: Item
    previous_item_id: IdRef | None = None


class ConversationItemTruncate(_ClientEvent):
    type: Literal[ev.CONVERSATION_ITEM_TRUNCATE]
    item_id: IdRef
    text_end: Annotated[int, Field(ge=0)]


class ConversationItemRetrieve(_ClientEvent):
    type: Literal[ev.CONVERSATION_ITEM_RETRIEVE]
    item_id: IdRef


class ConversationItemDelete(_ClientEvent):
    type: Literal[ev.CONVERSATION_ITEM_DELETE]
    item_id: IdRef


class ResponseCreate(_ClientEvent):
    type: Literal[ev.RESPONSE_CREATE]
    response: ResponseParams = Field(default_factory=ResponseParams)


class ResponseCancel(_ClientEvent):
    type: Literal[ev.RESPONSE_CANCEL]
    response_id: IdRef | None = None


class ResponseSteer(_ClientEvent):
    type: Literal[ev.RESPONSE_STEER]
    response_id: IdRef | None = None
    input: Annotated[str, StringConstraints(min_length=1)]


class SessionResume(_ClientEvent):
    type: Literal[ev.SESSION_RESUME]
    session_id: Annotated[str, Field(min_length=1, max_length=128)]  # also a Redis key part
    last_seq: Annotated[int, Field(ge=0)]


ClientEvent = (
    SessionUpdate
    | ConversationItemCreate
    | ConversationItemTruncate
    | ConversationItemRetrieve
    | ConversationItemDelete
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
_TAGS = {"message", "function_call_output", "mode", "named_choice"}


def _path_in(obj: Any, loc: tuple[int | str, ...]) -> list[str]:
    """Pydantic's error location as the client's own keys and indexes: the
    union and tag labels it adds (e.g. "literal['auto','none']", "dict",
    "function_call_output") are not in the input, so they are left out. A
    last key that is not there is a missing field's name."""
    path: list[str] = []
    node = obj
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        elif (
            i == len(loc) - 1
            and isinstance(node, dict)
            and isinstance(part, str)
            and _FIELD_NAME.match(part)
            and part not in _TAGS
        ):
            pass  # a missing field: named, though absent
        else:
            continue
        path.append(str(part))
    return path


_PYDANTIC_CODES = {
    "missing": ErrorCode.MISSING_FIELD,
    "extra_forbidden": ErrorCode.UNKNOWN_FIELD,
}


def event_id_of(obj: Any) -> str | None:
    """The client's event_id, if it is one an error may echo."""
    raw = obj.get("event_id") if isinstance(obj, dict) else None
    return raw if isinstance(raw, str) and len(raw) <= 128 else None


# Past this many problems an event is refused without reading them.
MAX_ERRORS_READ = 100


def parse_client_event(obj: Any) -> ClientEvent:
    """Validate one decoded frame; raise ProtocolError with a stable code."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.INVALID_EVENT, f"an event must be a map, got {type(obj).__name__}"
        )
    event_id = event_id_of(obj)
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
        count = exc.error_count()
        if count > MAX_ERRORS_READ:
            # errors() builds every one (60,000 unknown keys: 0.15 s) to give the first.
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"event: {count} fields are invalid; send a smaller, valid event",
                event_id=event_id,
            ) from None
        first = exc.errors(include_url=False, include_input=False)[0]
        # Both may quote the client's keys and values: an error stays small.
        param = ".".join(_path_in(obj, first["loc"]))[:256]
        code = _PYDANTIC_CODES.get(first["type"], ErrorCode.INVALID_FIELD)
        why = first["msg"]
        if first["type"] == "union_tag_not_found":  # an item without a type
            param, code, why = (
                f"{param}.type" if param else "type",
                ErrorCode.MISSING_FIELD,
                "Field required",
            )
        message = f"{param or 'event'}: {why}"
        raise ProtocolError(code, message[:512], event_id=event_id, param=param) from None
