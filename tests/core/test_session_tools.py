"""Tool calls, tool outputs and steering in the session state machine (no sockets)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenwire.core.conversation import ITEM_BYTES, render_messages
from tokenwire.core.events import AbortGeneration, CancelTimer, StartGeneration, StartTimer
from tokenwire.core.session import Session
from tokenwire.engines.base import ContextLengthExceeded, EngineDelta, ToolCallDelta

from ..helpers.session import begin, call, codes, drive, output, types
from ..helpers.tools import TIME, WEATHER


@pytest.fixture
def session() -> Session:
    s = Session()
    s.events_to_send()
    return s


def test_request_carries_tools_and_choice(session: Session) -> None:
    action = begin(session, tool_choice={"type": "function", "name": "get_weather"})
    req = action.request
    assert req.tool_choice == {"type": "function", "name": "get_weather"}
    assert [t["function"]["name"] for t in req.tools or []] == ["get_weather", "get_time"]


def test_parallel_calls_wait_then_continue_in_any_order(session: Session) -> None:
    action = begin(session, tool_choice="required")
    rq = action.request.request_id
    events = call(session, rq, 0, "get_weather", '{"city": ')
    assert types(events) == ["response.function_call_arguments.delta"]
    first = events[0]
    assert first["name"] == "get_weather" and first["delta"] == '{"city": '
    call(session, rq, 0, None, '"Paris"}')
    call(session, rq, 1, "get_time", "{}")
    session.receive_engine_output(rq, EngineDelta("", 0, "stop"))
    events = session.events_to_send()
    assert types(events) == ["response.function_call_arguments.done"] * 2 + [
        "response.requires_action"
    ]
    weather, time_call = events[0], events[1]
    assert weather["arguments"] == '{"city": "Paris"}'
    assert events[2]["call_ids"] == [weather["call_id"], time_call["call_id"]]
    (timer,) = session.actions_to_perform()
    assert isinstance(timer, StartTimer) and timer.delay_s == 60.0
    # Outputs arrive in reverse order; nothing runs until both are in.
    created = output(session, time_call["call_id"], '{"time": "14:05"}')
    assert types(created) == ["conversation.item.created"]
    assert session.actions_to_perform() == []
    output(session, weather["call_id"], '{"sky": "sunny"}')
    # The wait is over: its timer goes, and the same response goes on.
    cancel, cont = session.actions_to_perform()
    assert cancel == CancelTimer(action.response_id)
    assert isinstance(cont, StartGeneration) and cont.response_id == action.response_id
    # A forced choice is not forced again; the results are in the prompt.
    assert cont.request.tool_choice == "none" and cont.request.tools is None
    roles = [m["role"] for m in cont.request.messages]
    assert roles == ["user", "assistant", "tool", "tool"]
    assert len(cont.request.messages[1]["tool_calls"]) == 2
    session.receive_engine_output(cont.request.request_id, EngineDelta("Sunny.", 2, "stop"))
    events = session.events_to_send()
    done = events[-1]["response"]
    assert done["id"] == action.response_id and done["status"] == "completed"
    assert [o["type"] for o in done["output"]] == ["function_call", "function_call", "message"]
    assert types(events).count("response.done") == 1


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parallel_tool_calls_false_stops_at_a_second_call(session: Session, choice: str) -> None:
    """The engine forces one call only for "required"; with "auto" the model
    may start a second: the generation stops there, the first call is its
    result, and the second never reaches the client or the history."""
    action = begin(session, tool_choice=choice, parallel_tool_calls=False)
    rq = action.request.request_id
    call(session, rq, 0, "get_weather", '{"city": "Paris"}')
    session.actions_to_perform()
    events = call(session, rq, 1, "get_time", "{}")
    assert types(events) == ["response.function_call_arguments.done", "response.requires_action"]
    assert events[0]["name"] == "get_weather"
    assert events[1]["call_ids"] == [events[0]["call_id"]]
    abort, timer = session.actions_to_perform()
    assert isinstance(abort, AbortGeneration) and abort.request_id == rq
    assert isinstance(timer, StartTimer)
    assert [i.get("name") for i in session.items[1:]] == ["get_weather"]
    # Late outputs of the aborted request change nothing.
    assert call(session, rq, 1, None, "more", finish="stop") == []
    output(session, events[0]["call_id"], "sunny")
    (_, cont) = session.actions_to_perform()
    assert len(cont.request.messages[1]["tool_calls"]) == 1


def test_a_second_call_in_the_finishing_delta_aborts_nothing(session: Session) -> None:
    action = begin(session, parallel_tool_calls=False)
    rq = action.request.request_id
    chunks = [
        ToolCallDelta(0, "get_weather", '{"city": "Oslo"}'),
        ToolCallDelta(1, "get_time", "{}"),
    ]
    session.receive_engine_output(rq, EngineDelta("", 2, "stop", tool_calls=chunks))
    events = session.events_to_send()
    assert [e["name"] for e in events if e["type"].endswith("arguments.done")] == ["get_weather"]
    assert not [a for a in session.actions_to_perform() if isinstance(a, AbortGeneration)]


def test_parallel_tool_calls_true_lets_auto_make_several(session: Session) -> None:
    action = begin(session)
    rq = action.request.request_id
    call(session, rq, 0, "get_weather", '{"city": "Paris"}')
    call(session, rq, 1, "get_time", "{}", finish="stop")
    assert [i.get("name") for i in session.items[1:]] == ["get_weather", "get_time"]


def test_auto_choice_stays_auto_after_outputs(session: Session) -> None:
    action = begin(session)  # tool_choice defaults to auto
    call(session, action.request.request_id, 0, "get_time", "{}", finish="stop")
    call_id = session.items[-1]["call_id"]
    output(session, call_id, "noon")
    (cont,) = session.actions_to_perform()[-1:]
    assert cont.request.tool_choice == "auto"


def test_output_errors(session: Session) -> None:
    assert codes(output(session, "call_nope", "x")) == ["unknown_call_id"]
    action = begin(session, tool_choice="required")
    call(session, action.request.request_id, 0, "get_time", "{}", finish="stop")
    call_id = session.items[-1]["call_id"]
    assert codes(output(session, call_id, "1")) == []
    events = output(session, call_id, "2", event_id="again")
    assert codes(events) == ["duplicate_call_output"]
    assert events[0]["error"]["event_id"] == "again"


def test_tool_timeout_ends_incomplete(session: Session) -> None:
    drive(session, {"type": "session.update", "session": {"tool_timeout_s": 0.5}})
    action = begin(session, tool_choice="required")
    call(session, action.request.request_id, 0, "get_time", "{}", finish="stop")
    (timer,) = session.actions_to_perform()
    assert timer.delay_s == 0.5
    session.receive_timeout(action.response_id, timer.token - 1)  # a stale timer
    assert session.events_to_send() == []
    session.receive_timeout(action.response_id, timer.token)
    done = session.events_to_send()[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"]["reason"] == "tool_timeout"


def test_timer_after_outputs_is_ignored(session: Session) -> None:
    action = begin(session, tool_choice="required")
    call(session, action.request.request_id, 0, "get_time", "{}", finish="stop")
    (timer,) = session.actions_to_perform()
    output(session, session.items[-1]["call_id"], "noon")
    session.receive_timeout(action.response_id, timer.token)
    assert "response.done" not in types(session.events_to_send())


@pytest.mark.parametrize(
    ("name", "args", "why"),
    [
        ("get_weather", '{"town": "Paris"}', "schema"),
        ("get_weather", '{"city": 5}', "schema"),
        ("get_weather", '{"city": "Par', "JSON"),
        ("launch_rockets", "{}", "not defined"),
    ],
)
def test_bad_arguments_fail_the_response(session: Session, name: str, args: str, why: str) -> None:
    action = begin(session, tool_choice="required")
    events = call(session, action.request.request_id, 0, name, args, finish="stop")
    assert codes(events) == ["invalid_tool_arguments"]
    assert why in events[-2]["error"]["message"]
    assert events[-2]["error"]["event_id"] == "c"
    assert events[-1]["response"]["status"] == "failed"
    assert "response.function_call_arguments.done" not in types(events)


def test_steer_and_cancel_while_waiting_for_tools(session: Session) -> None:
    action = begin(session, tool_choice="required")
    call(session, action.request.request_id, 0, "get_time", "{}", finish="stop")
    (timer,) = session.actions_to_perform()
    assert codes(drive(session, {"type": "response.steer", "input": "hurry"})) == ["invalid_state"]
    events = drive(session, {"type": "response.cancel"})
    assert events[-1]["response"]["status"] == "cancelled"
    # The cancel ends the wait: the tool timer is dropped, not left to run out.
    assert session.actions_to_perform() == [CancelTimer(action.response_id)]
    session.receive_timeout(action.response_id, timer.token)
    assert session.events_to_send() == []


def test_closing_the_session_drops_the_tool_timer(session: Session) -> None:
    action = begin(session, tool_choice="required")
    call(session, action.request.request_id, 0, "get_time", "{}", finish="stop")
    session.actions_to_perform()
    session.close()
    assert session.actions_to_perform() == [CancelTimer(action.response_id)]


def test_named_choice_must_exist(session: Session) -> None:
    events = drive(
        session,
        {
            "type": "response.create",
            "event_id": "x",
            "response": {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        },
    )
    assert codes(events) == ["invalid_field"] and events[0]["error"]["param"] == (
        "response.tool_choice"
    )
    events = drive(session, {"type": "response.create", "response": {"tool_choice": "required"}})
    assert codes(events) == ["invalid_field"]


def test_steer_that_overflows_context_leaves_response_running() -> None:
    def check(request: Any) -> None:
        if sum(len(m["content"]) for m in request.messages) > 200:
            raise ContextLengthExceeded("too long")

    s = Session(preflight=check)
    drive(s, {"type": "response.create", "response": {"conversation": "none"}})
    (start,) = s.actions_to_perform()
    s.receive_engine_output(start.request.request_id, EngineDelta("Once", 1, None, 3, 0))
    s.events_to_send()
    events = drive(s, {"type": "response.steer", "event_id": "big", "input": "x" * 500})
    assert codes(events) == ["context_length_exceeded"]
    assert events[0]["error"]["event_id"] == "big"
    assert s.actions_to_perform() == []
    s.receive_engine_output(start.request.request_id, EngineDelta(" upon", 1, "stop"))
    assert s.events_to_send()[-1]["response"]["status"] == "completed"


def test_steer_drops_a_half_written_call(session: Session) -> None:
    action = begin(session)
    rq = action.request.request_id
    call(session, rq, 0, "get_weather", '{"ci')
    events = drive(session, {"type": "response.steer", "input": "never mind"})
    assert types(events) == ["response.steered"]
    abort, restart = session.actions_to_perform()
    assert abort == AbortGeneration(action.response_id, rq)
    assert all(m.get("tool_calls") is None for m in restart.request.messages)
    assert all(i["type"] != "function_call" for i in session.items)


def test_a_dropped_call_gives_its_bytes_back(session: Session) -> None:
    """Steers while a call streams must not push a small conversation towards
    conversation_too_large: the dropped call's arguments leave the count."""
    action = begin(session)
    before = session.conversation.history_bytes
    call(session, action.request.request_id, 0, "get_weather", '{"city": "' + "x" * 1000)
    drive(session, {"type": "response.steer", "input": "never mind"})
    steer = len(b"never mind")
    assert session.conversation.history_bytes == before + steer + ITEM_BYTES


