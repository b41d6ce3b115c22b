"""The asyncio layer: one session's runtime and the socket it is attached to.

It owns the socket, the tasks and the timers; the `Session` decides and the
`Outbox` numbers and merges. Backpressure works like the browser's
bufferedAmount: `buffered_amount` is the socket's write buffer plus the
outbox. Above the high-water mark deltas are merged; above the hard cap (or
when the writer has been blocked for `stall_s`) the session's generations
pause, freeing their engine slots, and the server stops reading from the
client; once the outbox drains they resume. A client blocked for
`slow_client_timeout_s` is closed with 4008. While the client keeps up (its
socket buffer empty, nothing queued) and there is no log to write first,
events skip the outbox and the writer task: they are framed and written by
the task that produced them, one write per batch.

A runtime outlives a dropped socket: detached, its generations go on (and
pause at the hard cap, like for a client that reads nothing) until a new
socket resumes it with `session.resume`, or the grace period ends. Every
event written is kept in a byte-bounded ring, so a resume replays exactly
what came after the client's `last_seq`, then continues with what was
never sent.

With Redis (`redisstore`) every event is logged there before it reaches the
socket, a detached session keeps logging, and the session can be resumed,
followed or taken over by another instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from redis.exceptions import RedisError
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedError
from websockets.protocol import State

from . import metrics
from .config import ServerConfig
from .engines.base import Engine, EngineDelta, EngineError
from .eventlog import MemoryLog, resume_problem
from .limits import KeyUsage
from .logs import get_logger
from .outbox import DELTA, Outbox
from .protocol import (
    CLOSE_IDLE,
    CLOSE_SERVICE_RESTART,
    CLOSE_SLOW_CLIENT,
    Codec,
    ErrorCode,
    ProtocolError,
    SessionResume,
    decode_frame,
    parse_client_event,
)
from .redisstore import Fenced, RedisStore, pack, unpack
from .session import AbortGeneration, Session, SessionLimits, StartGeneration, StartTimer

log = get_logger("tokenwire.transport")


# Events that change no state a takeover needs: no snapshot for them.
_NO_SNAPSHOT = frozenset(
    {
        DELTA,
        "response.function_call_arguments.delta",
        "error",
        "session.resumed",
        "session.going_away",
    }
)


class Runtime(Protocol):
    """What a resumed socket is served by: a local session, or a follower
    of a session another instance owns."""

    async def serve(self, ws: ServerConnection, resume_from: int | None = None) -> Outcome: ...


@dataclass(frozen=True, slots=True)
class Handoff:
    """The socket's first event resumed another session: serve that one on it."""

    target: Runtime
    last_seq: int


# What serve() ends with: the client closed cleanly, the socket was lost, or
# the socket goes to the session it resumed.
Outcome = Literal["ended", "lost"] | Handoff


