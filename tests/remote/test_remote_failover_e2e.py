"""End to end through `tokenwire serve --engine remote` with two replicas.
Both are TCP proxies in front of the one real `vllm serve` (a second vLLM
server would cost a minute and a GB here), so the test can kill either
replica's connections. A replica dying mid-stream: the client sees one
response, no gap, no duplicate, the text of a run never interrupted. Every
replica down: an `engine_unavailable` error, and the session works again
once a replica is back."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ..conftest import ARTIFACTS, Spawned, spawn_server
from ..helpers.wire import Wire
from .threaded_proxy import ThreadedProxy, threaded_proxy
from .vllm_serve import VllmOpenAI

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def fleet(vllm_openai: VllmOpenAI) -> Iterator[tuple[Spawned, list[ThreadedProxy]]]:
    port = int(vllm_openai.url.rsplit(":", 1)[1])
    with threaded_proxy(port) as one, threaded_proxy(port) as two:
        with spawn_server(
            "--engine",
            "remote",
            "--remote-url",
            one.url,
            "--remote-url",
            two.url,
            env=dict(os.environ, TOKENWIRE_LOG_LEVEL="info"),
            log_path=ARTIFACTS / "tokenwire-remote-fleet.log",
            ready_timeout=120,
        ) as spawned:
            yield spawned, [one, two]


async def respond(wire: Wire, on_delta: object = None, **params: object) -> tuple[str, dict]:
    """response.create on this session; the text and response.done (or the error)."""
    await wire.send({"type": "response.create", "response": params})
    text, deltas = "", 0
    while True:
        event = await wire.recv()
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
            deltas += 1
            if callable(on_delta):
                on_delta(deltas)
        if event["type"] == "response.done":
            return text, event["response"]


async def test_a_replica_dying_mid_stream_is_invisible_to_the_client(
    fleet: tuple[Spawned, list[ThreadedProxy]],
) -> None:
    gateway, proxies = fleet
    wire = await Wire.open(gateway.url)
    await wire.recv()  # session.created
    # Out of band (conversation "none"): both runs see the same prompt.
    params = {
        "temperature": 0,
        "max_output_tokens": 50,
        "ignore_eos": True,
        "conversation": "none",
        "input": [{"type": "message", "role": "user", "content": "Tell me a story about a cat."}],
    }
    expected, first = await respond(wire, **params)

    def kill_at(n: int) -> None:
        if n == 10:  # whichever replica carries the stream dies
            for proxy in proxies:
                proxy.cut()

    text, done = await respond(wire, on_delta=kill_at, **params)
    await wire.ws.close()
    assert done["status"] == first["status"], done  # nothing went wrong, as far as it shows
    assert done["usage"]["output_tokens"] == 50
    assert text == expected


async def test_every_replica_down_is_engine_unavailable_then_back(
    fleet: tuple[Spawned, list[ThreadedProxy]],
) -> None:
    gateway, proxies = fleet
    wire = await Wire.open(gateway.url)
    await wire.recv()
    await wire.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "Say hi."},
        }
    )
    await wire.recv()
    for proxy in proxies:
        proxy.refuse(True)
        proxy.cut()
    try:
        await wire.send({"type": "response.create", "event_id": "down"})
        events = []
        while not events or events[-1]["type"] != "response.done":
            events.append(await wire.recv())
    finally:
        for proxy in proxies:
            proxy.refuse(False)
    (error,) = [e for e in events if e["type"] == "error"]
    assert error["error"]["code"] == "engine_unavailable" and error["error"]["event_id"] == "down"
    assert events[-1]["response"]["status"] == "failed"
    # Same session, a replica back: it answers.
    text, done = await respond(wire, temperature=0, max_output_tokens=8)
    await wire.ws.close()
    assert text and done["status"] in ("completed", "incomplete")
