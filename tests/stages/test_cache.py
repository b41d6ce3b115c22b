"""The response cache (--response-cache) through the real server and client,
scripted engine, in memory and in a real redis-server: a hit without engine
work, single flight, tenants, what is never stored, expiry, the opt-outs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tokenwire.client import Client, Response, connect
from tokenwire.config import ServerConfig
from tokenwire.engines.base import EngineDelta, GenerationRequest
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.server import TokenwireServer
from tokenwire.stages.cache import ResponseCache

from ..conftest import RedisServer, RunningServer
from ..helpers.wait import until


class CountingEngine(ScriptedEngine):
    """The scripted engine, counting the generations it was asked for."""

    def __init__(self, tokens_per_s: float) -> None:
        super().__init__(tokens_per_s=tokens_per_s, max_context_tokens=512)
        self.requests: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        self.requests.append(request)
        return super().generate(request)

    @property
    def generations(self) -> int:
        return len(self.requests)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Config overrides for each backend."""
    if request.param == "redis":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        yield {"redis_url": redis_server.url}
    else:
        yield {}


@asynccontextmanager
async def cache_server(
    rate: float = 1000.0, **overrides: Any
) -> AsyncIterator[tuple[RunningServer, CountingEngine]]:
    config = ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=rate,
        max_events_per_s=0,
        response_cache=True,
        **overrides,
    )
    engine = CountingEngine(rate)
    server = TokenwireServer(config, engine)
    await server.start()
    try:
        yield RunningServer(server), engine
    finally:
        await server.close()


