"""One conversation and its responses, as a sans-I/O state machine.

Modelled on websockets' `Protocol`: inputs go in through `receive_*`
methods; the server events to send come out of `events_to_send()` and the
work to do (engine requests, timers) out of `actions_to_perform()`. Nothing
here awaits, so every transition is unit-tested without sockets or engines.

Server events come out *without* `seq`; the `Outbox` numbers them as they are
written, after any merging, so `seq` never has gaps.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import jsonschema

from . import protocol as p
from .engines.base import EngineDelta, EngineError, GenerationRequest
from .limits import TokenBucket
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


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Call `receive_timeout(response_id, token)` after `delay_s`."""

    response_id: str
    token: int
    delay_s: float


Action = StartGeneration | AbortGeneration | StartTimer


# ---------------------------------------------------------------------------
# State


@dataclass(slots=True)
class SessionLimits:
    max_active_responses: int = 8
    # Default cap on output tokens when neither session nor response sets one.
    default_max_output_tokens: int | None = None
    tool_timeout_s: float = 60.0
    # Text the conversation may hold (client items and model output); new
    # input past it is refused, which bounds a session's memory.
    max_conversation_bytes: int = 1 << 20
    # Client events per second (burst: twice that); 0 means unlimited.
    max_events_per_s: float = 0.0


