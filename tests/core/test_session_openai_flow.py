"""What the core does for OpenAI Realtime clients, in both dialects where it
applies: the client tool flow, conversation.item.delete, max_output_tokens "inf"."""

from __future__ import annotations

import pytest

from tokenwire.core.conversation import ITEM_BYTES
from tokenwire.core.events import StartGeneration, StartTimer
from tokenwire.core.session import Session, SessionLimits
from tokenwire.core.tools import ToolFlow
from tokenwire.engines.base import EngineDelta

from ..helpers.session import begin, call, codes, drive, output, start, types


@pytest.fixture
def client_flow() -> Session:
    s = Session(tool_flow=ToolFlow.CLIENT)
    s.events_to_send()
    return s


def test_calls_end_the_response_completed_and_the_client_continues(client_flow: Session) -> None:
    s = client_flow
    action = begin(s, tool_choice="required")
    rq = action.request.request_id
    call(s, rq, 0, "get_weather", '{"city": "Paris"}')
    events = call(s, rq, 1, "get_time", "{}", finish="stop")
    assert types(events) == [
        "response.function_call_arguments.delta",
        *["response.function_call_arguments.done"] * 2,
        "response.done",
    ]
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["status_details"] is None
    outputs = [(o["type"], o["status"]) for o in done["output"]]
    assert outputs == [("function_call", "completed")] * 2
    # No tool timer, no requires_action, nothing running: the response is over.
    assert s.actions_to_perform() == [] and s.active_responses == []
    weather, clock = events[1]["call_id"], events[2]["call_id"]
    assert types(output(s, weather, "sunny")) == ["conversation.item.created"]
    assert types(output(s, clock, "noon")) == ["conversation.item.created"]
    assert s.actions_to_perform() == []  # outputs alone start nothing
    assert codes(output(s, weather, "again")) == ["duplicate_call_output"]
    events = drive(s, {"type": "response.create", "response": {"tool_choice": "none"}})
    assert types(events) == ["response.created"]
    (cont,) = s.actions_to_perform()
    assert isinstance(cont, StartGeneration) and cont.response_id != action.response_id
    roles = [m["role"] for m in cont.request.messages]
    assert roles == ["user", "assistant", "tool", "tool"]


def test_bad_arguments_still_fail_the_response(client_flow: Session) -> None:
    action = begin(client_flow, tool_choice="required")
    events = call(client_flow, action.request.request_id, 0, "get_weather", "{", finish="stop")
    assert codes(events) == ["invalid_tool_arguments"]
    assert events[-1]["response"]["status"] == "failed"


def test_tokenwire_flow_still_waits_and_continues() -> None:
    s = Session()
    s.events_to_send()
    action = begin(s, tool_choice="required")
    events = call(s, action.request.request_id, 0, "get_time", "{}", finish="stop")
    assert types(events)[-1] == "response.requires_action"
    (timer,) = s.actions_to_perform()
    assert isinstance(timer, StartTimer)


@pytest.mark.parametrize("flow", list(ToolFlow))
def test_item_delete(flow: ToolFlow) -> None:
    s = Session(tool_flow=flow)
    s.events_to_send()
    _, gen = start(s, "first question")
    s.receive_engine_output(gen.request.request_id, EngineDelta("An answer.", 3, "stop"))
    s.events_to_send()
    user, answer = s.items
    before = s.history_bytes
    events = drive(s, {"type": "conversation.item.delete", "item_id": user["id"], "event_id": "d"})
    assert events == [{"type": "conversation.item.deleted", "item_id": user["id"], "event_id": "d"}]
    assert s.items == [answer] and s.history_bytes == before - len("first question") - ITEM_BYTES
    retrieve = {"type": "conversation.item.retrieve", "item_id": user["id"]}
    assert codes(drive(s, retrieve)) == ["unknown_item"]
    assert codes(drive(s, {"type": "conversation.item.delete", "item_id": user["id"]})) == [
        "unknown_item"
    ]
    # The next response no longer sees it.
    drive(s, {"type": "response.create"})
    (nxt,) = s.actions_to_perform()
    assert [m["content"] for m in nxt.request.messages] == ["An answer."]
    # What an active response writes stays.
    s.receive_engine_output(nxt.request.request_id, EngineDelta("Part", 1, None))
    s.events_to_send()
    writing = s.items[-1]
    assert writing["status"] == "in_progress"
    assert codes(drive(s, {"type": "conversation.item.delete", "item_id": writing["id"]})) == [
        "invalid_state"
    ]
    assert writing in s.items


def test_deleting_a_call_forgets_it(client_flow: Session) -> None:
    s = client_flow
    action = begin(s, tool_choice="required")
    events = call(s, action.request.request_id, 0, "get_time", "{}", finish="stop")
    call_id, item_id = events[0]["call_id"], events[0]["item_id"]
    assert types(drive(s, {"type": "conversation.item.delete", "item_id": item_id})) == [
        "conversation.item.deleted"
    ]
    assert codes(output(s, call_id, "noon")) == ["unknown_call_id"]


def test_a_private_item_is_not_in_the_conversation() -> None:
    s = Session()
    s.events_to_send()
    item = {"type": "message", "role": "user", "content": "x", "id": "private"}
    drive(s, {"type": "response.create", "response": {"conversation": "none", "input": [item]}})
    assert codes(drive(s, {"type": "conversation.item.delete", "item_id": "private"})) == [
        "unknown_item"
    ]


def test_inf_is_no_cap_even_over_the_servers_default() -> None:
    s = Session(limits=SessionLimits(default_max_output_tokens=16))
    s.events_to_send()
    _, capped = start(s)
    assert capped.request.max_output_tokens == 16
    s.receive_engine_output(capped.request.request_id, EngineDelta("ok", 1, "stop"))
    s.events_to_send()
    _, free = start(s, "again", max_output_tokens="inf")
    assert free.request.max_output_tokens is None
    s.receive_engine_output(free.request.request_id, EngineDelta("ok", 1, "stop"))
    updated = drive(s, {"type": "session.update", "session": {"max_output_tokens": "inf"}})
    assert updated[-1]["session"]["max_output_tokens"] == "inf"
    _, session_wide = start(s, "once more")
    assert session_wide.request.max_output_tokens is None
    bad = {"type": "session.update", "session": {"max_output_tokens": "infinite"}}
    assert codes(drive(s, bad)) == ["invalid_field"]
