"""Steering, tools and barge-in over real WebSockets, on the scripted engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenwire.client import TokenwireError, connect

from ..conftest import RunningServer
from ..helpers.tools import WEATHER

CLOCK = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


async def test_tool_handlers_continue_the_same_response(scripted: RunningServer) -> None:
    seen: list[str] = []

    async def get_weather(city: str) -> dict:
        seen.append(city)
        return {"sky": "sunny"}

    async def get_time(city: str) -> str:
        await asyncio.sleep(0.05)  # finishes after get_weather: outputs in any order
        return "14:05"

    tools = {"get_weather": get_weather, "get_time": get_time}
    async with await connect(scripted.url, tools=tools) as tw:
        await tw.update_session(tools=[WEATHER, CLOCK], tool_choice="required")
        await tw.add_message("Weather in Paris?")
        response = await tw.create_response()
        events = [e async for e in response]
        kinds = [e["type"] for e in events]
        done = events[-1]["response"]
        assert done["status"] == "completed"
        assert kinds.count("response.done") == 1 and kinds.count("response.created") == 0
        assert kinds.index("response.requires_action") < kinds.index("response.output_text.delta")
        arguments = {
            e["name"]: e["arguments"]
            for e in events
            if e["type"] == "response.function_call_arguments.done"
        }
        assert json.loads(arguments["get_weather"]) == {"city": "Paris"}
        deltas = "".join(
            e["delta"]
            for e in events
            if e["type"].endswith("arguments.delta") and e["name"] == "get_weather"
        )
        assert deltas == arguments["get_weather"]
        assert seen == ["Paris"]
        text = await response.text()
        assert text.startswith("Tool said:") and "sunny" in text and "14:05" in text


async def test_handler_errors_go_back_as_output(scripted: RunningServer) -> None:
    async def get_weather(city: str) -> str:
        raise RuntimeError("weather service down")

    async with await connect(scripted.url, tools={"get_weather": get_weather}) as tw:
        await tw.update_session(tools=[WEATHER])
        await tw.add_message("Paris")
        response = await tw.create_response(tool_choice={"type": "function", "name": "get_weather"})
        assert "weather service down" in await response.text()


async def test_manual_outputs_and_their_errors(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        await tw.update_session(tools=[WEATHER])
        await tw.add_message("Rome")
        response = await tw.create_response(tool_choice="required")
        call_ids = []
        async for event in response:
            if event["type"] == "response.requires_action":
                call_ids = event["call_ids"]
                break
        with pytest.raises(TokenwireError) as info:
            await tw.create_item(
                {"type": "function_call_output", "call_id": "call_x", "output": "?"}
            )
        assert info.value.code == "unknown_call_id"
        with pytest.raises(TokenwireError) as info:
            await tw.request({"type": "response.steer", "input": "faster"})
        assert info.value.code == "invalid_state"
        await tw.create_item(
            {"type": "function_call_output", "call_id": call_ids[0], "output": "rainy"}
        )
        with pytest.raises(TokenwireError) as info:
            await tw.create_item(
                {"type": "function_call_output", "call_id": call_ids[0], "output": "rainy"}
            )
        assert info.value.code == "duplicate_call_output"
        assert await response.text() == "Tool said: rainy"


async def test_tool_timeout(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        await tw.update_session(tools=[WEATHER], tool_timeout_s=0.2)
        await tw.add_message("Oslo")
        response = await tw.create_response(tool_choice="required")
        done = await asyncio.wait_for(response.done(), 5)
        assert done["status"] == "incomplete"
        assert done["status_details"]["reason"] == "tool_timeout"


async def test_steer_continues_same_response(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        await tw.add_message("tell me about cats " + "and more " * 40)
        response = await tw.create_response()
        seen = 0
        steered = None
        async for event in response:
            if event["type"] == "response.output_text.delta":
                seen += 1
                if seen == 3:
                    steered = await response.steer("dogs please")
        done = await response.done()
        assert steered is not None and steered["response_id"] == response.id
        assert done["status"] == "completed"
        first, second = [o for o in done["output"] if o["type"] == "message"]
        assert first["status"] == "incomplete" and first["content"].startswith("You said: tell")
        assert second["content"] == "You said: dogs please"
        history = await tw.request(
            {"type": "conversation.item.retrieve", "item_id": steered["item"]["id"]}
        )
        assert history["item"]["content"] == "dogs please"
        with pytest.raises(TokenwireError) as info:
            await response.steer("too late")
        assert info.value.code == "response_not_active"


async def test_steer_without_active_response(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        with pytest.raises(TokenwireError) as info:
            await tw.request({"type": "response.steer", "input": "hello?", "event_id": "s1"})
        assert info.value.code == "response_not_active"
        assert info.value.error["event_id"] == "s1"


async def test_barge_in_keeps_only_what_was_heard(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        response = await tw.create_response(ignore_eos=True, max_output_tokens=10_000)
        heard = ""
        async for delta in response.text_deltas():
            heard += delta
            if len(heard) > 40:
                break
        done = await response.cancel()
        item = next(o for o in done["output"] if o["type"] == "message")
        assert item["content"].startswith(heard)
        await tw.truncate(item["id"], 20)
        history = await tw.request({"type": "conversation.item.retrieve", "item_id": item["id"]})
        assert history["item"]["content"] == heard[:20]


async def test_delete_item_takes_it_out_of_the_conversation(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        first = await tw.add_message("forget this")
        await tw.add_message("keep that")
        deleted = await tw.delete_item(first["id"])
        assert deleted["type"] == "conversation.item.deleted"
        assert deleted["item_id"] == first["id"]
        with pytest.raises(TokenwireError) as info:
            await tw.request({"type": "conversation.item.retrieve", "item_id": first["id"]})
        assert info.value.code == "unknown_item"
        assert await (await tw.create_response()).text() == "You said: keep that"
