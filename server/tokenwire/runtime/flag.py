"""`Flag`: an asyncio.Event for objects that exist once per session."""

from __future__ import annotations

import asyncio


class Flag(asyncio.Event):
    """An `asyncio.Event` that keeps its waiters in a list, not a deque.

    A session has three events and at most one task waits on each; an empty
    deque takes about 600 bytes, an empty list 56."""

    def __init__(self, value: bool = False) -> None:
        # Not Event.__init__, which makes the deque; set, clear and wait only
        # iterate, append to and remove from `_waiters`.
        self._value = value
        self._waiters = []  # type: ignore[assignment]
