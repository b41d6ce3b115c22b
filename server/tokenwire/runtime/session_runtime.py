"""The runtime of one session: it owns the `Session`, turns its actions into
engine tasks and timers, and hands its events to `Delivery`.

A runtime outlives a dropped socket: detached, its generations go on (and
pause at the hard cap, like for a client that reads nothing) until a new
socket resumes it with `session.resume`, or the grace period ends. With a
durable log (Redis) a detached session keeps logging, and the session can be
followed or taken over by another instance (runtime.cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from typing import Any, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode

from .. import metrics
from ..config import ServerConfig
from ..core import events as ev
from ..core.errors import ErrorCode, ProtocolError
from ..core.events import AbortGeneration, CancelTimer, StartGeneration, StartTimer
from ..core.lifecycle import Quota
from ..core.schema import SessionResume, parse_client_event
from ..core.session import Session, SessionLimits
from ..core.stages import Source, Stage, StageContext
from ..engines.base import (
    Engine,
    EngineDelta,
    EngineError,
    TokenizeOffLoop,
    asking_off_loop,
)
from ..logs import get_logger
from ..storage.eventlog import EventLog, LogState, MemoryLog, resume_problem
from ..wire import Dialect, dialect_for
from ..wire.close_codes import CLOSE_SERVICE_RESTART
from .delivery import Delivery, Pace
from .flag import Flag
from .telemetry import GAP_BATCH, Telemetry, observe_gaps

log = get_logger("tokenwire.runtime")

_DELTA = ev.RESPONSE_OUTPUT_TEXT_DELTA
# Events that change no state a takeover needs: no snapshot for them (one is
# the whole conversation: a retrieve must not cost its rewrite).
_NO_SNAPSHOT = ev.DELTAS | {
    ev.ERROR,
    ev.SESSION_RESUMED,
    ev.SESSION_GOING_AWAY,
    ev.CONVERSATION_ITEM_RETRIEVED,
}


class RuntimeState(StrEnum):
    NEW = "new"  # made for a socket that has not attached yet
    ATTACHED = "attached"  # a socket on this instance serves it
    DETACHED = "detached"  # no socket: waiting for a resume within the grace period
    REMOTE = "remote"  # its client follows it from another instance
    ENDED = "ended"
    HANDED_OVER = "handed_over"  # another instance continues it


GONE = frozenset({RuntimeState.ENDED, RuntimeState.HANDED_OVER})


class KeyQuota(Quota, Protocol):
    """The API key's shared limits (server.admission.KeyUsage)."""

    key_id: str
    min_priority: int | None
    cache_salt: str | None


# Finds what serves a `session.resume` for a key, or raises ProtocolError.
FindSession = Callable[[SessionResume, str | None, "SessionRuntime"], Awaitable[Any]]


