"""A session as data another instance can continue from: snapshot, restore,
and the replay of what was logged after the snapshot.

A snapshot is taken when the conversation's structure changes; text produced
after it is carried by the logged delta events (`replay_delta`), and token
ids by the log's progress records (`progress`).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields
from typing import Any, Protocol

from ..engines.base import GenerationRequest
from . import events as ev
from .conversation import Conversation
from .lifecycle import Lifecycle
from .response import Response, ResponseStatus
from .tools import ToolFlow


class Session(Protocol):
    """The parts of core.session.Session a snapshot reads and restores."""

    id: str
    config: dict[str, Any]
    info: dict[str, Any]
    conversation: Conversation
    lifecycle: Lifecycle
    client_events: int
    clock: Callable[[], float]

    @property
    def responses(self) -> dict[str, Response]: ...

    @property
    def active_responses(self) -> list[Response]: ...

    def events_to_send(self) -> list[dict[str, Any]]: ...


# Not kept: the engine renders the prompt again where it continues.
_REQUEST_FIELDS = [f.name for f in fields(GenerationRequest) if f.name != "rendered"]


def take(session: Session) -> dict[str, Any]:
    """Everything needed to continue `session` elsewhere, JSON-shaped."""
    now, wall = session.clock(), time.time()
    conv = session.conversation
    # Items known by id outside the conversation: conversation:"none"
    # responses' outputs, steers and tool outputs (never their `input`).
    shared = {id(it) for it in conv.items}
    own = [r for r in session.active_responses if r.context is not conv.items]
    active = {id(it) for r in own for it in r.context}
    private = [it for it in conv.by_id.values() if id(it) not in shared]
    return {
        "id": session.id,
        "config": session.config,
        "info": session.info,
        "items": conv.items,
        # A finished response's (its calls' late outputs, retrieve), and the
        # ids of an active one's, which its context carries.
        "private_items": [it for it in private if id(it) not in active],
        "private_ids": [it["id"] for it in private if id(it) in active],
        "history_bytes": conv.history_bytes,
        "client_events": session.client_events,
        "tool_flow": session.lifecycle.tool_flow.value,
        "finished": list(session.lifecycle.finished.items()),
        "calls": {
            cid: [item["id"], rid, done]
            for cid, (item, rid, done) in session.lifecycle.calls.items()
        },
        "responses": [
            _response_state(r, now, wall, conv, shared) for r in session.active_responses
        ],
    }


def restore_into(session: Session, state: dict[str, Any]) -> None:
    """Make a fresh `session` the one `state` describes. Its generations are
    paused (no engine request runs); `Session.resume()` continues them."""
    session.events_to_send()  # no session.created: the client knows this session
    session.config.update(state["config"])
    session.info.update({k: v for k, v in state["info"].items() if k != "subprotocol"})
    conv = session.conversation
    conv.items = state["items"]
    conv.by_id = {it["id"]: it for it in conv.items}
    conv.by_id.update((it["id"], it) for it in state.get("private_items", ()))
    # None from an instance before private_ids: every context item, as it did.
    private_ids = set(state["private_ids"]) if "private_ids" in state else None
    conv.history_bytes = state["history_bytes"]
    session.client_events = state.get("client_events", 0)
    lifecycle = session.lifecycle
    # The flow of the dialect the session began with, whatever socket resumes it.
    lifecycle.tool_flow = ToolFlow(state.get("tool_flow", ToolFlow.CONTINUE))
    lifecycle.finished = OrderedDict((rid, status) for rid, status in state["finished"])
    now, wall = session.clock(), time.time()
    for rs in state["responses"]:
        resp = _restore_response(session, rs, now, wall, private_ids)
        lifecycle.responses[resp.id] = resp
        if resp.status is ResponseStatus.REQUIRES_ACTION:
            lifecycle.wait_for_tools(resp)
    for cid, (item_id, rid, done) in state["calls"].items():
        item = conv.by_id.get(item_id)
        if item is not None:
            lifecycle.calls[cid] = (item, rid, done)
    if lifecycle.quota is not None:
        # Once the whole state is read (a failed restore holds nothing). They
        # run already: counted even past the key's limits (an acquire could
        # refuse, and its release would then undercount).
        for _ in lifecycle.responses:
            lifecycle.quota.hold_response()


def _restore_response(
    session: Session, rs: dict[str, Any], now: float, wall: float, private_ids: set[str] | None
) -> Response:
    conv = session.conversation
    context = conv.items
    if rs.get("own_context", not rs["in_conversation"]):
        # Conversation items by id, the same objects: an OpenAI `input`
        # response's output, or the conversation an OpenAI "none" one read.
        shared = {it["id"]: it for it in conv.items}
        context = [shared[it] if isinstance(it, str) else it for it in rs["context"]]
        for item in rs["context"]:
            if isinstance(item, dict) and (private_ids is None or item["id"] in private_ids):
                conv.by_id[item["id"]] = item
    by_id = {it["id"]: it for it in context}
    req = rs["gen_request"]
    status = ResponseStatus(rs["status"])
    return Response(
        id=rs["id"],
        event_id=rs["event_id"],
        in_conversation=rs["in_conversation"],
        params=rs["params"],
        metadata=rs["metadata"],
        context=context,
        created_at=now - (wall - rs["created_wall"]),
        tool_choice=rs["tool_choice"],
        status=status,
        output=[by_id[i] for i in rs["output"]],
        current_item=by_id.get(rs["current_item"] or ""),
        calls={int(k): by_id[v] for k, v in rs["calls"].items()},
        pending_calls={cid: by_id[iid] for cid, iid in rs["pending_calls"].items()},
        gen_request=GenerationRequest(**req) if req else None,
        gen_token_ids=rs["gen_token_ids"],
        paused=status is ResponseStatus.IN_PROGRESS,
        generation=rs["generation"],
        wait_token=rs["wait_token"],
        input_tokens=rs["input_tokens"],
        cached_tokens=rs["cached_tokens"],
        output_tokens=rs["output_tokens"],
        queue_wait_s=rs.get("queue_wait_s", 0.0),
        cached_response=rs.get("cached_response", False),
        first_token_at=_monotonic(rs["first_token_wall"], now, wall),
        request_tag=f".{secrets.token_hex(3)}",
    )


# Wall clock in what goes to another instance: it has its own monotonic clock.
def _wall(at: float | None, now: float, wall: float) -> float | None:
    return None if at is None else wall - (now - at)


def _monotonic(at_wall: float | None, now: float, wall: float) -> float | None:
    return None if at_wall is None else now - (wall - at_wall)


def _response_state(
    resp: Response, now: float, wall: float, conv: Conversation, shared: set[int]
) -> dict[str, Any]:
    """`shared`: the conversation's items (by id()), which a context of its
    own names by item id (they are in the snapshot's `items`)."""
    req = resp.gen_request
    own = resp.context is not conv.items
    resp.logged_ids = len(resp.gen_token_ids)
    resp.logged_usage = resp.usage()
    return {
        "id": resp.id,
        "event_id": resp.event_id,
        "in_conversation": resp.in_conversation,
        "params": resp.params,
        "metadata": resp.metadata,
        "own_context": own,
        "context": [it["id"] if id(it) in shared else it for it in resp.context] if own else [],
        # Wall clock: the instance that restores it has its own monotonic clock.
        "created_wall": wall - (now - resp.created_at),
        "tool_choice": resp.tool_choice,
        "status": resp.status.value,
        "output": [item["id"] for item in resp.output],
        "current_item": resp.current_item["id"] if resp.current_item else None,
        "calls": {str(i): item["id"] for i, item in resp.calls.items()},
        "pending_calls": {cid: item["id"] for cid, item in resp.pending_calls.items()},
        "gen_request": None if req is None else {f: getattr(req, f) for f in _REQUEST_FIELDS},
        "gen_token_ids": resp.gen_token_ids,
        "generation": resp.generation,
        "wait_token": resp.wait_token,
        "input_tokens": resp.input_tokens,
        "cached_tokens": resp.cached_tokens,
        "output_tokens": resp.output_tokens,
        "queue_wait_s": resp.queue_wait_s,
        "cached_response": resp.cached_response,
        "first_token_wall": _wall(resp.first_token_at, now, wall),
    }


def replay_delta(session: Session, event: dict[str, Any]) -> None:
    """Fold a logged delta (sent after the snapshot) back into the state."""
    resp = session.responses.get(event.get("response_id", ""))
    if resp is None:
        return
    conv = session.conversation
    if event["type"] == ev.RESPONSE_OUTPUT_TEXT_DELTA:
        resp.append_text(conv, event["delta"], event["item_id"])
    elif event["type"] == ev.RESPONSE_FUNCTION_CALL_ARGUMENTS_DELTA:
        index = next(
            (i for i, c in resp.calls.items() if c["id"] == event["item_id"]), len(resp.calls)
        )
        resp.append_call_chunk(
            conv, index, event["name"], event["delta"], event["item_id"], event["call_id"]
        )
    resp.new_item = None  # its first delta, which placed it, was this one or went out before


def progress(session: Session) -> dict[str, list[Any]]:
    """What the logged deltas do not say: per active response, its output
    tokens and the token ids added since the last call (or snapshot), and its
    usage and timings when they changed (the first delta brings the prompt's)."""
    out: dict[str, list[Any]] = {}
    for r in session.responses.values():
        if r.active and len(r.gen_token_ids) > r.logged_ids:
            record = [r.output_tokens, r.logged_ids, r.gen_token_ids[r.logged_ids :]]
            r.logged_ids = len(r.gen_token_ids)
            usage = r.usage()
            if usage != r.logged_usage:
                r.logged_usage = usage
                now, wall = session.clock(), time.time()
                record.append([*usage[:4], _wall(usage[4], now, wall)])
            out[r.id] = record
    return out


def restore_progress(session: Session, record: dict[str, list[Any]]) -> None:
    now, wall = session.clock(), time.time()
    for rid, (output_tokens, start, token_ids, *usage) in record.items():
        resp = session.responses.get(rid)
        if resp is not None:
            resp.output_tokens = output_tokens
            resp.gen_token_ids = resp.gen_token_ids[:start] + list(token_ids)
            if usage:
                input_tokens, cached_tokens, queue_wait_s, cached_response, first = usage[0]
                resp.input_tokens, resp.cached_tokens = input_tokens, cached_tokens
                resp.queue_wait_s, resp.cached_response = queue_wait_s, cached_response
                resp.first_token_at = _monotonic(first, now, wall)
