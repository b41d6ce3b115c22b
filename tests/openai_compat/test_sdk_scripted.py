"""The official `openai` Python SDK, unmodified, on the scripted engine: an app
written for OpenAI's Realtime API with only its base URL changed. Every server
event the SDK receives is validated strictly against the SDK's own models
(tests/helpers/openai_clients.GAConnection)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.realtime import (
    ConversationItemDeletedEvent,
    ResponseDoneEvent,
    SessionUpdatedEvent,
)
from openai.types.realtime.realtime_server_event import ConversationItemRetrieved

from tokenwire.config import ServerConfig

from ..conftest import RunningServer, _scripted_server
from ..helpers.openai_clients import (
    GAConnection,
    function_call_output,
    ga_connect,
    text_of,
    user_message,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

# The GA lifecycle of a text response in the conversation, deltas aside.
TEXT_RESPONSE = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


@pytest.fixture
async def slow() -> AsyncIterator[RunningServer]:
    """A scripted server at 50 tokens/s: a long answer takes seconds to cancel into."""
    config = ServerConfig(engine="scripted", port=0, scripted_tokens_per_s=50.0)
    async with _scripted_server(config) as s:
        yield s


@pytest.fixture
async def short_tool_timeout() -> AsyncIterator[RunningServer]:
    """A scripted server whose tokenwire sessions give tools 0.2 s."""
    config = ServerConfig(engine="scripted", port=0, tool_timeout_s=0.2)
    async with _scripted_server(config) as s:
        yield s


def lifecycle(events: list[Any]) -> list[str]:
    return [e.type for e in events if e.type != "response.output_text.delta"]


async def ask(ga: GAConnection, text: str) -> tuple[str, ResponseDoneEvent]:
    await ga.conn.conversation.item.create(item=user_message(text))
    await ga.until("conversation.item.done")
    await ga.conn.response.create()
    events = await ga.until("response.done")
    done = events[-1]
    assert isinstance(done, ResponseDoneEvent)
    return text_of(events), done


async def test_a_text_response(scripted: RunningServer) -> None:
    async with ga_connect(scripted.url) as ga:
        session = ga.events[0]["session"]
        assert session["type"] == "realtime" and session["output_modalities"] == ["text"]

        await ga.conn.session.update(
            session={
                "type": "realtime",
                "instructions": "Be brief.",
                "output_modalities": ["text"],
                "max_output_tokens": "inf",
            }
        )
        (updated,) = await ga.until("session.updated")
        assert isinstance(updated, SessionUpdatedEvent)
        assert updated.session.instructions == "Be brief."
        assert updated.session.max_output_tokens == "inf"

        await ga.conn.conversation.item.create(item=user_message("hello sdk", "msg_user_1"))
        added, item_done = await ga.until("conversation.item.done")
        assert added.type == "conversation.item.added"
        assert added.item.id == "msg_user_1"
        assert item_done.item.content[0].text == "hello sdk"

        await ga.conn.response.create(event_id="create_1")
        events = await ga.until("response.done")
        assert lifecycle(events) == TEXT_RESPONSE
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) == 4
        assert text_of(events) == "You said: hello sdk"

        created, done = events[0], events[-1]
        assert isinstance(done, ResponseDoneEvent)
        rid = created.response.id
        assert done.response.id == rid and done.response.status == "completed"
        (item,) = done.response.output or []
        assert item.type == "message" and item.role == "assistant"
        assert item.content[0].text == "You said: hello sdk"
        assert {e.response_id for e in deltas} == {rid}
        assert {e.item_id for e in deltas} == {item.id}
        usage = done.response.usage
        assert usage is not None and usage.output_tokens == 4 and usage.input_tokens
        session_id = ga.events[0]["session"]["id"]
        assert done.response.conversation_id == "conv_" + session_id.removeprefix("sess_")


async def test_cancel_a_long_response(slow: RunningServer) -> None:
    long = " ".join(f"w{i}" for i in range(150))  # 152 tokens: 3 s at 50 tokens/s
    async with ga_connect(slow.url) as ga:
        await ga.conn.conversation.item.create(item=user_message(long))
        await ga.conn.response.create()
        seen = 0
        while seen < 3:
            event = await ga.recv()
            seen += event.type == "response.output_text.delta"
        await ga.conn.response.cancel(event_id="stop")
        events = await ga.until("response.done")
        done = events[-1]
        assert isinstance(done, ResponseDoneEvent)
        assert done.response.status == "cancelled"
        details = done.response.status_details
        assert details is not None and details.reason == "client_cancelled"
        assert done.response.usage is not None and done.response.usage.output_tokens < 100
        (item,) = done.response.output or []
        assert item.status == "incomplete"
        said = item.content[0].text
        assert said and ("You said: " + long).startswith(said) and len(said) < len(long)
        assert slow.server.engine.load().running == 0
        # The session goes on.
        assert (await ask(ga, "again"))[0] == "You said: again"


async def test_retrieve_and_delete_an_item(scripted: RunningServer) -> None:
    async with ga_connect(scripted.url) as ga:
        for item_id, text in (("msg_first", "first"), ("msg_second", "second")):
            await ga.conn.conversation.item.create(item=user_message(text, item_id))
            await ga.until("conversation.item.done")

        await ga.conn.conversation.item.retrieve(item_id="msg_second", event_id="get_1")
        (retrieved,) = await ga.until("conversation.item.retrieved")
        assert isinstance(retrieved, ConversationItemRetrieved)
        assert retrieved.item.id == "msg_second"
        assert retrieved.item.content[0].text == "second"

        await ga.conn.conversation.item.delete(item_id="msg_second", event_id="del_1")
        (deleted,) = await ga.until("conversation.item.deleted")
        assert isinstance(deleted, ConversationItemDeletedEvent)
        assert deleted.item_id == "msg_second"

        await ga.conn.conversation.item.retrieve(item_id="msg_second", event_id="get_2")
        error = (await ga.error()).error
        assert (error.code, error.param, error.event_id) == (
            "item_retrieve_invalid_item_id",
            "item_id",
            "get_2",
        )
        assert (
            error.message == "Error retrieving item: the item with id 'msg_second' does not exist."
        )
        assert error.type == "invalid_request_error"

        await ga.conn.conversation.item.delete(item_id="msg_second", event_id="del_2")
        error = (await ga.error()).error
        assert (error.code, error.param, error.event_id) == (
            "item_delete_invalid_item_id",
            "item_id",
            "del_2",
        )

        # The deleted message is out of the prompt too: the answer is to "first".
        await ga.conn.response.create()
        events = await ga.until("response.done")
        assert text_of(events) == "You said: first"


# Each bad event, and the GA error it gets: (code, param).
BAD_EVENTS: list[tuple[str, dict[str, Any] | str, tuple[str, str | None]]] = [
    ("unknown_type", {"type": "response.teleport"}, ("invalid_value", "type")),
    (
        "unknown_field",
        {"type": "session.update", "session": {"type": "realtime", "voice_speed": 2}},
        ("unknown_parameter", "session.voice_speed"),
    ),
    (
        "bad_value",
        {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"]}},
        ("invalid_value", "session.output_modalities"),
    ),
    (
        "missing_field",
        {"type": "conversation.item.create"},
        ("missing_required_parameter", "item"),
    ),
    (
        "audio",
        {"type": "input_audio_buffer.append", "audio": "AAAA"},
        ("invalid_value", "type"),
    ),
    ("cancel_nothing", {"type": "response.cancel"}, ("response_cancel_not_active", None)),
    ("not_json", "{not json", ("invalid_json", None)),
]


@pytest.mark.parametrize(
    ("event", "expected"), [b[1:] for b in BAD_EVENTS], ids=[b[0] for b in BAD_EVENTS]
)
async def test_a_bad_event_gets_a_ga_error_and_the_session_goes_on(
    scripted: RunningServer, event: dict[str, Any] | str, expected: tuple[str, str | None]
) -> None:
    async with ga_connect(scripted.url) as ga:
        if isinstance(event, str):
            await ga.send_raw(event)
            event_id = None
        else:
            event_id = "bad_1"
            await ga.send({**event, "event_id": event_id})
        error = (await ga.error()).error
        assert (error.code, error.param) == expected, error
        assert error.type == "invalid_request_error" and error.message
        assert error.event_id == event_id
        # Nothing else came of it, and the session still answers.
        assert (await ask(ga, "still here"))[0] == "You said: still here"
        assert [e["type"] for e in ga.events].count("error") == 1


async def test_a_tool_round(short_tool_timeout: RunningServer) -> None:
    """tool_choice forcing a function: the response ends completed with the call;
    its output and a new response.create give the answer. No tool timeout runs:
    the output may come after tokenwire's own sessions would have given up."""
    async with ga_connect(short_tool_timeout.url) as ga:
        choice = {"type": "function", "name": "get_weather"}
        await ga.conn.session.update(
            session={"type": "realtime", "tools": [WEATHER], "tool_choice": choice}
        )
        (updated,) = await ga.until("session.updated")
        assert [t.name for t in updated.session.tools] == ["get_weather"]

        await ga.conn.conversation.item.create(item=user_message("Weather in Paris?"))
        await ga.conn.response.create()
        events = await ga.until("response.done")
        done = events[-1]
        assert isinstance(done, ResponseDoneEvent)
        assert done.response.status == "completed"
        (call,) = done.response.output or []
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        streamed = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert streamed == call.arguments
        args_done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert args_done.call_id == call.call_id

        await asyncio.sleep(0.5)  # past the 0.2 s tool_timeout_s
        await ga.conn.conversation.item.create(
            item=function_call_output(call.call_id, "sunny, 22 C")
        )
        added = await ga.recv()  # the very next event: nothing came while the tool ran
        assert added.type == "conversation.item.added", added
        assert added.item.type == "function_call_output"
        await ga.conn.response.create(response={"tool_choice": "auto"})
        events = await ga.until("response.done")
        assert text_of(events) == "Tool said: sunny, 22 C"
        assert events[-1].response.status == "completed"
