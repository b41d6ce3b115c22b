"""GA semantics the OpenAI dialect owes its clients where tokenwire v1 differs:
previous_item_id "root" and on call outputs, function_call_arguments.done for
every call, response.cancel without response_id, and wrong-typed values. A real
Session with the client tool flow (what an OpenAI socket's session gets); every
frame is checked against the SDK's models (helpers.openai_session)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenwire.core.session import Session
from tokenwire.core.tools import ToolFlow
from tokenwire.engines.base import EngineDelta, ToolCallDelta

from ..helpers.openai_session import GAHarness, types
from ..helpers.session import codes, drive

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ARGS_DONE = "response.function_call_arguments.done"


def message(text: str, **item: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
        **item,
    }


def create(item: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"type": "conversation.item.create", "item": item, **fields}


@pytest.fixture
def h() -> GAHarness:
    h = GAHarness(ToolFlow.CLIENT)
    h.take()
    return h


def ids(h: GAHarness) -> list[str]:
    return [item["id"] for item in h.session.items]


def tool_round(h: GAHarness) -> dict[str, Any]:
    """u1, then a response that calls get_weather: its arguments.done frame."""
    h.send({"type": "session.update", "session": {"type": "realtime", "tools": [TOOL]}})
    h.send(create(message("Weather?", id="u1")))
    h.send({"type": "response.create"})
    call = ToolCallDelta(0, "get_weather", '{"city": "Paris"}')
    h.engine(EngineDelta("", 1, "stop", 5, 0, tool_calls=[call]))
    return next(f for f in h.take() if f["type"] == ARGS_DONE)


# -- previous_item_id ------------------------------------------------------------


def test_previous_item_id_root_inserts_at_the_beginning(h: GAHarness) -> None:
    h.send(create(message("a", id="a")))
    h.send(create(message("b", id="b"), previous_item_id="root"))
    h.send(create(message("c", id="c"), previous_item_id="b"))
    frames = h.take()
    assert "error" not in types(frames)
    added = [f for f in frames if f["type"] == "conversation.item.added"]
    assert [(f["item"]["id"], f["previous_item_id"]) for f in added] == [
        ("a", None),
        ("b", None),
        ("c", "b"),
    ]
    assert ids(h) == ["b", "c", "a"]
    h.send({"type": "response.create"})
    prompt = [m["content"] for m in h.session.active_responses[0].gen_request.messages]
    assert prompt == ["b", "c", "a"]


def test_root_stays_an_item_id_in_tokenwire_v1() -> None:
    s = Session()
    drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "a"},
        },
    )
    event = {
        "type": "conversation.item.create",
        "previous_item_id": "root",
        "item": {"type": "message", "role": "user", "content": "b"},
    }
    assert codes(drive(s, event)) == ["unknown_item"]


def test_a_function_call_output_goes_after_previous_item_id(h: GAHarness) -> None:
    call = tool_round(h)
    h.send(create(message("later", id="u2")))
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    h.send(create({**output, "id": "o1"}, previous_item_id=call["item_id"]))
    h.send(create({**output, "call_id": "call_x", "id": "o2"}, previous_item_id="root"))
    frames = h.take()
    added = next(
        f for f in frames if f["type"] == "conversation.item.added" and f["item"]["id"] == "o1"
    )
    assert added["previous_item_id"] == call["item_id"]
    assert ids(h) == ["u1", call["item_id"], "o1", "u2"]
    # The output is still checked as a call output: an unknown call is refused.
    assert [f["error"]["code"] for f in frames if f["type"] == "error"] == ["invalid_value"]


def test_a_function_call_output_at_the_root(h: GAHarness) -> None:
    call = tool_round(h)
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    h.send(create({**output, "id": "o1"}, previous_item_id="root"))
    (added, _) = h.take()
    assert added["previous_item_id"] is None
    assert ids(h) == ["o1", "u1", call["item_id"]]


# -- function_call_arguments.done for every call ---------------------------------


def open_call(h: GAHarness, arguments: str, finish: str | None) -> None:
    """A required city; the model writes `arguments` and the generation ends with `finish`."""
    tool = {**TOOL, "parameters": {"type": "object", "required": ["city"]}}
    h.send({"type": "session.update", "session": {"type": "realtime", "tools": [tool]}})
    h.send(create(message("Weather?")))
    h.send({"type": "response.create"})
    call = ToolCallDelta(0, "get_weather", arguments)
    h.engine(EngineDelta("", 1, finish, 5, 0, tool_calls=[call]))


def check_closed_call(frames: list[dict[str, Any]], arguments: str, status: str) -> None:
    """The call's arguments.done, then its output_item.done, then response.done
    with the call in `output`."""
    kinds = types(frames)
    assert kinds.count(ARGS_DONE) == 1
    args = frames[kinds.index(ARGS_DONE)]
    assert args["arguments"] == arguments and args["name"] == "get_weather"
    item_done = frames[kinds.index("response.output_item.done")]
    assert kinds.index(ARGS_DONE) < kinds.index("response.output_item.done")
    assert item_done["item"]["id"] == args["item_id"]
    assert item_done["item"]["status"] == "incomplete"
    done = frames[-1]["response"]
    assert done["status"] == status
    assert [(i["id"], i["arguments"], i["status"]) for i in done["output"]] == [
        (args["item_id"], arguments, "incomplete")
    ]


def test_a_call_cancelled_mid_arguments_is_closed_and_listed(h: GAHarness) -> None:
    open_call(h, '{"ci', None)
    h.take()
    h.send({"type": "response.cancel"})
    frames = h.take()
    check_closed_call(frames, '{"ci', "cancelled")
    # The core dropped it from the conversation: GA hears that too.
    assert "conversation.item.deleted" in types(frames)
    assert h.session.items[-1]["type"] == "message"


def test_a_call_cut_by_max_output_tokens_is_closed_and_listed(h: GAHarness) -> None:
    open_call(h, '{"ci', "length")
    frames = h.take()
    check_closed_call(frames, '{"ci', "incomplete")
    assert frames[-1]["response"]["status_details"]["reason"] == "max_output_tokens"


def test_a_call_that_fails_its_schema_is_closed(h: GAHarness) -> None:
    open_call(h, "{}", "stop")
    frames = h.take()
    assert [f["error"]["code"] for f in frames if f["type"] == "error"] == [
        "invalid_tool_arguments"
    ]
    check_closed_call(frames, "{}", "failed")
    assert "conversation.item.done" in types(frames)  # it stays in the conversation
    # Its output is refused, and the refusal says why (not "no such call").
    call_id = next(f for f in frames if f["type"] == ARGS_DONE)["call_id"]
    output = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    h.send(create(output))
    (error,) = h.take()
    assert "failed its argument check" in error["error"]["message"]
    h.send(create({**output, "call_id": "call_other"}))
    (error,) = h.take()
    assert "no function call 'call_other'" in error["error"]["message"]


# -- response.cancel without response_id -----------------------------------------


def out_of_band(h: GAHarness) -> None:
    response = {"conversation": "none", "input": [message("q")]}
    h.send({"type": "response.create", "response": response})


def test_cancel_without_an_id_leaves_an_out_of_band_response_alone(h: GAHarness) -> None:
    out_of_band(h)
    h.take()
    h.send({"type": "response.cancel", "event_id": "c1"})
    (error,) = h.take()
    assert error["error"]["code"] == "response_cancel_not_active"
    assert error["error"]["event_id"] == "c1"
    assert len(h.session.active_responses) == 1


def test_cancel_without_an_id_and_two_out_of_band_responses_is_not_active(
    h: GAHarness,
) -> None:
    out_of_band(h)
    out_of_band(h)
    h.take()
    h.send({"type": "response.cancel"})
    (error,) = h.take()
    assert error["error"]["code"] == "response_cancel_not_active"
    assert error["error"]["param"] is None
    assert len(h.session.active_responses) == 2


def test_cancel_without_an_id_cancels_the_conversation_response(h: GAHarness) -> None:
    out_of_band(h)
    h.send(create(message("hi")))
    h.send({"type": "response.create"})
    h.take()
    h.send({"type": "response.cancel"})
    done = h.take()[-1]["response"]
    assert done["status"] == "cancelled" and done["conversation_id"] is not None
    assert [r.in_conversation for r in h.session.active_responses] == [False]


# -- wrong types -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [[], 0, False, "", "x", 1])
def test_a_response_that_is_not_an_object_is_refused(h: GAHarness, bad: Any) -> None:
    h.send({"type": "response.create", "response": bad})
    (error,) = h.take()
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "response")
    assert h.session.active_responses == []


@pytest.mark.parametrize("bad", [0, "", {}, False, "x", {"a": 1}])
def test_include_that_is_not_an_array_is_refused(h: GAHarness, bad: Any) -> None:
    h.send({"type": "session.update", "session": {"type": "realtime", "include": bad}})
    (error,) = h.take()
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "session.include")


def test_an_input_over_1024_items_is_refused_before_any_is_read(h: GAHarness) -> None:
    items = [message("hi")] * 1024
    h.send({"type": "response.create", "response": {"input": [*items, {"type": "x"}]}})
    (error,) = h.take()
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "response.input")
    assert "at most 1024 items, got 1025" in error["error"]["message"]
    h.send({"type": "response.create", "response": {"input": items, "conversation": "none"}})
    assert "error" not in types(h.take())


def test_an_empty_include_and_a_null_response_pass(h: GAHarness) -> None:
    h.send({"type": "session.update", "session": {"type": "realtime", "include": []}})
    h.send(create(message("hi")))
    h.send({"type": "response.create", "response": None})
    assert "error" not in types(h.take())
    assert len(h.session.active_responses) == 1


# -- response.create input: the response's own context ---------------------------


def respond(h: GAHarness, **response: Any) -> list[dict[str, Any]]:
    h.send({"type": "response.create", "response": response})
    return h.take()


def prompt(h: GAHarness) -> list[Any]:
    (resp,) = h.session.active_responses
    assert resp.gen_request is not None
    return [(m["role"], m.get("content")) for m in resp.gen_request.messages]


def test_input_with_conversation_auto_is_the_prompt_and_is_not_added(h: GAHarness) -> None:
    h.send(create(message("history", id="h1")))
    h.take()
    frames = respond(h, conversation="auto", input=[message("only this", id="i1")])
    assert types(frames) == ["response.created"]  # no conversation.item.added for i1
    assert frames[0]["response"]["conversation_id"] is not None
    assert prompt(h) == [("user", "only this")]
    h.engine(EngineDelta("Hello", 1, "stop", 5, 0))
    frames = h.take()
    added = [f["item"]["id"] for f in frames if f["type"] == "conversation.item.added"]
    out = frames[-1]["response"]["output"][0]["id"]
    assert added == [out]  # the output goes into the conversation
    assert ids(h) == ["h1", out]
    h.send({"type": "conversation.item.retrieve", "item_id": "i1"})
    assert types(h.take()) == ["error"]  # the input is the response's alone
    h.send({"type": "response.create"})  # the next default response sees the conversation
    assert prompt(h) == [("user", "history"), ("assistant", "Hello")]


def test_out_of_band_without_input_reads_the_conversation(h: GAHarness) -> None:
    """Only `input` gives a response a context of its own: without it an
    out-of-band response (classify, summarise) reads the conversation as it
    is, and its output stays out of it."""
    h.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be"}})
    h.send(create(message("history", id="h1")))
    h.take()
    frames = respond(h, conversation="none")
    assert types(frames) == ["response.created"]
    assert frames[0]["response"]["conversation_id"] is None
    assert prompt(h) == [("system", "Be"), ("user", "history")]
    h.send(create(message("later", id="h2")))  # after it began: not in its prompt
    h.engine(EngineDelta("Topic: weather", 1, "stop", 5, 0))
    frames = h.take()
    assert frames[-1]["response"]["status"] == "completed"
    added = [f["item"]["id"] for f in frames if f["type"] == "conversation.item.added"]
    assert added == ["h2"]  # the client's; none for the response's output
    assert ids(h) == ["h1", "h2"]
    h.send({"type": "response.create"})
    assert prompt(h) == [("system", "Be"), ("user", "history"), ("user", "later")]


def test_an_empty_input_clears_the_context(h: GAHarness) -> None:
    h.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be"}})
    h.send(create(message("history")))
    h.take()
    assert types(respond(h, input=[])) == ["response.created"]
    assert prompt(h) == [("system", "Be")]
    h.engine(EngineDelta("Hi", 1, "stop", 5, 0))
    h.take()
    assert [i["content"] for i in h.session.items] == ["history", "Hi"]


def test_input_takes_function_call_outputs(h: GAHarness) -> None:
    call = tool_round(h)
    h.take()
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    other = {"type": "function_call_output", "call_id": "call_elsewhere", "output": "42"}
    frames = respond(h, conversation="auto", input=[message("Weather?"), output, other])
    assert types(frames) == ["response.created"]
    (resp,) = h.session.active_responses
    assert resp.gen_request is not None
    # A call of the session comes before its output; any other output is context as it is.
    assert resp.gen_request.messages == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_elsewhere", "content": "42"},
    ]
    h.engine(EngineDelta("Sunny.", 1, "stop", 5, 0))
    h.take()
    # The input answered no call: the conversation's output is still welcome.
    h.send(create(output))
    assert types(h.take()) == ["conversation.item.added", "conversation.item.done"]
    assert [i["type"] for i in h.session.items] == [
        "message",
        "function_call",
        "message",
        "function_call_output",
    ]


def test_an_input_responses_calls_are_the_conversations(h: GAHarness) -> None:
    h.send({"type": "session.update", "session": {"type": "realtime", "tools": [TOOL]}})
    respond(h, input=[message("Weather in Oslo?")])
    call = ToolCallDelta(0, "get_weather", '{"city": "Oslo"}')
    h.engine(EngineDelta("", 1, "stop", 5, 0, tool_calls=[call]))
    done = next(f for f in h.take() if f["type"] == ARGS_DONE)
    assert ids(h) == [done["item_id"]]
    h.send(create({"type": "function_call_output", "call_id": done["call_id"], "output": "cold"}))
    assert "error" not in types(h.take())
    h.send({"type": "response.create"})
    assert [m["role"] for m in h.session.active_responses[0].gen_request.messages] == [
        "assistant",
        "tool",
    ]


def test_an_input_responses_partial_call_leaves_the_conversation(h: GAHarness) -> None:
    h.send({"type": "session.update", "session": {"type": "realtime", "tools": [TOOL]}})
    h.send(create(message("history", id="h1")))
    respond(h, input=[message("Weather?")])
    h.engine(EngineDelta("", 1, None, 5, 0, tool_calls=[ToolCallDelta(0, "get_weather", '{"')]))
    h.take()
    (resp,) = h.session.active_responses
    h.send({"type": "response.cancel"})
    assert "conversation.item.deleted" in types(h.take())
    assert ids(h) == ["h1"]
    assert [i["type"] for i in resp.context] == ["message"]


def test_a_function_call_output_in_input_is_refused_in_tokenwire_v1() -> None:
    s = Session()
    output = {"type": "function_call_output", "call_id": "call_1", "output": "x"}
    event = {"type": "response.create", "response": {"input": [output]}}
    assert codes(drive(s, event)) == ["invalid_field"]


def test_input_with_conversation_auto_is_added_in_tokenwire_v1() -> None:
    s = Session()
    s.events_to_send()
    question = {"type": "message", "role": "user", "content": "q", "id": "i1"}
    events = drive(s, {"type": "response.create", "response": {"input": [question]}})
    assert types(events) == ["conversation.item.created", "response.created"]
    assert [i["id"] for i in s.items] == ["i1"]


@pytest.mark.parametrize("kind", ["no.such.event", None])
def test_a_refusal_echoes_no_event_id_over_128_characters(h: GAHarness, kind: str | None) -> None:
    """As the core's own errors: a long event_id is not echoed (it could be
    a megabyte a hostile client wants reflected)."""
    event: dict[str, Any] = {"event_id": "e" * 129}
    if kind is not None:
        event["type"] = kind
    h.send(event)
    (error,) = h.take()
    assert error["type"] == "error" and error["error"].get("event_id") is None
    h.send({"type": "no.such.event", "event_id": "e" * 128})
    (error,) = h.take()
    assert error["error"]["event_id"] == "e" * 128


# -- deleting and retrieving -------------------------------------------------------


def test_a_deleted_output_lets_its_call_be_answered_again(h: GAHarness) -> None:
    """The call stayed marked answered: a corrected output was refused
    ("already has its output") while the conversation held none."""
    call = tool_round(h)
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "wrong"}
    h.send(create({**output, "id": "o1"}))
    h.send({"type": "conversation.item.delete", "item_id": "o1"})
    h.send(create({**output, "output": "right", "id": "o2"}))
    assert "error" not in types(h.take())
    assert ids(h) == ["u1", call["item_id"], "o2"]
    h.send(create({**output, "id": "o3"}))  # one output a call, as before
    assert [f["error"]["code"] for f in h.take() if f["type"] == "error"] == ["invalid_value"]


def test_retrieve_reads_the_conversation_not_an_out_of_band_response(h: GAHarness) -> None:
    """retrieve found an out-of-band response's output, which delete said did not exist."""
    h.send({"type": "response.create", "response": {"conversation": "none", "input": []}})
    h.engine(EngineDelta("aside", 1, "stop", 5, 0))
    frames = h.take()
    aside = next(f for f in frames if f["type"] == "response.output_item.done")["item"]["id"]
    for kind in ("retrieve", "delete"):
        h.send({"type": f"conversation.item.{kind}", "item_id": aside})
        [error] = [f for f in h.take() if f["type"] == "error"]
        assert error["error"]["code"] == f"item_{kind}_invalid_item_id"


def test_each_call_is_done_before_the_next_calls_arguments_end(h: GAHarness) -> None:
    """As in GA: arguments.done then output_item.done, call by call (all the
    arguments.done came first, then all the items' .done)."""
    h.send({"type": "session.update", "session": {"type": "realtime", "tools": [TOOL]}})
    h.send(create(message("Weather in two cities?", id="u1")))
    h.take()
    h.send({"type": "response.create"})
    calls = [ToolCallDelta(i, "get_weather", f'{{"city": "{c}"}}') for i, c in enumerate("AB")]
    h.engine(EngineDelta("", 1, "stop", 5, 0, tool_calls=calls))
    order = [
        (f["type"], f.get("item_id") or f.get("item", {}).get("id"))
        for f in h.take()
        if f["type"] in (ARGS_DONE, "response.output_item.done", "conversation.item.done")
    ]
    first, second = order[0][1], order[3][1]
    assert order == [
        (ARGS_DONE, first),
        ("response.output_item.done", first),
        ("conversation.item.done", first),
        (ARGS_DONE, second),
        ("response.output_item.done", second),
        ("conversation.item.done", second),
    ]