def test_an_output_its_response_waits_on_cannot_be_deleted(session: Session) -> None:
    """Its call would go on without its answer (strict templates refuse the
    turn; others answer without the result)."""
    action = begin(session, tool_choice="required")
    rq = action.request.request_id
    call(session, rq, 0, "get_weather", '{"city": "Paris"}')
    events = call(session, rq, 1, "get_time", "{}", finish="stop")
    (waiting,) = [e for e in events if e["type"] == "response.requires_action"]
    ids = waiting["call_ids"]
    output(session, ids[0], "sunny")
    out_item = next(i for i in session.items if i["type"] == "function_call_output")
    events = drive(session, {"type": "conversation.item.delete", "item_id": out_item["id"]})
    assert codes(events) == ["invalid_state"]
    # Once the response has ended, it may go.
    output(session, ids[1], "noon")
    (cont,) = [a for a in session.actions_to_perform() if isinstance(a, StartGeneration)]
    session.receive_engine_output(cont.request.request_id, EngineDelta("Done.", 1, "stop"))
    session.events_to_send()
    events = drive(session, {"type": "conversation.item.delete", "item_id": out_item["id"]})
    assert types(events) == ["conversation.item.deleted"]


def test_a_call_cut_by_the_cap_under_ignore_eos_ends_incomplete(session: Session) -> None:
    """ignore_eos runs text to the cap by design; a call cut there is cut."""
    action = begin(session, tool_choice="required", ignore_eos=True, max_output_tokens=3)
    events = call(session, action.request.request_id, 0, "get_weather", '{"city": ', "length")
    done = [e for e in events if e["type"] == "response.done"][-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"]["reason"] == "max_output_tokens"


def test_retrieve_item(session: Session) -> None:
    (created,) = drive(
        session,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "hello"},
        },
    )
    (ev,) = drive(
        session,
        {"type": "conversation.item.retrieve", "event_id": "r", "item_id": created["item"]["id"]},
    )
    assert ev["type"] == "conversation.item.retrieved" and ev["item"]["content"] == "hello"
    assert codes(drive(session, {"type": "conversation.item.retrieve", "item_id": "x"})) == [
        "unknown_item"
    ]


