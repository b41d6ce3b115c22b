"""Fuzzing the session: `Session` takes arbitrary values, mutated valid events
and random sequences of them, mixed with engine output, timeouts and
pause/resume/close, driven as the runtime's pump drives it (helpers.session.drive).

Nothing may raise out of it, every bad client event yields exactly one `error`
event with a stable code, response invariants hold (Harness), and every event
produced from decoded frames can be sent by both codecs (strict JSON, msgpack).

All randomness is seeded (see helpers.fuzz.FUZZ).
"""

from __future__ import annotations

import copy
import http.server
import json
import math
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tokenwire.core.errors import ErrorCode, ProtocolError
from tokenwire.core.events import AbortGeneration, Action, CancelTimer, StartGeneration, StartTimer
from tokenwire.core.session import Session
from tokenwire.engines.base import (
    ContextLengthExceeded,
    EngineDelta,
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    RequestError,
    ToolCallDelta,
)
from tokenwire.engines.scripted import example_arguments
from tokenwire.wire.codec import decode_frame

from ..helpers.fuzz import (
    FUZZ,
    LONG_RUN,
    TYPE_NAMES,
    assert_event,
    assert_wire_safe,
    feed_client_event,
    new_session,
)
from ..helpers.session import Event, drive

ENGINE_ERRORS = [EngineError, EngineUnavailable, RequestError, ContextLengthExceeded]
# The sequence fuzzers report a failure unshrunk: shrinking a 30-step sequence
# takes a minute, and the bugs found so far have their own minimal tests
# (test_session_unresolvable_schema_ref_fails_the_response below, and
# tests/wire/test_fuzz_decode.py::test_decode_json_lone_surrogate).
# A long run (TOKENWIRE_FUZZ_EXAMPLES) shrinks.
FUZZ_SEQUENCES = settings(
    FUZZ, phases=list(Phase) if LONG_RUN else [Phase.explicit, Phase.reuse, Phase.generate]
)


FIELD_NAMES = [
    "type",
    "event_id",
    "session",
    "item",
    "response",
    "response_id",
    "item_id",
    "text_end",
    "input",
    "previous_item_id",
    "role",
    "content",
    "call_id",
    "output",
    "id",
    "tools",
    "tool_choice",
    "name",
    "parameters",
    "conversation",
    "metadata",
    "max_output_tokens",
    "temperature",
    "instructions",
    "ignore_eos",
    "session_id",
    "last_seq",
    "parallel_tool_calls",
    "tool_timeout_s",
    "description",
]
json_like = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),  # NaN and infinities included: json.loads accepts them
        st.text(max_size=20),
        st.sampled_from(TYPE_NAMES),
    ),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPE_NAMES)},
    optional={
        "event_id": st.text(max_size=10) | json_like,
        **{name: json_like for name in FIELD_NAMES[2:12]},
    },
)


def send_client_event(
    session: Session, obj: Any, binary: bool = False
) -> tuple[list[Action], list[Event]]:
    """One client event the way the transport takes it: encoded as a frame (as
    JSON text when msgpack cannot hold it), decoded, then handed to the session."""
    frame: str | bytes
    try:
        frame = msgpack.packb(obj) if binary else json.dumps(obj)
    except (OverflowError, TypeError, ValueError):
        frame = json.dumps(obj)
    try:
        value = decode_frame(frame)
    except ProtocolError as err:  # the decoder may refuse what JSON cannot carry
        assert err.code == ErrorCode.MALFORMED_FRAME
        actions, events = drive(session, err, actions=True)
        assert [e["error"]["code"] for e in events] == ["malformed_frame"], events
        return actions, events
    return feed_client_event(session, value)


@FUZZ
@given(st.lists(json_like | event_like, min_size=1, max_size=8))
def test_session_random_values_never_raise(values: list[Any]) -> None:
    """Straight into receive_client_event (any Python value), and through the
    wire into a second session (replies must then be sendable too)."""
    direct, wired = new_session(), new_session()
    for session in (direct, wired):
        assert [e["type"] for e in session.events_to_send()] == ["session.created"]
    for value in values:
        feed_client_event(direct, copy.deepcopy(value), wire=False)
        send_client_event(wired, value)
    for session in (direct, wired):
        session.close()
        for event in session.events_to_send():
            assert_event(event)


