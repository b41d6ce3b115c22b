"""End to end: `tokenwire serve --engine remote` in front of a real `vllm serve`
(SmolLM2 on the CPU; one server for the whole run, see conftest). A client
streams a response, the same text as the in-process engine gives; a cancel
frees the slot on the vLLM server (its own /metrics); a client that stops
reading has its generation paused (the remote slot freed) and resumed from
the exact token ids, byte-identical."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tokenwire.client import Client, connect

from ..conftest import (
    ARTIFACTS,
    VLLM_BACKPRESSURE_FLAGS,
    Spawned,
    VllmServer,
    http_json,
    log_tail,
    spawn_server,
)
from ..helpers.tools import WEATHER_DESCRIBED as WEATHER
from ..helpers.wire import raw_client
from .vllm_serve import VllmOpenAI

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

ESSAY = "Write a long essay about the history of the Roman Empire."


@pytest.fixture(scope="module")
def gateway(vllm_openai: VllmOpenAI) -> Iterator[Spawned]:
    ARTIFACTS.mkdir(exist_ok=True)
    with spawn_server(
        "--engine",
        "remote",
        "--remote-url",
        vllm_openai.url,
        # Small buffers and caps: a client that stops reading pauses within seconds.
        *VLLM_BACKPRESSURE_FLAGS,
        env=dict(os.environ, TOKENWIRE_LOG_LEVEL="info"),
        log_path=LOG,
        ready_timeout=120,
    ) as spawned:
        yield spawned


LOG = ARTIFACTS / "tokenwire-remote.log"
# Generous: the vLLM server's processes take both cores while they generate.
# A gateway that stalls says so in its log (event_loop_stalled).
PATIENCE_S = 30.0


def health(gateway: Spawned) -> dict:
    try:
        return http_json(gateway.http + "/healthz", timeout=PATIENCE_S)[1]
    except TimeoutError:
        raise AssertionError(f"no /healthz answer in {PATIENCE_S:g} s:\n{log_tail(LOG)}") from None


async def session(gateway: Spawned, **kwargs: Any) -> Client:
    try:
        return await connect(gateway.url, open_timeout=PATIENCE_S, **kwargs)
    except TimeoutError:
        raise AssertionError(f"no handshake in {PATIENCE_S:g} s:\n{log_tail(LOG)}") from None


async def test_a_client_streams_an_answer(gateway: Spawned, vllm_openai: VllmOpenAI) -> None:
    async with await session(gateway, protocol="json") as tw:
        await tw.add_message("What is the capital of France?")
        response = await tw.create_response(temperature=0, max_output_tokens=40)
        deltas = [d async for d in response.text_deltas()]
        assert "Paris" in "".join(deltas)
        assert len(deltas) > 1  # it streamed, not one lump
        done = await response.done()
    assert done["status"] == "completed"
    assert done["usage"]["input_tokens"] > 5 and 0 < done["usage"]["output_tokens"] <= 40
    assert done["usage"]["cached_tokens"] >= 0
    replicas = health(gateway)["engine_load"]["replicas"]
    assert [r["state"] for r in replicas.values()] == ["up"]
    assert list(replicas) == [vllm_openai.url] and replicas[vllm_openai.url]["requests"] >= 1
    # Per-replica Prometheus metrics, beside the gateway's own.
    with urllib.request.urlopen(gateway.http + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    label = f'{{replica="{vllm_openai.url}"}}'
    assert f"tokenwire_remote_up{label} 1.0" in metrics
    assert f"tokenwire_remote_ttft_seconds_count{label}" in metrics
    assert f"tokenwire_remote_requests_total{label}" in metrics


async def test_text_equals_the_in_process_engine(gateway: Spawned, vllm_server: VllmServer) -> None:
    """Same model, same prompt, temperature 0: `--engine remote` in front of
    `vllm serve` and `--engine vllm` in process give the same answer."""
    answers = []
    for url in (gateway.url, vllm_server.url):
        async with await connect(url) as tw:
            await tw.add_message("Name three colours and say why people like each one.")
            response = await tw.create_response(temperature=0, max_output_tokens=48)
            answers.append((await response.text(), (await response.done())["usage"]))
    (remote, remote_usage), (local, local_usage) = answers
    assert remote == local and len(remote) > 40
    assert remote_usage["input_tokens"] == local_usage["input_tokens"]
    assert remote_usage["output_tokens"] == local_usage["output_tokens"]


async def test_cancel_frees_the_remote_slot(gateway: Spawned, vllm_openai: VllmOpenAI) -> None:
    async with await session(gateway, protocol="msgpack") as tw:
        await tw.add_message("Write a very long story about a dragon and a knight.")
        response = await tw.create_response(temperature=0, max_output_tokens=1000, ignore_eos=True)
        seen = 0
        async for _ in response.text_deltas():
            seen += 1
            if seen == 3:
                break
        assert await asyncio.to_thread(vllm_openai.running) == 1
        t0 = time.monotonic()
        done = await response.cancel()
        assert done["status"] == "cancelled"
        while await asyncio.to_thread(vllm_openai.running) > 0:
            # 1000 tokens would take over 20 s here.
            assert time.monotonic() - t0 < 10.0, "the vLLM server still runs the cancelled request"
            await asyncio.sleep(0.005)
        print(f"\ncancel -> vLLM slot free in {(time.monotonic() - t0) * 1000:.0f} ms")
        # The session goes on.
        again = await (await tw.create_response(temperature=0, max_output_tokens=5)).done()
        assert again["status"] == "incomplete"  # it hit max_output_tokens
        assert again["usage"]["output_tokens"] == 5


async def test_pause_and_resume_is_byte_identical(
    gateway: Spawned, vllm_openai: VllmOpenAI
) -> None:
    params = {"temperature": 0, "max_output_tokens": 260, "ignore_eos": True}
    async with await session(gateway) as tw:
        await tw.add_message(ESSAY)
        baseline = await tw.create_response(**params)
        expected = await baseline.text()
        base_done = await baseline.done()
    assert base_done["usage"]["output_tokens"] == 260

    ws = await raw_client(gateway.url)
    item = {"type": "message", "role": "user", "content": ESSAY}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create", "response": params}))
    # Read nothing until the gateway pauses the generation.
    for _ in range(600):
        if (await asyncio.to_thread(health, gateway))["paused_connections"] >= 1:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the stalled client never caused a pause")
    # Paused: the vLLM server holds nothing for it.
    t0 = time.monotonic()
    while await asyncio.to_thread(vllm_openai.running) > 0:
        assert time.monotonic() - t0 < 10.0, "the paused generation still runs on the server"
        await asyncio.sleep(0.02)
    paused = (await asyncio.to_thread(health, gateway))["paused_connections"]
    assert paused == 1, log_tail(LOG)
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
    assert done["usage"]["output_tokens"] == 260
    # The resumed request re-sent the prompt plus the ids so far: a prefix-cache hit.
    assert done["usage"]["input_tokens"] > base_done["usage"]["input_tokens"]
    assert done["usage"]["cached_tokens"] > 0
    assert text == expected


async def retrieve(tw: Client, item_id: str) -> dict:
    return (await tw.request({"type": "conversation.item.retrieve", "item_id": item_id}))["item"]


async def test_steer_mid_stream_continues_on_the_remote_server(gateway: Spawned) -> None:
    async with await session(gateway) as tw:
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


async def test_forced_tool_call_then_result_continues(gateway: Spawned) -> None:
    calls: list[dict] = []

    async def get_weather(city: str) -> dict:
        calls.append({"city": city})
        return {"city": city, "temperature_c": 22, "sky": "sunny"}

    async with await session(gateway, tools={"get_weather": get_weather}) as tw:
        await tw.update_session(tools=[WEATHER], temperature=0)
        await tw.add_message("What is the weather in Paris?")
        response = await tw.create_response(tool_choice="required", max_output_tokens=80)
        events = [e async for e in response]
        answer = await response.text()
    done = events[-1]["response"]
    assert done["status"] == "completed", done
    (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    # structured_outputs reached the server: a valid call even from a 135M model.
    assert json.loads(args_done["arguments"]) == {"city": "Paris"}
    assert calls == [{"city": "Paris"}]
    assert "22" in answer, answer  # the tool's result reached the model