def test_render_messages_groups_parallel_calls() -> None:
    items = [
        {"type": "message", "role": "user", "content": "q"},
        {
            "type": "function_call",
            "call_id": "a",
            "name": "f",
            "arguments": "{}",
            "status": "completed",
        },
        {
            "type": "function_call",
            "call_id": "b",
            "name": "g",
            "arguments": "{}",
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "b", "output": "2"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
    ]
    msgs = render_messages("sys", items)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["a", "b"]
    assert json.loads(msgs[2]["tool_calls"][0]["function"]["arguments"]) == {}


# -- regressions found in review ---------------------------------------------


def test_previous_item_id_of_an_out_of_band_item_is_unknown(session: Session) -> None:
    drive(
        session,
        {
            "type": "response.create",
            "response": {
                "conversation": "none",
                "input": [{"type": "message", "role": "user", "content": "aside", "id": "side1"}],
            },
        },
    )
    events = drive(
        session,
        {
            "type": "conversation.item.create",
            "previous_item_id": "side1",
            "item": {"type": "message", "role": "user", "content": "x"},
        },
    )
    assert codes(events) == ["unknown_item"]


def test_steer_prompt_holds_the_partial_text_once() -> None:
    checked: list[Any] = []
    s = Session(preflight=checked.append)
    drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "story"},
        },
    )
    drive(s, {"type": "response.create"})
    (start,) = s.actions_to_perform()
    s.receive_engine_output(start.request.request_id, EngineDelta("Once upon", 2, None, 3, 0))
    drive(s, {"type": "response.steer", "input": "shorter"})
    _, restart = s.actions_to_perform()
    assert [m["content"] for m in restart.request.messages] == ["story", "Once upon", "shorter"]
    # The request that was checked is the one that runs.
    assert checked[-1] is restart.request


