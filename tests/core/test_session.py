"""The session state machine, driven without sockets or engines."""

from __future__ import annotations

import pytest

from tokenwire.core.conversation import ITEM_BYTES
from tokenwire.core.errors import ErrorCode, ProtocolError
from tokenwire.core.events import AbortGeneration, StartGeneration
from tokenwire.core.outbox import Outbox
from tokenwire.core.session import Session, SessionLimits
from tokenwire.engines.base import ContextLengthExceeded, EngineDelta, ToolCallDelta

from ..helpers.session import codes, drive, start, types
from ..helpers.tools import WEATHER as WEATHER_TOOL


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def session(clock: Clock) -> Session:
    s = Session(clock=clock)
    assert [e["type"] for e in s.events_to_send()] == ["session.created"]
    return s


def test_update_session_answers_with_full_session(session: Session) -> None:
    (ev,) = drive(
        session,
        {
            "type": "session.update",
            "event_id": "u",
            "session": {"instructions": "Be brief.", "temperature": 0.2},
        },
    )
    assert ev["type"] == "session.updated" and ev["event_id"] == "u"
    assert ev["session"]["instructions"] == "Be brief."
    assert ev["session"]["temperature"] == 0.2
    assert ev["session"]["id"] == session.id


def test_item_create_then_response_renders_chat(session: Session) -> None:
    drive(session, {"type": "session.update", "session": {"instructions": "sys"}})
    rid, action = start(session, "What is 2+2?", temperature=0, max_output_tokens=5)
    req = action.request
    assert req.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert req.temperature == 0 and req.max_output_tokens == 5
    assert action.response_id == rid


def test_an_output_items_first_delta_says_where_it_went(session: Session) -> None:
    """previous_item_id on the first delta of each item a conversation response
    writes (a client mirroring the conversation places it), on no later delta,
    and never for a conversation:"none" response."""
    _, action = start(session, "hi", tools=[WEATHER_TOOL])
    user_id = session.items[0]["id"]
    rq = action.request.request_id
    session.receive_engine_output(rq, EngineDelta("Let me", 1))
    session.receive_engine_output(rq, EngineDelta(" check.", 1))
    call = ToolCallDelta(0, "get_weather", '{"city"')
    session.receive_engine_output(rq, EngineDelta("", 1, tool_calls=[call]))
    more = ToolCallDelta(0, None, ': "Paris"}')
    session.receive_engine_output(rq, EngineDelta("", 1, "stop", tool_calls=[more]))
    deltas = [e for e in session.events_to_send() if e["type"].endswith(".delta")]
    message_id = deltas[0]["item_id"]
    assert [e.get("previous_item_id", "absent") for e in deltas] == [
        user_id,
        "absent",
        message_id,
        "absent",
    ]
    assert [i["id"] for i in session.items] == [user_id, message_id, deltas[2]["item_id"]]

    apart = Session()
    apart.events_to_send()
    _, other = start(apart, "again", conversation="none")
    apart.receive_engine_output(other.request.request_id, EngineDelta("no", 1, "stop"))
    first = next(e for e in apart.events_to_send() if e["type"].endswith(".delta"))
    assert "previous_item_id" not in first


def test_full_response_lifecycle(session: Session, clock: Clock) -> None:
    rid, action = start(session)
    rq = action.request.request_id
    clock.t += 0.25
    session.receive_engine_output(rq, EngineDelta("Hel", 1, None, 12, 4))
    clock.t += 0.10
    session.receive_engine_output(rq, EngineDelta("lo", 1, "stop"))
    events = session.events_to_send()
    assert [e["type"] for e in events] == [
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.done",
    ]
    assert events[2]["text"] == "Hello"
    done = events[3]["response"]
    assert done["id"] == rid and done["status"] == "completed"
    assert done["usage"] == {
        "input_tokens": 12,
        "output_tokens": 2,
        "cached_tokens": 4,
        "total_tokens": 14,
    }
    assert done["timings"]["ttft_ms"] == pytest.approx(250)
    assert done["timings"]["total_ms"] == pytest.approx(350)
    assert done["output"][0]["content"] == "Hello"
    # The answer is now part of the conversation.
    assert session.items[-1]["role"] == "assistant" and session.items[-1]["content"] == "Hello"


