"""The registry: its background writes at shutdown (finished, or cut off), and
the end of a resume's grace period."""

from __future__ import annotations

import asyncio

from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.runtime.session_runtime import RuntimeState
from tokenwire.server.admission import Limiter
from tokenwire.server.registry import Registry


def registry() -> Registry:
    return Registry(ScriptedEngine(), ServerConfig(engine="scripted"), Limiter(4, 0), None)


async def test_settle_waits_for_background_writes_and_those_they_start() -> None:
    reg, done = registry(), []

    async def write(name: str, then: str | None = None) -> None:
        await asyncio.sleep(0.05)
        done.append(name)
        if then is not None:
            reg._spawn(write(then))

    reg._spawn(write("mark", then="forget"))
    await reg.settle(5.0)
    assert done == ["mark", "forget"]


async def test_settle_cancels_a_write_that_outlives_its_bound() -> None:
    reg = registry()
    started = asyncio.Event()

    async def hung() -> None:
        started.set()
        await asyncio.Event().wait()

    reg._spawn(hung())
    await started.wait()
    (task,) = reg._background
    await reg.settle(0.1)
    await asyncio.sleep(0)
    assert task.cancelled()


async def test_a_resume_between_the_grace_ending_and_its_task_keeps_the_session() -> None:
    """The grace timer fires and spawns the ending; a resume attaches (with no
    await) before that task runs. The resumed session stays."""
    reg = registry()
    rt = await reg.new_session(reg.limiter.usage("k"), "tokenwire.v1.json")
    rt.state = RuntimeState.DETACHED
    reg._expire(rt)  # the grace period is over: ending it is spawned
    rt.state = RuntimeState.ATTACHED  # a resume took it meanwhile
    await reg.settle(5.0)
    assert reg.sessions.get(rt.session.id) is rt
    assert rt.state is RuntimeState.ATTACHED
    await reg.end_session(rt)
    # Without the resume, it ends.
    rt = await reg.new_session(reg.limiter.usage("k"), "tokenwire.v1.json")
    rt.state = RuntimeState.DETACHED
    reg._expire(rt)
    await reg.settle(5.0)
    assert rt.session.id not in reg.sessions and rt.state is RuntimeState.ENDED
