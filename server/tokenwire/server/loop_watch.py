"""How late the event loop runs: every socket of the process waits that long.

One timer, due every `period_s`, measures how late it fires. Lateness is what
a blocking call costs all sessions at once (a slow import, a long collection,
a CPU the engine's processes take); it goes to a histogram, and a lateness of
`stalled_s` or more is logged, so a slow /healthz or a late token can be told
apart from a slow client or engine. Lateness is a stall's length less up to
`period_s` (the part before the timer was due).
"""

from __future__ import annotations

import asyncio

from .. import metrics
from ..logs import get_logger

log = get_logger("tokenwire.server")

PERIOD_S = 0.5
STALLED_S = 1.0


class LoopWatch:
    def __init__(self, period_s: float = PERIOD_S, stalled_s: float = STALLED_S) -> None:
        self.period_s = period_s
        self.stalled_s = stalled_s
        self.stalls = 0
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._arm(asyncio.get_running_loop().time())

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, now: float) -> None:
        self._due = now + self.period_s
        self._timer = asyncio.get_running_loop().call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = asyncio.get_running_loop().time()
        lag = max(0.0, now - self._due)
        metrics.LOOP_LAG.observe(lag)
        if lag >= self.stalled_s:
            self.stalls += 1
            log.warning(
                "event_loop_stalled",
                lag_s=round(lag, 2),
                hint="every session waited this long: a blocking call in the server, "
                "or no CPU left for it (see tokenwire_event_loop_lag_seconds)",
            )
        self._arm(now)
