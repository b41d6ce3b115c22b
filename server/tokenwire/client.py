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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from .protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec, decode_frame

DEFAULT_URL = "ws://127.0.0.1:8765/v1/realtime"
_TERMINAL = "response.done"


class TokenwireError(Exception):
    """An `error` event from the server, raised from the call that caused it."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.error = error
        self.code: str = error.get("code", "")


class Response:
    """One response: iterate its events, or its text, until `response.done`."""

    def __init__(self, client: Client, created: dict[str, Any]) -> None:
        self.client = client
        self.id: str = created["response"]["id"]
        self.created = created
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.events: list[dict[str, Any]] = []

    def _feed(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._queue.put_nowait(event)
        if event["type"] == _TERMINAL and not self._done.done():
            self._done.set_result(event["response"])

    def _fail(self, exc: BaseException) -> None:
        if not self._done.done():
            self._done.set_exception(exc)
            self._done.exception()  # mark retrieved; iterators re-raise it
        self._queue.put_nowait({"type": "_closed"})

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            event = await self._queue.get()
            if event["type"] == "_closed":
                await self._done  # raises the connection error
                return
            yield event
            if event["type"] == _TERMINAL:
                return

    async def text_deltas(self) -> AsyncIterator[str]:
        async for event in self:
            if event["type"] == "response.output_text.delta":
                yield event["delta"]

    async def text(self) -> str:
        """All output text, once the response is done."""
        result = await self.done()
        return "".join(i.get("content", "") for i in result["output"] if i["type"] == "message")

    async def done(self) -> dict[str, Any]:
        """The `response` object of `response.done`."""
        return await asyncio.shield(self._done)

    @property
    def status(self) -> str | None:
        return self._done.result()["status"] if self._done.done() else None

    async def cancel(self) -> dict[str, Any]:
        """Stop the response; returns its final `response` (status cancelled)."""
        if not self._done.done():
            try:
                await self.client.send({"type": "response.cancel", "response_id": self.id})
            except TokenwireError as exc:
                # It finished in the meantime; that is not an error for the caller.
                if exc.code != "response_not_active":
                    raise
        return await self.done()

    async def steer(self, text: str) -> dict[str, Any]:
        """Add user input into the running response; returns `response.steered`."""
        return await self.client.request(
            {"type": "response.steer", "response_id": self.id, "input": text}
        )


ToolHandler = Callable[..., Awaitable[Any]]


class Client:
    def __init__(self, ws: ClientConnection, tools: dict[str, ToolHandler] | None = None) -> None:
        self.ws = ws
        # Tool name -> async function called with the call's arguments as keywords.
        self.tool_handlers: dict[str, ToolHandler] = dict(tools or {})
        self._tool_tasks: set[asyncio.Task[None]] = set()
        self.codec = Codec(ws.subprotocol)
        self.session: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._responses: dict[str, Response] = {}
        # Events that belong to no response and answer no request.
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.last_seq = 0
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_loop())

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    # -- sending -------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        """Send an event without waiting for a reply (errors still raise in request())."""
        event.setdefault("event_id", f"evt_{next(self._ids)}")
        await self.ws.send(self.codec.encode(event))

    async def send_raw(self, frame: str | bytes) -> None:
        await self.ws.send(frame)

    async def request(self, event: dict[str, Any]) -> dict[str, Any]:
        """Send an event and wait for the reply that echoes its event_id."""
        event_id = event.setdefault("event_id", f"evt_{next(self._ids)}")
        future = asyncio.get_running_loop().create_future()
        self._pending[event_id] = future
        try:
            await self.ws.send(self.codec.encode(event))
            return await future
        finally:
            self._pending.pop(event_id, None)

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
        reply = await self.request({"type": "response.create", "response": params})
        return self._responses[reply["response"]["id"]]

    async def truncate(self, item_id: str, text_end: int) -> dict[str, Any]:
        return await self.request(
            {"type": "conversation.item.truncate", "item_id": item_id, "text_end": text_end}
        )

    async def ask(self, text: str, **params: Any) -> str:
        """Add a user message, run a response, return its text."""
        await self.add_message(text)
        return await (await self.create_response(**params)).text()

    # -- receiving -----------------------------------------------------------

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionError("connection closed")
        try:
            async for frame in self.ws:
                self._dispatch(decode_frame(frame))
        except ConnectionClosed as exc:
            error = exc
        finally:
            if not self._ready.done():
                self._ready.set_exception(error)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)
            for response in self._responses.values():
                response._fail(error)

    def _dispatch(self, event: dict[str, Any]) -> None:
        self.last_seq = event.get("seq", self.last_seq)
        kind = event["type"]
        if kind == "session.created":
            self.session = event["session"]
            if not self._ready.done():
                self._ready.set_result(event)
        elif kind == "response.created":
            response = Response(self, event)
            self._responses[response.id] = response
        response_id = event.get("response_id") or (
            event["response"]["id"] if kind in ("response.created", _TERMINAL) else None
        )
        if response_id in self._responses and kind != "response.created":
            response = self._responses[response_id]
            response._feed(event)
            if kind == _TERMINAL:
                del self._responses[response_id]
        if kind == "response.function_call_arguments.done" and event["name"] in self.tool_handlers:
            task = asyncio.create_task(self._run_tool(event))
            self._tool_tasks.add(task)
            task.add_done_callback(self._tool_tasks.discard)
        event_id = event.get("event_id") or (
            event["error"].get("event_id") if kind == "error" else None
        )
        future = self._pending.get(event_id) if event_id else None
        if future is not None and not future.done():
            if kind == "error":
                future.set_exception(TokenwireError(event["error"]))
            else:
                future.set_result(event)
        elif response_id is None:
            self.events.put_nowait(event)

    async def _run_tool(self, event: dict[str, Any]) -> None:
        """Run a tool handler and send its result (or its error) back as the output."""
        handler = self.tool_handlers[event["name"]]
        try:
            result = await handler(**json.loads(event["arguments"] or "{}"))
            output = result if isinstance(result, str) else json.dumps(result)
        except Exception as exc:
            output = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        with contextlib.suppress(TokenwireError, ConnectionClosed):
            await self.create_item(
                {"type": "function_call_output", "call_id": event["call_id"], "output": output}
            )


async def connect(
    url: str = DEFAULT_URL,
    *,
    protocol: Literal["json", "msgpack"] = "msgpack",
    api_key: str | None = None,
    tools: dict[str, ToolHandler] | None = None,
    **kwargs: Any,
) -> Client:
    """Open a session; returns once `session.created` has arrived."""
    subprotocol = SUBPROTOCOL_MSGPACK if protocol == "msgpack" else SUBPROTOCOL_JSON
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    ws = await ws_connect(
        url,
        subprotocols=[subprotocol],
        additional_headers=headers,
        compression=None,  # type: ignore[list-item]
        **kwargs,
    )
    client = Client(ws, tools)
    await client._ready
    return client
