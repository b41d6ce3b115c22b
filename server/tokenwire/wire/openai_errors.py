"""The OpenAI Realtime (GA) dialect's errors: GA error codes and param paths,
and the checks that refuse what a GA client may send but tokenwire does not do.

The core's `ErrorCode` is a fixed enum, and the `error` events the core emits
(and logs) carry its codes. This module is the edge's dictionary:
- `Refused` (an `OpenAIProtocolError`) is what `OpenAIRealtime.parse` raises.
  It carries the GA code (`ga_code`) and, as its core `code`, the internal code
  that maps back onto that GA code (`GA_TO_INTERNAL`), so the `error` event the
  session emits from it (`ProtocolError.to_event`, unchanged) encodes into the
  same GA code.
- `ga_error` turns an internal `error` map into a GA one: the code (`ga_code`),
  the param path (`ga_param`: `tools.0.name` -> `tools[0].name`) and, for unknown
  and missing parameters, OpenAI's own wording of the message.

`unknown_parameter`, `missing_required_parameter`, `invalid_value`,
`response_cancel_not_active`, `conversation_already_has_active_response` and
the `item_*_invalid_*item_id` codes are the codes OpenAI sends in those cases.
`invalid_json` and `server_shutting_down` are this dialect's choice. Codes for
tokenwire-only conditions (quotas, engine failures, context length) keep their
tokenwire spelling.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from ..core import events as ev
from ..core.conversation import ADDING, DELETING, RETRIEVING, TRUNCATING
from ..core.errors import ErrorCode, ProtocolError


class GACode(StrEnum):
    UNKNOWN_PARAMETER = "unknown_parameter"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    INVALID_VALUE = "invalid_value"
    INVALID_JSON = "invalid_json"
    RESPONSE_CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE = "conversation_already_has_active_response"
    SERVER_SHUTTING_DOWN = "server_shutting_down"


# Internal code -> GA code. Codes missing here keep their tokenwire spelling.
INTERNAL_TO_GA: dict[str, str] = {
    ErrorCode.MALFORMED_FRAME: GACode.INVALID_JSON,
    ErrorCode.INVALID_EVENT: GACode.INVALID_VALUE,
    ErrorCode.UNKNOWN_EVENT_TYPE: GACode.INVALID_VALUE,
    ErrorCode.MISSING_FIELD: GACode.MISSING_REQUIRED_PARAMETER,
    ErrorCode.INVALID_FIELD: GACode.INVALID_VALUE,
    ErrorCode.UNKNOWN_FIELD: GACode.UNKNOWN_PARAMETER,
    # Only response.cancel reaches these here (steer is refused); a call output
    # whose response has finished is remapped in `ga_code`.
    ErrorCode.UNKNOWN_RESPONSE: GACode.RESPONSE_CANCEL_NOT_ACTIVE,
    ErrorCode.RESPONSE_NOT_ACTIVE: GACode.RESPONSE_CANCEL_NOT_ACTIVE,
    ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE: (
        GACode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE
    ),
    ErrorCode.UNKNOWN_ITEM: GACode.INVALID_VALUE,
    ErrorCode.DUPLICATE_ITEM_ID: GACode.INVALID_VALUE,
    ErrorCode.UNKNOWN_CALL_ID: GACode.INVALID_VALUE,
    ErrorCode.DUPLICATE_CALL_OUTPUT: GACode.INVALID_VALUE,
    ErrorCode.INVALID_STATE: GACode.INVALID_VALUE,
}

# GA code -> the internal code a refusal carries (it maps back onto the GA code).
GA_TO_INTERNAL: dict[GACode, ErrorCode] = {
    GACode.UNKNOWN_PARAMETER: ErrorCode.UNKNOWN_FIELD,
    GACode.MISSING_REQUIRED_PARAMETER: ErrorCode.MISSING_FIELD,
    GACode.INVALID_VALUE: ErrorCode.INVALID_FIELD,
    GACode.INVALID_JSON: ErrorCode.MALFORMED_FRAME,
}

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def ga_param(param: str | None) -> str | None:
    """`session.tools.0.name` (tokenwire) as `session.tools[0].name` (OpenAI)."""
    return _INDEX.sub(r"[\1]", param) if param else None


# An unknown item gets OpenAI's code for what the event was doing, which the
# core's message names (core/conversation.unknown_item). Clients switch on
# these: a retrieve of a deleted item, or a delete that lost a race, is not fatal.
UNKNOWN_ITEM_CODES = {
    f"Error {RETRIEVING} item:": "item_retrieve_invalid_item_id",
    f"Error {DELETING} item:": "item_delete_invalid_item_id",
    f"Error {TRUNCATING} item:": "item_truncate_invalid_item_id",
    f"Error {ADDING} item:": "item_create_invalid_previous_item_id",
}


def ga_code(code: str, param: str | None, message: str = "") -> str:
    if code == ErrorCode.RESPONSE_NOT_ACTIVE and param not in (None, "response_id"):
        return GACode.INVALID_VALUE
    if code == ErrorCode.UNKNOWN_ITEM:
        return UNKNOWN_ITEM_CODES.get(message.partition(":")[0] + ":", GACode.INVALID_VALUE)
    return INTERNAL_TO_GA.get(code, code)


def ga_message(code: str, param: str | None, message: str) -> str:
    if param and code == GACode.UNKNOWN_PARAMETER:
        return f"Unknown parameter: '{param}'."
    if param and code == GACode.MISSING_REQUIRED_PARAMETER:
        return f"Missing required parameter: '{param}'."
    return message


def ga_error(error: dict[str, Any]) -> dict[str, Any]:
    """An internal `error` map (`core.errors.error_event`) as a GA RealtimeError."""
    param = ga_param(error.get("param"))
    code = ga_code(
        str(error.get("code", "server_error")), error.get("param"), str(error.get("message", ""))
    )
    return {
        "type": error.get("type", "server_error"),
        "code": code,
        "message": ga_message(code, param, str(error.get("message", ""))),
        "param": param,
        "event_id": error.get("event_id"),
    }


class OpenAIProtocolError(ProtocolError):
    """A GA client event this dialect refuses, with its GA code."""

    def __init__(
        self,
        ga: GACode,
        message: str | None = None,
        *,
        param: str | None = None,
        event_id: str | None = None,
    ) -> None:
        text = message or ga_message(ga, param, f"Invalid value for '{param}'.")
        super().__init__(GA_TO_INTERNAL[ga], text, event_id=event_id, param=param)
        self.ga_code = ga


Refused = OpenAIProtocolError

# -- checks on GA client events ------------------------------------------------

TEXT_ONLY = "this server is text only"
AUDIO_EVENTS = frozenset(
    {
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "output_audio_buffer.clear",
    }
)
_MEDIA_PARTS = frozenset({"input_audio", "output_audio", "input_image"})


def refuse_event(kind: Any, event_id: str | None) -> OpenAIProtocolError:
    """The error for a client event type this dialect does not take."""
    if not isinstance(kind, str):  # not echoed: its repr may be a MiB long
        why = f"type must be a string, not {type(kind).__name__}"
        return Refused(GACode.INVALID_VALUE, why, param="type", event_id=event_id)
    if kind in AUDIO_EVENTS:
        why = f"{TEXT_ONLY}: {kind} is not supported"
    elif kind in (ev.RESPONSE_STEER, ev.SESSION_RESUME):
        why = f"{kind} is tokenwire's own; connect with the subprotocol tokenwire.v1.json"
    elif kind == "conversation.item.truncate":
        why = f"{TEXT_ONLY}: conversation.item.truncate cuts audio, and there is none"
    else:
        why = f"unknown event type {kind[:64]!r}"
    return Refused(GACode.INVALID_VALUE, why, param="type", event_id=event_id)


def invalid(param: str, why: str, event_id: str | None) -> OpenAIProtocolError:
    return Refused(GACode.INVALID_VALUE, why, param=param, event_id=event_id)


def missing(param: str, event_id: str | None) -> OpenAIProtocolError:
    return Refused(GACode.MISSING_REQUIRED_PARAMETER, param=param, event_id=event_id)


def check_keys(obj: dict[str, Any], allowed: set[str], prefix: str, event_id: str | None) -> None:
    for key in obj:
        if key not in allowed:
            param = f"{prefix}{str(key)[:64]}"  # echoed: the client's key, bounded
            raise Refused(GACode.UNKNOWN_PARAMETER, param=param, event_id=event_id)


def check_map(obj: Any, param: str, event_id: str | None) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise invalid(param, f"'{param}' must be an object", event_id)
    return obj


def check_part(part: Any, allowed: set[str], where: str, event_id: str | None) -> str:
    """One content part; returns its text."""
    part = check_map(part, where, event_id)
    kind = part.get("type")
    if not isinstance(kind, str) or kind not in allowed:
        why = f"{TEXT_ONLY}: " if isinstance(kind, str) and kind in _MEDIA_PARTS else ""
        raise invalid(f"{where}.type", f"{why}this part takes types {sorted(allowed)}", event_id)
    check_keys(part, {"type", "text"}, f"{where}.", event_id)
    if "text" not in part:
        raise missing(f"{where}.text", event_id)
    if not isinstance(part["text"], str):
        raise invalid(f"{where}.text", "text must be a string", event_id)
    return part["text"]


def check_settings(
    raw: dict[str, Any], prefix: str, event_id: str | None, strict_audio: bool
) -> None:
    """GA session or response settings tokenwire cannot honour."""
    modalities = raw.get("output_modalities")
    if modalities is not None and modalities != ["text"]:
        why = f'{TEXT_ONLY}: output_modalities must be ["text"]'
        raise invalid(f"{prefix}output_modalities", why, event_id)
    if raw.get("prompt") is not None:
        raise invalid(f"{prefix}prompt", "stored prompts are not supported", event_id)
    include = raw.get("include")
    if include is not None and not isinstance(include, list):
        raise invalid(f"{prefix}include", f"'{prefix}include' must be an array", event_id)
    if include:
        raise invalid(f"{prefix}include", f"{TEXT_ONLY}: there is nothing to include", event_id)
    audio = raw.get("audio")
    if audio is not None and (strict_audio or not isinstance(audio, dict)):
        raise invalid(f"{prefix}audio", f"{TEXT_ONLY}: audio settings are refused", event_id)
    if prefix == "session." and raw.get("type", "realtime") != "realtime":
        raise invalid("session.type", 'only sessions of type "realtime" are served', event_id)
    if prefix == "response." and raw.get("conversation") not in (None, "auto", "none"):
        why = 'conversation must be "auto" or "none"'
        raise invalid("response.conversation", why, event_id)
    tools = raw.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise invalid(f"{prefix}tools[{i}].type", "only function tools are served", event_id)
    choice = raw.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type", "function") != "function":
        why = "only function tool choices are served"
        raise invalid(f"{prefix}tool_choice.type", why, event_id)
