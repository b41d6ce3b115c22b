"""A follower's own decisions, against a stand-in store and socket: when it
lets its client's socket go, and with which close code."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from tokenwire.runtime.follower import Follower
from tokenwire.storage.redis import Meta

MOVED = (1011, "the session was resumed on another connection")


class Socket:
    """The client's socket: reads nothing until closed; records the close."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.close_code: tuple[int, str] | None = None
        self.transport = None
        self.protocol = SimpleNamespace(close_rcvd=None, close_rcvd_then_sent=False)

    def __aiter__(self) -> Socket:
        return self

    async def __anext__(self) -> Any:
        await self.closed.wait()
        raise StopAsyncIteration

    async def send(self, frame: Any) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        self.close_code = (code, reason)
        self.closed.set()


class Store:
    """Redis as a follower sees it: an idle log, a meta, live leases."""

    def __init__(self, live: set[str]) -> None:
        self.meta_now: Meta | None = Meta("A", None)
        self.marked: set[str] = set()  # followers let go
        self.live = live
        self.forwarded: list[tuple[str, str]] = []

    async def forward(self, owner: str, sid: str, op: str, data: Any = None, **_: Any) -> None:
        self.forwarded.append((owner, op))

    async def follow(self, sid: str, after: int, block_ms: int) -> list[Any]:
        await asyncio.sleep(block_ms / 1000)
        return []

    async def meta(self, sid: str, follower: str | None = None) -> Meta | None:
        if self.meta_now is None:  # as Redis answers: only the follower's own mark
            return None
        return replace(self.meta_now, let_go=follower in self.marked)

    async def alive(self, iid: str) -> bool:
        return iid in self.live


def following(store: Store) -> tuple[Follower, Socket, asyncio.Task[Any]]:
    follower = Follower(store, "sess_1", "A", ping_s=0.02)  # type: ignore[arg-type]
    socket = Socket()
    task = asyncio.create_task(follower.serve(socket, None))  # type: ignore[arg-type]
    return follower, socket, task


async def test_a_follower_the_owner_replaced_closes_with_1011() -> None:
    store = Store({"A"})
    follower, socket, task = following(store)
    store.marked.add("another")  # another follower's mark
    await asyncio.sleep(0.1)
    assert not task.done() and socket.close_code is None
    store.marked.add(follower.id)
    assert await asyncio.wait_for(task, 5) == "ended"
    assert socket.close_code == MOVED
    assert store.forwarded[0] == ("A", "attach") and store.forwarded[-1] == ("A", "detach")


async def test_a_session_with_a_new_owner_is_not_taken_from_its_client() -> None:
    """The owner died and a resume elsewhere took the session over: this
    follower closes with 1012 and never attaches to the new owner (which
    would drop that client's socket)."""
    store = Store({"A", "X"})
    _, socket, task = following(store)
    await asyncio.sleep(0.05)
    store.meta_now = Meta("X", None)
    assert await asyncio.wait_for(task, 5) == "ended"
    assert socket.close_code == (1012, "session moved")
    assert {owner for owner, _ in store.forwarded} == {"A"}
