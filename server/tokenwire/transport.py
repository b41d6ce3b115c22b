"""The asyncio layer around one WebSocket connection.

It owns the socket and the tasks; the `Session` decides and the `Outbox`
numbers and merges. A writer task drains the outbox; it merges deltas
whenever bytes are already waiting in the socket's buffer, which is the
bufferedAmount-style accounting the server does for each connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from .config import ServerConfig
from .engines.base import Engine, EngineDelta, EngineError
from .logs import get_logger
from .outbox import Outbox
from .protocol import Codec, ErrorCode, ProtocolError, decode_frame
from .session import AbortGeneration, Session, SessionLimits, StartGeneration, StartTimer

log = get_logger("tokenwire.transport")

# Bytes in the socket's write buffer above which pending deltas are merged.
MERGE_HIGH_WATER = 16 * 1024


class Connection:
    def __init__(self, ws: ServerConnection, engine: Engine, config: ServerConfig) -> None:
        self.ws = ws
        self.engine = engine
        self.config = config
        self.codec = Codec(ws.subprotocol)
        self.session = Session(
            limits=SessionLimits(
                max_active_responses=config.max_active_responses,
                default_max_output_tokens=config.default_max_output_tokens,
                tool_timeout_s=config.tool_timeout_s,
            ),
            info={
                "engine": engine.name,
                "subprotocol": self.codec.subprotocol,
                "max_message_bytes": config.max_message_bytes,
                # Applies when max_output_tokens is null.
                "default_max_output_tokens": config.default_max_output_tokens,
            },
            check_request=engine.check,
        )
        self.outbox = Outbox()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._wakeup = asyncio.Event()
        self._timers: dict[str, asyncio.TimerHandle] = {}  # by response id
        self.log = log.bind(session_id=self.session.id)

    @property
    def buffered_amount(self) -> int:
        """Bytes waiting for the client: socket write buffer (frames not yet queued
        are counted by the outbox length)."""
        transport = self.ws.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    async def run(self) -> None:
        self.log.info(
            "session_open", subprotocol=self.codec.subprotocol, remote=str(self.ws.remote_address)
        )
        writer = asyncio.create_task(self._write_loop())
        self._pump()
        close_reason = "client_closed"
        try:
            async for frame in self.ws:
                self._receive(frame)
        except ConnectionClosed as exc:
            close_reason = f"closed:{exc.rcvd.code if exc.rcvd else 'abnormal'}"
        finally:
            for timer in self._timers.values():
                timer.cancel()
            self.session.close()
            self._pump()
            pending = list(self.tasks.values())
            if pending:
                # Let the engine aborts run before the connection is gone.
                await asyncio.wait(pending, timeout=5)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
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

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while True:
                    event = self.outbox.pop(merge=self.buffered_amount > MERGE_HIGH_WATER)
                    if event is None:
                        break
                    await self.ws.send(self.codec.encode(event))
        except ConnectionClosed:
            pass

    def _log_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "response.done":
            r = event["response"]
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
            self.log.info("response_created", response_id=event["response"]["id"])
        elif kind == "error":
            self.log.info(
                "client_error", code=event["error"]["code"], event_id=event["error"].get("event_id")
            )
