"""The collector's thresholds (server.collector): young collections held above
what the open sessions hold in flight, so a burst of responses is not walked
over and over."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from websockets.asyncio.client import connect as ws_connect

from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.runtime.session_runtime import SessionRuntime
from tokenwire.server.collector import COLLECTOR, OLDER, PER_SESSION, YOUNG_MIN, Collector
from tokenwire.wire import dialect_for

from ..conftest import _scripted_server
from ..helpers.socket import open_socket
from ..helpers.wait import until


def test_thresholds_follow_the_open_sessions() -> None:
    calls: list[tuple[int, ...]] = []
    collector = Collector(lambda *t: calls.append(t))
    collector.session_opened()  # before the heap is frozen: Python's own settings
    assert calls == []
    try:
        collector.freeze()
    finally:
        gc.unfreeze()
    assert calls == [(YOUNG_MIN, *OLDER)]
    for _ in range(2_000):
        collector.session_opened()
    assert calls[-1] == (PER_SESSION * 2_001, *OLDER)
    for _ in range(2_001):
        collector.session_closed()
    assert calls[-1] == (YOUNG_MIN, *OLDER) and collector.sessions == 0
    # Unchanged thresholds are not set again, below YOUNG_MIN // PER_SESSION sessions.
    assert len(calls) == len(set(calls)) * 2 - 1


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


async def test_a_response_in_flight_holds_fewer_objects_than_its_budget() -> None:
    """What PER_SESSION stands for: the GC-tracked objects a session adds while
    its response streams. Counted on real session runtimes, each writing to a
    socket that takes everything."""
    n = 200
    engine = ScriptedEngine(tokens_per_s=1.0)  # the second token comes 1 s later
    runtimes: list[SessionRuntime] = []
    sockets: list[Any] = []
    for _ in range(n):
        rt = SessionRuntime(engine, ServerConfig(engine="scripted"))
        ws = open_socket()
        rt.attach(ws, dialect_for(None))  # type: ignore[arg-type]
        rt.go_live()
        runtimes.append(rt)
        sockets.append(ws)
    await asyncio.sleep(0.05)  # the writers start and wait
    try:
        idle = _tracked()
        for rt in runtimes:
            rt.receive('{"type": "response.create", "response": {"max_output_tokens": 50}}')
        await until(
            lambda: all(
                any(b"output_text.delta" in frame for frame in ws.transport.written)
                for ws in sockets
            ),
            "every session's first delta",
        )
        in_flight = _tracked()
        assert all(len(rt.session.active_responses) == 1 for rt in runtimes)
    finally:
        for rt in runtimes:
            await rt.end()
    per_response = (in_flight - idle) / n
    assert 10 < per_response <= PER_SESSION, per_response


async def test_the_server_tells_the_collector_its_sessions() -> None:
    before = COLLECTOR.sessions
    async with _scripted_server(ServerConfig(engine="scripted", port=0)) as running:
        await until(lambda: COLLECTOR.threshold0 > 0, "the engine is up: the heap frozen")
        async with ws_connect(running.url) as a, ws_connect(running.url) as b:
            for ws in (a, b):
                await ws.recv()  # session.created
            assert COLLECTOR.sessions == before + 2
        await until(lambda: COLLECTOR.sessions == before, "both sessions ended")
