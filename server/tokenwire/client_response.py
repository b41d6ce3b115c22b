"""What the asyncio client (tokenwire.client) hands its caller: a response to
iterate or await, and the error a call raises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol


class Requester(Protocol):
    """What a response asks of its client."""

    async def request(self, event: dict[str, Any]) -> dict[str, Any]: ...


TERMINAL = "response.done"


class TokenwireError(Exception):
    """An `error` event from the server, raised from the call that caused it;
    or the client's own (`type` "client_error"): `message_too_big`,
    `resume_failed`."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.error = error
        self.code: str = error.get("code", "")


class Response:
    """One response: iterate its events, or its text, until `response.done`.
    Each iteration starts from its first event: iterate as often as you like."""

    def __init__(self, client: Requester, created: dict[str, Any]) -> None:
        self.client = client
        self.id: str = created["response"]["id"]
        self.created = created
        self._done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._more = asyncio.Event()  # set when an event comes, or the end
        self.events: list[dict[str, Any]] = []

    def _feed(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._more.set()
        if event["type"] == TERMINAL and not self._done.done():
            self._done.set_result(event["response"])

    def _fail(self, exc: BaseException) -> None:
        if not self._done.done():
            self._done.set_exception(exc)
            self._done.exception()  # mark retrieved; iterators re-raise it
        self._more.set()

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        i = 0
        while True:
            while i == len(self.events):
                if self._done.done():
                    await self._done  # raises the connection error
                    return
                self._more.clear()
                await self._more.wait()
            event = self.events[i]
            i += 1
            yield event
            if event["type"] == TERMINAL:
                return

    async def text_deltas(self) -> AsyncIterator[str]:
        async for event in self:
            if event["type"] == "response.output_text.delta":
                yield event["delta"]

    async def text(self) -> str:
        """All output text, once the response is done; a `failed` response
        raises its error (`done()` still gives the response)."""
        result = await self.done()
        if result["status"] == "failed":
            raise TokenwireError((result.get("status_details") or {}).get("error") or {})
        return "".join(i.get("content", "") for i in result["output"] if i["type"] == "message")

    async def done(self) -> dict[str, Any]:
        """The `response` object of `response.done`."""
        return await asyncio.shield(self._done)

    @property
    def status(self) -> str | None:
        """The final status; None while it runs, or if the connection failed first."""
        if not self._done.done() or self._done.exception() is not None:
            return None
        return self._done.result()["status"]

    async def cancel(self) -> dict[str, Any]:
        """Stop the response; returns its final `response` (status cancelled,
        or the status it ended with just before). A refused cancel raises."""
        if not self._done.done():
            try:
                await self.client.request({"type": "response.cancel", "response_id": self.id})
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


async def cancel_reply(
    response: Response | None,
    refused: asyncio.Future[dict[str, Any]],
    cancelled: asyncio.Future[dict[str, Any]],
) -> dict[str, Any]:
    """What a `response.cancel` request returns: the `response.done` of
    `response`, or the server's error about it. With no `response` known here
    (its response.create still on the wire, say), the next `response.done`
    of a response cancelled by the client (`cancelled`)."""
    ended = asyncio.ensure_future(response.done()) if response is not None else cancelled
    try:
        await asyncio.wait({refused, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
    if refused.done():
        return refused.result()  # raises the error
    if response is None:
        return ended.result()
    return {"type": TERMINAL, "response": await response.done()}


def cancel_target(responses: dict[str, Response], event: dict[str, Any]) -> Response | None:
    """The response a `response.cancel` stops, as the server picks it
    (protocol.md §5); None if none is known here."""
    if (rid := event.get("response_id")) is not None:
        return responses.get(rid)
    live = list(responses.values())
    auto = [r for r in live if r.created["response"].get("conversation") == "auto"]
    return auto[0] if auto else (live[0] if len(live) == 1 else None)


def cancelled_by_client(
    event: dict[str, Any], waiters: set[asyncio.Future[dict[str, Any]]]
) -> None:
    """A response.done: the cancels that could not name their response take
    it if the client cancelled it."""
    details = event["response"].get("status_details") or {}
    if details.get("reason") == "client_cancelled":
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(event)
