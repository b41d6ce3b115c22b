"""The OpenAI Realtime API (GA), text mode, as a dialect: subprotocol `realtime`,
JSON text frames, and the dialect of a socket that offers no subprotocol.
A sans-I/O translation.

Client frames (`parse`): a GA event -> the internal map `core.schema` checks.
Dropped after their check: `session.type` ("realtime"), `model`, `tracing`,
`truncation`, `reasoning`, `include: []`, `output_modalities: ["text"]`, and
audio *settings* (`session.audio`, `response.audio`: openai-agents sends them on
every session.update; `ignore_audio_settings=False` refuses them). Content parts
become one string (joined by newlines); `max_output_tokens: "inf"` passes (the
core reads it as no cap).
Refused with a GA code (wire/openai_errors.py): audio use, stored prompts, MCP
tools, item references and client-made function_call items, conversations
other than auto/none, `conversation.item.truncate` (audio only in GA), `input_audio_buffer.*`,
`output_audio_buffer.clear`, and tokenwire's own `response.steer` and
`session.resume`. tokenwire's `temperature`, `priority`, `tool_timeout_s`, `seed`, `cache`,
`stream_interval` and `ignore_eos` pass as extensions.

Server events (`encode_all`): one internal event -> GA frames; main one marked *.
- session.created / .updated / .resumed -> session.created* / session.updated*
- session.going_away -> error* (server_error, server_shutting_down)
- conversation.item.created -> conversation.item.added*, conversation.item.done
- conversation.item.retrieved -> conversation.item.retrieved*
- conversation.item.truncated -> conversation.item.truncated* (audio_end_ms 0)
- conversation.item.deleted -> conversation.item.deleted*
- response.created -> response.created*
- first delta of an item -> response.output_item.added, conversation.item.added
  (conversation "auto" only), response.content_part.added (text), then the delta*
- response.output_text.delta / function_call_arguments.delta -> the same*
- response.output_text.done -> response.output_text.done*, content_part.done
- response.function_call_arguments.done -> the same*
- response.requires_action -> response.output_item.done* (+ conversation.item.
  done) for each call: GA has no such state, and the calls are final
- response.steered -> conversation.item.added*, conversation.item.done
- response.done -> for each item still open: function_call_arguments.done for
  a call that had none (GA sends it for a cancelled, cut or failed call too),
  output_item.done, conversation.item.done, or conversation.item.deleted for a
  partial call the core dropped (listed, `incomplete`, in response.done's
  output all the same); then response.done*
- error -> error* (GA code and param path)
Every frame gets `event_id`: `event_<seq>` for the main one and `event_<seq>_<i>`
for the i-th other, so a replay of the log gives the same ids. tokenwire-only
fields (`seq`, `timings`, the session's engine settings) are left out.

State. Unlike tokenwire v1 this dialect is not stateless; an instance serves one
socket. Internal events name items and responses but not positions, and GA
wants positions and lifecycle frames the core does not emit, so it keeps:
- `_responses`: each response between response.created and response.done:
  whether it writes to the conversation (conversation.item.* frames), its output
  item ids in order (`output_index` is the position; `content_index` is always
  0, one part per item), and the message whose text is done but whose
  output_item.done waits for its status: response.done gives it; a function
  call's done or requires_action means `completed`; a steer or a new item
  (a restarted generation) means `incomplete`;
- `_items`: each output item announced and not yet done: its response, index,
  kind, and for a call its call_id, name and arguments so far;
- `_conversation_id`: `conv_` + the session id, from session.created.
- `_last`: the last numbered event's frames, so that event passed again (live,
  then from the log) gives the same frames without moving the state twice.
Entries leave at their done, so the state is bounded by the open responses.
Pass events in order through `frames` (`encode_all`) or `from_logged`. `encode`
is the internal event as JSON, what the log keeps: a replay translates it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core import events as ev
from ..core.errors import ProtocolError, error_type
from ..core.schema import event_id_of
from .codec import decode_frame, encode_json
from .dialect import ToolFlow
from .openai_errors import GACode, Refused, ga_error, missing, refuse_event
from .openai_parse import PARSED, parse_event

SUBPROTOCOL = "realtime"

# -- server events: internal -> GA ---------------------------------------------

_REASONS = {  # internal status_details.reason -> GA's (absent: GA has no such reason)
    "client_cancelled": "client_cancelled",
    "client_disconnected": "client_cancelled",
    "max_output_tokens": "max_output_tokens",
    "content_filter": "content_filter",
}


def ga_item(item: dict[str, Any], status: str | None = None) -> dict[str, Any]:
    """A conversation item with its text as one content part."""
    kind = item.get("type")
    out: dict[str, Any] = {"id": item.get("id"), "object": "realtime.item", "type": kind}
    out["status"] = status or item.get("status", "completed")
    if kind == "message":
        role = out["role"] = item.get("role", "user")
        text = item.get("content")
        part = "output_text" if role == "assistant" else "input_text"
        out["content"] = [] if text is None else [{"type": part, "text": text}]
    else:
        keys = (
            ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
        )
        out.update((key, item.get(key, "")) for key in keys)
    return out


def ga_usage(usage: dict[str, Any]) -> dict[str, Any]:
    inp, outp, cached = usage["input_tokens"], usage["output_tokens"], usage.get("cached_tokens", 0)
    no_media = {"audio_tokens": 0, "image_tokens": 0}
    return {
        "total_tokens": usage.get("total_tokens", inp + outp),
        "input_tokens": inp,
        "output_tokens": outp,
        "input_token_details": {
            "text_tokens": inp,
            "cached_tokens": cached,
            "cached_tokens_details": {"text_tokens": cached, **no_media},
            **no_media,
        },
        "output_token_details": {"text_tokens": outp, "audio_tokens": 0},
    }


def ga_status_details(details: dict[str, Any] | None) -> dict[str, Any] | None:
    if not details:
        return None
    out: dict[str, Any] = {"type": details.get("type")}
    if details.get("reason") in _REASONS:
        out["reason"] = _REASONS[details["reason"]]
    if isinstance(details.get("error"), dict):
        error = details["error"]
        # The same type as the `error` event that came before it.
        error = ga_error({**error, "type": error_type(str(error.get("code")))})
        out["error"] = {k: error[k] for k in ("type", "code", "message")}
    return out


def ga_response(resp: dict[str, Any], conversation_id: str | None) -> dict[str, Any]:
    status = resp.get("status", "in_progress")
    out: dict[str, Any] = {
        "id": resp["id"],
        "object": "realtime.response",
        "status": "in_progress" if status == "requires_action" else status,
        "status_details": ga_status_details(resp.get("status_details")),
        "conversation_id": conversation_id if resp.get("conversation") == "auto" else None,
        "output_modalities": ["text"],
        "output": [ga_item(item) for item in resp.get("output", ())],
        "metadata": resp.get("metadata"),
    }
    if "usage" in resp:
        out["usage"] = ga_usage(resp["usage"])
    return out


def ga_session(session: dict[str, Any]) -> dict[str, Any]:
    """What a GA client reads of a session; tokenwire's own settings stay out."""
    limit = session.get("max_output_tokens") or session.get("default_max_output_tokens")
    tool_keys = ("type", "name", "description", "parameters")
    out = {
        "type": "realtime",
        "object": "realtime.session",
        "id": session.get("id"),
        "model": session.get("model") or session.get("engine") or "tokenwire",
        "output_modalities": ["text"],
        "instructions": session.get("instructions"),
        "tools": [
            {k: t[k] for k in tool_keys if t.get(k) is not None} for t in session.get("tools") or ()
        ],
        "tool_choice": session.get("tool_choice", "auto"),
        "parallel_tool_calls": session.get("parallel_tool_calls"),
        "max_output_tokens": limit or "inf",
    }
    return {k: v for k, v in out.items() if v is not None}