class Quota(Protocol):
    """Limits shared by all sessions of one API key (see limits.KeyUsage)."""

    def acquire_response(self) -> tuple[ErrorCode, str] | None: ...

    def release_response(self) -> None: ...

    def spend_tokens(self, n: int) -> None: ...


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
    tool_choice: str | dict[str, Any] = "auto"
    status: str = "in_progress"
    status_details: dict[str, Any] | None = None
    output: list[dict[str, Any]] = field(default_factory=list)
    current_item: dict[str, Any] | None = None  # the assistant text being written
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # this generation's
    pending_calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # call_id -> item
    request_id: str | None = None
    # The current generation's request and the token ids it has produced:
    # what a paused response resubmits.
    gen_request: GenerationRequest | None = None
    gen_token_ids: list[int] = field(default_factory=list)
    paused: bool = False
    logged_ids: int = 0  # gen_token_ids already in the event log (progress())
    generation: int = 0
    wait_token: int = 0
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
        quota: Quota | None = None,
    ) -> None:
        self.id = session_id or new_id("sess")
        self.limits = limits or SessionLimits()
        self.clock = clock
        # The engine's pre-flight check (context length); raises EngineError.
        self._check_request = check_request
        self._quota = quota
        rate = self.limits.max_events_per_s
        self._events_bucket = TokenBucket(rate, 2 * rate, clock) if rate > 0 else None
        self.config: dict[str, Any] = {
            "instructions": None,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "max_output_tokens": None,
            "tool_timeout_s": self.limits.tool_timeout_s,
        }
        self._info = dict(info or {})
        self.items: list[dict[str, Any]] = []
        self._items_by_id: dict[str, dict[str, Any]] = {}
        self.responses: dict[str, Response] = {}
        # Finished responses, kept briefly so a late cancel gets a precise error.
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._requests: dict[str, str] = {}  # engine request id -> response id
        # Every function call: call_id -> (item, owning response id, answered?)
        self._calls: dict[str, tuple[dict[str, Any], str, bool]] = {}
        self._events: list[dict[str, Any]] = []
        self._actions: list[Action] = []
        self.history_bytes = 0
        # Client frames taken so far (a resume request excepted): a resuming
        # client resends only what comes after them.
        self.client_events = 0
        self.closed = False
        self._emit({"type": "session.created", "session": self.describe()})

    # -- outputs -----------------------------------------------------------

    def events_to_send(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def actions_to_perform(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def update_info(self, **info: Any) -> None:
        """Facts about the session the transport knows (e.g. its subprotocol)."""
        self._info.update(info)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.session", **self._info, **self.config}

    @property
    def active_responses(self) -> list[Response]:
        return [r for r in self.responses.values() if r.active]

    # -- client input ------------------------------------------------------

    def receive_client_event(self, obj: Any) -> None:
        """Take one decoded frame; bad input becomes an `error` event."""
        self.client_events += 1
        try:
            try:
                p.check_values(obj)  # the transport's decoder checks too; this is the API
            except ValueError as exc:
                raise ProtocolError(ErrorCode.MALFORMED_FRAME, str(exc)) from None
            if self._events_bucket is not None and not self._events_bucket.take():
                event_id = obj.get("event_id") if isinstance(obj, dict) else None
                raise ProtocolError(
                    ErrorCode.RATE_LIMIT_EXCEEDED,
                    f"more than {self.limits.max_events_per_s:g} events per second; this one "
                    "was dropped",
                    event_id=event_id
                    if isinstance(event_id, str) and len(event_id) <= 128
                    else None,
                )
            event = p.parse_client_event(obj)
            getattr(self, "_on_" + event.type.replace(".", "_"))(event)
        except ProtocolError as err:
            self._emit(err.to_event())

    def receive_protocol_error(self, err: ProtocolError, *, frame: bool = True) -> None:
        """A frame the transport could not decode; `frame=False` for an error
        about no frame of this session (a refused resume)."""
        self.client_events += frame
        self._emit(err.to_event())

    def _on_session_update(self, ev: p.SessionUpdate) -> None:
        update = ev.session.model_dump(exclude_none=True)
        tools = update.get("tools", self.config["tools"])
        choice = update.get("tool_choice", self.config["tool_choice"])
        self._check_tool_choice(choice, tools, ev.event_id, "session.tool_choice")
        self.config.update(update)
        self._emit({"type": "session.updated", "session": self.describe()}, ev.event_id)

    def _on_conversation_item_create(self, ev: p.ConversationItemCreate) -> None:
        if ev.previous_item_id is not None and not any(
            it["id"] == ev.previous_item_id for it in self.items
        ):
            raise ProtocolError(
                ErrorCode.UNKNOWN_ITEM,
                f"no item {ev.previous_item_id!r} in the conversation",
                event_id=ev.event_id,
                param="previous_item_id",
            )
        if isinstance(ev.item, p.FunctionCallOutputItem):
            self._receive_call_output(ev.item, ev.event_id)
            return
        item = self._new_item(ev.item, ev.event_id)
        size = len(ev.item.content.encode())
        self._check_room(size, ev.event_id)
        self.history_bytes += size
        previous = ev.previous_item_id or (self.items[-1]["id"] if self.items else None)
        self._insert_item(item, ev.previous_item_id)
        self._emit_item_created(item, previous, ev.event_id)

    def _on_conversation_item_retrieve(self, ev: p.ConversationItemRetrieve) -> None:
        item = self._item(ev.item_id, ev.event_id)
        self._emit({"type": "conversation.item.retrieved", "item": dict(item)}, ev.event_id)

    def _on_conversation_item_truncate(self, ev: p.ConversationItemTruncate) -> None:
        item = self._item(ev.item_id, ev.event_id)
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
        conv_active = [r for r in self.active_responses if r.in_conversation]
        if in_conversation and conv_active:
            raise ProtocolError(
                ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                f"response {conv_active[0].id} is still active in this conversation; wait for "
                'its response.done, cancel it, or use conversation:"none"',
                event_id=ev.event_id,
            )
        if len(self.active_responses) >= self.limits.max_active_responses:
            raise ProtocolError(
                ErrorCode.TOO_MANY_RESPONSES,
                f"at most {self.limits.max_active_responses} responses may run at once",
                event_id=ev.event_id,
            )
        given = rp.model_dump(exclude_none=True)
        params = {
            key: given.get(key, self.config[key])
            for key in (
                "instructions",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "temperature",
                "max_output_tokens",
                "tool_timeout_s",
            )
            if key in self.config
        }
        params["max_output_tokens"] = (
            params["max_output_tokens"] or self.limits.default_max_output_tokens
        )
        params["ignore_eos"] = rp.ignore_eos
        self._check_tool_choice(
            params["tool_choice"], params["tools"], ev.event_id, "response.tool_choice"
        )
        inputs = [
            self._new_item(raw, ev.event_id)
            for raw in rp.input or []
            if isinstance(raw, p.MessageItem)
        ]
        if len({i["id"] for i in inputs}) < len(inputs):
            raise ProtocolError(
                ErrorCode.DUPLICATE_ITEM_ID,
                "two input items share an id",
                event_id=ev.event_id,
                param="response.input",
            )
        if any(isinstance(raw, p.FunctionCallOutputItem) for raw in rp.input or []):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                "send function_call_output items with conversation.item.create",
                event_id=ev.event_id,
                param="response.input",
            )
        resp = Response(
            id=new_id("resp"),
            event_id=ev.event_id,
            in_conversation=in_conversation,
            params=params,
            metadata=rp.metadata,
            context=self.items if in_conversation else inputs,
            created_at=self.clock(),
            tool_choice=params["tool_choice"],
        )
        request = self._next_request(resp, extra=inputs if in_conversation else [])
        if self._check_request is not None:
            try:
                self._check_request(request)
            except EngineError as exc:
                raise ProtocolError(exc.code, exc.message, event_id=ev.event_id) from None
        size = sum(len(i["content"].encode()) for i in inputs)
        self._check_room(size, ev.event_id)
        # Last check: from here on the response exists and holds its slot.
        if self._quota is not None and (problem := self._quota.acquire_response()):
            raise ProtocolError(problem[0], problem[1], event_id=ev.event_id)
        self.history_bytes += size
        if in_conversation:
            for item in inputs:
                previous = self.items[-1]["id"] if self.items else None
                self._insert_item(item, None)
                self._emit_item_created(item, previous, None)
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
                f"response {resp.id} is {resp.status}; only a generating response can be "
                "steered (send the pending function_call_output items instead)",
                event_id=ev.event_id,
            )
        size = len(ev.input.encode())
        self._check_room(size, ev.event_id)
        steer_item = self._make_item({"type": "message", "role": "user", "content": ev.input})
        # The partial text is already in the context; the steer goes after it.
        # Check that exact request first, so a steer that cannot fit leaves
        # the running generation alone.
        request = self._next_request(resp, extra=[steer_item])
        if self._check_request is not None:
            try:
                self._check_request(request)
            except EngineError as exc:
                raise ProtocolError(exc.code, exc.message, event_id=ev.event_id) from None
        self.history_bytes += size
        self._abort_current(resp)
        previous = self._close_text_item(resp, "incomplete")
        self._drop_partial_calls(resp)
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
        self._start_generation(resp, request)

    def _on_session_resume(self, ev: p.SessionResume) -> None:
        raise ProtocolError(
            ErrorCode.INVALID_STATE,
            "session.resume must be the first event on a new connection",
            event_id=ev.event_id,
        )

    def _receive_call_output(self, raw: p.FunctionCallOutputItem, event_id: str | None) -> None:
        known = self._calls.get(raw.call_id)
        if known is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_CALL_ID,
                f"no function call {raw.call_id!r} in this session",
                event_id=event_id,
                param="item.call_id",
            )
        call_item, response_id, answered = known
        resp = self.responses.get(response_id)
        if resp is None and call_item not in self.items:
            raise ProtocolError(
                ErrorCode.RESPONSE_NOT_ACTIVE,
                f'call {raw.call_id!r} came from a conversation:"none" response that has '
                "finished; its output has nowhere to go",
                event_id=event_id,
                param="item.call_id",
            )
        if answered:
            raise ProtocolError(
                ErrorCode.DUPLICATE_CALL_OUTPUT,
                f"call {raw.call_id!r} already has its output",
                event_id=event_id,
                param="item.call_id",
            )
        item = self._new_item(raw, event_id)
        self._check_room(len(raw.output.encode()), event_id)
        self.history_bytes += len(raw.output.encode())
        self._calls[raw.call_id] = (call_item, response_id, True)
        context = resp.context if resp is not None else self.items
        previous = context[-1]["id"] if context else None
        if resp is not None:
            self._append_context(resp, item)
        else:
            self._insert_item(item, None)
        self._emit_item_created(item, previous, event_id)
        if resp is not None and resp.status == "requires_action":
            resp.pending_calls.pop(raw.call_id, None)
            if not resp.pending_calls:
                # Every output is in: the same response goes on by itself.
                resp.status = "in_progress"
                resp.wait_token += 1
                if resp.tool_choice != "auto":
                    resp.tool_choice = "none"  # a forced call is made once, not forever
                self._start_generation(resp)

    # -- engine and timer input --------------------------------------------

    def receive_engine_output(self, request_id: str, delta: EngineDelta) -> None:
        resp = self._response_for(request_id)
        if resp is None:
            return  # a request we already aborted; its late outputs are dropped
        if delta.prompt_tokens is not None:
            resp.input_tokens += delta.prompt_tokens
            resp.cached_tokens += delta.cached_tokens or 0
        resp.output_tokens += delta.output_tokens
        if self._quota is not None:
            self._quota.spend_tokens(delta.output_tokens)
        if delta.token_ids:
            resp.gen_token_ids.extend(delta.token_ids)
        if (delta.text or delta.tool_calls) and resp.first_token_at is None:
            resp.first_token_at = self.clock()
        if delta.text:
            self._receive_text(resp, delta.text)
        for chunk in delta.tool_calls or ():
            self._receive_call_chunk(resp, chunk.index, chunk.name, chunk.arguments)
        if delta.finish_reason is not None:
            self._requests.pop(request_id, None)
            resp.request_id = None
            self._end_generation(resp, delta.finish_reason)

    def receive_engine_error(self, request_id: str, code: ErrorCode, message: str) -> None:
        resp = self._response_for(request_id)
        if resp is None:
            return
        self._requests.pop(request_id, None)
        resp.request_id = None
        self._fail(resp, code, message)

    def receive_timeout(self, response_id: str, token: int) -> None:
        resp = self.responses.get(response_id)
        if resp is None or resp.status != "requires_action" or resp.wait_token != token:
            return  # outputs arrived, or the response ended, before the timer fired
        self._finish(resp, "incomplete", {"type": "incomplete", "reason": "tool_timeout"})

    def pause(self) -> list[str]:
        """The client is too far behind: free the engine slots of its text
        generations. Returns the ids of the responses paused."""
        paused = []
        for resp in self.active_responses:
            req = resp.gen_request
            # Tool-call generations are short and their parsers keep state; leave them.
            if resp.request_id is None or req is None or req.tools is not None:
                continue
            self._abort_current(resp)
            resp.paused = True
            paused.append(resp.id)
        return paused

    def suspend(self) -> None:
        """Stop every generation without ending its response: the session is
        handed to another instance, which restores it and calls resume()."""
        for resp in self.active_responses:
            if resp.request_id is not None:
                self._abort_current(resp)
                resp.paused = True

    def abandon(self) -> None:
        """Another instance owns this session now: stop and forget its responses."""
        self.suspend()
        for resp in self.active_responses:
            if self._quota is not None:
                self._quota.release_response()
            del self.responses[resp.id]
        self._events.clear()
        self.closed = True

    def resume(self) -> list[str]:
        """The client drained: continue paused generations after their tokens."""
        resumed = []
        for resp in self.active_responses:
            if not resp.paused:
                continue
            resp.paused = False
            assert resp.gen_request is not None
            if resp.gen_request.tools is not None:
                # Only a takeover stops a tool-call generation (pause() never
                # does), and its parser state is gone: run it again from the start.
                self._drop_partial_calls(resp)
                self._close_text_item(resp, "incomplete")
                self._start_generation(resp)
                resumed.append(resp.id)
                continue
            request = replace(
                resp.gen_request,
                request_id=f"{resp.id}-{resp.generation + 1}",
                max_output_tokens=self._remaining_tokens(resp),
                resume_token_ids=tuple(resp.gen_token_ids),
            )
            self._start_generation(resp, request, fresh=False)
            resumed.append(resp.id)
        return resumed

    def close(self) -> None:
        """The client went away: stop every generation it owns."""
        for resp in self.active_responses:
            self._abort_current(resp)
            self._finish(resp, "cancelled", {"type": "cancelled", "reason": "client_disconnected"})
        self.closed = True

    # -- internals: output ---------------------------------------------------

    def _receive_text(self, resp: Response, text: str) -> None:
        item = self._append_text(resp, text)
        self._emit(
            {
                "type": "response.output_text.delta",
                "response_id": resp.id,
                "item_id": item["id"],
                "delta": text,
            }
        )

    def _append_text(self, resp: Response, text: str, item_id: str | None = None) -> dict[str, Any]:
        """Add text to the response's current message (made on first text)."""
        item = resp.current_item
        if item is None:
            item = self._make_item(
                {
                    "id": item_id,
                    "type": "message",
                    "role": "assistant",
                    "content": "",
                    "status": "in_progress",
                }
            )
            self._add_output(resp, item)
            resp.current_item = item
        item["content"] += text
        self.history_bytes += len(text.encode())
        return item

    def _receive_call_chunk(
        self, resp: Response, index: int, name: str | None, arguments: str
    ) -> None:
        item = self._append_call_chunk(resp, index, name, arguments)
        self._emit(
            {
                "type": "response.function_call_arguments.delta",
                "response_id": resp.id,
                "item_id": item["id"],
                "call_id": item["call_id"],
                "name": item["name"],
                "delta": arguments,
            }
        )

    def _append_call_chunk(
        self,
        resp: Response,
        index: int,
        name: str | None,
        arguments: str,
        item_id: str | None = None,
        call_id: str | None = None,
    ) -> dict[str, Any]:
        """Add arguments to the index-th call of this generation (made on its first chunk)."""
        item = resp.calls.get(index)
        if item is None:
            item = self._make_item(
                {
                    "id": item_id,
                    "type": "function_call",
                    "call_id": call_id or new_id("call"),
                    "name": name or "",
                    "arguments": "",
                    "status": "in_progress",
                }
            )
            self._add_output(resp, item)
            resp.calls[index] = item
        item["arguments"] += arguments
        self.history_bytes += len(arguments.encode())
        return item

    def _end_generation(self, resp: Response, finish_reason: str) -> None:
        if finish_reason not in ("stop", "length"):
            self._finish(resp, "incomplete", {"type": "incomplete", "reason": "engine_aborted"})
        elif finish_reason == "length" and not resp.params["ignore_eos"]:
            self._finish(resp, "incomplete", {"type": "incomplete", "reason": "max_output_tokens"})
        elif resp.calls:
            self._close_text_item(resp, "completed")
            self._emit_calls(resp)
        else:
            self._finish(resp, "completed", None)

    def _emit_calls(self, resp: Response) -> None:
        """The generation ended in tool calls: check them, then wait for outputs."""
        tools = {t["name"]: t for t in resp.params["tools"]}
        calls = [resp.calls[i] for i in sorted(resp.calls)]
        resp.calls = {}
        for item in calls:
            problem = self._check_arguments(item, tools)
            if problem is not None:
                for call in calls:
                    call["status"] = "incomplete"
                message = f"call {item['call_id']} to {item['name']!r}: {problem}"
                self._fail(resp, ErrorCode.INVALID_TOOL_ARGUMENTS, message)
                return
        for item in calls:
            item["status"] = "completed"
            self._calls[item["call_id"]] = (item, resp.id, False)
            resp.pending_calls[item["call_id"]] = item
            self._emit(
                {
                    "type": "response.function_call_arguments.done",
                    "response_id": resp.id,
                    "item_id": item["id"],
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        resp.status = "requires_action"
        resp.wait_token += 1
        self._emit(
            {
                "type": "response.requires_action",
                "response_id": resp.id,
                "call_ids": list(resp.pending_calls),
            }
        )
        self._actions.append(StartTimer(resp.id, resp.wait_token, resp.params["tool_timeout_s"]))

    @staticmethod
    def _check_arguments(item: dict[str, Any], tools: dict[str, dict[str, Any]]) -> str | None:
        tool = tools.get(item["name"])
        if tool is None:
            return "the model called a tool that is not defined"
        try:
            arguments = json.loads(item["arguments"])
        except ValueError as exc:
            return f"the arguments are not valid JSON ({exc})"
        try:
            error = jsonschema.exceptions.best_match(
                _ArgumentsValidator(tool["parameters"]).iter_errors(arguments)
            )
        except Exception as exc:  # an unresolvable $ref, a broken schema: the client's tool
            return f"the tool's parameters schema cannot be used: {type(exc).__name__}: {exc}"
        if error is not None:
            return f"the arguments fail the tool's schema: {error.message}"
        return None

    def _close_text_item(self, resp: Response, status: str) -> dict[str, Any] | None:
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

    def _drop_partial_calls(self, resp: Response) -> None:
        # Calls cut off mid-arguments cannot be run; they leave the history.
        for item in resp.calls.values():
            if item in resp.context:
                resp.context.remove(item)
            resp.output.remove(item)
            self._items_by_id.pop(item["id"], None)
        resp.calls = {}

    def _fail(self, resp: Response, code: ErrorCode, message: str) -> None:
        self._emit(p.error_event(code, message, event_id=resp.event_id))
        self._finish(
            resp, "failed", {"type": "failed", "error": {"code": str(code), "message": message}}
        )

    def _finish(self, resp: Response, status: str, details: dict[str, Any] | None) -> None:
        self._close_text_item(resp, "completed" if status == "completed" else "incomplete")
        self._drop_partial_calls(resp)
        resp.pending_calls.clear()
        resp.status = status
        resp.status_details = details
        resp.done_at = self.clock()
        if self._quota is not None:
            self._quota.release_response()
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

    # -- internals: items and requests ---------------------------------------

    def _emit(self, event: dict[str, Any], event_id: str | None = None) -> None:
        if event_id is not None:
            event["event_id"] = event_id
        self._events.append(event)

    def _emit_item_created(
        self, item: dict[str, Any], previous: str | None, event_id: str | None
    ) -> None:
        self._emit(
            {"type": "conversation.item.created", "previous_item_id": previous, "item": dict(item)},
            event_id,
        )

    def _response_for(self, request_id: str) -> Response | None:
        response_id = self._requests.get(request_id)
        return self.responses.get(response_id) if response_id else None

    def _find_active(self, response_id: str | None, event_id: str | None, verb: str) -> Response:
        if response_id is None:
            active = self.active_responses
            conv = [r for r in active if r.in_conversation]
            if len(conv) == 1 or len(active) == 1:
                return conv[0] if conv else active[0]
            if not active:
                raise ProtocolError(
                    ErrorCode.RESPONSE_NOT_ACTIVE,
                    f"no active response to {verb}",
                    event_id=event_id,
                )
            raise ProtocolError(
                ErrorCode.MISSING_FIELD,
                f"several responses are active; name one with response_id to {verb}",
                event_id=event_id,
                param="response_id",
            )
        resp = self.responses.get(response_id)
        if resp is not None:
            return resp
        if response_id in self._finished:
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

    def _item(self, item_id: str, event_id: str | None) -> dict[str, Any]:
        item = self._items_by_id.get(item_id)
        if item is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_ITEM,
                f"no item {item_id!r} in the conversation",
                event_id=event_id,
                param="item_id",
            )
        return item

    @staticmethod
    def _check_tool_choice(
        choice: Any, tools: list[dict[str, Any]], event_id: str | None, param: str
    ) -> None:
        names = {t["name"] for t in tools}
        if isinstance(choice, dict | p.NamedToolChoice):
            name = choice["name"] if isinstance(choice, dict) else choice.name
            if name not in names:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD,
                    f"tool_choice names {name!r}, which is not among the tools "
                    f"({sorted(names) or 'none defined'})",
                    event_id=event_id,
                    param=param,
                )
        elif choice == "required" and not names:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                'tool_choice "required" needs at least one tool',
                event_id=event_id,
                param=param,
            )

    def _make_item(self, fields: dict[str, Any]) -> dict[str, Any]:
        item = {"id": fields.pop("id", None) or new_id("item"), "object": "realtime.item"}
        item.update(fields)
        item.setdefault("status", "completed")
        return item

    def _check_room(self, text_bytes: int, event_id: str | None) -> None:
        """Refuse new client text past the conversation's cap; callers count it
        (history_bytes) once every other check has passed."""
        if self.history_bytes + text_bytes > self.limits.max_conversation_bytes:
            raise ProtocolError(
                ErrorCode.CONVERSATION_TOO_LARGE,
                f"the conversation would exceed {self.limits.max_conversation_bytes} bytes of "
                "text; start a new session",
                event_id=event_id,
            )

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
        return self._make_item(fields)

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
            self._items_by_id[item["id"]] = item

    def _add_output(self, resp: Response, item: dict[str, Any]) -> None:
        self._append_context(resp, item)
        resp.output.append(item)

    def _next_request(
        self, resp: Response, extra: list[dict[str, Any]] | None = None
    ) -> GenerationRequest:
        """The engine request for the response's next generation; changes nothing."""
        params = resp.params
        tools = None
        if params["tools"] and resp.tool_choice != "none":
            tools = [
                {
                    "type": "function",
                    "function": {
                        k: t[k] for k in ("name", "description", "parameters") if t.get(k)
                    },
                }
                for t in params["tools"]
            ]
        choice = resp.tool_choice
        if choice == "required" and not params["parallel_tool_calls"]:
            choice = "required_single"
        return GenerationRequest(
            request_id=f"{resp.id}-{resp.generation + 1}",
            messages=render_messages(params["instructions"], [*resp.context, *(extra or [])]),
            max_output_tokens=self._remaining_tokens(resp),
            temperature=params["temperature"],
            ignore_eos=params["ignore_eos"],
            tools=tools,
            tool_choice=choice,
        )

    def _start_generation(
        self, resp: Response, request: GenerationRequest | None = None, fresh: bool = True
    ) -> None:
        request = request or self._next_request(resp)
        if fresh:
            resp.gen_request, resp.gen_token_ids, resp.logged_ids = request, [], 0
        resp.paused = False
        resp.generation += 1
        resp.request_id = request.request_id
        self._requests[resp.request_id] = resp.id
        self._actions.append(StartGeneration(resp.id, request))

    def _remaining_tokens(self, resp: Response) -> int | None:
        limit = resp.params["max_output_tokens"]
        return None if limit is None else max(limit - resp.output_tokens, 1)

    def _abort_current(self, resp: Response) -> None:
        if resp.request_id is not None:
            self._actions.append(AbortGeneration(resp.id, resp.request_id))
            self._requests.pop(resp.request_id, None)
            resp.request_id = None

    # -- handover: a snapshot another instance can continue from -------------

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to continue this session elsewhere, JSON-shaped.

        Taken when the conversation's structure changes; text produced after
        it is carried by the logged delta events (`replay_delta`)."""
        now, wall = self.clock(), time.time()
        return {
            "id": self.id,
            "config": self.config,
            "info": self._info,
            "items": self.items,
            "history_bytes": self.history_bytes,
            "client_events": self.client_events,
            "finished": list(self._finished.items()),
            "calls": {
                cid: [item["id"], rid, done] for cid, (item, rid, done) in self._calls.items()
            },
            "responses": [_describe_state(r, now, wall) for r in self.active_responses],
        }

    @classmethod
    def restore(cls, state: dict[str, Any], **kwargs: Any) -> Session:
        """The session a snapshot describes. Its generations are paused (no
        engine request runs); `resume()` continues them after their tokens."""
        session = cls(session_id=state["id"], **kwargs)
        session._events.clear()  # no session.created: the client knows this session
        session.config.update(state["config"])
        session._info.update({k: v for k, v in state["info"].items() if k != "subprotocol"})
        session.items = state["items"]
        session._items_by_id = {it["id"]: it for it in session.items}
        session.history_bytes = state["history_bytes"]
        session.client_events = state.get("client_events", 0)
        session._finished = OrderedDict((rid, status) for rid, status in state["finished"])
        now, wall = session.clock(), time.time()
        for rs in state["responses"]:
            context = session.items if rs["in_conversation"] else rs["context"]
            for item in context:
                session._items_by_id[item["id"]] = item
            by_id = {it["id"]: it for it in context}
            req = rs["gen_request"]
            resp = Response(
                id=rs["id"],
                event_id=rs["event_id"],
                in_conversation=rs["in_conversation"],
                params=rs["params"],
                metadata=rs["metadata"],
                context=context,
                created_at=now - (wall - rs["created_wall"]),
                tool_choice=rs["tool_choice"],
                status=rs["status"],
                output=[by_id[i] for i in rs["output"]],
                current_item=by_id.get(rs["current_item"] or ""),
                calls={int(k): by_id[v] for k, v in rs["calls"].items()},
                pending_calls={cid: by_id[iid] for cid, iid in rs["pending_calls"].items()},
                gen_request=GenerationRequest(**req) if req else None,
                gen_token_ids=rs["gen_token_ids"],
                paused=rs["status"] == "in_progress",
                generation=rs["generation"],
                wait_token=rs["wait_token"],
                input_tokens=rs["input_tokens"],
                cached_tokens=rs["cached_tokens"],
                output_tokens=rs["output_tokens"],
                first_token_at=None
                if rs["first_token_wall"] is None
                else now - (wall - rs["first_token_wall"]),
            )
            session.responses[resp.id] = resp
            if session._quota is not None:
                session._quota.acquire_response()  # released by _finish, like any response
            if resp.status == "requires_action":
                resp.wait_token += 1
                session._actions.append(
                    StartTimer(resp.id, resp.wait_token, resp.params["tool_timeout_s"])
                )
        for cid, (item_id, rid, done) in state["calls"].items():
            item = session._items_by_id.get(item_id)
            if item is not None:
                session._calls[cid] = (item, rid, done)
        return session

    def replay_delta(self, event: dict[str, Any]) -> None:
        """Fold a logged delta (sent after the snapshot) back into the state."""
        resp = self.responses.get(event.get("response_id", ""))
        if resp is None:
            return
        if event["type"] == "response.output_text.delta":
            self._append_text(resp, event["delta"], event["item_id"])
        elif event["type"] == "response.function_call_arguments.delta":
            index = next(
                (i for i, c in resp.calls.items() if c["id"] == event["item_id"]), len(resp.calls)
            )
            self._append_call_chunk(
                resp, index, event["name"], event["delta"], event["item_id"], event["call_id"]
            )

    def progress(self) -> dict[str, list[Any]]:
        """What the logged deltas do not say: per active response, its output
        tokens and the token ids added since the last call (or snapshot)."""
        out: dict[str, list[Any]] = {}
        for r in self.responses.values():
            if r.active and len(r.gen_token_ids) > r.logged_ids:
                out[r.id] = [r.output_tokens, r.logged_ids, r.gen_token_ids[r.logged_ids :]]
                r.logged_ids = len(r.gen_token_ids)
        return out

    def restore_progress(self, progress: dict[str, list[Any]]) -> None:
        for rid, (output_tokens, start, token_ids) in progress.items():
            resp = self.responses.get(rid)
            if resp is not None:
                resp.output_tokens = output_tokens
                resp.gen_token_ids = resp.gen_token_ids[:start] + list(token_ids)


def _skip(validator: Any, value: Any, instance: Any, schema: Any) -> None:
    return None


# Client-supplied regexes would run against model output here, and Python's
# re has no time limit, so "pattern" is not checked by us (structured
# outputs enforce it while generating forced calls).
_ArgumentsValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"pattern": _skip, "patternProperties": _skip}
)


def _describe_state(resp: Response, now: float, wall: float) -> dict[str, Any]:
    """A response's part of Session.snapshot()."""
    req = resp.gen_request
    resp.logged_ids = len(resp.gen_token_ids)
    return {
        "id": resp.id,
        "event_id": resp.event_id,
        "in_conversation": resp.in_conversation,
        "params": resp.params,
        "metadata": resp.metadata,
        "context": [] if resp.in_conversation else resp.context,
        # Wall clock: the instance that restores it has its own monotonic clock.
        "created_wall": wall - (now - resp.created_at),
        "tool_choice": resp.tool_choice,
        "status": resp.status,
        "output": [item["id"] for item in resp.output],
        "current_item": resp.current_item["id"] if resp.current_item else None,
        "calls": {str(i): item["id"] for i, item in resp.calls.items()},
        "pending_calls": {cid: item["id"] for cid, item in resp.pending_calls.items()},
        "gen_request": None
        if req is None
        else {f: getattr(req, f) for f in req.__dataclass_fields__},
        "gen_token_ids": resp.gen_token_ids,
        "generation": resp.generation,
        "wait_token": resp.wait_token,
        "input_tokens": resp.input_tokens,
        "cached_tokens": resp.cached_tokens,
        "output_tokens": resp.output_tokens,
        "first_token_wall": None
        if resp.first_token_at is None
        else wall - (now - resp.first_token_at),
    }


def render_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat-completions messages, for the engine's chat template."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            if item["content"] or item["role"] != "assistant":
                messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call" and item["status"] == "completed":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            # Parallel calls (and text before them) make one assistant turn.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages
