"""The stage seam (core.stages): what a stage does to a generation's deltas
reaches the client, a block ends the response content_filter and frees the
engine, and a cache mark shows in usage. Real server and client, scripted engine."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.client import connect
from tokenwire.core.stages import CONTENT_FILTER, Source, StageContext
from tokenwire.engines.base import EngineDelta, GenerationRequest

from ..conftest import RunningServer
from ..helpers.wait import until


class Shout:
    """Upper-cases text, and remembers who each generation was for."""

    name = "shout"

    @staticmethod
    def session_info(tenant: str) -> dict[str, Any]:
        return {"shouting_for": tenant}

    def __init__(self) -> None:
        self.contexts: list[StageContext] = []

    async def stream(
        self, request: GenerationRequest, context: StageContext, source: Source
    ) -> AsyncIterator[EngineDelta]:
        self.contexts.append(context)
        async for delta in source(request):
            yield dataclasses.replace(delta, text=delta.text.upper())


class StopAt:
    """Blocks the generation once `word` was generated, delivering nothing of it."""

    name = "stop_at"

    @staticmethod
    def session_info(tenant: str) -> dict[str, Any]:
        return {}

    def __init__(self, word: str) -> None:
        self.word = word
        self.closed = False

    async def stream(
        self, request: GenerationRequest, context: StageContext, source: Source
    ) -> AsyncIterator[EngineDelta]:
        upstream = source(request)
        try:
            async for delta in upstream:
                if self.word in delta.text:
                    yield EngineDelta("", 0, CONTENT_FILTER)
                    return
                yield delta
        finally:
            await upstream.aclose()  # type: ignore[attr-defined]
            self.closed = True


class Cached:
    """Answers without the engine, marked as a cache would."""

    name = "cached"

    @staticmethod
    def session_info(tenant: str) -> dict[str, Any]:
        return {}

    async def stream(
        self, request: GenerationRequest, context: StageContext, source: Source
    ) -> AsyncIterator[EngineDelta]:
        yield EngineDelta("from ", 1, None, prompt_tokens=3, cached_response=True)
        yield EngineDelta("cache", 1, "stop")


async def test_stages_wrap_the_engine_innermost_first(scripted: RunningServer) -> None:
    shout = Shout()
    scripted.server.registry.stages = (shout,)
    async with await connect(scripted.url) as tw:
        await tw.add_message("hello there")
        response = await tw.create_response()
        assert await response.text() == "YOU SAID: HELLO THERE"
        done = await response.done()
        assert "cached_response" not in done["usage"]
        (context,) = shout.contexts
        assert context.session_id == tw.session["id"] and context.response_id == done["id"]
        assert context.tenant == "anonymous"
        assert tw.session["shouting_for"] == "anonymous"  # session_info reaches session.created


async def test_a_block_ends_the_response_content_filter(scripted: RunningServer) -> None:
    stop = StopAt("secret")
    scripted.server.registry.stages = (stop,)
    async with await connect(scripted.url) as tw:
        await tw.add_message("the secret word")
        response = await tw.create_response()
        done = await response.done()
        assert done["status"] == "incomplete"
        assert done["status_details"] == {"type": "incomplete", "reason": "content_filter"}
        assert "secret" not in await response.text()
        (item,) = done["output"]
        assert item["content"] == "You said: the" and item["status"] == "incomplete"
        assert stop.closed
        await until(lambda: scripted.server.engine.load().running == 0, "the engine freed")


async def test_a_cache_mark_shows_in_usage(scripted: RunningServer) -> None:
    scripted.server.registry.stages = (Cached(),)
    async with await connect(scripted.url) as tw:
        await tw.add_message("anything")
        response = await tw.create_response()
        assert await response.text() == "from cache"
        done = await response.done()
        assert done["usage"]["cached_response"] is True
        assert scripted.server.engine.load().running == 0
