"""The asyncio layer around one WebSocket connection.

It owns the socket, the tasks and the timers; the `Session` decides and the
`Outbox` numbers and merges. Backpressure works like the browser's
bufferedAmount: `buffered_amount` is the socket's write buffer plus the
outbox. Above the high-water mark deltas are merged; above the hard cap (or
when the writer has been blocked for `stall_s`) the session's generations
pause, freeing their engine slots, and the server stops reading from the
client; once the outbox drains they resume. A client blocked for
`slow_client_timeout_s` is closed with 4008.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

from . import metrics
from .config import ServerConfig
from .engines.base import Engine, EngineDelta, EngineError
from .limits import KeyUsage
from .logs import get_logger
from .outbox import Outbox
from .protocol import CLOSE_IDLE, CLOSE_SLOW_CLIENT, Codec, ErrorCode, ProtocolError, decode_frame
from .session import AbortGeneration, Session, SessionLimits, StartGeneration, StartTimer

log = get_logger("tokenwire.transport")


class Connection:
    def __init__(
        self,
        ws: ServerConnection,
        engine: Engine,
        config: ServerConfig,
        usage: KeyUsage | None = None,
    ) -> None:
        self.ws = ws
        self.engine = engine
        self.config = config
        self.codec = Codec(ws.subprotocol)
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
        self.log = log.bind(session_id=self.session.id, key_id=usage.key_id if usage else None)
        if config.sndbuf and ws.transport is not None:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.sndbuf)

    @property
    def buffered_amount(self) -> int:
        """Bytes waiting for the client: the socket's write buffer plus our queue."""
        transport = self.ws.transport
        sent = transport.get_write_buffer_size() if transport is not None else 0
        return sent + self.outbox.pending_bytes

    async def run(self) -> None:
        self.log.info(
            "session_open", subprotocol=self.codec.subprotocol, remote=str(self.ws.remote_address)
        )
        writer = asyncio.create_task(self._write_loop())
        loop = asyncio.get_running_loop()
        self._last_frame = loop.time()
        self._idle_timer = loop.call_later(self.config.idle_timeout_s, self._check_idle)
        self._pump()
        close_reason = "client_closed"
        try:
            async for frame in self.ws:
                self._last_frame = loop.time()
                self._receive(frame)
                if not self._drained.is_set():
                    # Upstream backpressure: read nothing more until the client
                    # reads what it asked for (TCP then slows the sender).
                    await self._unless_closed(self._drained.wait())
        except ConnectionClosed as exc:
            close_reason = f"closed:{exc.rcvd.code if exc.rcvd else 'abnormal'}"
        finally:
            self._cancel_timers()
            self.session.close()
            self._pump()
            pending = list(self.tasks.values())
            if pending:
                # Let the engine aborts run before the connection is gone.
                await asyncio.wait(pending, timeout=5)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            self.outbox.clear()
            self.log.info("session_closed", reason=close_reason)

    def _receive(self, frame: str | bytes) -> None:
        try:
            obj = decode_frame(frame)
        except ProtocolError as err:
            self.session.receive_protocol_error(err)
        else:
            self.session.receive_client_event(obj)
        self._pump()

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
        self._drained.clear()
        self.outbox.compact()
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
                    await self.ws.send(self.codec.encode(event))
                if self._stall_timer or self._slow_timer or not self._drained.is_set():
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
