"""One client socket: its reader, its attachment to a session, replay on
resume, the idle timeout, and how it ends.

A `ClientSocket` serves whatever owns a session (a `SocketOwner`): it
attaches, replays or goes live, then feeds client frames in until the socket
closes or its first frame resumes another session (a `Handoff`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from ..core.limits import TokenBucket
from ..core.schema import SessionResume
from ..wire import Dialect
from ..wire.close_codes import CLOSE_IDLE
from .ws import pace_reading, unless_closed


class SocketState(StrEnum):
    OPEN = "open"  # handshake done, not yet attached
    REPLAYING = "replaying"  # resending what the client missed
    LIVE = "live"  # reading frames, events flow
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Handoff:
    """The socket's first event resumed another session: serve that one on it."""

    target: Any  # a SessionRuntime or a Follower
    last_seq: int


# What serving ends with: the client closed cleanly, the socket was lost, or
# the socket goes to the session it resumed.
Outcome = Literal["ended", "lost"] | Handoff


class SocketOwner(Protocol):
    """What a socket needs of the session it is attached to."""

    # Set while the client may send more (upstream backpressure).
    drained: asyncio.Event
    log: Any  # a bound structlog logger

    @property
    def busy(self) -> bool:
        """Something runs that the client waits for: not idle."""
        ...

    @property
    def closed_for(self) -> str | None:
        """Why the owner closed the socket (a slow client), or None."""
        ...

    def attach(self, ws: ServerConnection, dialect: Dialect) -> None: ...

    async def replay(self, last_seq: int) -> None: ...

    def go_live(self) -> None: ...

    def receive(self, frame: str | bytes, *, first: bool) -> SessionResume | Awaitable[None] | None:
        """Take a client frame; a resume request the first frame makes comes
        back, or what to await before the next frame is read."""
        ...

    async def resolve(self, resume: SessionResume) -> Any | None:
        """What serves the session a resume asks for; None (and an error
        event) if nothing does."""
        ...

    async def detach(self, outcome: Outcome) -> None: ...


class ClientSocket:
    __slots__ = (
        "_closer",
        "_idle_timer",
        "_last_frame",
        "budget",
        "closed_for",
        "dialect",
        "idle_timeout_s",
        "state",
        "ws",
    )

    def __init__(
        self,
        ws: ServerConnection,
        dialect: Dialect,
        idle_timeout_s: float,
        budget: TokenBucket | None = None,
    ) -> None:
        self.ws = ws
        self.budget = budget  # the connection's inbound bytes (ws.inbound_budget)
        self.dialect = dialect
        self.idle_timeout_s = idle_timeout_s
        self.state = SocketState.OPEN
        self.closed_for: str | None = None
        self._last_frame = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._closer: asyncio.Task[None] | None = None

    async def serve(self, owner: SocketOwner, resume_from: int | None = None) -> Outcome:
        """Run `owner`'s session on this socket until it closes or moves on."""
        ws = self.ws
        owner.attach(ws, self.dialect)
        loop = asyncio.get_running_loop()
        outcome: Outcome = "lost"
        # A resumed socket resumes nothing else.
        first = resume_from is None
        try:
            # Whatever happens from here on (the socket may drop mid-replay),
            # the finally clause detaches, so a later resume never waits forever.
            if resume_from is not None:
                self.state = SocketState.REPLAYING
                await owner.replay(resume_from)
            else:
                owner.go_live()
            self.state = SocketState.LIVE
            self._last_frame = loop.time()
            self._idle_timer = loop.call_later(self.idle_timeout_s, self._check_idle, owner)
            # recv(), not `async for`: websockets' iterator is an async
            # generator, a few hundred bytes more per socket.
            while True:
                frame = await ws.recv()
                self._last_frame = loop.time()
                resume = owner.receive(frame, first=first)
                first = False
                if resume is not None and not isinstance(resume, SessionResume):
                    await resume  # its prompt tokenized off the loop; frames wait
                    resume = None
                if resume is not None:
                    target = await owner.resolve(resume)
                    if target is not None:
                        outcome = Handoff(target, resume.last_seq)
                        break
                await pace_reading(ws, self.budget, frame)
                self._last_frame = loop.time()  # a client we paused is not idle
                if not owner.drained.is_set():
                    # Upstream backpressure: read nothing more until the client
                    # reads what it asked for (TCP then slows the sender).
                    await unless_closed(ws, owner.drained.wait())
        except ConnectionClosedOK:
            outcome = "ended"  # the client closed the connection itself
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code in (1000, 1001):
                outcome = "ended"
        finally:
            self.state = SocketState.CLOSED
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            if self.closed_for is not None or owner.closed_for is not None:
                outcome = "ended"  # we closed it (slow or idle): nothing to resume
            await owner.detach(outcome)
        return outcome

    def _check_idle(self, owner: SocketOwner) -> None:
        loop = asyncio.get_running_loop()
        idle_for = loop.time() - self._last_frame
        limit = self.idle_timeout_s
        if owner.busy or idle_for < limit:
            self._idle_timer = loop.call_later(max(limit - idle_for, 1.0), self._check_idle, owner)
            return
        self._idle_timer = None
        self.closed_for = "idle"
        owner.log.info("idle_closed", idle_s=round(idle_for, 1))
        self._closer = loop.create_task(self.ws.close(CLOSE_IDLE, "idle timeout"))
