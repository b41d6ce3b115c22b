"""The event loop's lateness: measured, and a stall logged with its length."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import structlog

from tokenwire import metrics
from tokenwire.server.loop_watch import LoopWatch

from ..conftest import RunningServer
from ..helpers.wait import until


def lag_count(at_least_s: float) -> int:
    """Observations of the lag histogram above `at_least_s` (a bucket bound)."""
    hist = metrics.LOOP_LAG
    return sum(hist.counts[hist.bounds.index(at_least_s) + 1 :])


async def test_a_blocked_loop_is_measured_and_logged() -> None:
    watch = LoopWatch(period_s=0.05, stalled_s=1.5)  # a busy machine stalls less
    before = lag_count(0.25)
    with structlog.testing.capture_logs() as logs:
        watch.start()
        try:
            await asyncio.sleep(0.2)  # on time: measured, not logged
            assert watch.stalls == 0
            time.sleep(2.0)  # what a blocking call does to every session
            await asyncio.sleep(0.2)
        finally:
            watch.stop()
    assert watch.stalls == 1
    [stalled] = [e for e in logs if e["event"] == "event_loop_stalled"]
    assert stalled["lag_s"] >= 1.9 and "blocking call" in stalled["hint"]
    assert lag_count(0.25) >= before + 1  # a busy machine may add a late tick


async def test_the_server_watches_its_loop(scripted: RunningServer) -> None:
    before = sum(metrics.LOOP_LAG.counts)
    await until(lambda: sum(metrics.LOOP_LAG.counts) >= before + 2, "two periods", every=0.1)
    text = await asyncio.to_thread(scrape, scripted.http + "/metrics")
    assert "tokenwire_event_loop_lag_seconds_count" in text


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
