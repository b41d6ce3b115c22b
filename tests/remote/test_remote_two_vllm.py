"""Failover between two real vLLM servers: `tokenwire serve --engine remote`
with two `vllm serve` replicas (the run's shared one, and one of this
module's own). The replica a session is pinned to is killed with SIGKILL
mid-answer; the other, whose prefix cache has never seen the conversation,
takes the generation over from prompt + generated ids. The client sees one
response with the text of a run never interrupted."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from tokenwire.engines.replicas import Replica, replica_order

from ..conftest import ARTIFACTS, Spawned, free_port, http_json, spawn_server
from ..helpers.wire import Wire
from .test_remote_failover_e2e import respond
from .vllm_serve import VllmOpenAI, vllm_serve

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def doomed(vllm_openai: VllmOpenAI) -> Iterator[VllmOpenAI]:
    """The second replica, killed by the test."""
    with vllm_serve(vllm_openai.model, free_port(), ARTIFACTS / "vllm-openai-2.log") as server:
        yield server


@pytest.fixture(scope="module")
def gateway(vllm_openai: VllmOpenAI, doomed: VllmOpenAI) -> Iterator[Spawned]:
    with spawn_server(
        "--engine",
        "remote",
        "--remote-url",
        vllm_openai.url,
        "--remote-url",
        doomed.url,
        env=dict(os.environ, TOKENWIRE_LOG_LEVEL="info"),
        log_path=ARTIFACTS / "tokenwire-remote-two-vllm.log",
        ready_timeout=120,
    ) as spawned:
        yield spawned


async def session_on(gateway: Spawned, url: str) -> Wire:
    """A session that the gateway pins to the replica at `url`."""
    replicas = [Replica(u) for u in gateway_urls(gateway)]
    for _ in range(64):
        wire = await Wire.open(gateway.url)
        created = await wire.recv()
        if replica_order(replicas, created["session"]["id"])[0].url == url:
            return wire
        await wire.ws.close()
    raise AssertionError(f"no session landed on {url}")


def gateway_urls(gateway: Spawned) -> list[str]:
    return list(http_json(gateway.http + "/healthz")[1]["engine_load"]["replicas"])


async def test_a_killed_vllm_replica_hands_its_generation_to_the_other(
    gateway: Spawned, vllm_openai: VllmOpenAI, doomed: VllmOpenAI
) -> None:
    params = {
        "temperature": 0,
        "max_output_tokens": 50,
        "ignore_eos": True,
        "conversation": "none",
        "input": [{"type": "message", "role": "user", "content": "Tell me a story about a fox."}],
    }
    survivor = await session_on(gateway, vllm_openai.url)
    expected, first = await respond(survivor, **params)
    await survivor.ws.close()

    wire = await session_on(gateway, doomed.url)

    def kill_at(n: int) -> None:
        if n == 10:
            assert doomed.running() == 1  # the answer is being made there
            os.killpg(doomed.proc.pid, signal.SIGKILL)

    text, done = await respond(wire, on_delta=kill_at, **params)
    await wire.ws.close()
    assert doomed.proc.wait(timeout=10) == -signal.SIGKILL
    assert done["status"] == first["status"], done
    assert done["usage"]["output_tokens"] == 50
    assert text == expected
    health = (await asyncio.to_thread(http_json, gateway.http + "/healthz"))[1]
    replicas = health["engine_load"]["replicas"]
    assert replicas[doomed.url]["state"] in ("down", "probing")
    assert replicas[doomed.url]["failures"] == 1
    assert replicas[vllm_openai.url]["state"] == "up"