@FUZZ
@given(
    parameters=st.dictionaries(st.text(max_size=6), json_like, max_size=4),
    max_output_tokens=st.none() | st.integers(min_value=1),
)
def test_session_update_echo_is_always_sendable(
    parameters: dict[str, Any], max_output_tokens: int | None
) -> None:
    """What session.update accepts, session.updated repeats, so it must be
    sendable on either subprotocol. A JSON text frame can carry NaN, Infinity
    and integers of any size: Python's json.loads takes them all."""
    session = new_session()
    session.events_to_send()
    update = {
        "type": "session.update",
        "session": {
            "tools": [{"name": "f", "parameters": parameters}],
            "max_output_tokens": max_output_tokens,
        },
    }
    _, events = send_client_event(session, update)  # a JSON text frame; checks both codecs
    # Refusing such values (malformed_frame, invalid_field) is as good as echoing them.
    assert [e["type"] for e in events] in (["session.updated"], ["error"]), events


# -- mutated valid events, interleaved with engine output ----------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
LOOKUP = {
    "name": "lookup",
    "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
    },
}
# Tool parameters a client might send: valid, odd, or not a schema at all.
SCHEMAS = [
    WEATHER["parameters"],
    {"type": "object"},
    {},
    {"type": "nonsense"},
    {"type": "object", "properties": 5},
    {"type": "string", "pattern": "("},
    {"$ref": "#/definitions/missing"},
    {"$ref": "urn:example:missing"},
    {"type": "object", "properties": {"city": {"$ref": "#/nope"}}},
]
HUGE_INTS = [2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30), -(2**63) - 1, 10**400]
NONFINITE = [math.nan, math.inf, -math.inf]
LONG_STRINGS = ["x" * 129, "é" * 300, "w " * 3000, "y" * 70_000, "\x00" * 10, "😀" * 65]
weird_values = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 1, 3, 2.5, -0.0, 1e308, 5e-324]),
    st.sampled_from(HUGE_INTS),
    st.sampled_from(NONFINITE),
    st.sampled_from(["", " ", "auto", "none", "required", "user", "assistant", "x" * 65]),
    st.sampled_from(LONG_STRINGS),
    st.sampled_from(TYPE_NAMES),
    st.sampled_from([[], {}, [{}], {"type": "function"}, {"name": "get_weather"}]),
    st.sampled_from(SCHEMAS),
    json_like,
)
CALL_ARGUMENTS = [
    '{"city": "Oslo"}',
    '{"city": ',
    '"Oslo"}',
    "{}",
    "not json",
    "[1, 2]",
    '{"city": 3}',
    '{"q": "' + "z" * 30 + '"}',
    "NaN",
]
MUTATIONS = [
    "drop",
    "retype",
    "huge_int",
    "nonfinite",
    "long_string",
    "unknown_key",
    "wrap",
    "unwrap",
    "swap_type",
    "swap_id",
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        root = root[part]
    return root


def _set(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


@dataclass
class Harness:
    """Drives one Session like the runtime does (drive), and checks invariants."""

    now: float = 0.0
    session: Session = field(init=False)
    live: dict[str, str] = field(default_factory=dict)  # request id -> response id
    requests: dict[str, GenerationRequest] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)  # request ids that ended
    timers: list[tuple[str, int]] = field(default_factory=list)
    armed: set[str] = field(default_factory=set)  # responses whose timer is not cancelled
    created: dict[str, str] = field(default_factory=dict)  # response id -> conversation
    done: Counter[str] = field(default_factory=Counter)
    waiting_tools: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)
    # Ids seen, in order (ids are random: insertion order keeps draws reproducible).
    item_ids: dict[str, None] = field(default_factory=dict)
    call_ids: dict[str, None] = field(default_factory=dict)
    closed: bool = False

    def __post_init__(self) -> None:
        self.session = new_session(self.clock)
        events = self.collect()
        assert [e["type"] for e in events] == ["session.created"]

    def clock(self) -> float:
        self.now += 0.001
        return self.now

    @property
    def open_responses(self) -> list[str]:
        return [r for r in self.created if not self.done[r]]

    def collect(self, taken: tuple[list[Action], list[Event]] | None = None) -> list[Event]:
        """Check what the session produced: `taken` from a client event, else
        what the runtime's pump would take now (drive)."""
        actions, events = taken if taken is not None else drive(self.session, actions=True)
        for action in actions:
            if isinstance(action, StartGeneration):
                rid = action.request.request_id
                assert rid not in self.live, f"request id {rid} reused"
                assert action.response_id not in self.live.values(), (
                    f"two generations at once for {action.response_id}"
                )
                self.live[rid] = action.response_id
                self.requests[rid] = action.request
                self.waiting_tools.discard(action.response_id)
                self.paused.discard(action.response_id)
            elif isinstance(action, AbortGeneration):
                assert self.live.get(action.request_id) == action.response_id, (
                    f"abort of a request that is not running: {action}"
                )
                del self.live[action.request_id]
                self.stale.append(action.request_id)
            elif isinstance(action, StartTimer):
                assert action.delay_s > 0
                self.timers.append((action.response_id, action.token))
                self.armed.add(action.response_id)
            elif isinstance(action, CancelTimer):
                assert action.response_id in self.armed, f"cancel of no timer: {action}"
                self.armed.discard(action.response_id)
        for event in events:
            assert_wire_safe(event)
            self._track(event)
        # No engine slot runs for a response that is over.
        for rid, resp_id in self.live.items():
            assert resp_id in self.open_responses, f"request {rid} runs for finished {resp_id}"
        # A tool timer runs only while its response waits for outputs.
        assert self.armed <= self.waiting_tools, f"timers outlive their wait: {self.armed}"
        # No response is left hanging: it generates, waits for tools, or is paused.
        for resp_id in self.open_responses:
            assert (
                resp_id in self.live.values()
                or resp_id in self.waiting_tools
                or resp_id in self.paused
            ), f"response {resp_id} is open but nothing will ever finish it"
        auto = [r for r in self.open_responses if self.created[r] == "auto"]
        assert len(auto) <= 1, f"several conversation:auto responses active: {auto}"
        return events

    def _track(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "response.created":
            resp = event["response"]
            assert resp["id"] not in self.created, "response.created twice"
            self.created[resp["id"]] = resp["conversation"]
        elif kind == "response.done":
            resp = event["response"]
            assert resp["id"] in self.created, "response.done without response.created"
            self.done[resp["id"]] += 1
            assert self.done[resp["id"]] == 1, f"second response.done for {resp['id']}"
            assert resp["status"] in ("completed", "cancelled", "incomplete", "failed"), resp
            self.waiting_tools.discard(resp["id"])
            self.paused.discard(resp["id"])
        elif kind == "response.requires_action":
            self.waiting_tools.add(event["response_id"])
            self.call_ids.update(dict.fromkeys(event["call_ids"]))
        elif kind in ("conversation.item.created", "conversation.item.retrieved"):
            self.item_ids[event["item"]["id"]] = None
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.item_ids[event["item_id"]] = None
        elif kind == "response.steered":
            self.item_ids[event["item"]["id"]] = None

    # -- inputs ----------------------------------------------------------------

    def client(self, obj: Any, binary: bool = False) -> list[dict[str, Any]]:
        return self.collect(send_client_event(self.session, obj, binary))

    def engine_output(self, rid: str, delta: EngineDelta) -> list[dict[str, Any]]:
        self.session.receive_engine_output(rid, delta)
        if delta.finish_reason is not None and rid in self.live:
            del self.live[rid]  # the engine's stream ends with its finish reason
            self.stale.append(rid)
        return self.collect()

    def engine_error(self, rid: str, exc: EngineError) -> None:
        self.session.receive_engine_error(rid, exc)
        if rid in self.live:
            del self.live[rid]
            self.stale.append(rid)
        self.collect()

    def timeout(self, response_id: str, token: int) -> None:
        self.session.receive_timeout(response_id, token)
        self.collect()

    def pause(self) -> None:
        paused = self.session.pause()
        self.paused.update(paused)
        self.collect()

    def resume(self) -> None:
        self.session.resume()
        self.collect()

    def close(self) -> None:
        self.session.close()
        self.closed = True
        self.collect()
        assert not self.live, f"generations left running after close: {self.live}"
        for resp_id in self.created:
            assert self.done[resp_id] == 1, f"{resp_id} never got its response.done"


def _pick(data: st.DataObject, pool: Iterable[str], *extra: str) -> str:
    return data.draw(st.sampled_from([*dict.fromkeys(pool), *extra]))


def valid_event(data: st.DataObject, h: Harness) -> dict[str, Any]:
    """One valid client event, aimed at the ids this session knows."""
    kind = data.draw(
        st.sampled_from(
            [
                "session.update",
                "message",
                "call_output",
                "response.create",
                "response.create",
                "response.cancel",
                "response.steer",
                "conversation.item.truncate",
                "conversation.item.retrieve",
                "session.resume",
            ]
        )
    )
    event_id = data.draw(st.none() | st.sampled_from(["e1", "e2", "x" * 128]))
    tool = dict(WEATHER, parameters=copy.deepcopy(data.draw(st.sampled_from(SCHEMAS))))
    tools = data.draw(st.sampled_from([[], [tool], [tool, LOOKUP]]))
    choice = data.draw(
        st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}])
    )
    responses = list(h.created)
    ev: dict[str, Any]
    if kind == "session.update":
        ev = {
            "type": "session.update",
            "session": {
                "instructions": "Be brief.",
                "tools": tools,
                "tool_choice": choice,
                "parallel_tool_calls": data.draw(st.booleans()),
                "temperature": 0.5,
                "max_output_tokens": data.draw(st.sampled_from([None, 1, 5, 50])),
                "tool_timeout_s": 5.0,
            },
        }
    elif kind == "message":
        item: dict[str, Any] = {
            "type": "message",
            "role": data.draw(st.sampled_from(["user", "system", "assistant"])),
            "content": data.draw(st.sampled_from(["hello there", "Oslo", "", "a b c d"])),
        }
        if data.draw(st.booleans()):
            item["id"] = data.draw(st.sampled_from(["item_a", "item_b", "it.1:x-y"]))
        ev = {"type": "conversation.item.create", "item": item}
        if data.draw(st.booleans()):
            ev["previous_item_id"] = _pick(data, h.item_ids, "item_missing")
    elif kind == "call_output":
        ev = {
            "type": "conversation.item.create",
            "item": {
                "type": "function_call_output",
                "call_id": _pick(data, h.call_ids, "call_missing"),
                "output": '{"temperature": 20}',
            },
        }
    elif kind == "response.create":
        params: dict[str, Any] = {
            "conversation": data.draw(st.sampled_from(["auto", "none"])),
            "max_output_tokens": data.draw(st.sampled_from([1, 3, 20])),
            "ignore_eos": data.draw(st.booleans()),
        }
        if data.draw(st.booleans()):
            params.update(
                instructions="Use tools.",
                tools=tools,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=0.0,
                metadata={"k": "v"},
            )
        if data.draw(st.booleans()):
            params["input"] = [{"type": "message", "role": "user", "content": "hi there"}]
        ev = {"type": "response.create", "response": params}
    elif kind in ("response.cancel", "response.steer"):
        ev = {"type": kind}
        if data.draw(st.booleans()):
            ev["response_id"] = _pick(data, responses, "resp_missing")
        if kind == "response.steer":
            ev["input"] = "actually, Paris"
    elif kind == "conversation.item.truncate":
        ev = {
            "type": kind,
            "item_id": _pick(data, h.item_ids, "item_missing"),
            "text_end": data.draw(st.sampled_from([0, 1, 3, 1000])),
        }
    elif kind == "conversation.item.retrieve":
        ev = {"type": kind, "item_id": _pick(data, h.item_ids, "item_missing")}
    else:
        ev = {"type": "session.resume", "session_id": h.session.id, "last_seq": 3}
    if event_id is not None:
        ev["event_id"] = event_id
    return ev


