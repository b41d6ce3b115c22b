"""openai-agents' RealtimeRunner with one function tool, unmodified, on the
scripted engine: the tool runs and the agent's answer arrives. The client
(agents_client.py) runs in .venv-agents, which `make test` makes: openai-agents
pins websockets<17 and the server runs on 17. Every raw server event the agent
received is validated strictly against the `openai` SDK's models here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ..conftest import ROOT, RunningServer
from ..helpers.openai_models import validate

AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"
CLIENT = Path(__file__).with_name("agents_client.py")


async def run_agent(url: str) -> dict[str, Any]:
    assert AGENTS_PYTHON.exists(), "no .venv-agents: run `make test`, which makes it"
    proc = await asyncio.create_subprocess_exec(
        str(AGENTS_PYTHON),
        str(CLIENT),
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-4000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_a_realtime_agent_calls_its_tool_and_answers(scripted: RunningServer) -> None:
    result = await run_agent(scripted.url + "?model=gpt-realtime")
    assert result["errors"] == []

    for event in result["raw"]:
        validate(json.dumps(event))
    raw_types = [e["type"] for e in result["raw"]]
    assert raw_types.count("response.done") == 2
    assert "error" not in raw_types

    # The tool ran once, with the arguments the model gave it.
    assert result["calls"] == ["Paris"]
    assert result["tool_start"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert result["tool_end"] == {"name": "get_weather", "output": "Paris: sunny, 22 C"}

    # The agent's history: the question, the call with its output, the answer,
    # which is made from the tool's output (the scripted engine repeats it).
    user, call, answer = result["history"]
    assert user["role"] == "user"
    assert user["content"][0]["text"] == "What is the weather in Paris?"
    assert call["type"] == "function_call" and call["output"] == "Paris: sunny, 22 C"
    assert answer["role"] == "assistant" and answer["status"] == "completed"
    assert answer["content"][0]["text"] == "Tool said: Paris: sunny, 22 C"
