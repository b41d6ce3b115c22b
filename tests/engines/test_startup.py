"""An engine's start (engines/startup.py): ready, failed, or cut short."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from tokenwire.engines.base import EngineUnavailable
from tokenwire.engines.startup import Startup


def startup() -> Startup:
    return Startup(lambda exc: str(exc), "the engine", structlog.get_logger())


async def test_a_start_cancelled_midway_is_not_ready() -> None:
    """The server stops while the model loads: requests waiting for the start
    get engine_unavailable, and the engine never reads as ready."""
    s = startup()
    loading = asyncio.Event()

    async def load() -> None:
        loading.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(s.run(load))
    waiting = asyncio.create_task(s.wait())
    await loading.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not s.ready
    with pytest.raises(EngineUnavailable, match="cancelled"):
        await asyncio.wait_for(waiting, 5)


async def test_a_start_that_fails_or_succeeds_says_so() -> None:
    ok, bad = startup(), startup()

    async def fine() -> None:
        return None

    async def broken() -> None:
        raise RuntimeError("no model")

    await ok.run(fine)
    assert ok.ready
    await ok.wait()
    with pytest.raises(RuntimeError):
        await bad.run(broken)
    assert not bad.ready and bad.failure == "no model"
    with pytest.raises(EngineUnavailable, match="no model"):
        await bad.wait()