def test_length_finish_is_incomplete(session: Session) -> None:
    _, action = start(session)
    session.receive_engine_output(action.request.request_id, EngineDelta("a", 1, "length", 3, 0))
    done = session.events_to_send()[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"]["reason"] == "max_output_tokens"


def test_cancel_aborts_and_ends_at_once(session: Session) -> None:
    rid, action = start(session)
    rq = action.request.request_id
    session.receive_engine_output(rq, EngineDelta("partial", 1, None, 3, 0))
    session.events_to_send()
    events = drive(session, {"type": "response.cancel", "event_id": "c"})
    assert session.actions_to_perform() == [AbortGeneration(rid, rq, cancel=True)]
    assert [e["type"] for e in events] == ["response.output_text.done", "response.done"]
    assert events[1]["response"]["status"] == "cancelled"
    assert events[1]["response"]["status_details"]["reason"] == "client_cancelled"
    # Late engine output for the aborted request is ignored.
    session.receive_engine_output(rq, EngineDelta(" more", 1, None))
    assert session.events_to_send() == []
    assert session.items[-1]["content"] == "partial"


def test_cancel_errors(session: Session) -> None:
    assert codes(drive(session, {"type": "response.cancel", "response_id": "resp_x"})) == [
        "unknown_response"
    ]
    assert codes(drive(session, {"type": "response.cancel"})) == ["response_not_active"]
    rid, action = start(session)
    session.receive_engine_output(action.request.request_id, EngineDelta("x", 1, "stop", 1, 0))
    session.events_to_send()
    assert codes(drive(session, {"type": "response.cancel", "response_id": rid})) == [
        "response_not_active"
    ]


def test_a_cancel_without_id_meant_for_the_ended_auto_response_spares_the_other(
    session: Session, clock: Clock
) -> None:
    """An auto response and an out-of-band one run; the auto one ends just as
    the client cancels it without an id: that cancel fell to the other."""
    rid, action = start(session)
    clock.t += 1
    side = drive(session, {"type": "response.create", "response": {"conversation": "none"}})
    side_id = side[0]["response"]["id"]
    session.actions_to_perform()
    clock.t += 1
    session.receive_engine_output(action.request.request_id, EngineDelta("x", 1, "stop", 1, 0))
    session.events_to_send()
    events = drive(session, {"type": "response.cancel"})
    assert (
        codes(events) == ["response_not_active"] and "response_id" in events[0]["error"]["message"]
    )
    assert [r.id for r in session.active_responses] == [side_id]
    # Named, it is cancelled; and one started after the auto one ended needs no name.
    assert types(drive(session, {"type": "response.cancel", "response_id": side_id}))[-1] == (
        "response.done"
    )
    clock.t += 1
    later = drive(session, {"type": "response.create", "response": {"conversation": "none"}})
    session.actions_to_perform()
    done = drive(session, {"type": "response.cancel"})
    assert done[-1]["response"]["id"] == later[0]["response"]["id"]
    assert rid not in [r.id for r in session.active_responses]


def test_one_active_response_per_conversation(session: Session) -> None:
    start(session)
    events = drive(session, {"type": "response.create", "event_id": "second"})
    assert codes(events) == [ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE]
    assert events[0]["error"]["event_id"] == "second"
    # Out-of-band responses may run beside it, with their own input.
    events = drive(
        session,
        {
            "type": "response.create",
            "response": {
                "conversation": "none",
                "input": [{"type": "message", "role": "user", "content": "side question"}],
            },
        },
    )
    assert events[0]["type"] == "response.created"
    (action,) = session.actions_to_perform()
    assert action.request.messages == [{"role": "user", "content": "side question"}]


def test_max_active_responses(clock: Clock) -> None:
    s = Session(clock=clock, limits=SessionLimits(max_active_responses=2))
    for _ in range(2):
        drive(s, {"type": "response.create", "response": {"conversation": "none"}})
    assert codes(drive(s, {"type": "response.create", "response": {"conversation": "none"}})) == [
        "too_many_responses"
    ]


def test_engine_error_fails_response_and_echoes_event_id(session: Session) -> None:
    _, action = start(session)
    session.receive_engine_error(action.request.request_id, ContextLengthExceeded("too long"))
    events = session.events_to_send()
    assert events[0]["error"]["code"] == "context_length_exceeded"
    assert events[0]["error"]["event_id"] == "create"
    assert events[-1]["response"]["status"] == "failed"


def test_close_aborts_everything(session: Session) -> None:
    rid, action = start(session)
    session.close()
    assert session.actions_to_perform() == [AbortGeneration(rid, action.request.request_id)]
    assert session.events_to_send()[-1]["response"]["status_details"]["reason"] == (
        "client_disconnected"
    )


def test_truncate_keeps_heard_prefix(session: Session) -> None:
    _, action = start(session)
    rq = action.request.request_id
    session.receive_engine_output(rq, EngineDelta("The capital is Paris.", 5, None, 3, 0))
    item_id = session.items[-1]["id"]
    # Not while it is still generating: cancel first.
    assert codes(
        drive(session, {"type": "conversation.item.truncate", "item_id": item_id, "text_end": 3})
    ) == ["invalid_state"]
    drive(session, {"type": "response.cancel"})
    (ev,) = drive(
        session, {"type": "conversation.item.truncate", "item_id": item_id, "text_end": 11}
    )
    assert ev["type"] == "conversation.item.truncated"
    assert session.items[-1]["content"] == "The capital"
    assert codes(
        drive(session, {"type": "conversation.item.truncate", "item_id": item_id, "text_end": 50})
    ) == ["invalid_field"]
    assert codes(
        drive(session, {"type": "conversation.item.truncate", "item_id": "nope", "text_end": 1})
    ) == ["unknown_item"]


def test_steer_continues_same_response(session: Session) -> None:
    rid, action = start(session, "Tell me a story")
    old = action.request.request_id
    session.receive_engine_output(old, EngineDelta("Once upon", 2, None, 5, 0))
    session.events_to_send()
    events = drive(session, {"type": "response.steer", "event_id": "s", "input": "Make it short"})
    assert [e["type"] for e in events] == ["response.output_text.done", "response.steered"]
    assert events[1]["response_id"] == rid and events[1]["event_id"] == "s"
    abort, restart = session.actions_to_perform()
    assert abort == AbortGeneration(rid, old)
    assert isinstance(restart, StartGeneration) and restart.response_id == rid
    assert restart.request.messages[-2:] == [
        {"role": "assistant", "content": "Once upon"},
        {"role": "user", "content": "Make it short"},
    ]
    session.receive_engine_output(old, EngineDelta(" stale", 1, None))  # ignored
    session.receive_engine_output(restart.request.request_id, EngineDelta("The end.", 2, "stop"))
    events = session.events_to_send()
    done = events[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed"
    assert [i["content"] for i in done["output"]] == ["Once upon", "The end."]
    assert done["usage"]["output_tokens"] == 4
    assert all(e.get("delta") != " stale" for e in events)


def test_the_steer_item_says_which_item_it_follows(session: Session) -> None:
    """As conversation.item.created does: it was the partial item even when
    the client had added an item after it, and null before any text."""
    start(session, "Tell me a story")
    steer = {"type": "response.steer", "input": "Make it short"}
    events = drive(session, steer)
    question = session.items[0]["id"]
    assert events[-1]["previous_item_id"] == question  # no text yet: after the question
    rq = session.actions_to_perform()[-1].request.request_id  # type: ignore[attr-defined]
    session.receive_engine_output(rq, EngineDelta("Once", 1, None, 5, 0))
    session.events_to_send()
    note = {"type": "message", "role": "user", "content": "aside"}
    added = drive(session, {"type": "conversation.item.create", "item": note})
    events = drive(session, steer)
    assert events[-1]["previous_item_id"] == added[0]["item"]["id"]
    ids = [item["id"] for item in session.items]
    assert ids.index(events[-1]["item"]["id"]) == ids.index(added[0]["item"]["id"]) + 1


def test_steer_without_active_response(session: Session) -> None:
    assert codes(drive(session, {"type": "response.steer", "input": "x"})) == [
        "response_not_active"
    ]


def test_function_call_output_for_unknown_call(session: Session) -> None:
    events = drive(
        session,
        {
            "type": "conversation.item.create",
            "event_id": "f",
            "item": {"type": "function_call_output", "call_id": "call_1", "output": "{}"},
        },
    )
    assert codes(events) == ["unknown_call_id"]


def test_duplicate_item_id(session: Session) -> None:
    item = {"type": "message", "role": "user", "content": "x", "id": "mine"}
    drive(session, {"type": "conversation.item.create", "item": item})
    (error,) = drive(session, {"type": "conversation.item.create", "item": item})
    assert (error["error"]["code"], error["error"]["param"]) == ("duplicate_item_id", "item.id")
    # In a response's input, the param names the input item.
    other = {"type": "message", "role": "user", "content": "y"}
    response = {"conversation": "none", "input": [other, item]}
    (error,) = drive(session, {"type": "response.create", "response": response})
    assert (error["error"]["code"], error["error"]["param"]) == (
        "duplicate_item_id",
        "response.input.1.id",
    )


def test_seq_rises_by_one_on_every_event(session: Session) -> None:
    box = Outbox()
    _, action = start(session)
    for i in range(5):
        session.receive_engine_output(
            action.request.request_id, EngineDelta(f"t{i}", 1, "stop" if i == 4 else None)
        )
    drive(session, {"type": "nope"})
    box.extend(session.events_to_send())
    seqs = []
    while (e := box.pop(merge=True)) is not None:
        seqs.append(e["seq"])
    assert seqs == list(range(1, len(seqs) + 1))


def test_events_snapshot_items(session: Session) -> None:
    """An event already queued must not change when the conversation moves on."""
    _, action = start(session)
    created = session.events_to_send()
    session.receive_engine_output(action.request.request_id, EngineDelta("abc", 1, "stop", 1, 0))
    done = session.events_to_send()[-1]
    assert created == [] or all(not o["content"] for o in created[0]["response"]["output"])
    drive(
        session,
        {"type": "conversation.item.truncate", "item_id": session.items[-1]["id"], "text_end": 1},
    )
    assert done["response"]["output"][0]["content"] == "abc"


def test_conversation_size_is_capped(clock: Clock) -> None:
    cap = 60 + ITEM_BYTES + 100  # one item of 60 bytes fits, a second does not
    s = Session(clock=clock, limits=SessionLimits(max_conversation_bytes=cap))
    s.events_to_send()
    ok = drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "x" * 60},
        },
    )
    assert ok[0]["type"] == "conversation.item.created"
    events = drive(
        s,
        {
            "type": "conversation.item.create",
            "event_id": "big",
            "item": {"type": "message", "role": "user", "content": "y" * 60},
        },
    )
    assert codes(events) == ["conversation_too_large"]
    assert events[0]["error"]["event_id"] == "big"
    assert len(s.items) == 1
    events = drive(
        s,
        {
            "type": "response.create",
            "response": {"input": [{"type": "message", "role": "user", "content": "z" * 60}]},
        },
    )
    assert codes(events) == ["conversation_too_large"]
    assert s.history_bytes == 60 + ITEM_BYTES


