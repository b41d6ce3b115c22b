"""The asyncio layer: one session's runtime and the socket it is attached to.

It owns the socket, the tasks and the timers; the `Session` decides and the
`Outbox` numbers and merges. Backpressure works like the browser's
bufferedAmount: `buffered_amount` is the socket's write buffer plus the
outbox. Above the high-water mark deltas are merged; above the hard cap (or
when the writer has been blocked for `stall_s`) the session's generations
pause, freeing their engine slots, and the server stops reading from the
client; once the outbox drains they resume. A client blocked for
`slow_client_timeout_s` is closed with 4008.

A runtime outlives a dropped socket: detached, its generations go on (and
pause at the hard cap, like for a client that reads nothing) until a new
socket resumes it with `session.resume`, or the grace period ends. Every
event written is kept in a byte-bounded ring, so a resume replays exactly
what came after the client's `last_seq`, then continues with what was
never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

from . import metrics
from .config import ServerConfig
from .engines.base import Engine, EngineDelta, EngineError
from .limits import KeyUsage
from .logs import get_logger
from .outbox import Outbox
from .protocol import (
    CLOSE_IDLE,
    CLOSE_SLOW_CLIENT,
    Codec,
    ErrorCode,
    ProtocolError,
    SessionResume,
    decode_frame,
    parse_client_event,
)
from .session import AbortGeneration, Session, SessionLimits, StartGeneration, StartTimer

log = get_logger("tokenwire.transport")


@dataclass(frozen=True, slots=True)
class Handoff:
    """The socket's first event resumed another session: serve that one on it."""

    target: Connection
    last_seq: int


# What serve() ends with: the client closed cleanly, the socket was lost, or
# the socket goes to the session it resumed.
Outcome = Literal["ended", "lost"] | Handoff


