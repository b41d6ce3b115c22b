"""The response cache (`--response-cache`), a stage (core.stages).

Only deterministic generations take part: temperature 0 (GenerationRequest
has no seed, so no other sampling is reproducible), `cache` not switched off
by the response, and a response's first generation, fresh (not a resume after
a pause, nor the continuation after a steer or tool outputs). Of those, only
one that finished "stop" without tool calls is stored: a truncated, cancelled,
steered, paused, blocked or failed one never is.

- A hit streams the stored deltas (their token ids and token counts; a few
  deltas, not one per token) without engine work, the first marked
  `cached_response`.
- A miss streams live; the entry is written after the finish delta went
  through, in a task, so no token waits on the store.
- Single flight, per instance: a request identical to one in flight follows
  its stream (what it got so far, then live) instead of running the engine.
  If the leader's stream ends without finishing (its client cancelled,
  steered, paused, or a guardrail blocked), the follower goes on with its own
  generation after the token ids it already delivered. A request with tools
  never follows: a tool parser or a forced call's grammar cannot start in
  the middle of a call (the session restarts such a generation, as after a
  takeover), so it runs its own.

The leader reads the engine inside its own consumer's task, as any stage:
closing it closes the engine stream. A follower only waits on the flight, so
cancelling it never touches the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from .. import metrics
from ..core.stages import Source, StageContext
from ..engines.base import EngineDelta, EngineError, GenerationRequest
from ..logs import get_logger
from ..storage.redis import pack, unpack
from .cache_store import CacheStore

log = get_logger("tokenwire.cache")

CHUNK = 16  # recorded deltas per stored delta: a hit streams in a few deltas


def cache_key(model_id: str, request: GenerationRequest, tenant: str) -> str:
    """sha256 of what decides a deterministic generation's output, and of the
    tenant (tenants never share entries). Not the priority, ids or session."""
    material = {
        "model": model_id,
        # The engine's own rendering when its preflight gave one; else the chat.
        "prompt": list(request.rendered) if request.rendered is not None else request.messages,
        "temperature": request.temperature,
        "seed": request.seed,
        "max_output_tokens": request.max_output_tokens,
        "ignore_eos": request.ignore_eos,
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "tenant": tenant,
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cacheable(request: GenerationRequest, context: StageContext) -> bool:
    return (
        request.cache
        and (request.temperature == 0 or request.seed is not None)
        and not request.resume_token_ids
        # The response's first generation (core.lifecycle numbers them): later
        # ones follow a steer or tool calls, or resume after a pause.
        and request.request_id == f"{context.response_id}-1"
    )


def storable(deltas: list[EngineDelta]) -> bool:
    return (
        bool(deltas)
        and deltas[-1].finish_reason == "stop"
        and not any(d.tool_calls for d in deltas)
    )


def encode_entry(deltas: list[EngineDelta]) -> bytes:
    """msgpack: the prompt's token count and the deltas, CHUNK recorded ones
    joined into one (text, output tokens, token ids or None)."""
    chunks = []
    for i in range(0, len(deltas), CHUNK):
        group = deltas[i : i + CHUNK]
        with_ids = all(d.token_ids is not None or not d.output_tokens for d in group)
        ids = [t for d in group for t in d.token_ids or ()] if with_ids else None
        chunks.append(["".join(d.text for d in group), sum(d.output_tokens for d in group), ids])
    return pack({"p": sum(d.prompt_tokens or 0 for d in deltas), "d": chunks})


def decode_entry(data: bytes) -> list[EngineDelta]:
    entry = unpack(data)
    deltas = [EngineDelta(text, n, None, token_ids=ids) for text, n, ids in entry["d"]]
    first, last = deltas[0], deltas[-1]
    first.prompt_tokens, first.cached_tokens, first.cached_response = entry["p"], 0, True
    last.finish_reason = "stop"
    return deltas


class Flight:
    """One generation in progress that identical requests follow."""

    __slots__ = ("_wake", "deltas", "ended")

    def __init__(self) -> None:
        self.deltas: list[EngineDelta] = []
        self.ended = False
        self._wake: asyncio.Event | None = None  # made only when someone waits

    def push(self, delta: EngineDelta) -> None:
        self.deltas.append(delta)
        self._notify()

    def end(self) -> None:
        self.ended = True
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    async def changed(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        await self._wake.wait()


class ResponseCache:
    name = "response_cache"

    def __init__(self, backend: CacheStore, model_id: str | Callable[[], str | None]) -> None:
        self.backend = backend
        # The engine's model, asked per request (None: not ready yet).
        self.model_id = (lambda: model_id) if isinstance(model_id, str) else model_id
        # In flight (or being written) by key: what an identical request follows.
        self.flights: dict[str, Flight] = {}
        self._writes: set[asyncio.Task[None]] = set()

    def session_info(self, tenant: str) -> dict[str, Any]:
        return {"response_cache": True}

    def stream(
        self, request: GenerationRequest, context: StageContext, source: Source
    ) -> AsyncIterator[EngineDelta]:
        model = self.model_id()
        if model is None or not cacheable(request, context):
            return source(request)  # untouched: nothing added to its token path
        key = cache_key(model, request, context.tenant)
        flight = self.flights.get(key)
        if flight is None:
            return self._lead(key, request, source)
        if request.tools is not None:
            return source(request)
        metrics.CACHE_HITS.labels("in_flight").inc()
        return self._follow(flight, request, source)

    async def _lead(
        self, key: str, request: GenerationRequest, source: Source
    ) -> AsyncIterator[EngineDelta]:
        # Registered before the lookup, so that a twin arriving meanwhile follows.
        flight = self.flights[key] = Flight()
        writing = False
        try:
            data = await self._lookup(key)
            if data is not None:
                metrics.CACHE_HITS.labels("stored").inc()
                for delta in decode_entry(data):
                    flight.push(delta)
                    yield delta
                return
            metrics.CACHE_MISSES.inc()
            upstream = source(request)
            async with contextlib.aclosing(upstream):  # type: ignore[type-var]
                async for delta in upstream:
                    flight.push(delta)
                    # Stored once it is whole, before the consumer takes the
                    # finish: a stage around this one may end with it.
                    if delta.finish_reason is not None and storable(flight.deltas):
                        writing = True
                        task = asyncio.create_task(self._write(key, flight))
                        self._writes.add(task)
                        task.add_done_callback(self._writes.discard)
                    yield delta
        finally:
            flight.end()
            if not writing and self.flights.get(key) is flight:
                del self.flights[key]

    async def _lookup(self, key: str) -> bytes | None:
        try:
            return await self.backend.get(key)
        except Exception as exc:  # a cache that fails is a miss, never an error
            log.warning("response_cache_read_failed", error=str(exc))
            return None

    async def _write(self, key: str, flight: Flight) -> None:
        try:
            data = encode_entry(flight.deltas)
            if await self.backend.put(key, data):
                metrics.CACHE_STORED_BYTES.inc(len(data))
        except Exception as exc:
            log.warning("response_cache_write_failed", error=str(exc))
        finally:
            # Twins that came while it was written followed the finished flight.
            if self.flights.get(key) is flight:
                del self.flights[key]

    async def _follow(
        self, flight: Flight, request: GenerationRequest, source: Source
    ) -> AsyncIterator[EngineDelta]:
        seen = 0
        while True:
            while seen < len(flight.deltas):
                delta = flight.deltas[seen]
                seen += 1
                # A copy: the leader's session holds the original.
                yield dataclasses.replace(delta, cached_response=seen == 1)
                if delta.finish_reason is not None:
                    return
            if flight.ended:
                break
            await flight.changed()
        # The leader stopped short: go on from what this client already has.
        delivered = flight.deltas[:seen]
        upstream = source(_continuation(request, delivered))
        async with contextlib.aclosing(upstream):  # type: ignore[type-var]
            async for delta in upstream:
                yield delta


def _continuation(request: GenerationRequest, delivered: list[EngineDelta]) -> GenerationRequest:
    """The request that continues after `delivered`, as a resume after a pause does."""
    produced = sum(d.output_tokens for d in delivered)
    if not produced:
        return request
    if any(d.output_tokens and not d.token_ids for d in delivered):
        # Without the ids a continuation would repeat text the client holds.
        raise EngineError("the identical generation this response followed stopped early")
    limit = request.max_output_tokens
    return dataclasses.replace(
        request,
        resume_token_ids=tuple(t for d in delivered for t in d.token_ids or ()),
        max_output_tokens=None if limit is None else max(limit - produced, 1),
    )
