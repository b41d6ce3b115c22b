"""Crash takeover on the real engine: the owner is killed mid-answer, and
another vLLM instance continues the same response from the token ids logged
in Redis. With greedy decoding the text equals an uninterrupted run."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest

from tokenwire.client import connect

from ..conftest import ARTIFACTS, VLLM_ENGINE_FLAGS, RedisServer, VllmServer, spawn_server
from ..helpers.wire import Reader, Wire, resume, until_done_across_moves

pytestmark = pytest.mark.vllm

PROMPT = "Write a short poem about the sea."
TOKENS = 64


async def test_kill_9_takeover_keeps_greedy_text(
    vllm_server: VllmServer, redis_server: RedisServer
) -> None:
    params = {"temperature": 0, "max_output_tokens": TOKENS, "ignore_eos": True}
    async with await connect(vllm_server.url) as tw:
        await tw.add_message(PROMPT)
        baseline = await tw.create_response(**params)
        expected = await baseline.text()
    env = dict(os.environ, TOKENWIRE_KV_CACHE_GIB="1")
    with spawn_server(
        "--engine",
        "vllm",
        "--redis-url",
        redis_server.url,
        "--lease-s",
        "1",
        # As vllm_server's: the same numerics, and no 2 minutes of compiling.
        "--max-model-len",
        "2048",
        *VLLM_ENGINE_FLAGS,
        env=env,
        log_path=ARTIFACTS / "vllm-owner.log",
        ready_timeout=600,
    ) as owner:
        wire = await Wire.open(owner.url)
        sid = (await wire.recv())["session"]["id"]
        await wire.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": PROMPT},
            }
        )
        await wire.send({"type": "response.create", "response": params})
        reader = Reader(wire, 1)
        for _ in range(8):
            await reader.until("response.output_text.delta")
        # Mid-answer, no goodbye: the whole instance dies, as with a lost machine
        # (vLLM's engine-core child would otherwise outlive its parent).
        family = psutil.Process(owner.proc.pid).children(recursive=True)
        owner.proc.kill()
        owner.proc.wait()
        for child in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    # vllm_server shares the Redis: it follows until the lease lapses, closes
    # with 1012, and the next resume takes the session over.
    reader.wire, _ = await resume(vllm_server.url, sid, reader.last_seq)
    done = await until_done_across_moves(reader, vllm_server.url, sid)
    assert done["response"]["usage"]["output_tokens"] == TOKENS
    assert reader.text == expected
    assert len(reader.of("response.created")) == 1  # one response, continued
    await reader.wire.ws.close()