def words(n: int = 6) -> str:
    """A fresh prompt: Redis outlives a test, so every test asks something new."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"{tag}{i}" for i in range(n))


def expected(text: str) -> str:
    return "You said: " + text


async def ask(tw: Client, text: str, **params: Any) -> Response:
    """An out-of-band response to `text`: the same prompt however often asked."""
    params.setdefault("temperature", 0)
    return await tw.create_response(
        conversation="none",
        input=[{"type": "message", "role": "user", "content": text}],
        **params,
    )


async def streaming(response: Response, deltas: int = 3) -> None:
    """Until the client holds `deltas` text deltas of it."""
    await until(
        lambda: sum(e["type"] == "response.output_text.delta" for e in response.events) >= deltas,
        f"{deltas} deltas",
    )


def written(server: RunningServer) -> Callable[[], bool]:
    """Whether nothing is in flight or being written: what was stored is in."""
    cache = server.server.registry.stages[0]
    assert isinstance(cache, ResponseCache)
    return lambda: not cache.flights


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_hit_matches_the_miss_without_the_engine(backend: dict[str, Any]) -> None:
    text = words()
    hits = metric("tokenwire_response_cache_hits_total", source="stored")
    stored = metric("tokenwire_response_cache_stored_bytes_total")
    async with cache_server(**backend) as (server, engine):
        async with await connect(server.url) as tw:
            await tw.add_message(text)
            miss = await tw.create_response(temperature=0)
            assert await miss.text() == expected(text)
            first = await miss.done()
        assert "cached_response" not in first["usage"] and engine.generations == 1
        await until(
            lambda: metric("tokenwire_response_cache_stored_bytes_total") > stored, "stored"
        )
        async with await connect(server.url) as tw:  # a new session, the same conversation
            assert tw.session["response_cache"] is True
            await tw.add_message(text)
            hit = await tw.create_response(temperature=0)
            assert await hit.text() == expected(text)
            done = await hit.done()
        assert engine.generations == 1  # no engine work for the hit
        assert done["status"] == "completed" and done["usage"]["cached_response"] is True
        for field in ("input_tokens", "output_tokens"):
            assert done["usage"][field] == first["usage"][field]
        deltas = [e for e in hit.events if e["type"] == "response.output_text.delta"]
        assert 1 <= len(deltas) < len(expected(text).split())  # a few deltas, not per token
    assert metric("tokenwire_response_cache_hits_total", source="stored") == hits + 1


async def test_redis_entries_are_shared_by_instances(redis_server: RedisServer) -> None:
    text = words()
    async with cache_server(redis_url=redis_server.url) as (a, engine_a):
        async with cache_server(redis_url=redis_server.url) as (b, engine_b):
            async with await connect(a.url) as tw:
                assert await (await ask(tw, text)).text() == expected(text)
            await until(written(a), "written")
            async with await connect(b.url) as tw:
                hit = await ask(tw, text)
                assert await hit.text() == expected(text)
                assert (await hit.done())["usage"]["cached_response"] is True
    assert (engine_a.generations, engine_b.generations) == (1, 0)


async def test_single_flight_two_sessions_one_generation(backend: dict[str, Any]) -> None:
    text = words(30)
    followed = metric("tokenwire_response_cache_hits_total", source="in_flight")
    async with cache_server(rate=50, **backend) as (server, engine):
        async with await connect(server.url) as one, await connect(server.url) as two:
            first = await ask(one, text)
            await streaming(first)
            second = await ask(two, text)
            texts = await asyncio.gather(first.text(), second.text())
            assert texts == [expected(text)] * 2
            assert (await second.done())["usage"]["cached_response"] is True
            assert (await first.done())["usage"] == {
                k: v for k, v in (await second.done())["usage"].items() if k != "cached_response"
            }
        assert engine.generations == 1
    assert metric("tokenwire_response_cache_hits_total", source="in_flight") == followed + 1


async def test_a_follower_goes_on_alone_when_the_leader_is_cancelled() -> None:
    text = words(30)
    async with cache_server(rate=50) as (server, engine):
        async with await connect(server.url) as one, await connect(server.url) as two:
            first = await ask(one, text)
            second = await ask(two, text)
            await streaming(second)
            assert (await first.cancel())["status"] == "cancelled"
            assert await second.text() == expected(text)  # whole, nothing twice
            assert (await second.done())["status"] == "completed"
        assert engine.generations == 2
        assert engine.requests[1].resume_token_ids  # it went on after what it had
        # Neither is stored: the leader was cancelled, the follower resumed.
        async with await connect(server.url) as tw:
            again = await ask(tw, text)
            assert "cached_response" not in (await again.done())["usage"]
        assert engine.generations == 3


async def test_cancelling_a_follower_leaves_the_leader_running() -> None:
    text = words(30)
    async with cache_server(rate=50) as (server, engine):
        async with await connect(server.url) as one, await connect(server.url) as two:
            first = await ask(one, text)
            second = await ask(two, text)
            await streaming(second)
            assert (await second.cancel())["status"] == "cancelled"
            assert await first.text() == expected(text)
            assert (await first.done())["status"] == "completed"
            await until(written(server), "written")
            hit = await ask(one, text)
            assert (await hit.done())["usage"]["cached_response"] is True
        assert engine.generations == 1


async def test_tenants_never_share_entries(backend: dict[str, Any]) -> None:
    text = words()
    async with cache_server(api_keys="key-one,key-two", **backend) as (server, engine):
        for key in ("key-one", "key-two"):
            async with await connect(server.url, api_key=key) as tw:
                response = await ask(tw, text)
                assert await response.text() == expected(text)
                assert "cached_response" not in (await response.done())["usage"]
        assert engine.generations == 2  # two misses
        async with await connect(server.url, api_key="key-one") as tw:
            assert (await (await ask(tw, text)).done())["usage"]["cached_response"] is True
        assert engine.generations == 2


async def test_a_cancelled_response_is_not_stored(backend: dict[str, Any]) -> None:
    text = words(30)
    async with cache_server(rate=50, **backend) as (server, engine):
        async with await connect(server.url) as tw:
            first = await ask(tw, text)
            await streaming(first)
            assert (await first.cancel())["status"] == "cancelled"
            again = await ask(tw, text)
            assert await again.text() == expected(text)
            assert "cached_response" not in (await again.done())["usage"]
        assert engine.generations == 2


async def test_a_steered_response_is_not_stored(backend: dict[str, Any]) -> None:
    text = words(30)
    async with cache_server(rate=50, **backend) as (server, engine):
        async with await connect(server.url) as tw:
            await tw.add_message(text)
            first = await tw.create_response(temperature=0)
            await streaming(first)
            await first.steer("and then?")
            assert (await first.done())["status"] == "completed"
        assert engine.generations == 2  # the one steered, and the one after the steer
        async with await connect(server.url) as tw:
            await tw.add_message(text)
            again = await tw.create_response(temperature=0)
            assert await again.text() == expected(text)
            assert "cached_response" not in (await again.done())["usage"]
        assert engine.generations == 3


async def test_entries_expire(backend: dict[str, Any]) -> None:
    text = words()
    # Long enough for the hit to be asked for in time on a busy machine.
    async with cache_server(response_cache_ttl_s=2.0, **backend) as (server, engine):
        async with await connect(server.url) as tw:
            await (await ask(tw, text)).done()
            await until(written(server), "written")
            assert (await (await ask(tw, text)).done())["usage"]["cached_response"] is True
            await asyncio.sleep(2.1)
            expired = await ask(tw, text)
            assert "cached_response" not in (await expired.done())["usage"]
        assert engine.generations == 2


async def test_cache_false_neither_serves_nor_stores(backend: dict[str, Any]) -> None:
    text = words()
    async with cache_server(**backend) as (server, engine):
        async with await connect(server.url) as tw:
            await (await ask(tw, text, cache=False)).done()
            await asyncio.sleep(0.05)
            await (await ask(tw, text)).done()  # not stored by the first: a miss
            assert engine.generations == 2
            await until(written(server), "written")
            bypass = await ask(tw, text, cache=False)  # stored now, yet not served
            assert await bypass.text() == expected(text)
            assert "cached_response" not in (await bypass.done())["usage"]
        assert engine.generations == 3


async def test_temperature_above_zero_bypasses(backend: dict[str, Any]) -> None:
    text = words()
    async with cache_server(**backend) as (server, engine):
        async with await connect(server.url) as tw:
            for _ in range(2):
                response = await ask(tw, text, temperature=1)
                assert "cached_response" not in (await response.done())["usage"]
        assert engine.generations == 2


async def test_a_fixed_seed_takes_part_at_any_temperature(backend: dict[str, Any]) -> None:
    text = words()
    async with cache_server(**backend) as (server, engine):
        async with await connect(server.url) as tw:
            first = await ask(tw, text, temperature=1, seed=7)
            assert "cached_response" not in (await first.done())["usage"]
            again = await ask(tw, text, temperature=1, seed=7)
            assert (await again.done())["usage"]["cached_response"] is True
            assert await again.text() == await first.text()
            other = await ask(tw, text, temperature=1, seed=8)  # another seed: another key
            assert "cached_response" not in (await other.done())["usage"]
        assert engine.generations == 2


async def test_the_memory_cache_evicts_past_its_cap() -> None:
    evictions = metric("tokenwire_response_cache_evictions_total")
    first = words()
    async with cache_server(response_cache_max_bytes=8192) as (server, engine):
        async with await connect(server.url) as tw:
            await (await ask(tw, first)).done()
            for _ in range(40):  # about 100 bytes and 320 of overhead each: 8192 holds 19
                await (await ask(tw, words())).done()
            assert metric("tokenwire_response_cache_evictions_total") > evictions
            again = await ask(tw, first)
            assert "cached_response" not in (await again.done())["usage"]
        assert engine.generations == 42
