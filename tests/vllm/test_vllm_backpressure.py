"""Pause and resume on the real engine: a client that stops reading has its
vLLM request aborted (slot freed); when it reads again the request resumes
from the exact token ids, and greedy text equals a run with no pause."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenwire.client import connect

from ..conftest import VllmServer, log_tail
from ..helpers.wire import raw_client

pytestmark = pytest.mark.vllm

PROMPT = "Write a long essay about the history of the Roman Empire."
TOKENS = 260


async def test_pause_and_resume_keeps_greedy_text(vllm_server: VllmServer) -> None:
    params = {"temperature": 0, "max_output_tokens": TOKENS, "ignore_eos": True}
    async with await connect(vllm_server.url) as tw:
        await tw.add_message(PROMPT)
        baseline = await tw.create_response(**params)
        expected = await baseline.text()
        base_done = await baseline.done()
    assert base_done["usage"]["output_tokens"] == TOKENS

    ws = await raw_client(vllm_server.url)
    await ws.send(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": PROMPT},
            }
        )
    )
    await ws.send(json.dumps({"type": "response.create", "response": params}))
    # Stop reading until the server pauses the generation.
    saw_pause = False
    for _ in range(600):
        health = await asyncio.to_thread(vllm_server.health)
        if health["paused_connections"] >= 1:
            saw_pause = True
            break
        await asyncio.sleep(0.05)
    assert saw_pause, "the stalled client never caused a pause"
    # The engine slot is free while the client is paused.
    load = (await asyncio.to_thread(vllm_server.wait_idle))["engine_load"]
    assert (load["running"], load["waiting"], load["unfinished"]) == (0, 0, 0)
    paused = (await asyncio.to_thread(vllm_server.health))["paused_connections"]
    assert paused == 1, log_tail(vllm_server.log_path)
    text, seqs = "", []
    while True:
        event = json.loads(await ws.recv())
        seqs.append(event["seq"])
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
        if event["type"] == "response.done":
            done = event["response"]
            break
    ws.transport.abort()
    assert seqs == list(range(1, len(seqs) + 1))
    assert done["status"] == "completed"
    assert done["usage"]["output_tokens"] == TOKENS
    # The resumed request re-read the prompt plus the text so far, from the cache.
    assert done["usage"]["input_tokens"] > base_done["usage"]["input_tokens"]
    assert done["usage"]["cached_tokens"] > 0
    assert text == expected
