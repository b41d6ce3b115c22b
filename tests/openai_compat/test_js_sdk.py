"""The official `openai` npm package's OpenAIRealtimeWS, unmodified, in Node,
over wss:// with a CA made for the test (NODE_EXTRA_CA_CERTS) and an API key
(OPENAI_API_KEY, which the SDK sends as a bearer token), on the scripted engine:
a text response and one function-call round. The script
(client_js/test-support/openai_realtime_ws.mjs) prints every server event it
received; each is validated strictly against the Python SDK's models here."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from ..conftest import ROOT, TLSFiles, tls_scripted_server
from ..helpers.openai_models import validate

CLIENT_DIR = ROOT / "client_js"
SCRIPT = CLIENT_DIR / "test-support" / "openai_realtime_ws.mjs"
KEY = "tw-js-sdk-key-0123456789"


async def run_node(base_url: str, ca_pem: Path, api_key: str) -> dict[str, Any]:
    env = dict(
        os.environ,
        OPENAI_BASE_URL=base_url,
        OPENAI_API_KEY=api_key,
        NODE_EXTRA_CA_CERTS=str(ca_pem),
    )
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(SCRIPT),
        cwd=CLIENT_DIR,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-4000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def texts(output: list[dict[str, Any]]) -> list[str]:
    return [part["text"] for item in output for part in item.get("content", [])]


async def test_openai_realtime_ws_over_wss(tls_files: TLSFiles) -> None:
    async with tls_scripted_server(tls_files, api_keys=KEY) as server:
        # The base URL as a user gives it to the SDK: https, ending in /v1.
        port = server.server.port
        result = await run_node(f"https://127.0.0.1:{port}/v1", tls_files.ca_file, KEY)
        url = server.url
    assert "failure" not in result, result.get("failure")
    assert result["errors"] == []
    assert result["url"] == url + "?model=gpt-realtime"
    assert result["session"]["type"] == "realtime"

    for event in result["events"]:
        validate(json.dumps(event))  # strict, against the Python SDK's models
    ids = [e["event_id"] for e in result["events"]]
    assert len(ids) == len(set(ids))

    text = result["text"]
    assert text["status"] == "completed"
    assert text["said"] == "You said: hello from node" == texts(text["output"])[0]

    call = result["call"]
    assert call["status"] == "completed"
    (item,) = call["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"}

    answer = result["answer"]
    assert answer["status"] == "completed"
    assert answer["said"] == "Tool said: Paris: sunny, 22 C" == texts(answer["output"])[0]


async def test_a_wrong_key_is_refused(tls_files: TLSFiles) -> None:
    async with tls_scripted_server(tls_files, api_keys=KEY) as server:
        port = server.server.port
        result = await run_node(f"https://127.0.0.1:{port}/v1", tls_files.ca_file, "sk-wrong")
    assert result["events"] == []
    assert "Unexpected server response: 401" in result["failure"], result
