"""One session and its responses, as a sans-I/O state machine.

Modelled on websockets' `Protocol`: inputs go in through `receive_*`
methods; the server events to send come out of `events_to_send()` and the
work to do (engine requests, timers) out of `actions_to_perform()`. Nothing
here awaits, so every transition is unit-tested without sockets or engines.

Server events come out *without* `seq`; the `Outbox` numbers them as they are
written, after any merging, so `seq` never has gaps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..engines.base import EngineCapabilities, EngineDelta, EngineError, TokenizeOffLoop
from . import events as ev
from . import schema as s
from . import snapshot
from .conversation import (
    ITEM_BYTES,
    Conversation,
    Item,
    item_text,
    make_item,
    new_id,
    new_secret_id,
)
from .errors import ErrorCode, ProtocolError
from .events import Action, Outputs
from .lifecycle import Lifecycle, Preflight, Quota, forget_call
from .limits import TokenBucket
from .response import Response, ResponseStatus
from .tools import ToolFlow, check_tool_choice

# The settings a response takes from the session unless it sets its own.
_RESPONSE_SETTINGS = (
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "max_output_tokens",
    "tool_timeout_s",
    "priority",
)


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
    # The best (lowest) priority this session may ask for, set per API key so a
    # batch key cannot jump the queue; None: any. Also its default priority.
    min_priority: int | None = None
    # The engine's cache_salt for every request (per API key): prefix caches apart.
    cache_salt: str | None = None


def check_priority(
    floor: int | None, priority: int | None, event_id: str | None, param: str
) -> None:
    """`floor`: the best priority the session's API key may ask for."""
    if priority is not None and floor is not None and priority < floor:
        raise ProtocolError(
            ErrorCode.PRIORITY_NOT_ALLOWED,
            f"priority {priority} is not allowed for this API key; its best is {floor} "
            "(a lower value runs first)",
            event_id=event_id,
            param=param,
        )


def find_active(
    lifecycle: Lifecycle, openai: bool, response_id: str | None, event_id: str | None, verb: str
) -> Response:
    """The response a cancel or steer names; without a name, the only one
    (OpenAI: the conversation's)."""
    if response_id is None:
        active = lifecycle.active
        conv = [r for r in active if r.in_conversation]
        if openai and not conv:  # OpenAI: only the conversation's response
            raise ProtocolError(
                ErrorCode.RESPONSE_NOT_ACTIVE,
                f"no active response in the conversation to {verb}; name a "
                'conversation:"none" one with response_id',
                event_id=event_id,
            )
        if len(conv) == 1 or len(active) == 1:
            if not conv and active[0].created_at < lifecycle.auto_done_at:
                # The conversation's response ended meanwhile: it may be the one meant.
                raise ProtocolError(
                    ErrorCode.RESPONSE_NOT_ACTIVE,
                    f"the conversation's response has ended; name the "
                    f'conversation:"none" one with response_id to {verb} it',
                    event_id=event_id,
                )
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
    resp = lifecycle.responses.get(response_id)
    if resp is not None:
        return resp
    if response_id in lifecycle.finished:
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


