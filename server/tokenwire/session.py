"""One conversation and its responses, as a sans-I/O state machine.

Modelled on websockets' `Protocol`: inputs go in through `receive_*`
methods; the server events to send come out of `events_to_send()` and the
engine work to do out of `actions_to_perform()`. Nothing here awaits, so
every transition is unit-tested without sockets or engines.

Server events come out *without* `seq`; the `Outbox` numbers them as they are
written, after any merging, so `seq` never has gaps.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import protocol as p
from .engines.base import EngineDelta, EngineError, GenerationRequest
from .protocol import ErrorCode, ProtocolError

ACTIVE = ("in_progress", "requires_action")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


# ---------------------------------------------------------------------------
# Actions for the transport to perform


@dataclass(frozen=True, slots=True)
class StartGeneration:
    response_id: str
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class AbortGeneration:
    response_id: str
    request_id: str


Action = StartGeneration | AbortGeneration


# ---------------------------------------------------------------------------
# State


@dataclass(slots=True)
class SessionLimits:
    max_active_responses: int = 8
    # Default cap on output tokens when neither session nor response sets one.
    default_max_output_tokens: int | None = None


@dataclass(slots=True)
class Response:
    id: str
    event_id: str | None
    in_conversation: bool
    params: dict[str, Any]
    metadata: dict[str, str] | None
    # Items the prompt is rendered from: the session's list for conversation
    # "auto", a private one for "none". Output items are appended to it.
    context: list[dict[str, Any]]
    created_at: float
    status: str = "in_progress"
    status_details: dict[str, Any] | None = None
    output: list[dict[str, Any]] = field(default_factory=list)
    current_item: dict[str, Any] | None = None
    request_id: str | None = None
    generation: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    first_token_at: float | None = None
    done_at: float | None = None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE


class Session:
    def __init__(
        self,
        *,
        session_id: str | None = None,
        limits: SessionLimits | None = None,
        info: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        check_request: Callable[[GenerationRequest], None] | None = None,
    ) -> None:
        self.id = session_id or new_id("sess")
        self.limits = limits or SessionLimits()
        self.clock = clock
        # The engine's pre-flight check (context length); raises EngineError.
        self._check_request = check_request
        self.config: dict[str, Any] = {
            "instructions": None,
            "tools": [],
            "tool_choice": "auto",
            "temperature": 1.0,
            "max_output_tokens": None,
        }
        self._info = dict(info or {})
        self.items: list[dict[str, Any]] = []
        self._items_by_id: dict[str, dict[str, Any]] = {}
        self.responses: dict[str, Response] = {}
        # Finished responses, kept briefly so a late cancel gets a precise error.
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._requests: dict[str, str] = {}  # engine request id -> response id
        self._events: list[dict[str, Any]] = []
        self._actions: list[Action] = []
        self.closed = False
        self._emit({"type": "session.created", "session": self.describe()})

    # -- outputs -----------------------------------------------------------

    def events_to_send(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def actions_to_perform(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.session", **self._info, **self.config}

    @property
    def active_responses(self) -> list[Response]:
        return [r for r in self.responses.values() if r.active]

    # -- client input ------------------------------------------------------

    def receive_client_event(self, obj: Any) -> None:
        """Take one decoded frame; bad input becomes an `error` event."""
        try:
            event = p.parse_client_event(obj)
            handler = getattr(self, "_on_" + event.type.replace(".", "_"))
            handler(event)
        except ProtocolError as err:
            self._emit(err.to_event())

    def receive_protocol_error(self, err: ProtocolError) -> None:
        """A frame the transport could not decode."""
        self._emit(err.to_event())

    def _on_session_update(self, ev: p.SessionUpdate) -> None:
        for key, value in ev.session.model_dump(exclude_none=True).items():
            self.config[key] = value
        self._emit({"type": "session.updated", "session": self.describe()}, ev.event_id)

    def _on_conversation_item_create(self, ev: p.ConversationItemCreate) -> None:
        self._check_previous(ev.previous_item_id, ev.event_id)
        item = self._new_item(ev.item, ev.event_id)
        previous = self.items[-1]["id"] if self.items else None
        self._insert_item(item, ev.previous_item_id)
        self._emit(
            {
                "type": "conversation.item.created",
                "previous_item_id": ev.previous_item_id or previous,
                "item": dict(item),
            },
            ev.event_id,
        )

    def _on_conversation_item_truncate(self, ev: p.ConversationItemTruncate) -> None:
        item = self._items_by_id.get(ev.item_id)
        if item is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_ITEM,
                f"no item {ev.item_id!r} in the conversation",
                event_id=ev.event_id,
                param="item_id",
            )
        if item["type"] != "message" or item["role"] != "assistant":
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                "only assistant messages can be truncated",
                event_id=ev.event_id,
                param="item_id",
            )
        if item["status"] == "in_progress":
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                "the item is still being generated; send response.cancel first, then truncate",
                event_id=ev.event_id,
                param="item_id",
            )
        if ev.text_end > len(item["content"]):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"text_end {ev.text_end} is past the item's {len(item['content'])} characters",
                event_id=ev.event_id,
                param="text_end",
            )
        item["content"] = item["content"][: ev.text_end]
        item["status"] = "incomplete"
        self._emit(
            {"type": "conversation.item.truncated", "item_id": item["id"], "text_end": ev.text_end},
            ev.event_id,
        )

    def _on_response_create(self, ev: p.ResponseCreate) -> None:
        rp = ev.response
        in_conversation = rp.conversation == "auto"
        if in_conversation and any(r.in_conversation for r in self.active_responses):
            active = next(r for r in self.active_responses if r.in_conversation)
            raise ProtocolError(
                ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                f"response {active.id} is still active in this conversation; wait for its "
                'response.done, cancel it, or use conversation:"none"',
                event_id=ev.event_id,
            )
        if len(self.active_responses) >= self.limits.max_active_responses:
            raise ProtocolError(
                ErrorCode.TOO_MANY_RESPONSES,
                f"at most {self.limits.max_active_responses} responses may run at once",
                event_id=ev.event_id,
            )
        if in_conversation:
            if rp.input is not None:
                for raw in rp.input:
                    self._insert_item(self._new_item(raw, ev.event_id), None)
            context = self.items
        else:
            context = [self._new_item(raw, ev.event_id) for raw in rp.input or []]

        def pick(name: str) -> Any:
            value = getattr(rp, name)
            return self.config[name] if value is None else value

        params = {
            "instructions": pick("instructions"),
            "tools": rp.model_dump()["tools"] if rp.tools is not None else self.config["tools"],
            "tool_choice": pick("tool_choice"),
            "temperature": pick("temperature"),
            "max_output_tokens": pick("max_output_tokens") or self.limits.default_max_output_tokens,
            "ignore_eos": rp.ignore_eos,
        }
        if isinstance(params["tool_choice"], p.NamedToolChoice):
            params["tool_choice"] = params["tool_choice"].model_dump()
        resp = Response(
            id=new_id("resp"),
            event_id=ev.event_id,
            in_conversation=in_conversation,
            params=params,
            metadata=rp.metadata,
            context=context,
            created_at=self.clock(),
        )
        request = self._next_request(resp)
        if self._check_request is not None:
            try:
                self._check_request(request)
            except EngineError as exc:
                raise ProtocolError(exc.code, exc.message, event_id=ev.event_id) from None
        self.responses[resp.id] = resp
        self._emit({"type": "response.created", "response": self._describe(resp)}, ev.event_id)
        self._start_generation(resp, request)

    def _on_response_cancel(self, ev: p.ResponseCancel) -> None:
        resp = self._find_active(ev.response_id, ev.event_id, "cancel")
        self._abort_current(resp)
        self._finish(resp, "cancelled", {"type": "cancelled", "reason": "client_cancelled"})

    def _on_response_steer(self, ev: p.ResponseSteer) -> None:
        resp = self._find_active(ev.response_id, ev.event_id, "steer")
        if resp.status != "in_progress":
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                f"response {resp.id} is {resp.status}; only a generating response can be steered",
                event_id=ev.event_id,
            )
        self._abort_current(resp)
        previous = self._close_current_item(resp, "incomplete")
        steer_item = self._make_item({"type": "message", "role": "user", "content": ev.input})
        self._append_context(resp, steer_item)
        self._emit(
            {
                "type": "response.steered",
                "response_id": resp.id,
                "previous_item_id": previous["id"] if previous else None,
                "item": dict(steer_item),
            },
            ev.event_id,
        )
        self._start_generation(resp)

    def _on_session_resume(self, ev: p.SessionResume) -> None:
        raise ProtocolError(
            ErrorCode.INVALID_STATE,
            "session.resume must be the first event on a new connection",
            event_id=ev.event_id,
        )

    # -- engine input ------------------------------------------------------

    def receive_engine_output(self, request_id: str, delta: EngineDelta) -> None:
        resp = self._response_for(request_id)
        if resp is None:
            return  # a request we already aborted; its late outputs are dropped
        if delta.prompt_tokens is not None:
            resp.input_tokens += delta.prompt_tokens
            resp.cached_tokens += delta.cached_tokens or 0
        resp.output_tokens += delta.output_tokens
        if delta.text:
            item = resp.current_item
            assert item is not None
            if resp.first_token_at is None:
                resp.first_token_at = self.clock()
            item["content"] += delta.text
            self._emit(
                {
                    "type": "response.output_text.delta",
                    "response_id": resp.id,
                    "item_id": item["id"],
                    "delta": delta.text,
                }
            )
        if delta.finish_reason is not None:
            self._requests.pop(request_id, None)
            resp.request_id = None
            if delta.finish_reason == "stop" or resp.params["ignore_eos"]:
                self._finish(resp, "completed", None)
            elif delta.finish_reason == "length":
                self._finish(
                    resp, "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
                )
            else:
                self._finish(resp, "incomplete", {"type": "incomplete", "reason": "engine_aborted"})

    def receive_engine_error(self, request_id: str, code: ErrorCode, message: str) -> None:
        resp = self._response_for(request_id)
        if resp is None:
            return
        self._requests.pop(request_id, None)
        resp.request_id = None
        self._emit(p.error_event(code, message, event_id=resp.event_id))
        self._finish(
            resp, "failed", {"type": "failed", "error": {"code": str(code), "message": message}}
        )

    def close(self) -> None:
        """The client went away: stop every generation it owns."""
        for resp in self.active_responses:
            self._abort_current(resp)
            self._finish(resp, "cancelled", {"type": "cancelled", "reason": "client_disconnected"})
        self.closed = True

    # -- internals ---------------------------------------------------------

    def _emit(self, event: dict[str, Any], event_id: str | None = None) -> None:
        if event_id is not None:
            event["event_id"] = event_id
        self._events.append(event)

    def _response_for(self, request_id: str) -> Response | None:
        response_id = self._requests.get(request_id)
        return self.responses.get(response_id) if response_id else None

    def _find_active(self, response_id: str | None, event_id: str | None, verb: str) -> Response:
        if response_id is None:
            active = self.active_responses
            conv = [r for r in active if r.in_conversation]
            if len(conv) == 1 or len(active) == 1:
                return conv[0] if conv else active[0]
            raise ProtocolError(
                ErrorCode.RESPONSE_NOT_ACTIVE if not active else ErrorCode.MISSING_FIELD,
                f"no active response to {verb}"
                if not active
                else f"several responses are active; name one with response_id to {verb}",
                event_id=event_id,
                param=None if not active else "response_id",
            )
        resp = self.responses.get(response_id)
        if resp is not None and resp.active:
            return resp
        if resp is not None or response_id in self._finished:
            raise ProtocolError(
                ErrorCode.RESPONSE_NOT_ACTIVE,
                f"response {response_id} has already finished",
                event_id=event_id,
                param="response_id",
            )
        raise ProtocolError(
            ErrorCode.UNKNOWN_RESPONSE,
            f"no response {response_id!r} in this session",
            event_id=event_id,
            param="response_id",
        )

    def _make_item(self, fields: dict[str, Any]) -> dict[str, Any]:
        item = {"id": fields.pop("id", None) or new_id("item"), "object": "realtime.item"}
        item.update(fields)
        item.setdefault("status", "completed")
        return item

    def _new_item(
        self, raw: p.MessageItem | p.FunctionCallOutputItem, event_id: str | None
    ) -> dict[str, Any]:
        fields = raw.model_dump(exclude_none=True)
        if fields.get("id") in self._items_by_id:
            raise ProtocolError(
                ErrorCode.DUPLICATE_ITEM_ID,
                f"an item {fields['id']!r} already exists",
                event_id=event_id,
                param="item.id",
            )
        if isinstance(raw, p.FunctionCallOutputItem):
            raise ProtocolError(
                ErrorCode.UNKNOWN_CALL_ID,
                f"no pending function call {raw.call_id!r} in this session",
                event_id=event_id,
                param="item.call_id",
            )
        return self._make_item(fields)

    def _check_previous(self, previous_item_id: str | None, event_id: str | None) -> None:
        if previous_item_id is not None and previous_item_id not in self._items_by_id:
            raise ProtocolError(
                ErrorCode.UNKNOWN_ITEM,
                f"no item {previous_item_id!r} in the conversation",
                event_id=event_id,
                param="previous_item_id",
            )

    def _insert_item(self, item: dict[str, Any], previous_item_id: str | None) -> None:
        if previous_item_id is None:
            self.items.append(item)
        else:
            index = next(i for i, it in enumerate(self.items) if it["id"] == previous_item_id)
            self.items.insert(index + 1, item)
        self._items_by_id[item["id"]] = item

    def _append_context(self, resp: Response, item: dict[str, Any]) -> None:
        if resp.in_conversation:
            self._insert_item(item, None)
        else:
            resp.context.append(item)

    def _next_request(self, resp: Response) -> GenerationRequest:
        """The engine request for the response's next generation; changes nothing."""
        params = resp.params
        return GenerationRequest(
            request_id=f"{resp.id}-{resp.generation + 1}",
            messages=self._render(resp),
            max_output_tokens=self._remaining_tokens(resp),
            temperature=params["temperature"],
            ignore_eos=params["ignore_eos"],
        )

    def _start_generation(self, resp: Response, request: GenerationRequest | None = None) -> None:
        request = request or self._next_request(resp)
        item = self._make_item(
            {"type": "message", "role": "assistant", "content": "", "status": "in_progress"}
        )
        self._append_context(resp, item)
        resp.current_item = item
        resp.output.append(item)
        resp.generation += 1
        resp.request_id = request.request_id
        self._requests[resp.request_id] = resp.id
        self._actions.append(StartGeneration(resp.id, request))

    def _remaining_tokens(self, resp: Response) -> int | None:
        limit = resp.params["max_output_tokens"]
        return None if limit is None else max(limit - resp.output_tokens, 1)

    def _render(self, resp: Response) -> list[dict[str, Any]]:
        """Chat messages for the engine's chat template."""
        messages: list[dict[str, Any]] = []
        if resp.params["instructions"]:
            messages.append({"role": "system", "content": resp.params["instructions"]})
        for item in resp.context:
            if item["type"] == "message" and (item["content"] or item["role"] != "assistant"):
                messages.append({"role": item["role"], "content": item["content"]})
        return messages

    def _abort_current(self, resp: Response) -> None:
        if resp.request_id is not None:
            self._actions.append(AbortGeneration(resp.id, resp.request_id))
            self._requests.pop(resp.request_id, None)
            resp.request_id = None

    def _close_current_item(self, resp: Response, status: str) -> dict[str, Any] | None:
        item, resp.current_item = resp.current_item, None
        if item is None:
            return None
        item["status"] = status
        self._emit(
            {
                "type": "response.output_text.done",
                "response_id": resp.id,
                "item_id": item["id"],
                "text": item["content"],
            }
        )
        return item

    def _finish(self, resp: Response, status: str, details: dict[str, Any] | None) -> None:
        self._close_current_item(resp, "completed" if status == "completed" else "incomplete")
        resp.status = status
        resp.status_details = details
        resp.done_at = self.clock()
        self._emit({"type": "response.done", "response": self._describe(resp)})
        # Keep only a bounded record of finished responses.
        del self.responses[resp.id]
        self._finished[resp.id] = status
        while len(self._finished) > 256:
            self._finished.popitem(last=False)

    def _describe(self, resp: Response) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": resp.id,
            "object": "realtime.response",
            "status": resp.status,
            "status_details": resp.status_details,
            "conversation": "auto" if resp.in_conversation else "none",
            "metadata": resp.metadata,
            # Copies: the event is encoded later, after the items have moved on.
            "output": [dict(item) for item in resp.output],
        }
        if resp.done_at is not None:
            out["usage"] = {
                "input_tokens": resp.input_tokens,
                "output_tokens": resp.output_tokens,
                "cached_tokens": resp.cached_tokens,
                "total_tokens": resp.input_tokens + resp.output_tokens,
            }
            total = resp.done_at - resp.created_at
            ttft = None if resp.first_token_at is None else resp.first_token_at - resp.created_at
            decode = total - ttft if ttft is not None else 0.0
            out["timings"] = {
                "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
                "total_ms": round(total * 1000, 2),
                "output_tokens_per_s": (
                    round((resp.output_tokens - 1) / decode, 2)
                    if decode > 0 and resp.output_tokens > 1
                    else None
                ),
            }
        return out