def test_empty_items_count_against_the_cap(clock: Clock) -> None:
    """Each item counts too, or items without text would hold memory unbounded."""
    s = Session(clock=clock, limits=SessionLimits(max_conversation_bytes=10 * ITEM_BYTES))
    s.events_to_send()
    empty = {"type": "message", "role": "assistant", "content": ""}
    results = [
        drive(s, {"type": "conversation.item.create", "item": dict(empty)})[0]["type"]
        for _ in range(12)
    ]
    assert results == ["conversation.item.created"] * 10 + ["error"] * 2
    assert codes(drive(s, {"type": "conversation.item.create", "item": dict(empty)})) == [
        "conversation_too_large"
    ]
    # A deleted item gives its room back.
    drive(s, {"type": "conversation.item.delete", "item_id": s.items[0]["id"]})
    assert drive(s, {"type": "conversation.item.create", "item": dict(empty)})[0]["type"] == (
        "conversation.item.created"
    )
    # Model output items count as well: a response that writes one byte takes an item's room.
    s2 = Session(clock=clock, limits=SessionLimits(max_conversation_bytes=3 * ITEM_BYTES))
    s2.events_to_send()
    for expected in ("response.created", "response.created", "response.created", "error"):
        events = drive(s2, {"type": "response.create", "response": {"conversation": "none"}})
        assert events[0]["type"] == expected
        for action in s2.actions_to_perform():
            s2.receive_engine_output(action.request.request_id, EngineDelta("x", 1, "stop"))
        s2.events_to_send()


