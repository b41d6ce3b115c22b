"""A token bucket: the rate limits' one primitive."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """`rate` per second, up to `burst`. take() refuses; debit() may go negative."""

    __slots__ = ("_at", "burst", "clock", "level", "rate")

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.level = burst
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self._at) * self.rate)
        self._at = now

    def take(self, n: float = 1.0) -> bool:
        self._refill()
        if self.level < n:
            return False
        self.level -= n
        return True

    def debit(self, n: float) -> None:
        self._refill()
        self.level -= n

    def full(self) -> bool:
        """Nothing spent that has not been paid back: a new bucket is the same."""
        self._refill()
        return self.level >= self.burst

    def ready(self) -> bool:
        self._refill()
        return self.level > 0

    def retry_after_s(self) -> float:
        self._refill()
        return 0.0 if self.level > 0 else (1 - self.level) / self.rate
