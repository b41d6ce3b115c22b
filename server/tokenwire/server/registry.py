"""Every live session of this instance, by id: creation, resume lookup,
takeover from a dead owner, the resume grace period, and the end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any

from .. import metrics
from ..config import ServerConfig
from ..core.errors import ErrorCode, ProtocolError
from ..core.schema import SessionResume
from ..core.stages import Stage
from ..engines.base import Engine
from ..logs import get_logger
from ..runtime import cluster
from ..runtime.follower import Follower
from ..runtime.session_runtime import GONE, RuntimeState, SessionRuntime
from ..storage.eventlog import EventLog, resume_problem
from ..storage.redis import Meta, RedisStore
from ..storage.redis_log import RedisLog
from .admission import KeyUsage, Limiter
from .collector import COLLECTOR
from .memory import Reclaimer

log = get_logger("tokenwire.server")

# A session with no socket of its own here, waiting for a resume.
_WAITING = frozenset({RuntimeState.DETACHED, RuntimeState.REMOTE})


class Registry:
    def __init__(
        self, engine: Engine, config: ServerConfig, limiter: Limiter, store: RedisStore | None
    ) -> None:
        self.engine = engine
        self.config = config
        self.limiter = limiter
        self.store = store
        self.sessions: dict[str, SessionRuntime] = {}
        self.stages: tuple[Stage, ...] = ()  # what every new session's generations pass through
        self._background: set[asyncio.Task[None]] = set()  # held until done
        # Takeovers under way, by session: a second resume meanwhile waits for the first.
        self._taking: dict[str, asyncio.Future[SessionRuntime | None]] = {}
        # Sessions that ended here but whose keys Redis failed to drop, by when
        # that was: a follower's next forward drops them (the TTL, at most).
        self._undropped: dict[str, float] = {}
        self.reclaimer = Reclaimer()
        self.reclaimer.tables.append(self.sessions)

    def _log_for(self, session_id: str, logged_seq: int) -> EventLog:
        assert self.store is not None
        return RedisLog(self.store, session_id, logged_seq)

    async def new_session(
        self,
        usage: KeyUsage,
        subprotocol: str | None,
        restored: tuple[dict[str, Any], list[Any]] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> SessionRuntime:
        self.reclaimer.session_started()
        runtime = SessionRuntime(
            self.engine,
            self.config,
            usage,
            self.find_session,
            subprotocol,
            self._log_for if self.store is not None else None,
            restored,
            settings,
            self.stages,
        )
        runtime.on_moved = self.forget
        replaced = self.sessions.get(runtime.session.id)
        if replaced is None:
            COLLECTOR.session_opened()
        else:
            self._unhold(replaced)
        self.sessions[runtime.session.id] = runtime
        usage.sessions += 1
        if self.store is not None and restored is None:
            try:
                await self.store.register(runtime.session.id, usage.key_id)
            except Exception:
                # Redis failed us: nothing of this session may stay behind.
                await self.end_session(runtime)
                raise
        return runtime

    async def find_session(
        self, event: SessionResume, key_id: str | None, requester: SessionRuntime
    ) -> SessionRuntime | Follower:
        """What serves a resume of `event.session_id` by this key: the local
        session, or (with Redis) a follower or a takeover of another
        instance's. Another key's session looks unknown."""
        sid = event.session_id
        runtime = self.sessions.get(sid)
        if runtime is requester:
            runtime = None
        if runtime is not None and runtime.state not in GONE:
            if runtime.key_id != key_id:
                raise _not_found(event)
            if problem := await runtime.check_resume(event.last_seq):
                raise _not_possible(event, problem)
            return runtime
        if self.store is None:
            raise _not_found(event)
        meta = await self.store.meta(sid)
        if meta is None or meta.key_id != (key_id or None):
            raise _not_found(event)
        bounds = await self.store.bounds(sid)
        if bounds is not None and (problem := resume_problem(event.last_seq, *bounds)):
            raise _not_possible(event, problem)
        if meta.owner != self.store.instance_id and await self.store.alive(meta.owner):
            return Follower(
                self.store,
                sid,
                meta.owner,
                self.config.lease_s / 2,
                self.config.slow_client_timeout_s,
            )
        taken = await self.take_over(sid, meta)
        if taken is None:
            raise _not_found(event)
        return taken

    async def take_over(self, sid: str, meta: Meta) -> SessionRuntime | None:
        """Continue a session whose owner (`meta.owner`) is gone, from its
        snapshot and log; once: two resumes at a time get the same runtime."""
        local = self.sessions.get(sid)
        if local is not None and local.state not in GONE:
            return local  # taken over while this resume looked the session up
        pending = self._taking.get(sid)
        if pending is None:
            pending = self._taking[sid] = asyncio.ensure_future(self._take_over(sid, meta))
            pending.add_done_callback(lambda _: self._taking.pop(sid, None))
        return await asyncio.shield(pending)

    async def _take_over(self, sid: str, meta: Meta) -> SessionRuntime | None:
        assert self.store is not None
        if not await self.store.claim(sid, meta.owner):
            return None
        try:
            loaded = await self.store.load(sid)
        except Exception:
            with contextlib.suppress(Exception):
                await self.store.give_back(sid, meta.owner)
            raise
        if loaded is None:
            # Nothing to continue from (its snapshot is gone): gone for every
            # instance, rather than owned by one that does not run it.
            with contextlib.suppress(Exception):
                await self.store.drop(sid)
            return None
        usage = self.limiter.usage(meta.key_id or "anonymous")
        try:
            runtime = await self.new_session(usage, None, loaded)
        except Exception:
            # Its state cannot be rebuilt (a corrupt entry, a newer version's
            # shape): gone for all, not claimed by one that does not run it.
            log.exception("takeover_restore_failed", session_id=sid)
            with contextlib.suppress(Exception):
                await self.store.drop(sid)
            self.limiter.forget_idle(usage.key_id)
            return None
        runtime.log.info("session_taken_over", previous_owner=meta.owner)
        metrics.TAKEOVERS.inc()
        # Generations continue after the tokens the old owner logged; the
        # events they make are logged even before the client is attached.
        cluster.continue_restored(runtime)
        self.arm_expiry(runtime)
        return runtime

    async def on_forward(self, sid: str, op: str, data: Any, follower: str) -> None:
        """An op a follower on another instance forwarded to this owner."""
        runtime = self.sessions.get(sid)
        if runtime is None and sid in self._undropped:
            # Its keys outlived a drop that failed: dropped now (only if still
            # ours), the follower sees the end, rather than wait for the TTL.
            assert self.store is not None
            if await self.store.drop(sid):
                self._undropped.pop(sid, None)
            return
        if runtime is None or runtime.state in GONE:
            return
        if op != "attach" and follower != runtime.follower:
            if op in ("detach", "close"):  # a follower let go is done: drop its mark
                self._spawn(self._mark(runtime, follower, left=False))
            return  # from a follower the client has left
        if op == "close":
            # Not awaited: the inbox serves every session's followers.
            self._spawn(self.end_session(runtime))
            return
        if op == "attach" and runtime.follower != follower:
            self.replacing_follower(runtime)
        cluster.receive_forwarded(runtime, op, data, follower)
        if runtime.state in (RuntimeState.REMOTE, RuntimeState.DETACHED):
            self.arm_expiry(runtime)  # the follower is alive: the grace period starts over

    def replacing_follower(self, runtime: SessionRuntime) -> None:
        """A resume takes the session from the follower that serves its client
        (on another instance, whose socket this one cannot close): tell that
        follower to let its socket go. In the background: the inbox and the
        resume go on meanwhile."""
        if runtime.state is not RuntimeState.REMOTE or runtime.follower is None:
            return
        self._spawn(self._mark(runtime, runtime.follower, left=True))

    async def _mark(self, runtime: SessionRuntime, follower: str, *, left: bool) -> None:
        """Mark `follower` as let go, or drop the mark once it detached."""
        assert self.store is not None
        write = self.store.let_go if left else self.store.forget_follower
        try:
            await write(runtime.session.id, follower)
        except Exception as exc:
            # Let go: its socket stays open until its client leaves, as before.
            # Forgotten: the mark stays until the session's keys go.
            failed = "let_go_failed" if left else "forget_follower_failed"
            runtime.log.warning(failed, follower=follower, error=str(exc))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self, timeout_s: float) -> None:
        """Let the background writes finish before the store and engine close
        under them (a let-go mark would otherwise fail and stay unwritten);
        what still runs after `timeout_s` is cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._background and loop.time() < deadline:  # tasks may spawn tasks
            await asyncio.wait(list(self._background), timeout=deadline - loop.time())
        for task in list(self._background):
            task.cancel()

    def arm_expiry(self, runtime: SessionRuntime) -> None:
        if runtime.expiry is not None:
            runtime.expiry.cancel()
        runtime.expiry = asyncio.get_running_loop().call_later(
            self.config.resume_grace_s, self._expire, runtime
        )

    def _expire(self, runtime: SessionRuntime) -> None:
        if runtime.state in _WAITING:
            self._spawn(self._expired(runtime))

    async def _expired(self, runtime: SessionRuntime) -> None:
        # Checked again when the task runs: a resume may have taken the
        # session in between (it attaches without an await).
        if runtime.state in _WAITING:
            runtime.log.info("resume_grace_over")
            await self.end_session(runtime)

    async def end_session(self, runtime: SessionRuntime) -> None:
        self.forget(runtime)
        self.reclaimer.session_ended(len(self.sessions))
        if runtime.state is RuntimeState.HANDED_OVER:
            return  # it lives on elsewhere
        await runtime.end()
        if self.store is not None and runtime.state is RuntimeState.ENDED:
            if not await self.store.drop(runtime.session.id):
                self._remember_undropped(runtime.session.id)

    def _remember_undropped(self, sid: str) -> None:
        assert self.store is not None
        now = time.monotonic()
        horizon = now - self.store.ttl_ms / 1000  # by then Redis expired the keys
        for old in [s for s, at in self._undropped.items() if at < horizon]:
            del self._undropped[old]
        self._undropped[sid] = now

    def forget(self, runtime: SessionRuntime) -> None:
        """The session ends here, or moved to another instance."""
        if self.sessions.get(runtime.session.id) is runtime:
            del self.sessions[runtime.session.id]
            COLLECTOR.session_closed()
            self._unhold(runtime)
        if runtime.expiry is not None:
            runtime.expiry.cancel()

    def _unhold(self, runtime: SessionRuntime) -> None:
        """The session no longer holds its key's usage record."""
        usage = runtime.usage
        if isinstance(usage, KeyUsage):
            usage.sessions -= 1
            self.limiter.forget_idle(usage.key_id)

    def busy(self) -> int:
        """Responses running in sessions that are still ours."""
        return sum(
            len(r.session.active_responses)
            for r in self.sessions.values()
            if r.state is not RuntimeState.HANDED_OVER
        )


def _not_possible(event: SessionResume, problem: str) -> ProtocolError:
    return ProtocolError(
        ErrorCode.RESUME_NOT_POSSIBLE, problem, event_id=event.event_id, param="last_seq"
    )


def _not_found(event: SessionResume) -> ProtocolError:
    return ProtocolError(
        ErrorCode.SESSION_NOT_FOUND,
        f"no session {event.session_id!r} to resume (unknown, or its grace period ended); "
        "start a new session",
        event_id=event.event_id,
        param="session_id",
    )