def test_client_events_counts_every_frame_taken(session: Session) -> None:
    """What a resuming client is told the server took, so it resends the rest."""
    start(session)  # two events
    drive(session, {"type": "response.cancel", "event_id": "c"})  # taken, no echo
    assert codes(drive(session, {"type": "no.such.event"})) == ["unknown_event_type"]
    session.receive_protocol_error(ProtocolError(ErrorCode.MALFORMED_FRAME, "not JSON"))
    assert session.client_events == 5
    # A refused resume is about no frame of this session.
    session.receive_protocol_error(
        ProtocolError(ErrorCode.SESSION_NOT_FOUND, "no such session"), frame=False
    )
    assert session.client_events == 5


def test_a_rate_below_one_event_in_two_seconds_still_lets_events_through(clock: Clock) -> None:
    s = Session(clock=clock, limits=SessionLimits(max_events_per_s=0.25))
    s.events_to_send()
    update = {"type": "session.update", "session": {}}
    assert [e["type"] for e in drive(s, update)] == ["session.updated"]
    assert codes(drive(s, update)) == ["rate_limit_exceeded"]
    clock.t += 4.0  # one event's worth at 0.25/s
    assert [e["type"] for e in drive(s, update)] == ["session.updated"]


def test_frames_that_do_not_parse_count_against_the_event_rate(clock: Clock) -> None:
    """A flood of bad frames is held to --max-events-per-s like any other."""
    s = Session(clock=clock, limits=SessionLimits(max_events_per_s=2))
    s.events_to_send()
    bad = ProtocolError(ErrorCode.MALFORMED_FRAME, "not JSON", event_id="b")
    got = [codes(drive(s, bad))[0] for _ in range(6)]
    assert got == ["malformed_frame"] * 4 + ["rate_limit_exceeded"] * 2  # a burst of 2 s
    update = {"type": "session.update", "session": {}}
    assert codes(drive(s, update)) == ["rate_limit_exceeded"]
    clock.t += 1.0
    assert codes(drive(s, bad)) == ["malformed_frame"]
    assert [e["type"] for e in drive(s, update)] == ["session.updated"]


