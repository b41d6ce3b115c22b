"""An asyncio client for tokenwire, for agent programs and tests.

    async with await connect("ws://127.0.0.1:8765/v1/realtime") as tw:
        await tw.add_message("What is the capital of France?")
        response = await tw.create_response(temperature=0)
        async for delta in response.text_deltas():
            print(delta, end="", flush=True)

Every request carries an `event_id`; the server echoes it on its reply (or
on the `error` about it), which is how replies are matched to calls.

Tool handlers run when a call's arguments are complete; their return value
(JSON-encoded unless it is a str) or their exception goes back as the call's
`function_call_output`, and the same response continues:

    async def get_weather(city: str) -> dict: ...
    tw = await connect(url, tools={"get_weather": get_weather})

When the connection drops, the client reconnects and resumes the session by
itself (`reconnect=False` turns that off): calls in flight and responses go
on, replayed events are not seen twice, and events the server never took are
sent again, once (`session.resumed` says how many it took).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .client_response import TERMINAL as _TERMINAL
from .client_response import (
    Response,
    TokenwireError,
    cancel_reply,
    cancel_target,
    cancelled_by_client,
)
from .core.schema import check_values
from .wire.codec import decode_frame
from .wire.tokenwire_v1 import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, TokenwireV1

DEFAULT_URL = "ws://127.0.0.1:8765/v1/realtime"
# Closes after which the session is gone (or resuming cannot help): no reconnect.
_FINAL_CLOSE_CODES = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 4000, 4008})
# Handshake refusals that another attempt will not change.
_FINAL_HTTP_STATUSES = frozenset({400, 401, 403, 404})

log = logging.getLogger("tokenwire.client")


ToolHandler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Reconnect:
    """How the client gets back into its session after the connection drops:
    up to `max_attempts` tries in a row, each after a random delay of up to
    `initial_delay_s * 2**attempt` (capped at `max_delay_s`), and no sooner
    than a `session.going_away` asked."""

    max_attempts: int = 10
    initial_delay_s: float = 0.25
    max_delay_s: float = 10.0
    # How long one attempt may take: connect, then the replay up to session.resumed.
    attempt_timeout_s: float = 10.0

    def delay(self, attempt: int) -> float:
        """Full jitter, so clients dropped together do not come back together."""
        # 2**attempt as a float overflows past 1023; the cap is reached long before.
        return random.random() * min(self.max_delay_s, self.initial_delay_s * 2 ** min(attempt, 60))


def _client_error(code: str, message: str) -> TokenwireError:
    return TokenwireError({"type": "client_error", "code": code, "message": message})


class _ResumeRefused(Exception):
    def __init__(self, error: dict[str, Any], fresh: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.error = error
        self.fresh = fresh


class Client:
    def __init__(
        self,
        ws: ClientConnection,
        tools: dict[str, ToolHandler] | None = None,
        *,
        url: str | None = None,
        ws_options: dict[str, Any] | None = None,
        reconnect: Reconnect | None = None,
    ) -> None:
        self.ws = ws
        # Tool name -> async function called with the call's arguments as keywords.
        self.tool_handlers: dict[str, ToolHandler] = dict(tools or {})
        self._tool_tasks: set[asyncio.Task[None]] = set()
        self.codec = TokenwireV1(ws.subprotocol)
        self.session: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._responses: dict[str, Response] = {}
        # Cancels waiting for a response.done they cannot name (client_response.cancel_reply).
        self._cancel_waiters: set[asyncio.Future[dict[str, Any]]] = set()
        # create_response's event_id -> its Response once created: the
        # response may be done, and gone from _responses, before the call returns.
        self._created: dict[str, Response | None] = {}
        # create_response calls cancelled before their response came: it is
        # cancelled when it does.
        self._abandoned: set[str] = set()
        # Events that belong to no response and answer no request.
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.last_seq = 0
        # Reconnecting needs the URL and options the first connection used.
        self.reconnect = reconnect if url is not None else None
        self._url = url
        self._ws_options = dict(ws_options or {})
        # open | reconnecting | closed; sends wait while reconnecting.
        self.state = "open"
        self.reconnects = 0  # sessions resumed after a drop
        self._resending: asyncio.Task[None] | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._closing = False
        self._closed_error: BaseException = ConnectionError("connection closed")
        self._retry_after_s = 0.0
        # Frames sent in this session that the server may not have taken yet:
        # (number, event_id, frame). Numbers count every event sent but
        # session.resume, as the server's client_events does.
        self._sent_count = 0
        self._unconfirmed: list[tuple[int, str | None, str | bytes]] = []
        # Bumped when the session is replaced (a refused resume): a send
        # waiting to reconnect was meant for the old one.
        self._epoch = 0
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_loop())

    @property
    def session_id(self) -> str | None:
        return self.session.get("id")

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close for good (no reconnect)."""
        self._closing = True
        self._finish(ConnectionError("the client closed the connection"))
        self._reader.cancel()  # reconnecting, or reading: either way done
        if self._resending is not None:
            self._resending.cancel()
        if self.ws.transport.is_closing():
            self.ws.transport.abort()
        else:
            await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        for task in list(self._tool_tasks):  # their outputs have nowhere to go
            task.cancel()

    # -- sending -------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        """Send an event without waiting for a reply (errors still raise in request())."""
        event.setdefault("event_id", f"evt_{next(self._ids)}")
        await self._send(event)

    async def send_raw(self, frame: str | bytes) -> None:
        """Send a frame as is (tests send malformed ones with it)."""
        await self._write(frame, None)

    async def request(self, event: dict[str, Any]) -> dict[str, Any]:
        """Send an event and wait for the reply that echoes its event_id. A
        cancel that works has none: its reply is the response's
        `response.done` event."""
        event_id = event.setdefault("event_id", f"evt_{next(self._ids)}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[event_id] = future
        cancelled = loop.create_future()
        try:
            if event.get("type") != "response.cancel":
                await self._send(event)
                return await future
            # Chosen before the send, which may wait: the response may end meanwhile.
            target = cancel_target(self._responses, event)
            self._cancel_waiters.add(cancelled)
            await self._send(event)
            return await cancel_reply(target, future, cancelled)
        finally:
            self._pending.pop(event_id, None)
            self._cancel_waiters.discard(cancelled)
            if future.done() and not future.cancelled():
                future.exception()  # failed with the send: retrieved here

    async def _send(self, event: dict[str, Any]) -> None:
        try:
            check_values(event)
        except ValueError as exc:
            # The server would refuse the frame, with no event_id to say which call.
            raise _client_error("invalid_value", f"the event cannot be sent: {exc}") from None
        frame = self.codec.encode(event)
        limit = self.session.get("max_message_bytes")
        size = len(frame.encode() if isinstance(frame, str) else frame)
        if limit and size > limit:
            # The server would close the socket with 1009; refuse it here instead.
            raise _client_error(
                "message_too_big", f"the event is {size} bytes; the server accepts at most {limit}"
            )
        await self._write(frame, event.get("event_id"))

    async def _write(self, frame: str | bytes, event_id: str | None) -> None:
        epoch = self._epoch
        while self.state == "reconnecting":
            await self._open.wait()
        if self.state == "closed" or epoch != self._epoch:
            raise self._closed_error  # closed, or the session it was meant for is gone
        # No await between numbering and writing: numbers follow the wire order.
        self._sent_count += 1
        self._unconfirmed.append((self._sent_count, event_id, frame))
        try:
            await self.ws.send(frame)
        except ConnectionClosed:
            if self.reconnect is None or self._closing:
                raise
            # The resume sends it again if the server did not take it.

    def _confirm(self, event_id: str) -> None:
        """A reply echoes `event_id`: the server took that event and, since it
        takes them in order, every one before it."""
        for i, (_, sent_id, _) in enumerate(self._unconfirmed):
            if sent_id == event_id:
                del self._unconfirmed[: i + 1]
                return

    async def update_session(self, **fields: Any) -> dict[str, Any]:
        reply = await self.request({"type": "session.update", "session": fields})
        self.session = reply["session"]
        return self.session

    async def create_item(self, item: dict[str, Any]) -> dict[str, Any]:
        reply = await self.request({"type": "conversation.item.create", "item": item})
        return reply["item"]

    async def add_message(self, content: str, role: str = "user") -> dict[str, Any]:
        return await self.create_item({"type": "message", "role": role, "content": content})

    async def create_response(self, **params: Any) -> Response:
        event_id = f"evt_{next(self._ids)}"
        self._created[event_id] = None
        try:
            await self.request(
                {"type": "response.create", "event_id": event_id, "response": params}
            )
            response = self._created[event_id]
        except asyncio.CancelledError:
            # Nobody holds the response: it must not run on (and block the next).
            self._abandoned.add(event_id)
            if self._created.get(event_id) is not None:
                self._cancel_abandoned(event_id)
            raise
        finally:
            self._created.pop(event_id, None)
        assert response is not None  # response.created resolved the request
        return response

    async def truncate(self, item_id: str, text_end: int) -> dict[str, Any]:
        return await self.request(
            {"type": "conversation.item.truncate", "item_id": item_id, "text_end": text_end}
        )

    async def delete_item(self, item_id: str) -> dict[str, Any]:
        """Take an item out of the conversation (conversation.item.deleted)."""
        return await self.request({"type": "conversation.item.delete", "item_id": item_id})

    async def ask(self, text: str, **params: Any) -> str:
        """Add a user message, run a response, return its text."""
        await self.add_message(text)
        return await (await self.create_response(**params)).text()

    # -- receiving -----------------------------------------------------------

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionError("connection closed")
        try:
            while True:
                error = ConnectionError("connection closed")
                try:
                    async for frame in self.ws:
                        self._dispatch(decode_frame(frame))
                    # A clean close ends the iteration: its exception says how.
                    error = self.ws.protocol.close_exc
                except ConnectionClosed as exc:
                    error = exc
                except Exception as exc:  # a frame we cannot read: the connection is useless
                    log.error("tokenwire: closing on a bad server frame: %r", exc)
                    self.ws.transport.abort()
                    error = exc
                    break
                code = self.ws.close_code
                if (
                    self._closing
                    or self.reconnect is None
                    or not self._ready.done()
                    or code in _FINAL_CLOSE_CODES
                ):
                    break
                if not await self._reconnect(code):
                    error = _client_error(
                        "reconnect_failed",
                        f"could not resume session {self.session_id} after the connection "
                        f"closed ({code})",
                    )
                    break
        finally:
            self._finish(error)

    def _finish(self, error: BaseException) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        self._closed_error = error
        self._open.set()  # waiting sends see "closed"
        if not self._ready.done():
            self._ready.set_exception(error)
        self._fail_in_flight(error)

    def _fail_in_flight(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for response in self._responses.values():
            response._fail(error)
        self._responses.clear()

    async def _reconnect(self, code: int | None) -> bool:
        """Back into the same session on a new connection; False if that failed."""
        assert self.reconnect is not None and self._url is not None
        self.state = "reconnecting"
        self._open.clear()
        floor, self._retry_after_s = self._retry_after_s, 0.0
        for attempt in range(self.reconnect.max_attempts):
            delay = max(self.reconnect.delay(attempt), floor)
            floor = 0.0
            log.warning(
                "tokenwire: connection closed (%s); resuming session %s, attempt %d in %.2f s",
                code,
                self.session_id,
                attempt + 1,
                delay,
            )
            await asyncio.sleep(delay)
            taken: int | None = None
            try:
                async with asyncio.timeout(self.reconnect.attempt_timeout_s):
                    ws = await ws_connect(self._url, **self._ws_options)
                    taken = await _resume_on(self, ws)
            except _ResumeRefused as refused:
                self._resume_failed(refused)
                break
            except InvalidStatus as exc:
                if exc.response.status_code in _FINAL_HTTP_STATUSES:
                    log.error("tokenwire: reconnect refused: %s", exc)
                    return False
                log.warning("tokenwire: reconnect attempt %d refused: %s", attempt + 1, exc)
                continue
            except Exception as exc:  # OSError, a timeout, a handshake, a bad frame: all alike
                log.warning("tokenwire: reconnect attempt %d failed: %r", attempt + 1, exc)
                continue
            self.reconnects += 1
            log.warning("tokenwire: resumed session %s", self.session_id)
            break
        else:
            return False
        if taken is None:  # refused: the fresh session has nothing to resend
            self.state = "open"
            self._open.set()
        else:  # a long backlog may take its time, past the attempt's timeout
            self._resending = asyncio.create_task(_resend_untaken(self, taken))
        return True

    def _resume_failed(self, refused: _ResumeRefused) -> None:
        """The old session is gone: what was in flight fails, and the client
        goes on in the fresh session the new socket announced."""
        old = self.session_id
        error = _client_error(
            "resume_failed",
            f"could not resume session {old}: {refused.error['error'].get('code')}: "
            f"{refused.error['error'].get('message')}",
        )
        log.error("tokenwire: %s; going on in session %s", error, refused.fresh["session"]["id"])
        self._fail_in_flight(error)
        self._closed_error = error
        self._epoch += 1
        self._sent_count = 0
        self._unconfirmed.clear()
        self.session = refused.fresh["session"]
        self.last_seq = max(refused.fresh.get("seq", 0), refused.error.get("seq", 0))

    def _dispatch(self, event: dict[str, Any]) -> None:
        seq = event.get("seq")
        if isinstance(seq, int):
            if seq <= self.last_seq:
                return  # replayed after a resume, and already seen
            self.last_seq = seq
        kind = event["type"]
        if kind in ("session.created", "session.resumed"):
            self.session = event["session"]
            if not self._ready.done():
                self._ready.set_result(event)
        elif kind == "session.going_away":
            self._retry_after_s = event.get("retry_after_ms", 0) / 1000
        elif kind == "response.created":
            response = Response(self, event)
            self._responses[response.id] = response
            if event.get("event_id") in self._created:
                self._created[event["event_id"]] = response
            if event.get("event_id") in self._abandoned:
                self._cancel_abandoned(event["event_id"], response)
        response_id = event.get("response_id") or (
            event["response"]["id"] if kind in ("response.created", _TERMINAL) else None
        )
        if response_id in self._responses and kind != "response.created":
            response = self._responses[response_id]
            response._feed(event)
            if kind == _TERMINAL:
                del self._responses[response_id]
        if kind == _TERMINAL and self._cancel_waiters:
            cancelled_by_client(event, self._cancel_waiters)
        if kind == "response.function_call_arguments.done" and event["name"] in self.tool_handlers:
            task = asyncio.create_task(self._run_tool(event))
            self._tool_tasks.add(task)
            task.add_done_callback(self._tool_tasks.discard)
        event_id = event.get("event_id") or (
            event["error"].get("event_id") if kind == "error" else None
        )
        if event_id:
            self._confirm(event_id)
        future = self._pending.get(event_id) if event_id else None
        if future is not None and not future.done():
            if kind == "error":
                future.set_exception(TokenwireError(event["error"]))
            else:
                future.set_result(event)
        elif response_id is None:
            self.events.put_nowait(event)

    def _cancel_abandoned(self, event_id: str, response: Response | None = None) -> None:
        self._abandoned.discard(event_id)
        response = response or self._created.get(event_id)
        if response is None or response._done.done():
            return
        task = asyncio.create_task(
            self.send({"type": "response.cancel", "response_id": response.id})
        )
        self._tool_tasks.add(task)  # kept until done, as tool tasks are
        task.add_done_callback(self._tool_tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _run_tool(self, event: dict[str, Any]) -> None:
        """Run a tool handler and send its result (or its error) back as the output."""
        handler = self.tool_handlers[event["name"]]
        epoch = self._epoch
        try:
            result = await handler(**json.loads(event["arguments"] or "{}"))
            output = result if isinstance(result, str) else json.dumps(result)
        except Exception as exc:
            output = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        if epoch != self._epoch:
            return  # the session that called it is gone (a refused resume)
        try:
            await self.create_item(
                {"type": "function_call_output", "call_id": event["call_id"], "output": output}
            )
        except (TokenwireError, ConnectionClosed, ConnectionError) as exc:
            # The response waits for it until its tool timeout: say why.
            log.error("tokenwire: the output of %s could not be sent: %s", event["name"], exc)
            self.events.put_nowait({"type": "client.tool_error", "call": event, "error": exc})


async def _resend_untaken(client: Client, taken: int) -> None:
    """After session.resumed, beside the read loop (a backlog written while
    nothing reads could stall both sides: the server stops reading a client
    that does not read): send again, in order, what the server never took;
    then new sends may go."""
    ws = client.ws
    client._unconfirmed = [u for u in client._unconfirmed if u[0] > taken]
    try:
        for _, _, frame in list(client._unconfirmed):
            await ws.send(frame)
    except ConnectionClosed:
        return  # the read loop sees the close, and resumes again
    if client.ws is ws and client.state == "reconnecting":
        client.state = "open"
        client._open.set()


async def _resume_on(client: Client, ws: ClientConnection) -> int:
    """Resume `client`'s session on a new socket and take the replay; returns how many
    frames the server took (session.resumed's client_events)."""
    try:
        fresh = decode_frame(await ws.recv())  # the new socket's own session
        resume_id = f"evt_{next(client._ids)}"
        await ws.send(
            client.codec.encode(
                {
                    "type": "session.resume",
                    "event_id": resume_id,
                    "session_id": client.session_id,
                    "last_seq": client.last_seq,
                }
            )
        )
        while True:
            event = decode_frame(await ws.recv())
            if event["type"] == "error" and event["error"].get("event_id") == resume_id:
                client.ws = ws  # the client goes on in the fresh session
                raise _ResumeRefused(event, fresh)
            client._dispatch(event)
            if event["type"] == "session.resumed":
                client.ws = ws
                return int(event.get("client_events", 0))
    except BaseException:
        if client.ws is not ws:
            ws.transport.abort()  # no close handshake with a socket that failed us
        raise


async def connect(
    url: str = DEFAULT_URL,
    *,
    protocol: Literal["json", "msgpack"] = "msgpack",
    api_key: str | None = None,
    tools: dict[str, ToolHandler] | None = None,
    reconnect: Reconnect | bool = True,
    **kwargs: Any,
) -> Client:
    """Open a session; returns once `session.created` has arrived.

    `reconnect`: resume the session by itself when the connection drops
    (`True`: `Reconnect()`'s defaults; `False`: never). Other keyword
    arguments go to `websockets.asyncio.client.connect`."""
    subprotocol = SUBPROTOCOL_MSGPACK if protocol == "msgpack" else SUBPROTOCOL_JSON
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    options: dict[str, Any] = {
        "subprotocols": [subprotocol],
        "additional_headers": headers,
        "compression": None,
        # A response.done or a retrieve can pass 1 MiB (websockets' default).
        "max_size": None,
        **kwargs,
    }
    ws = await ws_connect(url, **options)
    policy = Reconnect() if reconnect is True else reconnect or None
    client = Client(ws, tools, url=url, ws_options=options, reconnect=policy)
    try:
        await client._ready
    except BaseException:  # failed, timed out or cancelled: nothing stays open
        await client.close()
        raise
    return client
