"""Rate and concurrency limits: token buckets and per-key usage."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .protocol import ErrorCode


class TokenBucket:
    """`rate` per second, up to `burst`. take() refuses; debit() may go negative."""

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

    def ready(self) -> bool:
        self._refill()
        return self.level > 0

    def retry_after_s(self) -> float:
        self._refill()
        return 0.0 if self.level > 0 else (1 - self.level) / self.rate


@dataclass
class KeyUsage:
    """What one API key (or, without keys, the whole server) is using now."""

    key_id: str
    max_responses: int
    tokens: TokenBucket | None
    connections: int = 0
    responses: int = 0

    def acquire_response(self) -> tuple[ErrorCode, str] | None:
        """Reserve a response slot, or say why not."""
        if self.responses >= self.max_responses:
            return (
                ErrorCode.TOO_MANY_RESPONSES,
                f"this API key already runs {self.responses} responses, its limit",
            )
        if self.tokens is not None and not self.tokens.ready():
            return (
                ErrorCode.RATE_LIMIT_EXCEEDED,
                f"this API key is over its token rate; retry in "
                f"{self.tokens.retry_after_s():.1f} s",
            )
        self.responses += 1
        return None

    def release_response(self) -> None:
        self.responses -= 1

    def spend_tokens(self, n: int) -> None:
        if self.tokens is not None and n:
            self.tokens.debit(n)


class Limiter:
    """Per-key usage, created on first use."""

    def __init__(self, max_responses_per_key: int, tokens_per_s_per_key: float) -> None:
        self.max_responses = max_responses_per_key
        self.tokens_per_s = tokens_per_s_per_key
        self.keys: dict[str, KeyUsage] = {}

    def usage(self, key_id: str) -> KeyUsage:
        usage = self.keys.get(key_id)
        if usage is None:
            bucket = None
            if self.tokens_per_s > 0:
                bucket = TokenBucket(self.tokens_per_s, burst=self.tokens_per_s * 2)
            usage = self.keys[key_id] = KeyUsage(key_id, self.max_responses, bucket)
        return usage

    def forget_idle(self, key_id: str) -> None:
        usage = self.keys.get(key_id)
        if usage is not None and usage.connections == 0 and usage.responses == 0:
            del self.keys[key_id]
