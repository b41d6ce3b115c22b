"""OpenAI's own clients, unmodified, against tokenwire's OpenAI Realtime (GA) dialect.

- GAConnection: the `openai` Python SDK's realtime connection; every server
  event it receives is first validated strictly against the SDK's own models
  (the SDK itself parses with `construct`, which checks nothing), then parsed as
  the SDK parses it.
- ga_connect(): `AsyncOpenAI(websocket_base_url=...).realtime.connect(model=...)`,
  as an application written for OpenAI runs it with only the base URL changed.
- user_message(), function_call_output(): GA conversation items.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from openai import AsyncOpenAI
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from openai.types.realtime import RealtimeErrorEvent, RealtimeServerEvent
from pydantic import TypeAdapter

from .openai_models import validate

MODEL = "gpt-realtime"  # what an app written for OpenAI asks for; tokenwire serves its own
API_KEY = "sk-unused"  # the SDK needs one; a server without keys ignores it
# The SDK's union of server events, discriminated by `type`.
SERVER_EVENT: TypeAdapter[RealtimeServerEvent] = TypeAdapter(RealtimeServerEvent)


def base_url(realtime_url: str) -> str:
    """ws://host:port/v1/realtime -> ws://host:port/v1: the SDK appends /realtime."""
    assert realtime_url.endswith("/v1/realtime"), realtime_url
    return realtime_url.removesuffix("/realtime")


class GAConnection:
    """One SDK connection; `events` holds every server event received, as sent."""

    def __init__(self, conn: AsyncRealtimeConnection) -> None:
        self.conn = conn
        self.events: list[dict[str, Any]] = []
        self._event_ids: set[str] = set()

    async def recv(self, timeout: float = 10) -> RealtimeServerEvent:
        raw = await asyncio.wait_for(self.conn.recv_bytes(), timeout)
        obj = validate(raw.decode())  # strict types, required fields, no unknown field
        SERVER_EVENT.validate_python(obj, strict=True)  # and through the SDK's union
        assert obj["event_id"] not in self._event_ids, f"event_id used twice: {obj}"
        self._event_ids.add(obj["event_id"])
        self.events.append(obj)
        return self.conn.parse_event(raw)

    async def until(self, kind: str, timeout: float = 10) -> list[RealtimeServerEvent]:
        """Events up to and including the next one of type `kind`."""
        got: list[RealtimeServerEvent] = []
        while True:
            event = await self.recv(timeout)
            got.append(event)
            if event.type == kind:
                return got

    async def error(self) -> RealtimeErrorEvent:
        event = (await self.until("error"))[-1]
        assert isinstance(event, RealtimeErrorEvent), event
        return event

    async def send(self, event: dict[str, Any]) -> None:
        """A client event as a dict, through the SDK's own `send` (its transform)."""
        await self.conn.send(event)  # type: ignore[arg-type]  # any event, even a bad one

    async def send_raw(self, frame: str) -> None:
        await self.conn.send_raw(frame)


@asynccontextmanager
async def ga_connect(realtime_url: str) -> AsyncIterator[GAConnection]:
    """Connected, with session.created received and checked."""
    client = AsyncOpenAI(api_key=API_KEY, websocket_base_url=base_url(realtime_url))
    async with client.realtime.connect(model=MODEL) as conn:
        ga = GAConnection(conn)
        created = await ga.recv()
        assert created.type == "session.created", created
        yield ga


def user_message(text: str, item_id: str | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    if item_id is not None:
        item["id"] = item_id
    return item


def function_call_output(call_id: str, output: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def text_of(events: list[RealtimeServerEvent]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")
