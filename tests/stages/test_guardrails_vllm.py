"""A blocklist on the real SmolLM2 engine: the block stops the response with
content_filter, frees the engine, and no frame the client got holds the word.

At temperature 0 SmolLM2 answers "What is the capital of France?" with
"The capital of France is Paris." (checked once, and by test_vllm_e2e)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect as ws_connect

from ..conftest import ARTIFACTS, VLLM_ENGINE_FLAGS, Spawned, http_json, spawn_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawned]:
    words = tmp_path_factory.mktemp("guardrail") / "words.txt"
    words.write_text("# what the model says second\ncapital\n")
    ARTIFACTS.mkdir(exist_ok=True)
    env = dict(os.environ, TOKENWIRE_KV_CACHE_GIB="1")
    with spawn_server(
        "--engine", "vllm", "--max-model-len", "2048", "--guardrail", f"blocklist:{words}",
        "--guardrail", "pii", *VLLM_ENGINE_FLAGS,
        env=env, log_path=ARTIFACTS / "vllm-guardrail-server.log", ready_timeout=600,
    ) as spawned:  # fmt: skip
        yield spawned


async def test_a_blocked_word_never_reaches_the_socket_and_frees_the_engine(
    guarded: Spawned,
) -> None:
    async with ws_connect(guarded.url, subprotocols=["tokenwire.v1.json"]) as ws:
        frames = [await ws.recv()]
        assert json.loads(frames[0])["session"]["guardrails"] == ["blocklist", "pii"]
        item = {"type": "message", "role": "user", "content": "What is the capital of France?"}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        # ignore_eos: without the block the engine would run for 300 tokens.
        params = {"temperature": 0, "max_output_tokens": 300, "ignore_eos": True}
        await ws.send(json.dumps({"type": "response.create", "response": params}))
        while '"response.done"' not in frames[-1]:
            frames.append(await asyncio.wait_for(ws.recv(), 60))
    done = json.loads(frames[-1])["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "content_filter"}
    assert done["usage"]["output_tokens"] < 300  # cancelled, not run to the end
    assert "capital" not in done["output"][0]["content"].lower()
    said = [f for f in frames if json.loads(f)["type"].startswith("response.")]
    assert said and not any("capital" in str(f).lower() for f in said)
    for _ in range(100):  # the engine slot is freed
        load = (await asyncio.to_thread(http_json, guarded.http + "/healthz"))[1]["engine_load"]
        if load["running"] == 0 and load["waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    assert load["running"] == 0 and load["waiting"] == 0
