"""The official `openai` Python SDK, unmodified, on the real vLLM engine
(SmolLM2, CPU): a function-call round trip the OpenAI way. Every server event is
validated strictly against the SDK's models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.realtime import ResponseDoneEvent

from ..conftest import VllmServer
from ..helpers.openai_clients import function_call_output, ga_connect, text_of, user_message
from ..helpers.tools import WEATHER_DESCRIBED as WEATHER

pytestmark = pytest.mark.vllm


async def completed(ga: Any) -> tuple[list[Any], ResponseDoneEvent]:
    """The events up to the next response.done, which must be completed."""
    events = await ga.until("response.done", timeout=60)
    done = events[-1]
    assert isinstance(done, ResponseDoneEvent)
    assert done.response.status == "completed", done.response
    return events, done


async def test_function_call_round_trip(vllm_server: VllmServer) -> None:
    async with ga_connect(vllm_server.url) as ga:
        await ga.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "tools": [WEATHER],
                    "tool_choice": {"type": "function", "name": "get_weather"},
                    "temperature": 0,  # tokenwire's extension: a reproducible answer
                },
            }
        )
        await ga.until("session.updated")
        await ga.conn.conversation.item.create(item=user_message("What is the weather in Paris?"))
        await ga.conn.response.create(response={"max_output_tokens": 80})
        events, done = await completed(ga)
        (call,) = done.response.output or []
        assert call.type == "function_call" and call.name == "get_weather"
        args = json.loads(call.arguments)
        # The schema: an object with a string city and nothing else.
        assert set(args) == {"city"} and isinstance(args["city"], str) and args["city"]
        streamed = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert streamed == call.arguments

        result = {"city": args["city"], "temperature_c": 22, "sky": "sunny"}
        await ga.conn.conversation.item.create(
            item=function_call_output(call.call_id, json.dumps(result))
        )
        await ga.until("conversation.item.done")
        await ga.conn.response.create(response={"tool_choice": "auto", "max_output_tokens": 200})
        events, done = await completed(ga)
        (message,) = done.response.output or []
        assert message.type == "message" and message.role == "assistant"
        answer = text_of(events)
        assert answer.strip() and message.content[0].text == answer
        # The answer uses the tool's result, so the result reached the model.
        assert "22" in answer, answer
    vllm_server.wait_idle()