@pytest.mark.parametrize(
    ("event", "param"),
    [
        ({"type": "session.update", "session": {"tools": [{"name": "f"}] * 129}}, "session.tools"),
        (
            {"type": "response.create", "response": {"metadata": {str(i): "" for i in range(17)}}},
            "response.metadata",
        ),
        ({"type": "response.create", "response": {"metadata": {"k" * 65: ""}}}, None),
        ({"type": "response.create", "response": {"metadata": {"k": "v" * 513}}}, None),
        (
            {
                "type": "response.create",
                "response": {"input": [{"type": "message", "role": "user", "content": "x"}] * 1025},
            },
            "response.input",
        ),
        ({"type": "conversation.item.retrieve", "item_id": "\x01" * 100_000}, "item_id"),
        ({"type": "conversation.item.delete", "item_id": "i" * 129}, "item_id"),
        (
            {"type": "session.update", "session": {"tool_choice": {"name": "x" * 500_000}}},
            "session.tool_choice.name",
        ),
        ({"type": "response.cancel", "response_id": "r" * 129}, "response_id"),
        ({"type": "response.steer", "response_id": "r" * 129, "input": "x"}, "response_id"),
        (
            {
                "type": "conversation.item.create",
                "previous_item_id": "p" * 129,
                "item": {"type": "message", "role": "user", "content": "x"},
            },
            "previous_item_id",
        ),
    ],
)
def test_lists_maps_and_ids_are_bounded_and_errors_stay_small(
    session: Session, event: dict[str, object], param: str | None
) -> None:
    """OpenAI's limits on tools and metadata, and ids of at most 128
    characters: a client cannot make an error (or a setting every response
    renders) as large as its frame."""
    (error,) = drive(session, event)
    assert error["type"] == "error" and error["error"]["code"] == "invalid_field"
    if param is not None:
        assert error["error"]["param"] == param
    assert len(error["error"]["message"]) < 300
    assert session.config["tools"] == []  # nothing was applied


