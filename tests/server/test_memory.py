"""Memory back to the OS after a wave of sessions (server.memory): the
Reclaimer collects and trims once per wave, keeps what the server's tables
hold."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
import tracemalloc
from collections.abc import Iterator

import pytest
import uvloop
from websockets.asyncio.client import connect as ws_connect

from tokenwire.config import ServerConfig
from tokenwire.server import memory
from tokenwire.server.memory import Reclaimer

from ..conftest import _scripted_server
from ..helpers.wait import until


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "MIN_ENDED", 4)
    monkeypatch.setattr(memory, "QUIET_S", 0.15)
    monkeypatch.setattr(memory, "MAX_WAIT_S", 1.2)


class Trim:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


class Purge(Trim):
    """Stands in for allocator.Mimalloc: idle from its purge until `busy`."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = False

    def __call__(self) -> None:
        super().__call__()
        self.idle = True

    def busy(self) -> None:
        self.idle = False

    def purging(self) -> Iterator[None]:
        self()
        yield


class SlicedPurge(Purge):
    """A purge of `steps` steps of `step_s` each, that records when it ran."""

    def __init__(self, steps: int, step_s: float) -> None:
        super().__init__()
        self.steps, self.step_s = steps, step_s
        self.ran: list[float] = []
        self.closed = False

    def purging(self) -> Iterator[None]:
        self.idle = True
        try:
            for _ in range(self.steps):
                self.ran.append(time.perf_counter())
                time.sleep(self.step_s)
                yield
        finally:
            self.closed = True


async def test_the_purge_runs_in_slices_between_other_callbacks() -> None:
    """mimalloc's sweep after a wave held the loop 100-365 ms at once."""
    purge = SlicedPurge(steps=40, step_s=0.001)
    reclaimer = Reclaimer(Trim())
    reclaimer._mimalloc = purge  # type: ignore[assignment]
    ticks: list[float] = []

    async def other_session() -> None:
        for _ in range(200):
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)

    other = asyncio.create_task(other_session())
    await asyncio.sleep(0)
    reclaimer.reclaim()
    await other
    await until(lambda: reclaimer._purge is None, "the purge done")
    assert len(purge.ran) == 40 and purge.idle
    # Other callbacks ran between its first and its last step.
    assert any(purge.ran[0] < t < purge.ran[-1] for t in ticks)
    # Cancelled halfway (the server stops): the sweep is closed, its blocks freed.
    halfway = SlicedPurge(steps=1000, step_s=0.001)
    reclaimer._mimalloc = halfway  # type: ignore[assignment]
    reclaimer.reclaim()
    reclaimer.cancel()
    assert halfway.closed and len(halfway.ran) < 1000


@pytest.mark.usefixtures("fast")
async def test_a_wave_is_reclaimed_once_after_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Quiet for a second, not 0.15 s: a busy machine may stall a 10 ms sleep that long.
    monkeypatch.setattr(memory, "QUIET_S", 1.0)
    monkeypatch.setattr(memory, "MAX_WAIT_S", 5.0)
    trim = Trim()
    reclaimer = Reclaimer(trim)
    for still_open in range(9, -1, -1):  # 10 sessions end, one every 10 ms
        reclaimer.session_ended(still_open)
        await asyncio.sleep(0.01)
    assert reclaimer.reclaims == 0  # still ending: wait for quiet
    await asyncio.sleep(1.5)
    assert reclaimer.reclaims == 1 and trim.calls == 1
    assert reclaimer.ended == 0


@pytest.mark.usefixtures("fast")
async def test_few_ended_or_many_still_open_do_not_reclaim() -> None:
    trim = Trim()
    reclaimer = Reclaimer(trim)
    for _ in range(3):  # under MIN_ENDED
        reclaimer.session_ended(0)
    await asyncio.sleep(0.3)
    for _ in range(10):  # 13 ended, but 100 still open: a collection costs too much
        reclaimer.session_ended(100)
    await asyncio.sleep(0.3)
    assert reclaimer.reclaims == 0 and trim.calls == 0
    for still_open in range(6, 0, -1):  # 19 ended, 1 open
        reclaimer.session_ended(still_open)
    await asyncio.sleep(0.3)
    assert reclaimer.reclaims == 1


@pytest.mark.usefixtures("fast")
async def test_a_wave_that_goes_on_is_reclaimed_at_the_latest_after_max_wait() -> None:
    reclaimer = Reclaimer(Trim())
    for _ in range(150):  # endings every 10 ms for 1.5 s: never quiet
        reclaimer.session_ended(0)
        await asyncio.sleep(0.01)
    assert reclaimer.reclaims >= 1