def _frame(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


@dataclass(slots=True)
class _Out:
    """An output item announced (output_item.added) and not yet done."""

    response_id: str
    index: int
    kind: str  # message or function_call
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    args_done: bool = False  # response.function_call_arguments.done sent
    text: str | None = None  # from output_text.done
    previous: str | None = None  # the item it follows in the conversation


@dataclass(slots=True)
class _Resp:
    in_conversation: bool
    items: list[str] = field(default_factory=list)
    text_done: str | None = None  # the message whose output_item.done waits


Frames = list[dict[str, Any]]


class OpenAIRealtime:
    """One socket's GA dialect; the module docstring describes its state."""

    name = "openai.realtime"
    binary = False
    single_frame = False
    # GA clients run the tools, then send response.create themselves.
    tool_flow = ToolFlow.CLIENT
    resumable = False  # session.resume is tokenwire v1's
    subprotocol = SUBPROTOCOL  # also for a socket that offered no subprotocol

    def __init__(self, subprotocol: str | None = None, *, ignore_audio_settings: bool = True):
        self.strict_audio = not ignore_audio_settings
        self._responses: dict[str, _Resp] = {}
        self._items: dict[str, _Out] = {}
        self._conversation_id: str | None = None
        self._unnumbered = 0
        # The last numbered event's translation: the same event again (live,
        # then from the log) gives the same frames and moves no state.
        self._last: tuple[Any, Frames, int] = (None, [], 0)

    # -- client frames -----------------------------------------------------------

    def parse(self, frame: str | bytes) -> dict[str, Any]:
        try:
            obj = decode_frame(frame.decode() if isinstance(frame, bytes) else frame)
        except UnicodeDecodeError:
            raise Refused(GACode.INVALID_JSON, "a binary frame must hold UTF-8 JSON") from None
        except ProtocolError as exc:  # malformed_frame
            raise Refused(GACode.INVALID_JSON, exc.message) from None
        if not isinstance(obj, dict):
            raise Refused(GACode.INVALID_VALUE, "an event must be a JSON object")
        eid = event_id_of(obj)  # as the core echoes it: a string of up to 128 characters
        kind = obj.get("type")
        if kind is None:
            raise missing("type", eid)
        if not isinstance(kind, str) or kind not in PARSED:
            raise refuse_event(kind, eid)
        return parse_event(obj, eid, self.strict_audio)

    # -- server events -----------------------------------------------------------

    def encode_all(self, event: dict[str, Any]) -> list[str]:
        """Every GA frame for one internal server event, in order."""
        frames, _ = self._translate(event)
        return [encode_json(frame) for frame in frames]

    frames = encode_all

    def main_frame(self, event: dict[str, Any]) -> str:
        """The frame that stands for the event (its `event_id` is `event_<seq>`);
        "" in the one case with none: requires_action (each call's item closed
        at its arguments.done)."""
        frames, main = self._translate(event)
        return encode_json(frames[main]) if frames else ""

    @staticmethod
    def encode(event: dict[str, Any]) -> str:
        """What the log keeps: the internal event (a replay translates it again)."""
        return encode_json(event)

    def from_logged(self, frame: str | bytes) -> list[str]:
        return self.encode_all(decode_frame(frame))

    def _translate(self, event: dict[str, Any]) -> tuple[Frames, int]:
        seq = event.get("seq")
        if seq is not None and seq == self._last[0]:
            return self._last[1], self._last[2]
        method = _ENCODERS.get(event.get("type"))  # type: ignore[arg-type]
        if method is None:  # a type this dialect does not know yet: as it is
            frames, main = [{k: v for k, v in event.items() if k not in ("seq", "event_id")}], 0
        else:
            frames, main = method(self, event)
        name = seq
        if seq is None:
            self._unnumbered += 1
            name = f"n{self._unnumbered}"
        if len(frames) == 1:  # every delta but an item's first
            frames[0]["event_id"] = f"event_{name}"
        else:
            for i, frame in enumerate(frames):
                frame["event_id"] = f"event_{name}" if i == main else f"event_{name}_{i}"
        if seq is not None:
            self._last = (seq, frames, main)
        return frames, main

    def _session(self, event: dict[str, Any]) -> tuple[Frames, int]:
        session = event["session"]
        self._conversation_id = "conv_" + str(session.get("id", "")).removeprefix("sess_")
        kind = "session.created" if event["type"] == ev.SESSION_CREATED else "session.updated"
        return [_frame(kind, session=ga_session(session))], 0

    def _going_away(self, event: dict[str, Any]) -> tuple[Frames, int]:
        message = (
            f"the server is shutting down ({event.get('reason')}); reconnect in "
            f"{event.get('retry_after_ms', 0)} ms"
        )
        error = {"type": "server_error", "code": GACode.SERVER_SHUTTING_DOWN, "message": message}
        return [_frame("error", error=ga_error(error))], 0

    def _error(self, event: dict[str, Any]) -> tuple[Frames, int]:
        return [_frame("error", error=ga_error(event["error"]))], 0

    def _item_created(self, event: dict[str, Any]) -> tuple[Frames, int]:
        item, previous = ga_item(event["item"]), event.get("previous_item_id")
        return [
            _frame("conversation.item.added", previous_item_id=previous, item=item),
            _frame("conversation.item.done", previous_item_id=previous, item=item),
        ], 0

    def _item_retrieved(self, event: dict[str, Any]) -> tuple[Frames, int]:
        return [_frame("conversation.item.retrieved", item=ga_item(event["item"]))], 0

    def _item_deleted(self, event: dict[str, Any]) -> tuple[Frames, int]:
        return [_frame("conversation.item.deleted", item_id=event["item_id"])], 0

    def _item_truncated(self, event: dict[str, Any]) -> tuple[Frames, int]:
        item_id = event["item_id"]
        frame = _frame("conversation.item.truncated", item_id=item_id, content_index=0)
        return [{**frame, "audio_end_ms": 0}], 0

    def _response_created(self, event: dict[str, Any]) -> tuple[Frames, int]:
        resp = event["response"]
        self._responses[resp["id"]] = _Resp(resp.get("conversation") == "auto")
        return [_frame("response.created", response=ga_response(resp, self._conversation_id))], 0

    # -- output items ------------------------------------------------------------

    def _resp(self, response_id: str) -> _Resp:
        resp = self._responses.get(response_id)
        if resp is None:  # joined mid-response (a replay): assume the conversation
            resp = self._responses[response_id] = _Resp(True)
        return resp

    def _out(self, event: dict[str, Any], kind: str, frames: Frames) -> _Out:
        """The item's state; on its first event, announce it."""
        item_id = event["item_id"]
        out = self._items.get(item_id)
        if out is not None:
            return out
        rid = event["response_id"]
        resp = self._resp(rid)
        self._close_text(resp, "incomplete", frames)  # a new item after a restart
        out = self._items[item_id] = _Out(rid, len(resp.items), kind)
        out.previous = event.get("previous_item_id")
        resp.items.append(item_id)
        if kind == "function_call":
            out.call_id, out.name = event.get("call_id", ""), event.get("name", "")
        item = self._item_of(item_id, out, "in_progress")
        frames.append(_frame("response.output_item.added", **self._at(out), item=item))
        if resp.in_conversation:
            frames.append(
                _frame("conversation.item.added", previous_item_id=out.previous, item=item)
            )
        if kind == "message":
            part = {"type": "text", "text": ""}
            frames.append(
                _frame("response.content_part.added", **self._at(out, item_id), part=part)
            )
        return out

    @staticmethod
    def _item_of(item_id: str, out: _Out, status: str) -> dict[str, Any]:
        """The item as this dialect knows it (an announced message has no part)."""
        if out.kind == "message":
            item = {"type": "message", "role": "assistant", "content": out.text}
        else:
            item = {"type": "function_call", "call_id": out.call_id, "name": out.name}
            item["arguments"] = out.arguments
        return ga_item({"id": item_id, **item}, status)

    @staticmethod
    def _at(out: _Out, item_id: str | None = None) -> dict[str, Any]:
        """Where an event sits: response and output_index (and item, content_index)."""
        where: dict[str, Any] = {"response_id": out.response_id, "output_index": out.index}
        if item_id is not None:
            where.update(item_id=item_id, content_index=0)
        return where

    def _item_done(
        self, item_id: str, item: dict[str, Any] | None, status: str, frames: Frames
    ) -> None:
        """output_item.done (+ conversation.item.done) for an announced item;
        `item` is the core's own (from response.done), or None to build it."""
        out = self._items.pop(item_id, None)
        if out is None:
            return
        done = ga_item(item) if item is not None else self._item_of(item_id, out, status)
        frames.append(_frame("response.output_item.done", **self._at(out), item=done))
        if self._resp(out.response_id).in_conversation:
            frames.append(
                _frame("conversation.item.done", previous_item_id=out.previous, item=done)
            )

    def _close_text(self, resp: _Resp, status: str, frames: Frames, output: Any = None) -> None:
        if resp.text_done is not None:
            item_id, resp.text_done = resp.text_done, None
            self._item_done(item_id, (output or {}).get(item_id), status, frames)

    def _text_delta(self, event: dict[str, Any]) -> tuple[Frames, int]:
        # Per token: the frame in one go (what _at and _frame would build).
        frames: Frames = []
        item_id, delta = event["item_id"], event["delta"]
        out = self._items.get(item_id) or self._out(event, "message", frames)
        where = {"response_id": out.response_id, "output_index": out.index, "item_id": item_id}
        kind = "response.output_text.delta"
        frames.append({"type": kind, **where, "content_index": 0, "delta": delta})
        return frames, len(frames) - 1

    def _text_done(self, event: dict[str, Any]) -> tuple[Frames, int]:
        frames: Frames = []
        out = self._out(event, "message", frames)
        out.text = text = event["text"]
        at, main = self._at(out, event["item_id"]), len(frames)
        frames.append(_frame("response.output_text.done", **at, text=text))
        part = {"type": "text", "text": text}
        frames.append(_frame("response.content_part.done", **at, part=part))
        self._resp(event["response_id"]).text_done = event["item_id"]
        return frames, main

    def _args_delta(self, event: dict[str, Any]) -> tuple[Frames, int]:
        frames: Frames = []
        out = self._out(event, "function_call", frames)
        out.arguments += event["delta"]
        at = {**self._at(out), "item_id": event["item_id"], "call_id": out.call_id}
        frames.append(_frame("response.function_call_arguments.delta", **at, delta=event["delta"]))
        return frames, len(frames) - 1

    def _args_done(self, event: dict[str, Any]) -> tuple[Frames, int]:
        frames: Frames = []
        self._close_text(self._resp(event["response_id"]), "completed", frames)
        out = self._out(event, "function_call", frames)
        out.arguments, out.name = event["arguments"], event.get("name", out.name)
        out.args_done = True
        at = {**self._at(out), "item_id": event["item_id"], "call_id": out.call_id}
        kind = "response.function_call_arguments.done"
        frames.append(_frame(kind, **at, name=out.name, arguments=out.arguments))
        main = len(frames) - 1
        # The core sends it once the call is checked: the call is done, as in
        # GA each call's item is before the next call's arguments end.
        self._item_done(event["item_id"], None, "completed", frames)
        return frames, main

    def _requires_action(self, event: dict[str, Any]) -> tuple[Frames, int]:
        frames: Frames = []
        resp = self._resp(event["response_id"])
        self._close_text(resp, "completed", frames)
        main = len(frames)
        calls = set(event.get("call_ids", ()))
        for item_id in list(resp.items):
            out = self._items.get(item_id)
            if out is not None and out.call_id in calls:
                self._item_done(item_id, None, "completed", frames)
        return frames, main if len(frames) > main else 0

    def _steered(self, event: dict[str, Any]) -> tuple[Frames, int]:
        frames: Frames = []
        self._close_text(self._resp(event["response_id"]), "incomplete", frames)
        main = len(frames)
        return frames + self._item_created(event)[0], main

    def _response_done(self, event: dict[str, Any]) -> tuple[Frames, int]:
        frames: Frames = []
        core = event["response"]
        resp = self._resp(core["id"])
        output = {item["id"]: item for item in core.get("output", ())}
        self._close_text(resp, "incomplete", frames, output)
        dropped: dict[str, dict[str, Any]] = {}
        for item_id in resp.items:
            out = self._items.get(item_id)
            if out is None:
                continue
            item = output.get(item_id)
            if item is None and out.kind == "function_call":
                # A partial call the core dropped: GA lists every item it announced.
                item = dropped[item_id] = {
                    "id": item_id,
                    "type": "function_call",
                    **{"call_id": out.call_id, "name": out.name, "arguments": out.arguments},
                    "status": "incomplete",
                }
            if out.kind == "function_call" and not out.args_done:
                # GA closes the arguments of a cancelled, cut or failed call too.
                at = {**self._at(out), "item_id": item_id, "call_id": out.call_id}
                args = item["arguments"] if item is not None else out.arguments
                kind = "response.function_call_arguments.done"
                frames.append(_frame(kind, **at, name=out.name, arguments=args))
            self._item_done(item_id, item, "incomplete", frames)
            if item_id in dropped and resp.in_conversation:  # it leaves the conversation
                frames[-1] = _frame("conversation.item.deleted", item_id=item_id)
        del self._responses[core["id"]]
        if dropped:  # in output_index order
            every = {**output, **dropped}
            listed = [every.pop(i) for i in resp.items if i in every]
            core = {**core, "output": listed + list(every.values())}
        frames.append(_frame("response.done", response=ga_response(core, self._conversation_id)))
        return frames, len(frames) - 1


_ENCODERS = {
    ev.SESSION_CREATED: OpenAIRealtime._session,
    ev.SESSION_UPDATED: OpenAIRealtime._session,
    ev.SESSION_RESUMED: OpenAIRealtime._session,
    ev.SESSION_GOING_AWAY: OpenAIRealtime._going_away,
    ev.ERROR: OpenAIRealtime._error,
    ev.CONVERSATION_ITEM_CREATED: OpenAIRealtime._item_created,
    ev.CONVERSATION_ITEM_RETRIEVED: OpenAIRealtime._item_retrieved,
    ev.CONVERSATION_ITEM_TRUNCATED: OpenAIRealtime._item_truncated,
    ev.CONVERSATION_ITEM_DELETED: OpenAIRealtime._item_deleted,
    ev.RESPONSE_CREATED: OpenAIRealtime._response_created,
    ev.RESPONSE_OUTPUT_TEXT_DELTA: OpenAIRealtime._text_delta,
    ev.RESPONSE_OUTPUT_TEXT_DONE: OpenAIRealtime._text_done,
    ev.RESPONSE_FUNCTION_CALL_ARGUMENTS_DELTA: OpenAIRealtime._args_delta,
    ev.RESPONSE_FUNCTION_CALL_ARGUMENTS_DONE: OpenAIRealtime._args_done,
    ev.RESPONSE_REQUIRES_ACTION: OpenAIRealtime._requires_action,
    ev.RESPONSE_STEERED: OpenAIRealtime._steered,
    ev.RESPONSE_DONE: OpenAIRealtime._response_done,
}


class OpenAIRealtimeFamily:
    subprotocols = (SUBPROTOCOL,)

    @staticmethod
    def for_subprotocol(subprotocol: str | None) -> OpenAIRealtime:
        return OpenAIRealtime(subprotocol)