@pytest.mark.parametrize(
    "event",
    [
        {"type": "response.create", "response": {"k" * 100_000: 1}},
        {"type": "conversation.item.create", "item": {"type": "t" * 100_000, "content": ""}},
        {"type": "response.create", "response": {"metadata": {"k" * 100_000: "v"}}},
    ],
)
def test_errors_quoting_the_clients_keys_and_values_stay_small(
    session: Session, event: dict[str, object]
) -> None:
    (error,) = drive(session, event)
    assert error["error"]["code"] in ("unknown_field", "invalid_field")
    assert len(error["error"]["message"]) <= 512
    assert len(error["error"]["param"]) <= 256


def test_the_limits_themselves_are_allowed(session: Session) -> None:
    tools = [{"name": f"t{i}"} for i in range(128)]
    (updated,) = drive(session, {"type": "session.update", "session": {"tools": tools}})
    assert len(updated["session"]["tools"]) == 128
    metadata = {f"k{i:062d}": "v" * 512 for i in range(16)}
    created = drive(session, {"type": "response.create", "response": {"metadata": metadata}})
    assert created[0]["type"] == "response.created"
    assert created[0]["response"]["metadata"] == metadata


@pytest.mark.parametrize("value", [b"\x00", {"k": [b"\x00"]}])
def test_a_bin_value_anywhere_is_a_malformed_frame(session: Session, value: object) -> None:
    """msgpack's bin values are not JSON: no field takes them, not even deep in
    a tool's parameters (which pydantic no longer walks)."""
    tool = {"type": "function", "name": "f", "parameters": {"properties": {"c": {"enum": [value]}}}}
    (error,) = drive(session, {"type": "session.update", "session": {"tools": [tool]}})
    assert error["error"]["code"] == "malformed_frame"
    assert "bin value" in error["error"]["message"]
    (error,) = drive(session, {"type": "session.update", "session": {"instructions": b"hi"}})
    assert error["error"]["code"] == "malformed_frame"


def test_a_missing_field_is_named_in_param(session: Session) -> None:
    (error,) = drive(
        session,
        {"type": "conversation.item.create", "item": {"type": "function_call_output"}},
    )
    assert error["error"]["code"] == "missing_field"
    assert error["error"]["param"] == "item.call_id"


