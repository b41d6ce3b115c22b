"""Steering, tool calls and barge-in on the real vLLM engine (SmolLM2, CPU)."""

from __future__ import annotations

import json

import pytest

from tokenwire.client import connect

from ..conftest import VllmServer
from ..helpers.tools import WEATHER_DESCRIBED as WEATHER

pytestmark = pytest.mark.vllm


async def retrieve(tw, item_id: str) -> dict:
    return (await tw.request({"type": "conversation.item.retrieve", "item_id": item_id}))["item"]


async def test_forced_tool_call_then_result_continues_same_response(
    vllm_server: VllmServer,
) -> None:
    calls: list[dict] = []

    async def get_weather(city: str) -> dict:
        calls.append({"city": city})
        return {"city": city, "temperature_c": 22, "sky": "sunny"}

    async with await connect(vllm_server.url, tools={"get_weather": get_weather}) as tw:
        await tw.update_session(tools=[WEATHER], temperature=0)
        await tw.add_message("What is the weather in Paris?")
        response = await tw.create_response(tool_choice="required", max_output_tokens=80)
        events = [e async for e in response]
        kinds = [e["type"] for e in events]
        done = events[-1]["response"]
        assert done["status"] == "completed", done
        assert kinds.count("response.done") == 1
        (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        # Structured outputs make even a 135M model produce a valid call.
        assert json.loads(args_done["arguments"]) == {"city": "Paris"}
        assert calls == [{"city": "Paris"}]
        streamed = "".join(
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        )
        assert streamed == args_done["arguments"]
        assert kinds.index("response.requires_action") < kinds.index("response.output_text.delta")
        answer = await response.text()
        # The answer uses the tool's result, so the result reached the model.
        assert "22" in answer, answer


async def test_steer_mid_stream_continues_same_response(vllm_server: VllmServer) -> None:
    async with await connect(vllm_server.url) as tw:
        await tw.add_message("Tell me a long story about a brave knight.")
        response = await tw.create_response(temperature=0, max_output_tokens=60)
        seen, steered = 0, None
        async for event in response:
            if event["type"] == "response.output_text.delta":
                seen += 1
                if seen == 5:
                    steered = await response.steer("Make the knight a dragon instead.")
        done = await response.done()
        assert steered is not None and steered["response_id"] == response.id
        assert done["status"] in ("completed", "incomplete"), done
        messages = [o for o in done["output"] if o["type"] == "message"]
        assert len(messages) == 2
        assert messages[0]["status"] == "incomplete" and messages[0]["content"]
        assert messages[1]["content"]  # it went on generating after the steer
        steer_item = await retrieve(tw, steered["item"]["id"])
        assert steer_item["role"] == "user"
        assert steer_item["content"] == "Make the knight a dragon instead."
        # The partial answer stays in history before the steer.
        assert (await retrieve(tw, messages[0]["id"]))["content"] == messages[0]["content"]


async def test_barge_in_history_holds_only_the_heard_text(vllm_server: VllmServer) -> None:
    async with await connect(vllm_server.url) as tw:
        await tw.add_message("Describe the city of Paris in detail.")
        response = await tw.create_response(temperature=0, max_output_tokens=200)
        heard = ""
        async for delta in response.text_deltas():
            heard += delta
            if len(heard) > 30:
                break
        done = await response.cancel()
        assert done["status"] == "cancelled"
        item = next(o for o in done["output"] if o["type"] == "message")
        cut = len(heard) // 2
        await tw.truncate(item["id"], cut)
        assert (await retrieve(tw, item["id"]))["content"] == heard[:cut]
        health = vllm_server.wait_idle()
        assert health["engine_load"]["running"] == 0
