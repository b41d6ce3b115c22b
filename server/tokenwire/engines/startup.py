"""An engine's start, once: whether it is ready, why it failed, and the wait
every request makes for it. Shared by the engines that start slowly (vLLM in
process, the remote servers' probes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .base import EngineUnavailable


class Startup:
    def __init__(self, describe: Callable[[Exception], str], what: str, log: Any) -> None:
        self._describe = describe  # a start failure as /readyz and requests show it
        self._what = what
        self._log = log
        self._done = asyncio.Event()
        self.failure: str | None = None

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self.failure is None

    async def run(self, start: Callable[[], Awaitable[None]]) -> None:
        try:
            await start()
        except Exception as exc:  # reported through /readyz and every request
            self.failure = self._describe(exc)
            self._log.error("engine_start_failed", error=self.failure)
            raise
        except asyncio.CancelledError:  # the server stops while the engine starts
            self.failure = "the start was cancelled: the server is stopping"
            raise
        finally:
            self._done.set()

    async def wait(self) -> None:
        """Until the start ended; EngineUnavailable if it failed."""
        await self._done.wait()
        if self.failure is not None:
            raise EngineUnavailable(f"{self._what} failed to start: {self.failure}")