def test_calls_failing_the_check_are_incomplete(session: Session) -> None:
    action = begin(session, tool_choice="required")
    events = call(session, action.request.request_id, 0, "get_weather", "{}", finish="stop")
    done = events[-1]["response"]
    assert [o["status"] for o in done["output"]] == ["incomplete"]


def test_cancel_output_lists_no_partial_call(session: Session) -> None:
    action = begin(session)
    call(session, action.request.request_id, 0, "get_weather", '{"ci')
    events = drive(session, {"type": "response.cancel"})
    assert events[-1]["response"]["output"] == []


def test_duplicate_ids_in_one_input(session: Session) -> None:
    item = {"type": "message", "role": "user", "content": "x", "id": "same"}
    events = drive(session, {"type": "response.create", "response": {"input": [item, item]}})
    assert codes(events) == ["duplicate_item_id"]
    assert session.items == []


def test_output_for_finished_out_of_band_response(session: Session) -> None:
    drive(
        session,
        {
            "type": "response.create",
            "response": {"conversation": "none", "tools": [TIME], "tool_choice": "required"},
        },
    )
    (start,) = session.actions_to_perform()
    call(session, start.request.request_id, 0, "get_time", "{}", finish="stop")
    call_id = session.lifecycle.calls and next(iter(session.lifecycle.calls))
    drive(session, {"type": "response.cancel"})
    assert codes(output(session, call_id, "late")) == ["response_not_active"]
    assert all(i["type"] != "function_call_output" for i in session.items)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_tool_round_after_the_budget_is_spent_does_not_run(
    session: Session, ignore_eos: bool
) -> None:
    """max_output_tokens is one budget for the whole response: a call that
    spends it all ends the response once its output is in, as a generation
    cut at the cap would, and no continuation is asked for."""
    action = begin(session, tool_choice="required", max_output_tokens=3, ignore_eos=ignore_eos)
    rq = action.request.request_id
    for chunk in ('{"city":', ' "Par', 'is"}'):
        call(session, rq, 0, "get_weather", chunk)
    session.receive_engine_output(rq, EngineDelta("", 0, "stop"))
    call_id = session.events_to_send()[0]["call_id"]
    session.actions_to_perform()  # the tool timer
    events = output(session, call_id, "sunny")
    # The wait is over; no generation with a cap of 0 (or 1).
    assert session.actions_to_perform() == [CancelTimer(action.response_id)]
    assert types(events) == ["conversation.item.created", "response.done"]
    done = events[-1]["response"]
    assert done["usage"]["output_tokens"] == 3
    if ignore_eos:
        assert done["status"] == "completed"
    else:
        assert done["status"] == "incomplete"
        assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}