def mutate(data: st.DataObject, h: Harness, event: dict[str, Any], least: int = 0) -> Any:
    root: Any = copy.deepcopy(event)
    for _ in range(data.draw(st.integers(least, 3))):
        paths = _paths(root)
        path = data.draw(st.sampled_from(paths))
        op = data.draw(st.sampled_from(MUTATIONS))
        target = _get(root, path)
        if op == "drop":
            if path:
                parent = _get(root, path[:-1])
                del parent[path[-1]]
        elif op == "retype":
            root = _set(root, path, copy.deepcopy(data.draw(weird_values)))
        elif op == "huge_int":
            root = _set(root, path, data.draw(st.sampled_from(HUGE_INTS)))
        elif op == "nonfinite":
            root = _set(root, path, data.draw(st.sampled_from(NONFINITE)))
        elif op == "long_string":
            root = _set(root, path, data.draw(st.sampled_from(LONG_STRINGS)))
        elif op == "unknown_key":
            key = data.draw(st.sampled_from(FIELD_NAMES) | st.text(max_size=6))
            if isinstance(target, dict):
                target[key] = copy.deepcopy(data.draw(weird_values))
            else:
                root = _set(root, path, {key: target})
        elif op == "wrap":
            root = _set(root, path, data.draw(st.sampled_from([[target], {"value": target}])))
        elif op == "unwrap":
            if isinstance(target, dict) and target:
                root = _set(root, path, next(iter(target.values())))
            elif isinstance(target, list) and target:
                root = _set(root, path, target[0])
        elif op == "swap_type":
            type_paths = [p for p in paths if p and p[-1] == "type"] or [path]
            root = _set(
                root, data.draw(st.sampled_from(type_paths)), data.draw(st.sampled_from(TYPE_NAMES))
            )
        elif op == "swap_id":
            pool = [*h.item_ids, *h.call_ids, *h.created, h.session.id]
            root = _set(root, path, _pick(data, pool, "x"))
    return root


