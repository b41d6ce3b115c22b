"""OpenAI Realtime GA client events as internal ones (the `parse` half of
`openai_realtime.OpenAIRealtime`; its docstring says what passes, what is
dropped and what is refused)."""

from __future__ import annotations

from typing import Any

from ..core import events as ev
from ..core.schema import MAX_INPUT_ITEMS
from .openai_errors import (
    GACode,
    Refused,
    check_keys,
    check_map,
    check_part,
    check_settings,
    invalid,
    missing,
)

_SETTINGS = {"instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens"}
_EXTENSIONS = {"temperature", "priority"}
_SESSION_PASS = _SETTINGS | _EXTENSIONS | {"tool_timeout_s"}
_SESSION_DROP = {"type", "model", "tracing", "truncation", "reasoning", "include", "audio"}
_RESPONSE_PASS = (
    _SETTINGS
    | _EXTENSIONS
    | {"metadata", "conversation", "input", "ignore_eos", "seed", "cache", "stream_interval"}
)
_RESPONSE_DROP = {"audio", "reasoning"}
_CHECKED = {"output_modalities", "prompt"}  # refused unless harmless, then dropped
_PART_TYPES = {"assistant": {"output_text", "text"}}  # others: input_text
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "object"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "object"},
}


def _item(raw: Any, param: str, eid: str | None) -> dict[str, Any]:
    """A GA item as an internal one: status and object dropped, parts joined."""
    raw = check_map(raw, param, eid)
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in _ITEM_KEYS:
        if kind is None:
            raise missing(f"{param}.type", eid)
        why = (
            f"items of type {kind[:64]!r} are not served; send message or function_call_output"
            if isinstance(kind, str)
            else f"type must be a string, not {type(kind).__name__}"  # not echoed: maybe a MiB
        )
        raise Refused(GACode.INVALID_VALUE, why, param=f"{param}.type", event_id=eid)
    check_keys(raw, _ITEM_KEYS[kind], f"{param}.", eid)
    out = {k: v for k, v in raw.items() if k not in ("status", "object")}
    content = out.get("content")
    if isinstance(content, list):  # a plain string (tokenwire's form) passes as it is
        allowed = _PART_TYPES.get(str(out.get("role")), {"input_text"})
        out["content"] = "\n".join(
            check_part(part, allowed, f"{param}.content[{i}]", eid)
            for i, part in enumerate(content)
        )
    return out


def _settings(raw: Any, prefix: str, eid: str | None, strict: bool, kind: str) -> dict[str, Any]:
    raw = check_map(raw, prefix[:-1], eid)
    passed, dropped = (
        (_SESSION_PASS, _SESSION_DROP) if kind == "session" else (_RESPONSE_PASS, _RESPONSE_DROP)
    )
    check_keys(raw, passed | dropped | _CHECKED, prefix, eid)
    check_settings(raw, prefix, eid, strict)
    out = {k: v for k, v in raw.items() if k in passed and v is not None}  # null: leave as is
    if isinstance(out.get("input"), list):
        if len(out["input"]) > MAX_INPUT_ITEMS:  # before the walk over each one
            why = f"at most {MAX_INPUT_ITEMS} items, got {len(out['input'])}"
            raise invalid("response.input", why, eid)
        out["input"] = [_item(it, f"response.input[{i}]", eid) for i, it in enumerate(out["input"])]
    return out


def parse_event(obj: dict[str, Any], eid: str | None, strict: bool) -> dict[str, Any]:
    kind = obj["type"]
    out: dict[str, Any] = {"type": kind}
    if kind == ev.SESSION_UPDATE:
        check_keys(obj, {"type", "event_id", "session"}, "", eid)
        if "session" not in obj:
            raise missing("session", eid)
        out["session"] = _settings(obj["session"], "session.", eid, strict, "session")
    elif kind == ev.RESPONSE_CREATE:
        check_keys(obj, {"type", "event_id", "response"}, "", eid)
        raw = obj.get("response")  # absent or null: the session's settings
        out["response"] = _settings(
            {} if raw is None else raw, "response.", eid, strict, "response"
        )
    elif kind == ev.CONVERSATION_ITEM_CREATE:
        check_keys(obj, {"type", "event_id", "item", "previous_item_id"}, "", eid)
        if "item" not in obj:
            raise missing("item", eid)
        out["item"] = _item(obj["item"], "item", eid)
        if obj.get("previous_item_id") is not None:
            out["previous_item_id"] = obj["previous_item_id"]
    else:  # response.cancel, conversation.item.retrieve / delete
        key = "response_id" if kind == ev.RESPONSE_CANCEL else "item_id"
        check_keys(obj, {"type", "event_id", key}, "", eid)
        out.update((k, v) for k, v in obj.items() if k == key and v is not None)
    if "event_id" in obj:
        out["event_id"] = obj["event_id"]
    return out


PARSED = frozenset(
    {
        ev.SESSION_UPDATE,
        ev.RESPONSE_CREATE,
        ev.CONVERSATION_ITEM_CREATE,
        ev.CONVERSATION_ITEM_RETRIEVE,
        ev.CONVERSATION_ITEM_DELETE,
        ev.RESPONSE_CANCEL,
    }
)