async def close_or_abort(ws: ServerConnection, code: int, reason: str) -> None:
    """Close with a code the client can act on; drop the socket if the client
    does not answer within a second (often one that stopped reading)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code, reason), 1)
    if ws.transport is not None:
        ws.transport.abort()


# Finds what serves a `session.resume` for a key, or raises ProtocolError.
FindSession = Callable[[SessionResume, str | None, "Connection"], Awaitable[Runtime]]


class Connection:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        usage: KeyUsage | None = None,
        find_session: FindSession | None = None,
        subprotocol: str | None = None,
        store: RedisStore | None = None,
        restored: tuple[dict[str, Any], list[Any]] | None = None,
    ) -> None:
        self.ws: ServerConnection | None = None
        self.engine = engine
        self.config = config
        self.usage = usage
        self.store = store
        self._find_session = find_session
        self.codec = Codec(subprotocol)
        kwargs: dict[str, Any] = {
            "limits": SessionLimits(
                max_active_responses=config.max_active_responses,
                default_max_output_tokens=config.default_max_output_tokens,
                tool_timeout_s=config.tool_timeout_s,
                max_conversation_bytes=config.max_conversation_bytes,
                max_events_per_s=config.max_events_per_s,
            ),
            "info": {
                "engine": engine.name,
                "subprotocol": self.codec.subprotocol,
                "max_message_bytes": config.max_message_bytes,
                # Applies when max_output_tokens is null.
                "default_max_output_tokens": config.default_max_output_tokens,
            },
            "check_request": engine.check,
            "quota": usage,
        }
        # The last seq logged, and the last one the attached socket was sent.
        self._logged_seq = 0
        self._sent_seq = 0
        if restored is None:
            self.session = Session(**kwargs)
        else:
            state, entries = restored
            self.session = Session.restore(state["session"], **kwargs)
            self._logged_seq = state["seq"]
            for entry in entries:  # what happened after the snapshot
                self.session.replay_delta(unpack(entry.event))
                if entry.progress:
                    self.session.restore_progress(entry.progress)
                if entry.client_events is not None:
                    self.session.client_events = entry.client_events
                self._logged_seq = entry.seq
        self.outbox = Outbox(first_seq=self._logged_seq + 1)
        # Events written to sockets, for replay on resume (without Redis).
        self.ring = MemoryLog(config.resume_log_bytes)
        self._live = False  # the attached socket is past its replay
        self._writer: asyncio.Task[None] | None = None
        self._log_lock = asyncio.Lock()  # one batch at a time, in seq order
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()  # set while below the hard cap
        self._drained.set()
        self._timers: dict[str, asyncio.TimerHandle] = {}  # tool timeouts, by response id
        self._stall_timer: asyncio.TimerHandle | None = None
        self._slow_timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.closed_for: str | None = None
        self._last_delta: dict[str, float] = {}  # response id -> time, for inter-token latency
        self._last_frame = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._closer: asyncio.Task[None] | None = None
        self._resuming: asyncio.Task[None] | None = None
        # The follower serving this session's client from another instance.
        self.follower: str | None = None
        # "new" | "attached" | "detached" | "remote" (followed from another
        # instance) | "ended" | "handed_over" (another instance continues it)
        self.state = "new" if restored is None else "detached"
        self.detached = asyncio.Event()  # set while no socket is attached
        self.detached.set()
        self.expiry: asyncio.TimerHandle | None = None  # end of the resume grace period
        self._first_frame = True
        self.on_moved: Callable[[Connection], None] | None = None  # set by the server
        self.log = log.bind(session_id=self.session.id, key_id=usage.key_id if usage else None)

    @property
    def key_id(self) -> str | None:
        return self.usage.key_id if self.usage else None

    @property
    def buffered_amount(self) -> int:
        """Bytes waiting for the client: the socket's write buffer plus our queue."""
        transport = self.ws.transport if self.ws is not None and self.state == "attached" else None
        sent = transport.get_write_buffer_size() if transport is not None else 0
        return sent + self.outbox.pending_bytes

    async def serve(self, ws: ServerConnection, resume_from: int | None = None) -> Outcome:
        """Run the session on this socket until it closes or hands the socket on."""
        self._attach(ws)
        loop = asyncio.get_running_loop()
        outcome: Outcome = "lost"
        try:
            # Whatever happens from here on (the socket may drop mid-replay),
            # the finally clause detaches, so a later resume never waits forever.
            if resume_from is not None:
                self._first_frame = False  # a resumed socket resumes nothing else
                await self._replay(resume_from)
            else:
                self._sent_seq = self._logged_seq
                self._live = True
            self._start_writer()
            # Events may have queued up while no socket was attached.
            self._wakeup.set()
            self._last_frame = loop.time()
            self._idle_timer = loop.call_later(self.config.idle_timeout_s, self._check_idle)
            self._pump()
            async for frame in ws:
                self._last_frame = loop.time()
                resume = self._receive(frame)
                if resume is not None:
                    target = await self._resolve(resume)
                    if target is not None:
                        outcome = Handoff(target, resume.last_seq)
                        break
                if not self._drained.is_set():
                    # Upstream backpressure: read nothing more until the client
                    # reads what it asked for (TCP then slows the sender).
                    await self._unless_closed(self._drained.wait())
            else:
                outcome = "ended"  # the client closed the connection itself
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code in (1000, 1001):
                outcome = "ended"
        finally:
            self._live = False
            if self.store is None:
                # Without Redis nothing is written while detached: events wait
                # in the outbox (and pause generation at the hard cap).
                await self._stop_writer()
            self._detach()
        if self.closed_for is not None:
            outcome = "ended"  # we closed it (slow or idle): nothing to resume
        self.log.info("socket_closed", outcome=outcome if isinstance(outcome, str) else "resume")
        return outcome

    def _start_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_loop())

    def _attach(self, ws: ServerConnection) -> None:
        self.ws = ws
        self.follower = None  # the client is here now: a follower's late ops are stale
        self.codec = Codec(ws.subprotocol)
        self.session.update_info(subprotocol=self.codec.subprotocol)
        self.state = "attached"
        self.detached.clear()
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        if self.config.sndbuf and ws.transport is not None:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.sndbuf)
        self.log.info(
            "socket_attached", subprotocol=self.codec.subprotocol, remote=str(ws.remote_address)
        )

    def _detach(self) -> None:
        for timer in (self._stall_timer, self._slow_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._slow_timer = self._idle_timer = None
        if self.state == "attached":
            self.state = "detached"
        self.detached.set()

    async def end(self) -> None:
        """Stop everything the session owns and free it."""
        if self.state in ("ended", "handed_over"):
            return
        self.state = "ended"
        self._cancel_timers()
        if self.expiry is not None:
            self.expiry.cancel()
        self.session.close()
        self._pump()
        await self._wait_generations()
        await self._stop_writer()
        self.outbox.clear()
        self.ring.clear()
        self.detached.set()
        self.log.info("session_closed")

    async def _wait_generations(self) -> None:
        """Let the engine aborts just ordered run before going on."""
        pending = list(self.tasks.values())
        if pending:
            await asyncio.wait(pending, timeout=5)

    async def _stop_writer(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None

    async def check_resume(self, last_seq: int) -> str | None:
        """Why `last_seq` cannot be resumed from, or None."""
        if self.store is None:
            return self.ring.check(last_seq, self._logged_seq)
        bounds = await self.store.bounds(self.session.id)
        oldest = bounds[0] if bounds else self._logged_seq + 1
        return resume_problem(last_seq, oldest, self._logged_seq)

    async def _replay(self, last_seq: int) -> None:
        """Resend what came after last_seq, then announce the resume and go live."""
        assert self.ws is not None
        self._sent_seq = last_seq
        replayed = 0
        # The writer may log more meanwhile (with Redis it logs while detached):
        # read until caught up with it, then go live with no await in between.
        while self._sent_seq < self._logged_seq:
            frames = await self.logged_after(self._sent_seq)
            if not frames:
                break
            for seq, frame in frames:
                if seq <= self._sent_seq:
                    continue
                await self.ws.send(frame)
                self._sent_seq = seq
                replayed += 1
        self._live = True
        self.push_resumed(last_seq, replayed)

    def push_resumed(self, last_seq: int, replayed: int) -> None:
        self.outbox.push_front(
            {
                "type": "session.resumed",
                "session": self.session.describe(),
                "last_seq": last_seq,
                "replayed": replayed,
                "client_events": self.session.client_events,
            }
        )
        self._wakeup.set()
        self.log.info("session_resumed", last_seq=last_seq, replayed=replayed)

    async def logged_after(self, seq: int) -> list[tuple[int, str | bytes]]:
        """Logged frames after `seq`, encoded for the attached socket."""
        if self.store is not None:
            logged = [(e.seq, e.event) for e in await self.store.read(self.session.id, seq)]
        else:
            logged = self.ring.after(seq)
        return [(s, self._for_socket(f)) for s, f in logged]

    def _for_socket(self, frame: str | bytes) -> str | bytes:
        """A logged frame (JSON text or msgpack bytes) in the socket's subprotocol."""
        if isinstance(frame, bytes) == self.codec.binary:
            return frame
        return self.codec.encode(decode_frame(frame))

    def _receive(self, frame: str | bytes) -> SessionResume | None:
        """Take a client frame; returns a resume request made by the first one."""
        try:
            obj = decode_frame(frame)
        except ProtocolError as err:
            self.session.receive_protocol_error(err)
        else:
            first, self._first_frame = self._first_frame, False
            if first and isinstance(obj, dict) and obj.get("type") == "session.resume":
                try:
                    event = parse_client_event(obj)
                    assert isinstance(event, SessionResume)
                    return event
                except ProtocolError as err:
                    self.session.receive_protocol_error(err, frame=False)
            else:
                self.session.receive_client_event(obj)
        self._pump()
        return None

    async def _resolve(self, event: SessionResume) -> Runtime | None:
        """What serves the session this socket asks to resume; errors go out here."""
        try:
            if self._find_session is None:
                raise ProtocolError(
                    ErrorCode.SESSION_NOT_FOUND, "resume is off", event_id=event.event_id
                )
            return await self._find_session(event, self.key_id, self)
        except ProtocolError as err:
            self.session.receive_protocol_error(err, frame=False)
            self._pump()
            return None

    # -- another instance follows this session, or takes it over ---------------

    def receive_forwarded(self, op: str, data: Any, follower: str) -> None:
        """An op from the instance whose client follows this session."""
        if op == "attach":
            old_socket = self.state == "attached" and self.ws is not None and self.ws.transport
            self.follower = follower
            self.state = "remote"
            self._first_frame = False  # the follower's socket resumed already
            if old_socket:
                assert self.ws is not None
                self.ws.transport.abort()  # the client has moved on from that socket
                # Frames that socket already received are still taken; count
                # them in session.resumed's client_events, so none is resent.
                if self._resuming is not None:
                    self._resuming.cancel()
                self._resuming = asyncio.get_running_loop().create_task(
                    self._resumed_after_detach(data["last_seq"])
                )
            else:
                self._resumed_remotely(data["last_seq"])
        elif op == "frame" and self.state == "remote":
            self._receive(data)
        elif op == "detach" and self.state == "remote":
            self.state = "detached"

    async def _resumed_after_detach(self, last_seq: int) -> None:
        await self.detached.wait()
        if self.state == "remote":
            self._resumed_remotely(last_seq)

    def _resumed_remotely(self, last_seq: int) -> None:
        """The follower replays the log itself: all after last_seq counts."""
        self.push_resumed(last_seq, max(self._logged_seq - last_seq, 0))

    def continue_restored(self) -> None:
        """A taken-over session: continue its generations (logged while no
        socket is attached) and re-arm its tool timeouts."""
        self.session.resume()
        self._pump()
        self._start_writer()

    def going_away(self, reason: str, retry_after_ms: int) -> None:
        self.outbox.push(
            {"type": "session.going_away", "reason": reason, "retry_after_ms": retry_after_ms}
        )
        self._wakeup.set()

    async def hand_over(self) -> None:
        """Drain: stop the generations here and leave the session, snapshot
        and log complete in Redis, for another instance to continue."""
        assert self.store is not None
        if self.state in ("ended", "handed_over"):
            return
        self._cancel_timers()
        self.session.suspend()
        self._pump()
        await self._wait_generations()
        await self._stop_writer()
        async with self._log_lock:
            try:
                batch = await self._log_batch(merge=False)
                await self.store.append(
                    self.session.id, [], None, (self._logged_seq, self.session.snapshot())
                )
            except Fenced:
                batch = []
        with contextlib.suppress(Exception):
            for seq, event, _ in batch:
                if self._live and self.ws is not None and seq > self._sent_seq:
                    self._sent_seq = seq
                    await self.ws.send(self.codec.encode(event))
        if self._live and self.ws is not None:
            # Let the socket take the last frames before the close.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._wait_socket_below(0), 1)
        self.state = "handed_over"
        await self._close_socket(CLOSE_SERVICE_RESTART, "draining; resume the session")
        self.detached.set()
        self.log.info("session_handed_over", last_seq=self._logged_seq)

    def _pump(self) -> None:
        """Carry out what the session asked for, then queue its events."""
        for action in self.session.actions_to_perform():
            if isinstance(action, StartGeneration):
                rid = action.request.request_id
                self.tasks[rid] = asyncio.create_task(self._generate(action))
            elif isinstance(action, AbortGeneration):
                task = self.tasks.pop(action.request_id, None)
                if task is not None:
                    task.cancel()
                    started = time.perf_counter()
                    task.add_done_callback(
                        lambda _, t0=started: metrics.CANCEL_LATENCY.observe(
                            time.perf_counter() - t0
                        )
                    )
            elif isinstance(action, StartTimer):
                old = self._timers.pop(action.response_id, None)
                if old is not None:
                    old.cancel()
                self._timers[action.response_id] = asyncio.get_running_loop().call_later(
                    action.delay_s, self._timeout, action.response_id, action.token
                )
        events = self.session.events_to_send()
        if events:
            for event in events:
                self._log_event(event)
            ws = self._writable_now()
            if ws is not None:
                self._write_now(ws, events)
            else:
                self.outbox.extend(events)
                self._wakeup.set()
            buffered = self.buffered_amount
            if buffered > self.config.outbound_high_water:
                # Only the writer task sees the client catch up and stops the
                # clocks; a direct write did not wake it.
                self._wakeup.set()
                if self.state == "attached":
                    self._arm_clocks()
                if buffered > self.config.outbound_hard_cap:
                    self._fall_behind("hard_cap")

    def _writable_now(self) -> ServerConnection | None:
        """The socket, when events may skip the queue and the writer task: no
        log to write first (Redis), nothing queued ahead, and a client that
        keeps up (the socket's buffer is empty)."""
        ws = self.ws
        if (
            ws is None
            or not self._live
            or self.store is not None
            or len(self.outbox)
            or self._behind()
            or ws.protocol.state is not State.OPEN
            or ws.transport is None
            or ws.transport.is_closing()
            or ws.transport.get_write_buffer_size()
        ):
            return None
        return ws

    def _write_now(self, ws: ServerConnection, events: list[dict[str, Any]]) -> None:
        """Frame and write `events` in one go, without a task switch per event.

        What `ws.send` does for one frame, minus its wait for the buffer to
        drain (the buffer is empty, and the caller checks buffered_amount).
        Order holds because `ws.send` too writes its frame before it first
        awaits, and we never send fragmented messages."""
        protocol = ws.protocol
        for event in events:
            self.outbox.number(event)
            frame = self._ring_frame(event)
            self._sent_seq = event["seq"]
            if isinstance(frame, bytes):
                protocol.send_binary(frame)
            else:
                protocol.send_text(frame.encode())
        ws.transport.writelines(protocol.data_to_send())

    # -- backpressure --------------------------------------------------------

    def _behind(self) -> bool:
        """The client fell behind and has not been seen to catch up (the
        writer task's `_caught_up` ends this)."""
        return (
            self.paused
            or self._stall_timer is not None
            or self._slow_timer is not None
            or not self._drained.is_set()
        )

    def _arm_clocks(self) -> None:
        """The client is behind: from now on it has stall_s, then slow_client_timeout_s."""
        if self._stall_timer is None and self._slow_timer is None:
            loop = asyncio.get_running_loop()
            self._stall_timer = loop.call_later(self.config.stall_s, self._on_stall)
            self._slow_timer = loop.call_later(
                self.config.slow_client_timeout_s, self._on_slow_client
            )

    def _fall_behind(self, why: str) -> None:
        if self._drained.is_set():  # newly behind: compact once, not on every event
            self._drained.clear()
            self.outbox.compact()
        # Every time, though: a frame read just before the pause may have
        # started a generation.
        paused = self.session.pause()
        self._pump()
        if paused:
            metrics.PAUSES.inc()
            self.paused = True
            self.log.info(
                "generation_paused", reason=why, response_ids=paused, buffered=self.buffered_amount
            )

    def _on_stall(self) -> None:
        self._stall_timer = None
        self._fall_behind("stall")

    def _on_slow_client(self) -> None:
        self._slow_timer = None
        self.log.warning("slow_client_closed", buffered=self.buffered_amount)
        # Free what it holds now; the close frame may never be read.
        self.outbox.clear()
        self.session.close()
        self._pump()
        self._closer = asyncio.get_running_loop().create_task(self._close_slow())

    async def _close_slow(self) -> None:
        self.closed_for = "slow_client"
        await self._close_socket(CLOSE_SLOW_CLIENT, "client is not reading")

    def _caught_up(self) -> None:
        """The writer emptied the queue and the socket accepted it all."""
        for timer in (self._stall_timer, self._slow_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._slow_timer = None
        self._drained.set()
        if self.paused:
            self.paused = False
            resumed = self.session.resume()
            self.log.info("generation_resumed", response_ids=resumed)
            self._pump()

    async def _wait_socket_below(self, low: int) -> None:
        """Wait, without polling, until the socket's write buffer is at most `low`."""
        transport = self.ws.transport
        if transport is None or transport.get_write_buffer_size() <= low:
            return
        # Lowering the transport's limits pauses the protocol now and resumes
        # it once the buffer falls to `low`; websockets' drain() waits for that.
        limits = transport.get_write_buffer_limits()  # (low, high)
        transport.set_write_buffer_limits(high=low, low=low)
        try:
            await self._unless_closed(self.ws.drain())
        finally:
            if not transport.is_closing():
                transport.set_write_buffer_limits(high=limits[1], low=limits[0])

    async def _unless_closed(self, awaitable: Any) -> None:
        """Await `awaitable`, but stop waiting if the connection goes away."""
        waiter = asyncio.ensure_future(awaitable)
        closed = asyncio.ensure_future(self.ws.wait_closed())
        try:
            await asyncio.wait({waiter, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            closed.cancel()
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            raise ConnectionClosedError(None, None) from waiter.exception()

    def _check_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle_for = loop.time() - self._last_frame
        limit = self.config.idle_timeout_s
        if self.session.active_responses or idle_for < limit:
            self._idle_timer = loop.call_later(max(limit - idle_for, 1.0), self._check_idle)
            return
        self._idle_timer = None
        self.closed_for = "idle"
        self.log.info("idle_closed", idle_s=round(idle_for, 1))
        self._closer = loop.create_task(self.ws.close(CLOSE_IDLE, "idle timeout"))

    def _cancel_timers(self) -> None:
        for timer in (
            self._stall_timer,
            self._slow_timer,
            self._idle_timer,
            *self._timers.values(),
        ):
            if timer is not None:
                timer.cancel()
        self._timers.clear()

    async def _write_loop(self) -> None:
        high_water = self.config.outbound_high_water
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                try:
                    await self._write_queued()
                    ws = self.ws if self._live else None
                    if ws is None:
                        if self.store is not None and (self.paused or not self._drained.is_set()):
                            self._caught_up()  # the log took it all: generate on
                        continue
                    if self._behind():
                        # The queue is empty, but the socket may still hold what
                        # the client has not read: wait until it has.
                        await self._wait_socket_below(high_water // 2)
                        if len(self.outbox):
                            self._wakeup.set()  # events queued meanwhile: send them first
                            continue
                        self._caught_up()
                except (ConnectionClosed, OSError):
                    self._live = False
                    self._drained.set()  # never leave the reader waiting on a dead socket
                    if self.store is None:
                        return
                    self._wakeup.set()  # keep logging what is queued
        except Fenced:
            self.log.warning("session_taken_over_elsewhere")
            await self._lost_ownership()
        finally:
            self._drained.set()

    async def _write_queued(self) -> None:
        """Log what is queued, then send it to the socket if one is live."""
        high_water = self.config.outbound_high_water
        while True:
            ws = self.ws if self._live else None
            if ws is None and self.store is None:
                return  # without Redis, events wait in the outbox for a socket
            behind = ws is not None and self.buffered_amount > high_water
            if self.store is None:
                batch = self._ring_batch(behind)
            else:
                # Shielded: a batch once popped is always logged, even if the
                # writer is cancelled meanwhile (it then holds the lock until done).
                batch = await asyncio.shield(self._locked_log_batch(behind))
            if not batch:
                return
            if behind:
                self._arm_clocks()  # the send below may block on a slow reader
            for seq, event, frame in batch:
                ws = self.ws if self._live else None
                if ws is None or seq <= self._sent_seq:
                    continue  # no socket, or the replay sent it already
                self._sent_seq = seq
                if isinstance(frame, bytes) != self.codec.binary:  # the subprotocol changed
                    frame = self.codec.encode(event)
                await ws.send(frame)

    async def _locked_log_batch(self, merge: bool) -> list[tuple[int, dict[str, Any], str | bytes]]:
        async with self._log_lock:
            if self.state == "handed_over":
                return []
            return await self._log_batch(merge)

    def _ring_batch(self, merge: bool) -> list[tuple[int, dict[str, Any], str | bytes]]:
        """Without Redis: pop one event and keep its frame in the ring."""
        event = self.outbox.pop(merge=merge)
        if event is None:
            return []
        return [(event["seq"], event, self._ring_frame(event))]

    def _ring_frame(self, event: dict[str, Any]) -> str | bytes:
        """Encode a numbered event and keep its frame in the ring, for resume."""
        frame = self.codec.encode(event)
        self.ring.append(event["seq"], frame)
        self._logged_seq = event["seq"]
        return frame

    async def _log_batch(self, merge: bool) -> list[tuple[int, dict[str, Any], str | bytes]]:
        """With Redis: pop everything queued and log it, with a snapshot when
        the conversation's structure changed."""
        assert self.store is not None
        events = []
        while (event := self.outbox.pop(merge=merge)) is not None:
            events.append(event)
        if not events:
            return []
        # Taken before any await, so they match the events exactly.
        packed = [(e["seq"], pack(e)) for e in events]
        snapshot = None
        if any(e["type"] not in _NO_SNAPSHOT for e in events):
            snapshot = (events[-1]["seq"], self.session.snapshot())
        progress = self.session.progress()
        taken = self.session.client_events
        delay = 0.1
        while True:
            try:
                await self.store.append(self.session.id, packed, progress, snapshot, taken)
                break
            except RedisError as exc:
                # Nothing goes out unlogged; generation pauses at the hard cap meanwhile.
                self.log.warning("redis_append_failed", error=str(exc), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self._logged_seq = events[-1]["seq"]
        return [(seq, e, data) for (seq, data), e in zip(packed, events, strict=True)]

    async def _lost_ownership(self) -> None:
        """Another instance took this session over: stop, silently."""
        self.state = "handed_over"
        self._cancel_timers()
        self.session.abandon()
        self._pump()
        if self.on_moved is not None:
            self.on_moved(self)
        await self._close_socket(CLOSE_SERVICE_RESTART, "session moved")
        self.detached.set()

    async def _close_socket(self, code: int, reason: str) -> None:
        if self.ws is not None:
            await close_or_abort(self.ws, code, reason)

    # -- engine and timers ---------------------------------------------------

    def _timeout(self, response_id: str, token: int) -> None:
        self._timers.pop(response_id, None)
        self.session.receive_timeout(response_id, token)
        self._pump()

    async def _generate(self, action: StartGeneration) -> None:
        rid = action.request.request_id
        try:
            async for delta in self.engine.generate(action.request):
                self.session.receive_engine_output(rid, delta)
                self._pump()
            # A stream that ends without a finish reason still ends the response.
            self.session.receive_engine_output(rid, EngineDelta("", 0, "abort"))
        except EngineError as exc:
            self.session.receive_engine_error(rid, exc.code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.exception("engine_failure", request_id=rid)
            self.session.receive_engine_error(
                rid, ErrorCode.ENGINE_ERROR, f"the engine failed: {type(exc).__name__}"
            )
        finally:
            self.tasks.pop(rid, None)
        self._pump()

    def _log_event(self, event: dict[str, Any]) -> None:
        """Logs and metrics for the events that matter; deltas only feed a histogram."""
        kind = event["type"]
        if kind == "response.output_text.delta":
            now = time.perf_counter()
            last = self._last_delta.get(event["response_id"])
            if last is not None:
                metrics.INTER_TOKEN.observe(now - last)
            self._last_delta[event["response_id"]] = now
        elif kind == "response.done":
            r = event["response"]
            self._last_delta.pop(r["id"], None)
            metrics.ACTIVE_RESPONSES.dec()
            metrics.RESPONSES.labels(r["status"]).inc()
            if r.get("timings") and r["timings"]["ttft_ms"] is not None:
                metrics.TTFT.observe(r["timings"]["ttft_ms"] / 1000)
            fields: dict[str, Any] = {
                "response_id": r["id"],
                "status": r["status"],
                "usage": r.get("usage"),
                "timings": r.get("timings"),
            }
            if self.config.log_content:
                fields["text"] = "".join(i.get("content", "") for i in r["output"])
            self.log.info("response_done", **fields)
        elif kind == "response.created":
            metrics.ACTIVE_RESPONSES.inc()
            self.log.info("response_created", response_id=event["response"]["id"])
        elif kind == "error":
            metrics.ERRORS.labels(event["error"]["code"]).inc()
            self.log.info(
                "client_error", code=event["error"]["code"], event_id=event["error"].get("event_id")
            )
