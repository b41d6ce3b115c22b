"""The response lifecycle: generations started, paused and stopped, engine
output folded into items, tool calls awaited, and responses finished.

Sans-I/O like the session that owns it: events go out through the session's
`Outputs`, engine work is asked for as actions.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from ..engines.base import (
    RESUMED_TEXT_CHARS,
    ContextLengthExceeded,
    ConversationRefused,
    EngineCapabilities,
    EngineDelta,
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    ToolCallDelta,
)
from . import events as ev
from . import schema as s
from .conversation import Conversation, Item, render_messages
from .errors import ErrorCode, ProtocolError, error_event
from .events import AbortGeneration, CancelTimer, Outputs, StartGeneration, StartTimer
from .response import Response, ResponseStatus
from .stages import CONTENT_FILTER
from .tools import ToolFlow, check_arguments, engine_tools

Preflight = Callable[[GenerationRequest], tuple[int, ...] | None]


class Quota(Protocol):
    """Limits shared by all sessions of one API key (see server.admission.KeyUsage)."""

    def acquire_response(self) -> tuple[ErrorCode, str] | None: ...

    def hold_response(self) -> None:
        """Count a response that runs already (restored), whatever the limits."""

    def release_response(self) -> None: ...

    def spend_tokens(self, n: int) -> None: ...


def resumed_text(resp: Response) -> str:
    """The end of the text the client holds of the generation being resumed."""
    item = resp.current_item
    return item["content"][-RESUMED_TEXT_CHARS:] if item is not None else ""


def error_code(exc: EngineError) -> ErrorCode:
    """The wire code for an engine failure: a dead engine, a request that
    cannot fit, a conversation the chat template refuses, or anything else
    the engine did wrong."""
    if isinstance(exc, ContextLengthExceeded):
        return ErrorCode.CONTEXT_LENGTH_EXCEEDED
    if isinstance(exc, ConversationRefused):
        return ErrorCode.INVALID_STATE
    if isinstance(exc, EngineUnavailable):
        return ErrorCode.ENGINE_UNAVAILABLE
    return ErrorCode.ENGINE_ERROR


def _awaited_call(
    lifecycle: Lifecycle, call_id: str, event_id: str | None
) -> tuple[Item, str, Response | None]:
    """The call an output answers: its item, its response's id and, while
    that is active, the response; else why the output is refused."""
    known = lifecycle.calls.get(call_id)
    if known is None:
        # A call the model made that failed its argument check is in the
        # history (and, in the OpenAI dialect, got its arguments.done).
        failed = any(
            it.get("call_id") == call_id and it["type"] == "function_call"
            for it in lifecycle.conversation.by_id.values()
        )
        raise ProtocolError(
            ErrorCode.UNKNOWN_CALL_ID,
            f"call {call_id!r} failed its argument check (invalid_tool_arguments), so it "
            "takes no output; its response ended failed: send response.create to go on"
            if failed
            else f"no function call {call_id!r} in this session",
            event_id=event_id,
            param="item.call_id",
        )
    call_item, response_id, answered = known
    resp = lifecycle.responses.get(response_id)
    if resp is None and call_item not in lifecycle.conversation.items:
        raise ProtocolError(
            ErrorCode.RESPONSE_NOT_ACTIVE,
            f'call {call_id!r} came from a conversation:"none" response that has '
            "finished; its output has nowhere to go",
            event_id=event_id,
            param="item.call_id",
        )
    if answered:
        raise ProtocolError(
            ErrorCode.DUPLICATE_CALL_OUTPUT,
            f"call {call_id!r} already has its output",
            event_id=event_id,
            param="item.call_id",
        )
    return call_item, response_id, resp


def forget_call(calls: dict[str, tuple[Item, str, bool]], item: Item) -> None:
    """An item deleted from the conversation: a call's output has nowhere to
    go now; a call whose output went may get another."""
    known = calls.get(item["call_id"]) if "call_id" in item else None
    if known is None:
        return
    if item["type"] == "function_call":
        del calls[item["call_id"]]
    else:
        calls[item["call_id"]] = (known[0], known[1], False)


class Lifecycle:
    """A session's responses, from response.create to response.done."""

    def __init__(
        self,
        session_id: str,
        out: Outputs,
        conversation: Conversation,
        clock: Callable[[], float],
        capabilities: EngineCapabilities,
        preflight: Preflight | None,
        quota: Quota | None,
        tool_flow: ToolFlow = ToolFlow.CONTINUE,
        cache_salt: str | None = None,
    ) -> None:
        self.session_id = session_id
        self._out = out
        # Where `emit` puts events; the per-token path appends to it directly
        # (no event_id to set), and Outputs never replaces the list.
        self._events = out.events
        self.conversation = conversation
        self.clock = clock
        self.capabilities = capabilities
        self._preflight = preflight
        self.quota = quota
        self.tool_flow = tool_flow
        self.cache_salt = cache_salt
        self.responses: dict[str, Response] = {}
        # Finished responses, kept briefly so a late cancel gets a precise error.
        self.finished: OrderedDict[str, str] = OrderedDict()
        self.auto_done_at = -math.inf  # when a conversation response last ended
        self._requests: dict[str, str] = {}  # engine request id -> response id
        # Every function call: call_id -> (item, owning response id, answered?)
        self.calls: dict[str, tuple[Item, str, bool]] = {}

    @property
    def active(self) -> list[Response]:
        return [r for r in self.responses.values() if r.active]

    def add(self, resp: Response, request: GenerationRequest) -> None:
        """A response that passed every check starts its first generation."""
        self.responses[resp.id] = resp
        self._out.emit({"type": ev.RESPONSE_CREATED, "response": resp.describe()}, resp.event_id)
        self.start_generation(resp, request)

    def receive_engine_output(self, request_id: str, delta: EngineDelta) -> None:
        # Run per token: lookups inlined, and what a delta seldom carries tested once.
        response_id = self._requests.get(request_id)
        resp = self.responses.get(response_id) if response_id else None
        if resp is None:
            return  # a request we already aborted; its late outputs are dropped
        if delta.prompt_tokens is not None:
            resp.input_tokens += delta.prompt_tokens
            resp.cached_tokens += delta.cached_tokens or 0
        if delta.queue_wait_s is not None:
            resp.queue_wait_s += delta.queue_wait_s
        if delta.cached_response:
            resp.cached_response = True
        n = delta.output_tokens
        resp.output_tokens += n
        if self.quota is not None:
            self.quota.spend_tokens(n)
        if delta.token_ids:
            resp.gen_token_ids.extend(delta.token_ids)
        text, calls = delta.text, delta.tool_calls
        if (text or calls) and resp.first_token_at is None:
            resp.first_token_at = self.clock()
        if text:
            item = resp.append_text(self.conversation, text)
            event = {
                "type": ev.RESPONSE_OUTPUT_TEXT_DELTA,
                "response_id": resp.id,
                "item_id": item["id"],
                "delta": text,
            }
            self._events.append(event if resp.new_item is None else resp.placed(event))
        finish = delta.finish_reason
        if calls and self._call_chunks(resp, calls):
            # A second call with parallel_tool_calls false: the first is the result.
            if finish is None:
                self.abort_current(resp)
            finish = "stop"
        if finish is not None:
            self._requests.pop(request_id, None)
            resp.request_id = None
            self._end_generation(resp, finish)

    def _call_chunks(self, resp: Response, chunks: list[ToolCallDelta]) -> bool:
        """True at a second call with `parallel_tool_calls` false, which is
        not taken: the generation ends (the engine can force one call only
        for tool_choice "required")."""
        single = not resp.params["parallel_tool_calls"]
        for chunk in chunks:
            if single and resp.calls and chunk.index not in resp.calls:
                return True
            item = resp.append_call_chunk(
                self.conversation, chunk.index, chunk.name, chunk.arguments
            )
            self._out.emit(
                resp.placed(
                    {
                        "type": ev.RESPONSE_FUNCTION_CALL_ARGUMENTS_DELTA,
                        "response_id": resp.id,
                        "item_id": item["id"],
                        "call_id": item["call_id"],
                        "name": item["name"],
                        "delta": chunk.arguments,
                    }
                )
            )
        return False

    def receive_engine_error(self, request_id: str, exc: EngineError) -> None:
        resp = self._response_for(request_id)
        if resp is None:
            return
        self._requests.pop(request_id, None)
        resp.request_id = None
        self._fail(resp, error_code(exc), exc.message)

    def receive_timeout(self, response_id: str, token: int) -> None:
        resp = self.responses.get(response_id)
        waiting = (ResponseStatus.REQUIRES_ACTION, token)
        if resp is None or (resp.status, resp.wait_token) != waiting:
            return  # outputs arrived, or the response ended, before the timer fired
        self.finish(
            resp, ResponseStatus.INCOMPLETE, {"type": "incomplete", "reason": "tool_timeout"}
        )

    def pause(self) -> list[str]:
        if not self.capabilities.resume_from_token_ids:
            return []  # they could not continue where they stopped
        paused = []
        for resp in self.active:
            req = resp.gen_request
            # Tool-call generations are short and their parsers keep state; leave them.
            if resp.request_id is None or req is None or req.tools is not None:
                continue
            self.abort_current(resp)
            resp.paused = True
            paused.append(resp.id)
        return paused

    def suspend(self) -> None:
        for resp in self.active:
            if resp.request_id is not None:
                self.abort_current(resp)
                resp.paused = True

    def abandon(self) -> None:
        self.suspend()
        for resp in self.active:
            if self.quota is not None:
                self.quota.release_response()
            del self.responses[resp.id]
        self._out.take_events()

    def resume(self) -> list[str]:
        resumed = []
        for resp in self.active:
            if not resp.paused:
                continue
            resp.paused = False
            assert resp.gen_request is not None
            if resp.gen_request.tools is not None or not self.capabilities.resume_from_token_ids:
                # Only a takeover stops a tool-call generation (pause() never
                # does), and its parser state is gone: run it again from the start.
                resp.drop_partial_calls(self.conversation)
                self.close_text_item(resp, "incomplete")
                self.start_generation(resp)
                resumed.append(resp.id)
                continue
            request = replace(
                resp.gen_request,
                request_id=resp.next_request_id(),
                max_output_tokens=resp.remaining_tokens(),
                resume_token_ids=tuple(resp.gen_token_ids),
                resumed_text=resumed_text(resp),
            )
            self.start_generation(resp, request, fresh=False)
            resumed.append(resp.id)
        return resumed

    def close(self) -> None:
        gone = {"type": "cancelled", "reason": "client_disconnected"}
        for resp in self.active:
            self.abort_current(resp)
            self.finish(resp, ResponseStatus.CANCELLED, dict(gone))

    # -- internals: generations ---------------------------------------------

    def _next_request(self, resp: Response, extra: list[Item] | None = None) -> GenerationRequest:
        """The engine request for the response's next generation; changes nothing."""
        params = resp.params
        tools, choice = engine_tools(
            params["tools"], resp.tool_choice, params["parallel_tool_calls"]
        )
        return GenerationRequest(
            request_id=resp.next_request_id(),
            messages=render_messages(params["instructions"], [*resp.context, *(extra or [])]),
            max_output_tokens=resp.remaining_tokens(),
            temperature=params["temperature"],
            ignore_eos=params["ignore_eos"],
            tools=tools,
            tool_choice=choice,
            priority=params.get("priority", 0),
            session_id=self.session_id,
            cache=params.get("cache", True),
            seed=params.get("seed"),
            stream_interval=params.get("stream_interval", 1),
            cache_salt=self.cache_salt,
        )

    def checked_request(
        self, resp: Response, extra: list[Item], event_id: str | None
    ) -> GenerationRequest:
        """The next request, through the engine's preflight (or a ProtocolError)."""
        request = self._next_request(resp, extra)
        if self._preflight is None:
            return request
        try:
            rendered = self._preflight(request)
        except EngineError as exc:
            # Refused before any engine work: the conversation cannot run as it is.
            raise ProtocolError(error_code(exc), exc.message, event_id=event_id) from None
        return request if rendered is None else replace(request, rendered=rendered)

    def start_generation(
        self, resp: Response, request: GenerationRequest | None = None, fresh: bool = True
    ) -> None:
        request = request or self._next_request(resp)
        if request.max_output_tokens == 0:
            # A tool round, steer or resume after the whole response's budget
            # is spent: it ends as a generation cut at its cap would.
            self._end_generation(resp, "length")
            return
        if fresh:
            resp.gen_request, resp.gen_token_ids, resp.logged_ids = request, [], 0
        resp.paused = False
        resp.generation += 1
        resp.request_id = request.request_id
        self._requests[resp.request_id] = resp.id
        self._out.perform(StartGeneration(resp.id, request))

    def abort_current(self, resp: Response, cancel: bool = False) -> None:
        if resp.request_id is not None:
            self._out.perform(AbortGeneration(resp.id, resp.request_id, cancel))
            self._requests.pop(resp.request_id, None)
            resp.request_id = None

    def _end_generation(self, resp: Response, finish_reason: str) -> None:
        if finish_reason == CONTENT_FILTER:
            # What was delivered stays; the engine request is already closed.
            self.finish(
                resp, ResponseStatus.INCOMPLETE, {"type": "incomplete", "reason": CONTENT_FILTER}
            )
        elif finish_reason not in ("stop", "length"):
            self.finish(
                resp, ResponseStatus.INCOMPLETE, {"type": "incomplete", "reason": "engine_aborted"}
            )
        elif finish_reason == "length" and (not resp.params["ignore_eos"] or resp.calls):
            # With ignore_eos a text answer runs to the cap by design; a call
            # cut there is cut all the same.
            self.finish(
                resp,
                ResponseStatus.INCOMPLETE,
                {"type": "incomplete", "reason": "max_output_tokens"},
            )
        elif resp.calls:
            self.close_text_item(resp, "completed")
            self._emit_calls(resp)
        else:
            self.finish(resp, ResponseStatus.COMPLETED, None)

    def _emit_calls(self, resp: Response) -> None:
        """The generation ended in tool calls: check them, then wait for outputs."""
        tools = {t["name"]: t for t in resp.params["tools"]}
        calls = [resp.calls[i] for i in sorted(resp.calls)]
        resp.calls = {}
        for item in calls:
            problem = check_arguments(item, tools)
            if problem is not None:
                for call in calls:
                    call["status"] = "incomplete"
                message = f"call {item['call_id']} to {item['name']!r}: {problem}"
                self._fail(resp, ErrorCode.INVALID_TOOL_ARGUMENTS, message)
                return
        for item in calls:
            item["status"] = "completed"
            self.calls[item["call_id"]] = (item, resp.id, False)
            resp.pending_calls[item["call_id"]] = item
            self._out.emit(
                {
                    "type": ev.RESPONSE_FUNCTION_CALL_ARGUMENTS_DONE,
                    "response_id": resp.id,
                    "item_id": item["id"],
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        if self.tool_flow is ToolFlow.CLIENT:
            # The calls are the response's result; the client continues.
            resp.pending_calls.clear()
            self.finish(resp, ResponseStatus.COMPLETED, None)
            return
        resp.status = ResponseStatus.REQUIRES_ACTION
        self._out.emit(
            {
                "type": ev.RESPONSE_REQUIRES_ACTION,
                "response_id": resp.id,
                "call_ids": list(resp.pending_calls),
            }
        )
        self.wait_for_tools(resp)

    def wait_for_tools(self, resp: Response) -> None:
        """Time the wait for tool outputs; `wait_token` tells a stale timer."""
        resp.wait_token += 1
        self._out.perform(StartTimer(resp.id, resp.wait_token, resp.params["tool_timeout_s"]))

    def close_text_item(self, resp: Response, status: str) -> Item | None:
        item = resp.close_text_item(status)
        if item is not None:
            self._out.emit(
                {
                    "type": ev.RESPONSE_OUTPUT_TEXT_DONE,
                    "response_id": resp.id,
                    "item_id": item["id"],
                    "text": item["content"],
                }
            )
        return item

    def _fail(self, resp: Response, code: ErrorCode, message: str) -> None:
        self._out.emit(error_event(code, message, event_id=resp.event_id))
        self.finish(
            resp,
            ResponseStatus.FAILED,
            {"type": "failed", "error": {"code": str(code), "message": message}},
        )

    def finish(
        self, resp: Response, status: ResponseStatus, details: dict[str, Any] | None
    ) -> None:
        completed = status is ResponseStatus.COMPLETED
        if resp.status is ResponseStatus.REQUIRES_ACTION:
            _end_wait(self._out, resp)
        self.close_text_item(resp, "completed" if completed else "incomplete")
        resp.drop_partial_calls(self.conversation)
        resp.pending_calls.clear()
        resp.status = status
        resp.status_details = details
        resp.done_at = self.clock()
        if resp.in_conversation:
            self.auto_done_at = resp.done_at
        if self.quota is not None:
            self.quota.release_response()
        self._out.emit({"type": ev.RESPONSE_DONE, "response": resp.describe()})
        # Keep only a bounded record of finished responses.
        del self.responses[resp.id]
        self.finished[resp.id] = status.value
        while len(self.finished) > 256:
            self.finished.popitem(last=False)

    def receive_call_output(
        self, raw: s.FunctionCallOutputItem, event_id: str | None, after: str | None = None
    ) -> None:
        conv = self.conversation
        call_item, response_id, resp = _awaited_call(self, raw.call_id, event_id)
        item = conv.new_item(raw, event_id)
        conv.check_room(len(raw.output.encode()), event_id)
        conv.add_bytes(raw.output)
        self.calls[raw.call_id] = (call_item, response_id, True)
        # After `after` in the conversation (OpenAI's), else at the history's end.
        previous = conv.append_to(resp.context if resp is not None else conv.items, item, after)
        self._out.emit(
            {
                "type": ev.CONVERSATION_ITEM_CREATED,
                "previous_item_id": previous,
                "item": dict(item),
            },
            event_id,
        )
        if resp is not None and resp.status is ResponseStatus.REQUIRES_ACTION:
            resp.pending_calls.pop(raw.call_id, None)
            if not resp.pending_calls:
                # Every output is in: the same response goes on by itself.
                resp.status = ResponseStatus.IN_PROGRESS
                _end_wait(self._out, resp)
                if resp.tool_choice != "auto":
                    resp.tool_choice = "none"  # a forced call is made once, not forever
                self.start_generation(resp)

    def _response_for(self, request_id: str) -> Response | None:
        response_id = self._requests.get(request_id)
        return self.responses.get(response_id) if response_id else None


def _end_wait(out: Outputs, resp: Response) -> None:
    """The wait for tool outputs is over (outputs in, or the response ends):
    its timer goes too, and a late one finds a stale token."""
    resp.wait_token += 1
    out.perform(CancelTimer(resp.id))