@FUZZ_SEQUENCES
@given(st.data())
def test_session_mutated_single_events(data: st.DataObject) -> None:
    """One mutated event on a session that already has tools, items and a
    response: every reply, echoes included, must still be sendable."""
    h = Harness()
    h.client({"type": "session.update", "session": {"tools": [WEATHER]}})
    h.client(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "hi"},
        }
    )
    h.client(
        {"type": "response.create", "response": {"conversation": "none", "max_output_tokens": 5}}
    )
    for _ in range(data.draw(st.integers(1, 3), label="events")):
        h.client(mutate(data, h, valid_event(data, h), least=1))
    h.close()


def test_session_unresolvable_schema_ref_fails_the_response() -> None:
    """The minimal case the sequence fuzzer finds: a tool whose parameters
    hold a $ref to nowhere, and the model calls it. The argument check must fail
    the response, not raise out of receive_engine_output (which leaves it
    in_progress forever: see the socket test of the same name in
    tests/server/test_fuzz_socket.py)."""
    h = Harness()
    tool = {"name": "f", "parameters": {"$ref": "#/definitions/missing"}}
    reply = h.client({"type": "session.update", "session": {"tools": [tool]}})
    if reply[0]["type"] == "error":  # refusing the schema up front is a fix too
        assert reply[0]["error"]["code"] == "invalid_field"
        return
    h.client({"type": "response.create", "response": {"tool_choice": "required"}})
    (rid,) = h.live
    events = h.engine_output(
        rid, EngineDelta("", 1, "stop", tool_calls=[ToolCallDelta(0, "f", "{}")])
    )
    assert [e["type"] for e in events][-2:] == ["error", "response.done"]
    assert events[-2]["error"]["code"] == "invalid_tool_arguments"
    assert events[-1]["response"]["status"] == "failed"


