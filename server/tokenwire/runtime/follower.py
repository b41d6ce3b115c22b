"""Serving a session that another instance owns, from its Redis log.

A client that resumes on an instance other than its session's owner is
served by a `Follower`: it replays the log after `last_seq`, then follows the
tail the owner keeps writing, and forwards the client's frames to the owner's
inbox. The owner's events (errors included) all come back through the log,
so `seq` stays the owner's and nothing is sent twice. When the owner's lease
is gone (crash, or drain), or another instance owns the session now, the
follower closes the socket with 1012: frames it
forwarded may have died with the owner, and only a fresh resume tells the
client exactly which ones to send again (`client_events`). That resume, here
or anywhere, takes the session over. When the client resumed elsewhere
while this socket looked alive, the owner marks this follower in the meta
(`left:`), and it closes with 1011.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..core.limits import TokenBucket
from ..logs import get_logger
from ..storage.redis import RedisStore
from ..wire import Dialect
from ..wire.close_codes import CLOSE_SERVICE_RESTART, CLOSE_SLOW_CLIENT
from .socket import Outcome
from .ws import close_or_abort, fell_behind_the_log, pace_reading

log = get_logger("tokenwire.follow")


class Follower:
    def __init__(
        self,
        store: RedisStore,
        session_id: str,
        owner: str,
        ping_s: float,
        slow_s: float = 0.0,
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.owner = owner
        # Tags what this follower forwards: the owner ignores a follower the
        # client has left (its late frames or detach would land in the session).
        self.id = uuid.uuid4().hex[:12]
        self._ping_s = ping_s
        self._slow_s = slow_s or None  # --slow-client-timeout-s; 0: none
        self._slow = False
        self.log = log.bind(session_id=session_id, owner=owner, follower=self.id)
        self._ws: ServerConnection | None = None

    async def serve(
        self,
        ws: ServerConnection,
        dialect: Dialect,
        resume_from: int | None = None,
        budget: TokenBucket | None = None,
    ) -> Outcome:
        self._ws = ws
        sent = resume_from or 0
        await self._forward("attach", {"last_seq": sent})
        reader = asyncio.create_task(self._forward_frames(ws, budget))
        self.log.info("following", last_seq=sent)
        last_ping = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            while not reader.done():
                entries = await self.store.follow(
                    self.session_id, sent, block_ms=int(self._ping_s * 1000)
                )
                # A client that stopped reading blocks a send for good: as on
                # the owner, it is closed with 4008 after --slow-client-timeout-s.
                async with asyncio.timeout(None) as clock:
                    for entry in entries:
                        if entry.seq != sent + 1:  # trimmed past this client (MAXLEN)
                            await fell_behind_the_log(ws, dialect, sent, entry.seq)
                            return "ended"
                        for frame in dialect.from_logged(entry.event):
                            if self._slow_s:
                                clock.reschedule(loop.time() + self._slow_s)
                            await ws.send(frame)
                        sent = entry.seq
                due = time.monotonic() - last_ping >= self._ping_s
                if due:
                    last_ping = time.monotonic()
                    await self._forward("ping")
                if entries and not due:
                    continue
                meta = await self.store.meta(self.session_id, self.id)
                if meta is None:  # the session ended (or expired) on its owner
                    await ws.close(1011, "the session ended")
                    return "ended"
                if meta.let_go:
                    # One socket per session: the client resumed elsewhere.
                    await close_or_abort(ws, 1011, "the session was resumed on another connection")
                    return "ended"
                if meta.owner != self.owner or not await self.store.alive(meta.owner):
                    # The owner died or drained. A new owner took the session
                    # over for a resume elsewhere: attaching to it would take
                    # the session from that client.
                    reader.cancel()
                    await ws.close(CLOSE_SERVICE_RESTART, "session moved")
                    return "ended"
            return "ended" if reader.result() else "lost"
        except ConnectionClosed:
            return "lost"
        except TimeoutError:
            self._slow = True
            self.log.warning("slow_client_closed", last_seq=sent)
            await close_or_abort(ws, CLOSE_SLOW_CLIENT, "client is not reading")
            return "ended"
        finally:
            clean = reader.done() and not reader.cancelled() and reader.result() is True
            clean = clean or self._slow  # 4008 ends the session, as on the owner
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            # A clean close ends the session, as it would on the owner.
            with contextlib.suppress(Exception):
                await self._forward("close" if clean else "detach")
            self.log.info("unfollowing", last_seq=sent, clean=clean)

    async def _forward_frames(self, ws: ServerConnection, budget: TokenBucket | None) -> bool:
        """Client frames to the owner; True once the client closed cleanly."""
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                await self._forward("frame", frame)
                await pace_reading(ws, budget, frame)  # the owner decodes it
        # Only a close the client started counts: our own 1012 is echoed back.
        rcvd = ws.protocol.close_rcvd
        return bool(
            rcvd is not None and rcvd.code in (1000, 1001) and ws.protocol.close_rcvd_then_sent
        )

    async def _forward(self, op: str, data: object = None) -> None:
        await self.store.forward(self.owner, self.session_id, op, data, follower=self.id)

    async def close(self) -> None:
        """This instance drains: the client resumes elsewhere (no going_away:
        the follower has no seq of its own to give it)."""
        if self._ws is not None:
            await close_or_abort(self._ws, CLOSE_SERVICE_RESTART, "draining; resume the session")