def test_a_steer_after_the_budget_is_spent_ends_the_response(session: Session) -> None:
    drive(
        session,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "hi"},
        },
    )
    drive(session, {"type": "response.create", "response": {"max_output_tokens": 2}})
    (gen,) = session.actions_to_perform()
    session.receive_engine_output(gen.request.request_id, EngineDelta("Hello there", 2))
    session.events_to_send()
    events = drive(session, {"type": "response.steer", "input": "shorter"})
    actions = session.actions_to_perform()
    assert [type(a) for a in actions] == [AbortGeneration]  # and nothing started
    assert types(events)[-1] == "response.done"
    assert events[-1]["response"]["status_details"]["reason"] == "max_output_tokens"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2


def _shape(messages: list[dict[str, Any]]) -> list[tuple[str, object]]:
    return [
        (
            m["role"],
            m.get("tool_call_id") or [c["id"] for c in m.get("tool_calls", [])] or m["content"],
        )
        for m in messages
    ]


def test_a_late_output_is_rendered_right_after_its_call(session: Session) -> None:
    """Response A's call waits, A is cancelled; response B calls and waits. A's
    output arrives late (accepted), then B's, and a user message was sent
    while B waited. The conversation keeps the order things came in, but the
    prompt puts each output right after the turn that made its call, as chat
    templates want (strict ones refuse a tool message anywhere else)."""
    first = begin(session, tool_choice="required")
    (a,) = [
        e
        for e in call(session, first.request.request_id, 0, "get_weather", '{"city": "A"}', "stop")
        if e["type"] == "response.requires_action"
    ]
    drive(session, {"type": "response.cancel"})
    session.actions_to_perform()
    drive(
        session,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "q2"},
        },
    )
    drive(session, {"type": "response.create", "response": {"tool_choice": "required"}})
    (second,) = session.actions_to_perform()
    (b,) = [
        e
        for e in call(session, second.request.request_id, 0, "get_time", "{}", "stop")
        if e["type"] == "response.requires_action"
    ]
    [c1], [c2] = a["call_ids"], b["call_ids"]
    drive(
        session,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "q3"},
        },
    )
    output(session, c1, "late A")
    output(session, c2, "B")
    cont = [x for x in session.actions_to_perform() if isinstance(x, StartGeneration)][-1]
    assert _shape(cont.request.messages) == [
        ("user", "Weather and time in Paris?"),
        ("assistant", [c1]),
        ("tool", c1),
        ("user", "q2"),
        ("assistant", [c2]),
        ("tool", c2),
        ("user", "q3"),
    ]
    conversation = [i.get("call_id") or i.get("content") for i in session.conversation.items]
    assert conversation[-4:] == [c2, "q3", c1, c2]  # as they came
