"""One way to wait for state that no event signals."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(
    check: Callable[[], object], what: str, timeout: float = 10, every: float = 0.005
) -> None:
    """Poll `check` every `every` s until it holds; fail the test with `what`
    after `timeout` s. A costly `check` (a request, a new connection) wants a
    larger `every`."""
    try:
        async with asyncio.timeout(timeout):
            while not check():  # noqa: ASYNC110 - polls state no event signals
                await asyncio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"not seen within {timeout} s: {what}") from None