class Connection:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        usage: KeyUsage | None = None,
        find_session: Callable[[str, str | None], Connection | None] | None = None,
        subprotocol: str | None = None,
    ) -> None:
        self.ws: ServerConnection | None = None
        self.engine = engine
        self.config = config
        self.usage = usage
        self._find_session = find_session
        self.codec = Codec(subprotocol)
        self.session = Session(
            limits=SessionLimits(
                max_active_responses=config.max_active_responses,
                default_max_output_tokens=config.default_max_output_tokens,
                tool_timeout_s=config.tool_timeout_s,
                max_conversation_bytes=config.max_conversation_bytes,
                max_events_per_s=config.max_events_per_s,
            ),
            info={
                "engine": engine.name,
                "subprotocol": self.codec.subprotocol,
                "max_message_bytes": config.max_message_bytes,
                # Applies when max_output_tokens is null.
                "default_max_output_tokens": config.default_max_output_tokens,
            },
            check_request=engine.check,
            quota=usage,
        )
        self.outbox = Outbox()
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
        # "new" | "attached" | "detached" | "ended"
        self.state = "new"
        self.detached = asyncio.Event()  # set while no socket is attached
        self.detached.set()
        self.expiry: asyncio.TimerHandle | None = None  # end of the resume grace period
        # (seq, frame) of events written to sockets, for replay on resume;
        # bounded in bytes. Frames, not dicts: a third of the memory.
        self.sent: deque[tuple[int, str | bytes]] = deque()
        self._sent_bytes = 0
        self._first_frame = True
        self._handoff: Handoff | None = None
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
        writer: asyncio.Task[None] | None = None
        outcome: Outcome = "lost"
        try:
            # Whatever happens from here on (the socket may drop mid-replay),
            # the finally clause detaches, so a later resume never waits forever.
            if resume_from is not None:
                self._first_frame = False  # a resumed socket resumes nothing else
                await self._replay(resume_from)
            writer = asyncio.create_task(self._write_loop())
            # Events may have queued up while no socket was attached.
            self._wakeup.set()
            self._last_frame = loop.time()
            self._idle_timer = loop.call_later(self.config.idle_timeout_s, self._check_idle)
            self._pump()
            async for frame in ws:
                self._last_frame = loop.time()
                self._receive(frame)
                if self._handoff is not None:
                    outcome = self._handoff
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
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            self._detach()
        if self.closed_for is not None:
            outcome = "ended"  # we closed it (slow or idle): nothing to resume
        self.log.info("socket_closed", outcome=outcome if isinstance(outcome, str) else "resume")
        return outcome

    def _attach(self, ws: ServerConnection) -> None:
        self.ws = ws
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
        if self.state == "ended":
            return
        self.state = "ended"
        self._cancel_timers()
        if self.expiry is not None:
            self.expiry.cancel()
        self.session.close()
        self._pump()
        pending = list(self.tasks.values())
        if pending:
            # Let the engine aborts run before the session is gone.
            await asyncio.wait(pending, timeout=5)
        self.outbox.clear()
        self.sent.clear()
        self.detached.set()
        self.log.info("session_closed")

    def can_resume(self, last_seq: int) -> str | None:
        """Why `last_seq` cannot be resumed from, or None."""
        last_sent = self.sent[-1][0] if self.sent else self.outbox.next_seq - 1
        if last_seq > last_sent:
            return f"last_seq {last_seq} is past the last event sent ({last_sent})"
        oldest = self.sent[0][0] if self.sent else last_sent + 1
        if last_seq + 1 < oldest:
            return (
                f"events after {last_seq} are no longer kept (the oldest is {oldest}); "
                "start a new session"
            )
        return None

    async def _replay(self, last_seq: int) -> None:
        """Resend what came after last_seq, then announce the resume."""
        assert self.ws is not None
        replayed = 0
        for seq, frame in list(self.sent):
            if seq > last_seq:
                if isinstance(frame, bytes) != self.codec.binary:  # the subprotocol changed
                    frame = self.codec.encode(decode_frame(frame))
                await self.ws.send(frame)
                replayed += 1
        self.outbox.push_front(
            {
                "type": "session.resumed",
                "session": self.session.describe(),
                "last_seq": last_seq,
                "replayed": replayed,
            }
        )
        self.log.info("session_resumed", last_seq=last_seq, replayed=replayed)

    def _remember(self, seq: int, frame: str | bytes) -> None:
        self.sent.append((seq, frame))
        self._sent_bytes += len(frame)
        while self._sent_bytes > self.config.resume_log_bytes and len(self.sent) > 1:
            self._sent_bytes -= len(self.sent.popleft()[1])

    def _receive(self, frame: str | bytes) -> None:
        try:
            obj = decode_frame(frame)
        except ProtocolError as err:
            self.session.receive_protocol_error(err)
        else:
            first, self._first_frame = self._first_frame, False
            if first and isinstance(obj, dict) and obj.get("type") == "session.resume":
                self._resume_request(obj)
            else:
                self.session.receive_client_event(obj)
        self._pump()

    def _resume_request(self, obj: dict[str, Any]) -> None:
        """The first event asks to resume another session onto this socket."""
        try:
            event = parse_client_event(obj)
            assert isinstance(event, SessionResume)
            target = (
                self._find_session(event.session_id, self.key_id) if self._find_session else None
            )
            if target is None or target is self:
                raise ProtocolError(
                    ErrorCode.SESSION_NOT_FOUND,
                    f"no session {event.session_id!r} to resume (unknown, or its grace period "
                    "ended); start a new session",
                    event_id=event.event_id,
                    param="session_id",
                )
            problem = target.can_resume(event.last_seq)
            if problem is not None:
                raise ProtocolError(
                    ErrorCode.RESUME_NOT_POSSIBLE,
                    problem,
                    event_id=event.event_id,
                    param="last_seq",
                )
        except ProtocolError as err:
            self.session.receive_protocol_error(err)
            return
        self._handoff = Handoff(target, event.last_seq)

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
            self.outbox.extend(events)
            self._wakeup.set()
            buffered = self.buffered_amount
            if buffered > self.config.outbound_high_water:
                if self.state == "attached":
                    self._arm_clocks()
                if buffered > self.config.outbound_hard_cap:
                    self._fall_behind("hard_cap")

    # -- backpressure --------------------------------------------------------

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
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(CLOSE_SLOW_CLIENT, "client is not reading"), 1)
        if self.ws.transport is not None:
            self.ws.transport.abort()

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
        ws = self.ws
        assert ws is not None
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while True:
                    behind = self.buffered_amount > high_water
                    event = self.outbox.pop(merge=behind)
                    if event is None:
                        break
                    if behind:
                        self._arm_clocks()  # the send below may block on a slow reader
                    frame = self.codec.encode(event)
                    self._remember(event["seq"], frame)
                    await ws.send(frame)
                if (
                    self.paused
                    or self._stall_timer
                    or self._slow_timer
                    or not self._drained.is_set()
                ):
                    # The queue is empty, but the socket may still hold what
                    # the client has not read: wait until it has.
                    await self._wait_socket_below(high_water // 2)
                    if len(self.outbox):
                        self._wakeup.set()  # events queued meanwhile: send them first
                        continue
                    self._caught_up()
        except (ConnectionClosed, OSError):
            pass
        finally:
            # Never leave the reader waiting on a connection that is gone.
            self._drained.set()

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