class Session:
    def __init__(
        self,
        *,
        session_id: str | None = None,
        limits: SessionLimits | None = None,
        info: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        preflight: Preflight | None = None,
        capabilities: EngineCapabilities | None = None,
        quota: Quota | None = None,
        settings: dict[str, Any] | None = None,
        tool_flow: ToolFlow = ToolFlow.CONTINUE,
    ) -> None:
        self.id = session_id or new_secret_id("sess")
        self.limits = limits or SessionLimits()
        self.clock = clock
        # Without an engine's word: what the scripted and vLLM engines can do.
        capabilities = capabilities or EngineCapabilities(
            resume_from_token_ids=True, preflight=True
        )
        rate = self.limits.max_events_per_s
        # A burst of at least one event, or a rate below 0.5/s would refuse all.
        self._events_bucket = TokenBucket(rate, max(2 * rate, 1), clock) if rate > 0 else None
        self.config: dict[str, Any] = {
            "instructions": None,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "max_output_tokens": None,
            "tool_timeout_s": self.limits.tool_timeout_s,
            "priority": max(self.limits.min_priority or 0, 0),
        }
        # Settings the server gave this session before its client spoke (a
        # client secret's), already checked: like a first session.update.
        self.config.update(settings or {})
        self.info = dict(info or {})
        self.conversation = Conversation(self.limits.max_conversation_bytes)
        # The client flow is OpenAI's, and so is its conversation: previous_item_id
        # "root" is the start, a call output is placed like any item, and a cancel
        # without response_id means the conversation's response.
        self._openai = tool_flow is ToolFlow.CLIENT
        self._received_at: float | None = None  # of an event taken `again`
        self._out = Outputs()
        self.lifecycle = Lifecycle(
            self.id,
            self._out,
            self.conversation,
            clock,
            capabilities,
            preflight if capabilities.preflight else None,
            quota,
            tool_flow,
            self.limits.cache_salt,
        )
        # Called once or more per token: bound straight to their owners, so
        # the per-token path takes no extra hop through the session.
        self.events_to_send: Callable[[], list[dict[str, Any]]] = self._out.take_events
        self.actions_to_perform: Callable[[], list[Action]] = self._out.take_actions
        self.receive_engine_output: Callable[[str, EngineDelta], None] = (
            self.lifecycle.receive_engine_output
        )
        # Client frames taken so far (a resume request excepted): a resuming
        # client resends only what comes after them.
        self.client_events = 0
        self.closed = False
        self._emit({"type": ev.SESSION_CREATED, "session": self.describe()})

    # -- outputs -----------------------------------------------------------

    def update_info(self, **info: Any) -> None:
        """Facts about the session the runtime knows (e.g. its subprotocol)."""
        self.info.update(info)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.session", **self.info, **self.config}

    @property
    def items(self) -> list[Item]:
        return self.conversation.items

    @property
    def history_bytes(self) -> int:
        return self.conversation.history_bytes

    @property
    def responses(self) -> dict[str, Response]:
        return self.lifecycle.responses

    @property
    def active_responses(self) -> list[Response]:
        return self.lifecycle.active

    # -- handover (see core.snapshot) ----------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return snapshot.take(self)

    @classmethod
    def restore(cls, state: dict[str, Any], **kwargs: Any) -> Session:
        session = cls(session_id=state["id"], **kwargs)
        snapshot.restore_into(session, state)
        session._openai = session.lifecycle.tool_flow is ToolFlow.CLIENT  # as it began
        return session

    def replay_delta(self, event: dict[str, Any]) -> None:
        snapshot.replay_delta(self, event)

    def progress(self) -> dict[str, list[Any]]:
        return snapshot.progress(self)

    def restore_progress(self, record: dict[str, list[Any]]) -> None:
        snapshot.restore_progress(self, record)

    # -- client input ------------------------------------------------------

    def receive_client_event(
        self, obj: Any, *, checked: bool = False, again: float | None = None
    ) -> None:
        """Take one client event (internal schema, as a dialect parsed it; `checked`:
        its values passed `check_values`); bad input becomes an `error` event.
        A closed session ignores it: nothing may start once its responses are ended.
        A preflight may raise TokenizeOffLoop out of it, having changed nothing
        but the rate: the event is not taken, nor counted, until the caller
        hands it over `again` with the clock reading it first came at (the rate
        is not charged twice; a response's timings start there)."""
        if self.closed:
            return
        self._received_at = again
        self.client_events += 1
        try:
            try:
                checked or s.check_values(obj)
            except ValueError as exc:
                raise ProtocolError(ErrorCode.MALFORMED_FRAME, str(exc)) from None
            if again is None and self._over_rate():
                raise self._rate_error(s.event_id_of(obj))
            event = s.parse_client_event(obj)
            self._HANDLERS[event.type](self, event)
        except ProtocolError as err:
            self._emit(err.to_event())
        except TokenizeOffLoop:
            self.client_events -= 1  # a resume before it is taken must resend it
            raise

    def receive_protocol_error(self, err: ProtocolError, *, frame: bool = True) -> None:
        """A frame the dialect could not parse; `frame=False` for an error
        about no frame of this session (a refused resume)."""
        if self.closed:
            return
        self.client_events += frame
        if frame and self._over_rate():
            err = self._rate_error(err.event_id)  # a bad frame counts as an event too
        self._emit(err.to_event())

    def _over_rate(self) -> bool:
        return self._events_bucket is not None and not self._events_bucket.take()

    def _rate_error(self, event_id: str | None) -> ProtocolError:
        return ProtocolError(
            ErrorCode.RATE_LIMIT_EXCEEDED,
            f"more than {self.limits.max_events_per_s:g} events per second; this one was dropped",
            event_id=event_id,
        )

    def _on_session_update(self, ev_: s.SessionUpdate) -> None:
        update = ev_.session.given()
        tools = update.get("tools", self.config["tools"])
        choice = update.get("tool_choice", self.config["tool_choice"])
        check_tool_choice(choice, tools, ev_.event_id, "session.tool_choice")
        check_priority(
            self.limits.min_priority, update.get("priority"), ev_.event_id, "session.priority"
        )
        self.config.update(update)
        self._emit({"type": ev.SESSION_UPDATED, "session": self.describe()}, ev_.event_id)

    def _on_conversation_item_create(self, ev_: s.ConversationItemCreate) -> None:
        conv, after = self.conversation, ev_.previous_item_id
        conv.check_previous(after, ev_.event_id, root=self._openai)
        if isinstance(ev_.item, s.FunctionCallOutputItem):
            # tokenwire v1 appends outputs to their response's history (§7).
            place = after if self._openai else None
            self.lifecycle.receive_call_output(ev_.item, ev_.event_id, place)
            return
        item = conv.new_item(ev_.item, ev_.event_id)
        conv.check_room(len(ev_.item.content.encode()), ev_.event_id)
        conv.add_bytes(ev_.item.content)
        previous = conv.insert(item, after, root=self._openai)
        self._emit_item_created(item, previous, ev_.event_id)

    def _on_conversation_item_retrieve(self, ev_: s.ConversationItemRetrieve) -> None:
        # OpenAI's retrieve reads the conversation: not an out-of-band response's items.
        item = self.conversation.get(ev_.item_id, ev_.event_id, listed=self._openai)
        self._emit({"type": ev.CONVERSATION_ITEM_RETRIEVED, "item": dict(item)}, ev_.event_id)

    def _on_conversation_item_delete(self, ev_: s.ConversationItemDelete) -> None:
        # What an active response still writes, and the outputs its next
        # round reads (its calls would go on without their answers).
        active = self.active_responses
        busy = {item["id"] for r in active for item in r.output}
        waited = {c["call_id"] for r in active for c in r.output if c["type"] == "function_call"}
        busy |= {
            it["id"]
            for it in self.conversation.items
            if it["type"] == "function_call_output" and it["call_id"] in waited
        }
        item = self.conversation.delete(ev_.item_id, busy, ev_.event_id)
        forget_call(self.lifecycle.calls, item)
        self._emit({"type": ev.CONVERSATION_ITEM_DELETED, "item_id": item["id"]}, ev_.event_id)

    def _on_conversation_item_truncate(self, ev_: s.ConversationItemTruncate) -> None:
        item = self.conversation.truncate(ev_.item_id, ev_.text_end, ev_.event_id)
        self._emit(
            {
                "type": ev.CONVERSATION_ITEM_TRUNCATED,
                "item_id": item["id"],
                "text_end": ev_.text_end,
            },
            ev_.event_id,
        )

    def _on_response_create(self, ev_: s.ResponseCreate) -> None:
        rp, event_id, conv = ev_.response, ev_.event_id, self.conversation
        in_conversation = rp.conversation == "auto"
        conv_active = [r for r in self.active_responses if r.in_conversation]
        if in_conversation and conv_active:
            raise ProtocolError(
                ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                f"response {conv_active[0].id} is still active in this conversation; wait for "
                'its response.done, cancel it, or use conversation:"none"',
                event_id=event_id,
            )
        if len(self.active_responses) >= self.limits.max_active_responses:
            raise ProtocolError(
                ErrorCode.TOO_MANY_RESPONSES,
                f"at most {self.limits.max_active_responses} responses may run at once",
                event_id=event_id,
            )
        given = rp.given()
        params = {key: given.get(key, self.config[key]) for key in _RESPONSE_SETTINGS}
        limit = params["max_output_tokens"] or self.limits.default_max_output_tokens
        params["max_output_tokens"] = None if limit == "inf" else limit
        params.update(
            ignore_eos=rp.ignore_eos,
            cache=rp.cache,
            seed=rp.seed,
            stream_interval=rp.stream_interval,
        )
        check_tool_choice(params["tool_choice"], params["tools"], event_id, "response.tool_choice")
        check_priority(
            self.limits.min_priority, given.get("priority"), event_id, "response.priority"
        )
        # OpenAI's `input` (`[]` too) is the prompt instead of the conversation,
        # even with "auto", and without it an out-of-band response reads the
        # conversation as it is now. tokenwire v1 appends `input` to the
        # conversation, and a "none" response's prompt is its `input` (§4).
        own = not in_conversation or (self._openai and rp.input is not None)
        calls = self.lifecycle.calls if self._openai else None
        inputs = conv.response_inputs(rp.input, event_id, calls) if rp.input else []
        context = inputs if own else conv.items
        if self._openai and own and rp.input is None:
            context = list(conv.items)
        resp = Response(
            id=new_id("resp"),
            event_id=event_id,
            in_conversation=in_conversation,
            params=params,
            metadata=rp.metadata,
            context=context,
            created_at=self.clock() if self._received_at is None else self._received_at,
            tool_choice=params["tool_choice"],
        )
        request = self.lifecycle.checked_request(resp, [] if own else inputs, event_id)
        size = sum(len(item_text(i).encode()) for i in inputs)
        conv.check_room(size, event_id, items=len(inputs))
        # Last check: from here on the response exists and holds its slot.
        quota = self.lifecycle.quota
        if quota is not None and (problem := quota.acquire_response()):
            raise ProtocolError(problem[0], problem[1], event_id=event_id)
        conv.history_bytes += size
        if not own:
            for item in inputs:
                self._emit_item_created(item, conv.insert(item), None)
        else:  # the response's own context, not announced: counted as inserted ones are
            conv.history_bytes += len(inputs) * ITEM_BYTES
        self.lifecycle.add(resp, request)

    def _on_response_cancel(self, ev_: s.ResponseCancel) -> None:
        resp = find_active(self.lifecycle, self._openai, ev_.response_id, ev_.event_id, "cancel")
        self.lifecycle.abort_current(resp, cancel=True)
        self.lifecycle.finish(
            resp, ResponseStatus.CANCELLED, {"type": "cancelled", "reason": "client_cancelled"}
        )

    def _on_response_steer(self, ev_: s.ResponseSteer) -> None:
        lifecycle = self.lifecycle
        resp = find_active(self.lifecycle, self._openai, ev_.response_id, ev_.event_id, "steer")
        if resp.status is not ResponseStatus.IN_PROGRESS:
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                f"response {resp.id} is {resp.status.value}; only a generating response can be "
                "steered (send the pending function_call_output items instead)",
                event_id=ev_.event_id,
            )
        conv = self.conversation
        conv.check_room(len(ev_.input.encode()), ev_.event_id)
        steer_item = make_item({"type": "message", "role": "user", "content": ev_.input})
        # The partial text is already in the context; the steer goes after it.
        # Check that exact request first, so a steer that cannot fit leaves
        # the running generation alone.
        request = lifecycle.checked_request(resp, [steer_item], ev_.event_id)
        conv.add_bytes(ev_.input)
        lifecycle.abort_current(resp)
        lifecycle.close_text_item(resp, "incomplete")
        resp.drop_partial_calls(conv)
        previous = conv.append_to(resp.context, steer_item)  # where it is, as for any item
        self._emit(
            {
                "type": ev.RESPONSE_STEERED,
                "response_id": resp.id,
                "previous_item_id": previous,
                "item": dict(steer_item),
            },
            ev_.event_id,
        )
        lifecycle.start_generation(resp, request)

    def _on_session_resume(self, ev_: s.SessionResume) -> None:
        self.client_events -= 1  # clients number their frames without session.resume
        raise ProtocolError(
            ErrorCode.INVALID_STATE,
            "session.resume must be the first event on a new connection",
            event_id=ev_.event_id,
        )

    _HANDLERS: ClassVar[dict[str, Callable[[Session, Any], None]]] = {
        ev.SESSION_UPDATE: _on_session_update,
        ev.CONVERSATION_ITEM_CREATE: _on_conversation_item_create,
        ev.CONVERSATION_ITEM_RETRIEVE: _on_conversation_item_retrieve,
        ev.CONVERSATION_ITEM_TRUNCATE: _on_conversation_item_truncate,
        ev.CONVERSATION_ITEM_DELETE: _on_conversation_item_delete,
        ev.RESPONSE_CREATE: _on_response_create,
        ev.RESPONSE_CANCEL: _on_response_cancel,
        ev.RESPONSE_STEER: _on_response_steer,
        ev.SESSION_RESUME: _on_session_resume,
    }

    # -- engine, timers, and the client's pace --------------------------------

    def receive_engine_error(self, request_id: str, exc: EngineError) -> None:
        self.lifecycle.receive_engine_error(request_id, exc)

    def receive_timeout(self, response_id: str, token: int) -> None:
        self.lifecycle.receive_timeout(response_id, token)

    def pause(self) -> list[str]:
        """The client is too far behind: free the engine slots of its text
        generations. Returns the ids of the responses paused."""
        return self.lifecycle.pause()

    def resume(self) -> list[str]:
        """The client drained (or the session was taken over): continue
        paused generations after their tokens. A closed session (suspended
        for a hand-over: a client may catch up meanwhile) starts nothing."""
        return [] if self.closed else self.lifecycle.resume()

    def suspend(self) -> None:
        """Stop every generation without ending its response: the session is
        handed to another instance, which restores it and calls resume().
        Frames that come meanwhile start nothing here (the client resends
        what its `client_events` says was not taken)."""
        self.lifecycle.suspend()
        self.closed = True

    def abandon(self) -> None:
        """Another instance owns this session now: stop and forget its responses."""
        self.lifecycle.abandon()
        self.closed = True

    def close(self) -> None:
        """The client went away: stop every generation it owns."""
        self.lifecycle.close()
        self.closed = True

    # -- internals -------------------------------------------------------------

    def _emit(self, event: dict[str, Any], event_id: str | None = None) -> None:
        self._out.emit(event, event_id)

    def _emit_item_created(self, item: Item, previous: str | None, event_id: str | None) -> None:
        self._emit(
            {
                "type": ev.CONVERSATION_ITEM_CREATED,
                "previous_item_id": previous,
                "item": dict(item),
            },
            event_id,
        )