class SessionLog:
    """A runtime's log lines, with its session's and key's ids: what a
    structlog logger bound to them writes, for a tenth of its memory (about
    400 bytes a session, and most of these lines are below the log level)."""

    __slots__ = ("key_id", "session_id")

    def __init__(self, session_id: str, key_id: str | None) -> None:
        self.session_id, self.key_id = session_id, key_id

    def info(self, event: str, **fields: Any) -> None:
        log.info(event, session_id=self.session_id, key_id=self.key_id, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        log.warning(event, session_id=self.session_id, key_id=self.key_id, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        log.exception(event, session_id=self.session_id, key_id=self.key_id, **fields)


class SessionRuntime:
    __slots__ = (
        "_find_session",
        "_telemetry",
        "_timers",
        "config",
        "delivery",
        "detached",
        "drained",
        "engine",
        "expiry",
        "follower",
        "forwarded",
        "log",
        "on_moved",
        "resuming",
        "session",
        "stages",
        "state",
        "tasks",
        "usage",
    )

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        usage: KeyQuota | None = None,
        find_session: FindSession | None = None,
        subprotocol: str | None = None,
        log_for: Callable[[str, int], EventLog] | None = None,
        restored: tuple[dict[str, Any], list[Any]] | None = None,
        settings: dict[str, Any] | None = None,
        stages: Sequence[Stage] = (),
    ) -> None:
        self.engine = engine
        # Between the engine and the session, innermost first (core.stages).
        self.stages = tuple(stages)
        self.config = config
        self.usage = usage
        self._find_session = find_session
        dialect = dialect_for(subprotocol)
        kwargs: dict[str, Any] = {
            "limits": SessionLimits(
                max_active_responses=config.max_active_responses,
                default_max_output_tokens=config.default_max_output_tokens,
                tool_timeout_s=config.tool_timeout_s,
                max_conversation_bytes=config.max_conversation_bytes,
                max_events_per_s=config.max_events_per_s,
                min_priority=usage.min_priority if usage is not None else None,
                cache_salt=usage.cache_salt if usage is not None else None,
            ),
            "info": {
                "engine": engine.name,
                "subprotocol": dialect.subprotocol,
                "max_message_bytes": config.max_message_bytes,
                # Applies when max_output_tokens is null.
                "default_max_output_tokens": config.default_max_output_tokens,
                **{
                    k: v
                    for stage in stages
                    for k, v in stage.session_info(usage.key_id if usage else "anonymous").items()
                },
            },
            "preflight": engine.preflight,
            "capabilities": engine.capabilities,
            "quota": usage,
            "tool_flow": dialect.tool_flow,
        }
        logged_seq = 0
        if restored is None:
            self.session = Session(settings=settings, **kwargs)
        else:
            self.session, logged_seq = _restore(restored, kwargs)
        event_log = (
            log_for(self.session.id, logged_seq)
            if log_for is not None
            else MemoryLog(config.resume_log_bytes)
        )
        pace = Pace(
            config.outbound_high_water,
            config.outbound_hard_cap,
            config.stall_s,
            config.slow_client_timeout_s,
            config.sndbuf,
        )
        self.delivery = Delivery(self, event_log, dialect, pace, logged_seq=logged_seq)
        self.drained = self.delivery.drained
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}  # tool timeouts, by response id
        self.state = RuntimeState.NEW if restored is None else RuntimeState.DETACHED
        # Set while no socket is attached and no frame it sent is still to take.
        self.detached = Flag()
        self.detached.set()
        # Forwarded frames waiting behind one whose prompt is tokenized (cluster).
        self.forwarded: deque[Any] | None = None
        self.expiry: asyncio.TimerHandle | None = None  # end of the resume grace period
        # The follower serving this session's client from another instance.
        self.follower: str | None = None
        self.on_moved: Callable[[SessionRuntime], None] | None = None  # set by the registry
        self.resuming: asyncio.Task[None] | None = None
        self.log = SessionLog(self.session.id, usage.key_id if usage else None)
        self._telemetry = Telemetry(self.log, config.log_content)

    @property
    def key_id(self) -> str | None:
        return self.usage.key_id if self.usage else None

    @property
    def ws(self) -> ServerConnection | None:
        return self.delivery.ws

    @property
    def buffered_amount(self) -> int:
        return self.delivery.buffered_amount

    @property
    def paused(self) -> bool:
        return self.delivery.paused

    # -- SocketOwner: what the client socket drives ------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.session.active_responses)

    @property
    def closed_for(self) -> str | None:
        return self.delivery.closed_for

    def attach(self, ws: ServerConnection, dialect: Dialect) -> None:
        self.follower = None  # the client is here now: a follower's late ops are stale
        self.delivery.attach(ws, dialect)
        self.session.update_info(subprotocol=dialect.subprotocol)
        self.state = RuntimeState.ATTACHED
        self.detached.clear()
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        self.log.info(
            "socket_attached", subprotocol=dialect.subprotocol, remote=str(ws.remote_address)
        )

    async def replay(self, last_seq: int) -> None:
        replayed = await self.delivery.replay(last_seq)
        self.push_resumed(last_seq, replayed)
        self._go_on()

    def go_live(self) -> None:
        self.delivery.go_live()
        self._go_on()

    def _go_on(self) -> None:
        self.delivery.start_writer()
        self.pump()

    def receive(
        self, frame: str | bytes, *, first: bool = False, off_loop: bool = True
    ) -> SessionResume | Awaitable[None] | None:
        """Take a client frame; returns a resume request made by the first one,
        or (`off_loop`) what to await before the next frame: a long prompt
        being tokenized off the event loop."""
        if self.session.closed:
            return None  # ended (or closing as slow): a late frame starts nothing
        later = None
        try:
            obj = self.delivery.dialect.parse(frame)
        except ProtocolError as err:
            self.session.receive_protocol_error(err)
        else:
            if first and isinstance(obj, dict) and obj.get("type") == ev.SESSION_RESUME:
                try:
                    event = parse_client_event(obj)
                    assert isinstance(event, SessionResume)
                    return event
                except ProtocolError as err:
                    self.session.receive_protocol_error(err, frame=False)
            elif off := _take(self.session, obj, off_loop=off_loop):
                later = _tokenized_then_taken(self, obj, off)
        self.pump()
        return later

    async def resolve(self, event: SessionResume) -> Any | None:
        """What serves the session this socket asks to resume; errors go out here."""
        try:
            if self._find_session is None:
                raise ProtocolError(
                    ErrorCode.SESSION_NOT_FOUND, "resume is off", event_id=event.event_id
                )
            return await self._find_session(event, self.key_id, self)
        except ProtocolError as err:
            self.session.receive_protocol_error(err, frame=False)
            self.pump()
            return None

    async def detach(self, outcome: Any) -> None:
        # A session.resumed its socket never got describes that socket's
        # resume: the next resume must not deliver it too.
        self.delivery.outbox.discard(ev.SESSION_RESUMED)
        await self.delivery.detach()
        if self.state is RuntimeState.ATTACHED:
            self.state = RuntimeState.DETACHED
        if self.forwarded is None:  # else the last forwarded frame's taking sets it
            self.detached.set()
        self.log.info("socket_closed", outcome=outcome if isinstance(outcome, str) else "resume")

    # -- resume ------------------------------------------------------------------

    async def check_resume(self, last_seq: int) -> str | None:
        """Why `last_seq` cannot be resumed from, or None."""
        logged = self.delivery.logged_seq
        bounds = await self.delivery.log.bounds()
        oldest = bounds[0] if bounds else logged + 1
        return resume_problem(last_seq, oldest, logged)

    def push_resumed(self, last_seq: int, replayed: int) -> None:
        self.delivery.send_first(
            {
                "type": ev.SESSION_RESUMED,
                "session": self.session.describe(),
                "last_seq": last_seq,
                "replayed": replayed,
                "client_events": self.session.client_events,
            }
        )
        self.log.info("session_resumed", last_seq=last_seq, replayed=replayed)

    def going_away(self, reason: str, retry_after_ms: int) -> None:
        self.delivery.enqueue(
            {"type": ev.SESSION_GOING_AWAY, "reason": reason, "retry_after_ms": retry_after_ms}
        )

    # -- DeliveryOwner: what delivery asks for -------------------------------------

    def fall_behind(self, why: str) -> None:
        paused = self.session.pause()
        self.pump()
        if paused:
            metrics.PAUSES.inc(len(paused))
            self.delivery.paused = True
            self.log.info(
                "generation_paused", reason=why, response_ids=paused, buffered=self.buffered_amount
            )

    def caught_up(self) -> None:
        resumed = self.session.resume()
        self.log.info("generation_resumed", response_ids=resumed)
        self.pump()

    def slow_client(self) -> None:
        self.log.warning("slow_client_closed", buffered=self.buffered_amount)
        self.session.close()
        self.pump()

    def log_state(self, events: list[dict[str, Any]]) -> LogState:
        structural = any(e["type"] not in _NO_SNAPSHOT for e in events)
        return LogState(
            self.session.snapshot() if structural else None,
            self.session.progress(),
            self.session.client_events,
        )

    async def lost_ownership(self) -> None:
        """Another instance took this session over: stop, silently."""
        self.log.warning("session_taken_over_elsewhere")
        self.state = RuntimeState.HANDED_OVER
        self.delivery.stopped = True
        self.cancel_timers()
        metrics.ACTIVE_RESPONSES.dec(len(self.session.active_responses))  # they end elsewhere
        self.session.abandon()
        self.pump()
        if self.on_moved is not None:
            self.on_moved(self)
        await self.delivery.close_socket(CLOSE_SERVICE_RESTART, "session moved")
        self.detached.set()

    # -- the session's actions -----------------------------------------------------

    def pump(self) -> None:
        """Carry out what the session asked for, then deliver its events."""
        for action in self.session.actions_to_perform():
            if isinstance(action, StartGeneration):
                rid = action.request.request_id
                self.tasks[rid] = asyncio.create_task(self._generate(action))
            elif isinstance(action, AbortGeneration):
                # Kept in `tasks` until its cancellation has run (the engine's
                # abort with it): wait_generations waits for that.
                task = self.tasks.get(action.request_id)
                if task is not None and not task.cancelling():
                    task.cancel()
                    started = time.perf_counter() if action.cancel else None
                    task.add_done_callback(
                        functools.partial(self._aborted, action.request_id, started)
                    )
            elif isinstance(action, StartTimer):
                old = self._timers.pop(action.response_id, None)
                if old is not None:
                    old.cancel()
                self._timers[action.response_id] = asyncio.get_running_loop().call_later(
                    action.delay_s, self._timeout, action.response_id, action.token
                )
            elif isinstance(action, CancelTimer):
                timer = self._timers.pop(action.response_id, None)
                if timer is not None:
                    timer.cancel()
        events = self.session.events_to_send()
        if events:
            for event in events:
                if event["type"] is not _DELTA:  # per token: no call for a delta
                    self._telemetry.observe(event)
            self.delivery.send(events)

    def _aborted(self, request_id: str, started: float | None, _: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never ran its own cleanup.
        self.tasks.pop(request_id, None)
        if started is not None:  # a client's cancel: steers, pauses and closes are not
            metrics.CANCEL_LATENCY.observe(time.perf_counter() - started)

    def _timeout(self, response_id: str, token: int) -> None:
        self._timers.pop(response_id, None)
        self.session.receive_timeout(response_id, token)
        self.pump()

    def _source(self, response_id: str) -> Source:
        """The engine's generate, wrapped by the stages."""
        source: Source = self.engine.generate
        if self.stages:
            context = StageContext(self.key_id or "anonymous", self.session.id, response_id)
            for stage in self.stages:
                source = functools.partial(stage.stream, context=context, source=source)
        return source

    async def _generate(self, action: StartGeneration) -> None:
        rid = action.request.request_id
        receive, pump, clock = self.session.receive_engine_output, self.pump, time.perf_counter
        # Between text deltas: the histogram takes them in batches. An array:
        # 8 bytes a gap, where a list holds a float object each.
        gaps = array("d")
        last = 0.0
        try:
            stream = self._source(action.response_id)(action.request)
            # Closed however the loop ends: a stage's close closes what it wraps.
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    if delta.text:
                        now = clock()
                        if last:
                            gaps.append(now - last)
                            if len(gaps) >= GAP_BATCH:
                                observe_gaps(gaps)
                        last = now
                    receive(rid, delta)
                    pump()
            # A stream that ends without a finish reason still ends the response.
            self.session.receive_engine_output(rid, EngineDelta("", 0, "abort"))
        except EngineError as exc:
            self.session.receive_engine_error(rid, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.exception("engine_failure", request_id=rid)
            self.session.receive_engine_error(
                rid, EngineError(f"the engine failed: {type(exc).__name__}")
            )
        finally:
            self.tasks.pop(rid, None)
            observe_gaps(gaps)
        self.pump()

    async def wait_generations(self) -> None:
        """Let the engine aborts just ordered run before going on (up to 5 s)."""
        pending = list(self.tasks.values())
        if pending:
            await asyncio.wait(pending, timeout=5)

    def cancel_timers(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def end(self) -> None:
        """Stop everything the session owns and free it."""
        if self.state in GONE:
            return
        self.state = RuntimeState.ENDED
        self.cancel_timers()
        if self.expiry is not None:
            self.expiry.cancel()
        self.session.close()
        self.pump()
        await self.wait_generations()
        await self.delivery.stop()
        # Still attached (a drain without Redis): nothing serves its frames now.
        self.delivery.close_soon(CloseCode.GOING_AWAY, "")
        self.detached.set()
        self.log.info("session_closed")


def _restore(
    restored: tuple[dict[str, Any], list[Any]], kwargs: dict[str, Any]
) -> tuple[Session, int]:
    """The session a durable log describes: its snapshot, then the entries
    (storage.redis.Entry) logged after it."""
    state, entries = restored
    session = Session.restore(state["session"], **kwargs)
    logged_seq = state["seq"]
    try:
        for entry in entries:
            session.replay_delta(entry.decoded)
            if entry.progress:
                session.restore_progress(entry.progress)
            if entry.client_events is not None:
                session.client_events = entry.client_events
            logged_seq = entry.seq
    except Exception:
        session.lifecycle.abandon()  # the key's response slots the restore held
        raise
    return session, logged_seq


async def until_detached(rt: SessionRuntime) -> None:
    """Wait until `rt.detached` is set and still set as this task runs on (a
    forwarded frame queued between the set and now clears it again, and a
    resume must count that frame too), or until the session is attached or
    gone: the caller then refuses."""
    while True:
        await rt.detached.wait()
        if rt.detached.is_set() or rt.state is RuntimeState.ATTACHED or rt.state in GONE:
            return


def _take(
    session: Session, obj: Any, *, off_loop: bool, received_at: float | None = None
) -> TokenizeOffLoop | None:
    """Hand a client event to the session (`received_at`: again, when it came);
    its preflight may (`off_loop`) ask for its prompt's tokens instead of
    making them on the loop."""
    asked = asking_off_loop(
        lambda: session.receive_client_event(obj, checked=True, again=received_at),
        off_loop,
    )
    return asked if isinstance(asked, TokenizeOffLoop) else None


async def _tokenized_then_taken(rt: SessionRuntime, obj: Any, off: TokenizeOffLoop) -> None:
    """A client event whose preflight asked for its prompt's tokens: they are
    made in a thread (the loop serves everyone meanwhile), then the event is
    taken again and finds them. A steer's prompt grows with each token the
    response makes meanwhile: after a few tries its preflight tokenizes on
    the loop. A session gone meanwhile never took the event (nor counted it).
    A tokenizer that fails in the thread is tried on the loop: the event is
    then taken, or fails, as one with a short prompt would."""
    received_at = rt.session.clock()  # the wait for the tokens is the client's too
    for tries_left in (2, 1, 0):
        try:
            off.remember(await asyncio.to_thread(off.tokenize, off.text))
        except Exception:
            tries_left = 0
        if rt.state in GONE:
            return
        asked = _take(rt.session, obj, off_loop=tries_left > 0, received_at=received_at)
        if asked is None:
            break
        off = asked
    rt.pump()