@pytest.mark.usefixtures("fast")
async def test_the_tail_of_a_wave_is_reclaimed_when_its_last_session_ends() -> None:
    reclaimer = Reclaimer(Trim())
    for _ in range(8):
        reclaimer.session_ended(3)  # 8 ended, 3 still open: reclaim, with a tail
    await asyncio.sleep(0.3)
    assert reclaimer.reclaims == 1
    for still_open in (2, 1):
        reclaimer.session_ended(still_open)
    await asyncio.sleep(0.3)
    assert reclaimer.reclaims == 1  # 2 ended: not yet
    reclaimer.session_ended(0)  # the last one
    await asyncio.sleep(0.3)
    assert reclaimer.reclaims == 2


async def test_tables_keep_their_entries_and_give_back_their_size() -> None:
    reclaimer = Reclaimer(Trim())
    sessions = {f"s{i}": i for i in range(10_000)}
    sockets = set(range(10_000))
    grown = sys.getsizeof(sessions), sys.getsizeof(sockets)
    for i in range(1, 10_000):
        del sessions[f"s{i}"]
        sockets.discard(i)
    assert (sys.getsizeof(sessions), sys.getsizeof(sockets)) == grown  # what a dict keeps
    reclaimer.tables += [sessions, sockets]
    reclaimer.reclaim()
    assert sessions == {"s0": 0} and sockets == {0}
    assert sys.getsizeof(sessions) < grown[0] / 100
    assert sys.getsizeof(sockets) < grown[1] / 100


async def test_reclaim_lets_go_of_the_names_the_type_cache_holds() -> None:
    class Probe:
        attr = 1

    # A new string, as C code makes one per call (datetime's "utcoffset" for
    # each log line's timestamp); the type cache keeps it until cleared.
    name = "".join(["at", "tr"])
    before = sys.getrefcount(name)
    assert getattr(Probe, name) == 1
    assert sys.getrefcount(name) > before  # the cache's references
    Reclaimer(Trim()).reclaim()
    assert sys.getrefcount(name) == before


@pytest.mark.usefixtures("fast")
async def test_a_server_reclaims_after_a_wave_and_open_sessions_go_on() -> None:
    config = ServerConfig(engine="scripted", port=0, scripted_tokens_per_s=1000.0)
    async with _scripted_server(config) as running:
        reclaimer = running.server.registry.reclaimer
        trim = Purge()
        reclaimer._trim = reclaimer._mimalloc = trim  # type: ignore[assignment]
        async with ws_connect(running.url) as stays:
            created = json.loads(await stays.recv())
            assert created["type"] == "session.created"
            for _ in range(6):  # a wave: 6 sessions open and close
                async with ws_connect(running.url) as ws:
                    await ws.recv()
            # The reclaim runs once the wave has been quiet a while: wait for it
            # (a loaded machine may take longer than the quiet period).
            await until(lambda: reclaimer.reclaims and trim.idle, "the wave's reclaim", every=0.02)
            assert reclaimer.reclaims >= 1 and trim.calls
            assert len(running.server.connections) == 1  # the tables kept the open one
            assert trim.idle
            async with ws_connect(running.url) as ws:  # the next session: busy again
                await ws.recv()
                assert not trim.idle
            await stays.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "response": {"ignore_eos": True, "max_output_tokens": 3},
                    }
                )
            )
            types = []
            async with asyncio.timeout(10):
                while "response.done" not in types:
                    types.append(json.loads(await stays.recv())["type"])
            assert "response.output_text.delta" in types


async def _wave(n: int) -> None:
    """What sessions leave in the loop's free lists: many handles, timers and
    awaited futures (an iterator each) alive at once, then gone."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(n)]

    async def wait(future: asyncio.Future[None]) -> None:
        await future

    tasks = [loop.create_task(wait(future)) for future in futures]
    await asyncio.sleep(0)  # every task now awaits its future
    for future in futures:
        loop.call_soon(future.set_result, None)
        loop.call_later(3600, future.cancel).cancel()
    await asyncio.gather(*tasks)


_WAVE_LINES, _WAVE_START = inspect.getsourcelines(_wave)


def _wave_blocks(snapshot: tracemalloc.Snapshot) -> int:
    """pymalloc blocks (512 bytes at most) still alive that `_wave` allocated;
    the loop's ready deque keeps a few 528-byte blocks, which malloc holds."""
    lines = range(_WAVE_START, _WAVE_START + len(_WAVE_LINES))
    return sum(
        1
        for trace in snapshot.traces
        if trace.size <= 512
        and any(f.filename == __file__ and f.lineno in lines for f in trace.traceback)
    )


def test_the_loops_free_lists_let_go_of_a_waves_blocks() -> None:
    async def main(cycle: bool) -> int:
        tracemalloc.start(10)
        try:
            await _wave(2000)
            await asyncio.sleep(0)
            if cycle:
                memory.cycle_free_lists(asyncio.get_running_loop())
                for _ in range(3):
                    await asyncio.sleep(0)  # the handles run, then are released
            return _wave_blocks(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        kept = runner.run(main(cycle=False))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        after = runner.run(main(cycle=True))
    assert kept >= 500  # the free lists hold the wave's last handles, timers, iterators
    assert after <= 8  # not a free list's worth: a stray object or two of the wave's end
