"""An openai-agents RealtimeAgent with one function tool, unmodified, against a
tokenwire server: `.venv-agents/bin/python tests/openai_compat/agents_client.py URL`.

Run by test_agents.py in its own venv (openai-agents pins websockets<17; the
server runs on 17). Prints one JSON object: the tool's calls, the agent's
events, the answer, and every raw server event the agent received.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner, RealtimeSession
from agents.realtime.model_inputs import RealtimeModelSendRawMessage

QUESTION = "What is the weather in Paris?"


async def run(url: str) -> dict[str, Any]:
    calls: list[str] = []
    sessions: list[RealtimeSession] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        # The first response was made to call this tool; let the next one answer.
        # (openai-agents' Agent has reset_tool_choice for this; RealtimeAgent has
        # no such setting, so the app sends the session.update itself.)
        auto = {"session": {"type": "realtime", "tool_choice": "auto"}}
        await sessions[0].model.send_event(
            RealtimeModelSendRawMessage(message={"type": "session.update", "other_data": auto})
        )
        return f"{city}: sunny, 22 C"

    agent = RealtimeAgent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather]
    )
    runner = RealtimeRunner(
        agent,
        config={"model_settings": {"output_modalities": ["text"], "tool_choice": "required"}},
    )
    out: dict[str, Any] = {"calls": calls, "kinds": [], "errors": [], "raw": []}
    session = await runner.run(model_config={"url": url, "api_key": "sk-unused"})
    async with session:
        sessions.append(session)
        await session.send_message(QUESTION)
        tool_ended = False
        async with asyncio.timeout(30):
            async for event in session:
                out["kinds"].append(event.type)
                if event.type == "raw_model_event":
                    data = event.data
                    if data.type == "raw_server_event":
                        out["raw"].append(data.data)
                    elif data.type in ("error", "exception"):
                        out["errors"].append(repr(data))
                elif event.type == "error":
                    out["errors"].append(repr(event.error))
                elif event.type == "tool_start":
                    out["tool_start"] = {"name": event.tool.name, "arguments": event.arguments}
                elif event.type == "tool_end":
                    out["tool_end"] = {"name": event.tool.name, "output": str(event.output)}
                    tool_ended = True
                elif event.type == "history_updated":
                    out["history"] = [item.model_dump(mode="json") for item in event.history]
                elif event.type == "agent_end" and tool_ended:
                    break
    return out


if __name__ == "__main__":
    result = asyncio.run(run(sys.argv[1]))
    sys.stdout.write(json.dumps(result) + "\n")
