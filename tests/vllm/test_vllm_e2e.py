"""End to end on the real vLLM engine with SmolLM2-135M-Instruct on the CPU.

One `tokenwire serve --engine vllm` process is shared by the whole run (see
conftest). The engine's own scheduler counts (running/waiting) come from
/healthz, fed by a vLLM stat logger.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from tokenwire.client import TokenwireError, connect

from ..conftest import VllmServer

pytestmark = pytest.mark.vllm


def idle(load: dict) -> bool:
    return (load["running"], load["waiting"], load["unfinished"]) == (0, 0, 0)


async def wait_busy(server: VllmServer) -> dict:
    for _ in range(200):
        load = (await asyncio.to_thread(server.health))["engine_load"]
        if load["running"] + load["waiting"] > 0:
            return load
        await asyncio.sleep(0.02)
    raise AssertionError("the engine never picked the request up")


async def test_greedy_answer_contains_paris(vllm_server: VllmServer) -> None:
    async with await connect(vllm_server.url, protocol="json") as tw:
        await tw.add_message("What is the capital of France?")
        response = await tw.create_response(temperature=0, max_output_tokens=40)
        deltas = [d async for d in response.text_deltas()]
        text = "".join(deltas)
        assert "Paris" in text
        assert len(deltas) > 1  # it streamed, not one lump
        done = await response.done()
        assert done["status"] == "completed"
        usage = done["usage"]
        assert usage["input_tokens"] > 5 and 0 < usage["output_tokens"] <= 40
        assert usage["cached_tokens"] >= 0
        assert 0 < done["timings"]["ttft_ms"] <= done["timings"]["total_ms"]


async def test_cancel_mid_stream_frees_the_engine(vllm_server: VllmServer) -> None:
    async with await connect(vllm_server.url, protocol="msgpack") as tw:
        await tw.add_message("Write a very long story about a dragon and a knight.")
        response = await tw.create_response(temperature=0, max_output_tokens=1000, ignore_eos=True)
        seen = 0
        async for _ in response.text_deltas():
            seen += 1
            if seen == 3:
                break
        busy = await wait_busy(vllm_server)
        assert busy["unfinished"] == 1
        done = await response.cancel()
        assert done["status"] == "cancelled"
        assert done["usage"]["output_tokens"] < 1000
        health = await asyncio.to_thread(vllm_server.wait_idle)
        assert idle(health["engine_load"]), health
        # The session goes on: a new response works after the cancel.
        await tw.add_message("What is the capital of France?")
        again = await tw.create_response(temperature=0, max_output_tokens=30)
        assert "Paris" in await again.text()


async def test_closing_the_socket_aborts_the_request(vllm_server: VllmServer) -> None:
    tw = await connect(vllm_server.url)
    await tw.add_message("Count from one to one thousand.")
    response = await tw.create_response(temperature=0, max_output_tokens=1000, ignore_eos=True)
    async for _ in response.text_deltas():
        break
    await wait_busy(vllm_server)
    await tw.ws.close()
    health = await asyncio.to_thread(vllm_server.wait_idle)
    assert idle(health["engine_load"]), health


async def test_prompt_longer_than_context_is_refused_before_engine_work(
    vllm_server: VllmServer,
) -> None:
    async with await connect(vllm_server.url) as tw:
        await tw.add_message("hello " * 3000)  # the server's context is 2048 tokens
        with pytest.raises(TokenwireError) as info:
            await tw.request({"type": "response.create", "event_id": "too-long"})
        assert info.value.code == "context_length_exceeded"
        assert info.value.error["event_id"] == "too-long"
        assert "2048" in info.value.error["message"]
        assert idle((await asyncio.to_thread(vllm_server.health))["engine_load"])


async def test_a_seed_makes_sampling_reproducible(vllm_server: VllmServer) -> None:
    """temperature 1 samples; the same seed samples the same answer, another
    seed (almost surely, over 40 tokens) another one."""
    story = [{"type": "message", "role": "user", "content": "Tell me a story about a cat."}]
    async with await connect(vllm_server.url, protocol="json") as tw:

        async def sample(seed: int) -> str:
            response = await tw.create_response(
                conversation="none", input=story, temperature=1.0, seed=seed,
                max_output_tokens=40,
            )  # fmt: skip
            return await response.text()

        first, again, other = await sample(1234), await sample(1234), await sample(99)
        assert first and first == again
        assert other != first


def vllm_totals(server: VllmServer) -> dict[str, float]:
    """vLLM's own counters on tokenwire's /metrics, summed over engines."""
    with urllib.request.urlopen(server.http + "/metrics", timeout=5) as r:
        text = r.read().decode()
    totals = dict.fromkeys(("vllm:generation_tokens_total", "vllm:request_success_total"), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def test_vllms_own_metrics_count_every_step_at_each_scrape(
    vllm_server: VllmServer,
) -> None:
    """vLLM's `vllm:*` metrics are recorded in batches of steps (vllm_stats.py):
    a scrape still sees every token. 150 tokens: more steps than one batch, so
    one flush comes from the batch filling and the rest from the scrape."""
    await asyncio.to_thread(vllm_server.wait_idle)
    before = await asyncio.to_thread(vllm_totals, vllm_server)
    ask = [{"type": "message", "role": "user", "content": "Count upwards from one."}]
    async with await connect(vllm_server.url) as tw:
        response = await tw.create_response(
            conversation="none", input=ask, temperature=0, max_output_tokens=150, ignore_eos=True
        )
        done = await response.done()
    assert done["usage"]["output_tokens"] == 150
    after = await asyncio.to_thread(vllm_totals, vllm_server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 150
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1