def _called(tool: dict, arguments: str) -> list[dict]:
    """The events of a forced call of `tool` the model made with `arguments`."""
    h = Harness()
    reply = h.client({"type": "session.update", "session": {"tools": [tool]}})
    assert reply[0]["type"] == "session.updated"
    h.client({"type": "response.create", "response": {"tool_choice": "required"}})
    (rid,) = h.live
    return h.engine_output(
        rid, EngineDelta("", 1, "stop", tool_calls=[ToolCallDelta(0, tool["name"], arguments)])
    )


def _failed_on_arguments(events: list[dict]) -> str:
    assert [e["type"] for e in events][-2:] == ["error", "response.done"]
    assert events[-2]["error"]["code"] == "invalid_tool_arguments"
    assert events[-1]["response"]["status"] == "failed"
    return events[-2]["error"]["message"]


def test_a_schema_ref_beyond_the_schema_is_never_fetched(tmp_path: Path) -> None:
    """A client's schema may not make the server fetch a URL or read a file
    (on the event loop, with no timeout): such a $ref is unresolvable."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = tmp_path / "local.json"
    local.write_text('{"const": "contents-of-a-local-file"}')
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        for ref in (f"{url}/ref", local.as_uri()):
            tool = {"name": "f", "parameters": {"properties": {"x": {"$ref": ref}}}}
            message = _failed_on_arguments(_called(tool, '{"x": "s"}'))
            assert "Unresolvable" in message and "contents-of" not in message
        relative = {"$id": f"{url}/root/", "properties": {"x": {"$ref": "rel"}}}
        _failed_on_arguments(_called({"name": "f", "parameters": relative}, '{"x": "s"}'))
    finally:
        server.shutdown()
    assert hits == []
    # A $ref within the schema still resolves.
    inner = {"$defs": {"i": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/i"}}}
    message = _failed_on_arguments(_called({"name": "f", "parameters": inner}, '{"x": "s"}'))
    assert "'s' is not of type 'integer'" in message


def test_arguments_nested_too_deeply_fail_the_response() -> None:
    """json.loads raises RecursionError past ~1000 levels: the response fails
    with a message, rather than staying in_progress with its request gone."""
    tool = {"name": "f", "parameters": {"type": "object"}}
    message = _failed_on_arguments(_called(tool, '{"a": ' + "[" * 5000))
    assert message.endswith("the arguments nest too deeply to parse")


STEPS = ["client"] * 5 + ["text"] * 3 + ["tool"] * 2 + ["error", "timeout", "pause", "resume"]


@FUZZ_SEQUENCES
@given(st.data())
def test_session_mutated_sequences_keep_invariants(data: st.DataObject) -> None:
    h = Harness()
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        step = data.draw(st.sampled_from(STEPS))
        if step == "client":
            ev = valid_event(data, h)
            if data.draw(st.integers(0, 2)):  # two thirds mutated
                ev = mutate(data, h, ev)
            h.client(ev, binary=data.draw(st.booleans()))
            continue
        # Engine inputs go to running requests, sometimes to ended or unknown ones.
        rid = _pick(data, h.live, *h.stale[-2:], "resp_x-1")
        if step == "text":
            h.engine_output(
                rid,
                EngineDelta(
                    text=data.draw(
                        st.sampled_from(["", " Hello", " t1", "é😀"]) | st.text(max_size=8)
                    ),
                    output_tokens=data.draw(st.integers(0, 3)),
                    finish_reason=data.draw(
                        st.sampled_from([None, None, None, "stop", "length", "abort", "weird"])
                    ),
                    prompt_tokens=data.draw(st.none() | st.integers(0, 100)),
                    cached_tokens=data.draw(st.none() | st.integers(0, 10)),
                    token_ids=data.draw(st.none() | st.lists(st.integers(0, 50_000), max_size=3)),
                ),
            )
        elif step == "tool":
            # Mostly a whole, well-formed call to one of the request's tools (so
            # the argument check passes and tool outputs get exercised), else chunks.
            request = h.requests.get(rid)
            offered = [t["function"] for t in (request.tools or [])] if request else []
            calls = []
            for index in range(data.draw(st.integers(1, 2))):
                if offered and data.draw(st.integers(0, 3)):
                    tool = data.draw(st.sampled_from(offered))
                    try:
                        example = example_arguments(tool.get("parameters") or {}, "Oslo")
                    except (AttributeError, TypeError):  # parameters that are no schema
                        example = {}
                    arguments = json.dumps(example)
                    calls.append(ToolCallDelta(index, tool["name"], arguments))
                    continue
                calls.append(
                    ToolCallDelta(
                        index=data.draw(st.integers(0, 2)),
                        name=data.draw(
                            st.sampled_from([None, "get_weather", "lookup", "undefined"])
                        ),
                        arguments=data.draw(st.sampled_from(CALL_ARGUMENTS) | st.text(max_size=8)),
                    )
                )
            h.engine_output(
                rid,
                EngineDelta(
                    text=data.draw(st.sampled_from(["", " ok"])),
                    output_tokens=1,
                    finish_reason=data.draw(st.sampled_from([None, "stop", "stop", "length"])),
                    tool_calls=calls,
                ),
            )
        elif step == "error":
            kind = data.draw(st.sampled_from(ENGINE_ERRORS))
            h.engine_error(rid, kind(data.draw(st.text(max_size=20))))
        elif step == "timeout":
            if h.timers:
                resp_id, token = data.draw(st.sampled_from(h.timers))
                token += data.draw(st.sampled_from([0, 0, -1, 1]))
            else:
                resp_id, token = "resp_missing", 1
            h.timeout(resp_id, token)
        elif step == "pause":
            h.pause()
        else:
            h.resume()
    h.close()