@pytest.mark.parametrize(
    ("event", "code", "param"),
    [
        ({"type": "conversation.item.create", "item": {}}, "missing_field", "item.type"),
        (
            {"type": "response.create", "response": {"input": [{"role": "user"}]}},
            "missing_field",
            "response.input.0.type",
        ),
        (
            {"type": "session.update", "session": {"tool_choice": {"type": "function"}}},
            "missing_field",
            "session.tool_choice.name",
        ),
        (
            {"type": "response.create", "response": {"tool_choice": {"name": "f", "x": 1}}},
            "unknown_field",
            "response.tool_choice.x",
        ),
        (
            {"type": "session.update", "session": {"tool_choice": "sometimes"}},
            "invalid_field",
            "session.tool_choice",
        ),
        (  # Chat Completions' shape: the name is not where this API has it
            {
                "type": "session.update",
                "session": {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            },
            "missing_field",
            "session.tool_choice.name",
        ),
    ],
)
def test_a_union_field_names_what_is_wrong_with_the_shape_given(
    session: Session, event: dict[str, object], code: str, param: str
) -> None:
    """An item without a type, or a named tool_choice missing its name, is a
    missing field, not "should be 'auto', 'none' or 'required'"."""
    (error,) = drive(session, event)
    assert (error["error"]["code"], error["error"]["param"]) == (code, param)
    assert "discriminator" not in error["error"]["message"]


def test_a_resume_frame_mid_session_is_not_counted(session: Session) -> None:
    """Clients number their frames without session.resume (docs: Resume)."""
    drive(session, {"type": "session.update", "session": {}})
    events = drive(session, {"type": "session.resume", "session_id": session.id, "last_seq": 1})
    assert codes(events) == ["invalid_state"]
    assert session.client_events == 1


def test_a_closed_session_ignores_client_events() -> None:
    s = Session()
    s.events_to_send()
    s.close()
    s.receive_client_event({"type": "response.create", "response": {}})
    s.receive_client_event({"type": "nonsense"})
    assert s.events_to_send() == [] and s.actions_to_perform() == []
    assert not s.responses and s.client_events == 0


@pytest.mark.parametrize(
    "event",
    [
        {"type": "session.update", "session": {f"k{i}": 1 for i in range(5000)}},
        {"type": "response.create", "response": {"metadata": {f"k{i}": 1 for i in range(5000)}}},
    ],
)
def test_an_event_with_thousands_of_problems_is_refused_without_listing_them(
    event: dict,
) -> None:
    """pydantic builds every error to give the first (60,000: 0.15 s); past 100
    the event is refused as a whole, with its count."""
    s = Session()
    s.events_to_send()
    (error,) = drive(s, {**event, "event_id": "big"})
    assert error["error"]["code"] == "invalid_field"
    assert error["error"]["event_id"] == "big"
    assert error["error"]["message"] == (
        "event: 5000 fields are invalid; send a smaller, valid event"
    )
    few = {"type": "session.update", "session": {"a": 1, "b": 2}}
    assert codes(drive(s, few)) == ["unknown_field"]  # a few are still named


def test_input_ids_are_checked_before_an_output_in_input(session: Session) -> None:
    """protocol.md §4: duplicate ids (step 4), then outputs in input (step 5);
    an output whose id already existed got step 5's error."""
    drive(
        session,
        {"type": "conversation.item.create", "item": {"id": "u1", "type": "message",
                                                      "role": "user", "content": "x"}},
    )  # fmt: skip
    output = {"type": "function_call_output", "call_id": "c", "output": "o"}
    events = drive(
        session, {"type": "response.create", "response": {"input": [{**output, "id": "u1"}]}}
    )
    assert codes(events) == ["duplicate_item_id"]
    assert events[0]["error"]["param"] == "response.input.0.id"
    events = drive(session, {"type": "response.create", "response": {"input": [output]}})
    assert codes(events) == ["invalid_field"] and events[0]["error"]["param"] == "response.input"
