"""The response cache's parts without a server: the key, what may be cached
and stored, the stored form, and the in-memory LRU."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from tokenwire.config import ServerConfig
from tokenwire.core.stages import StageContext
from tokenwire.engines.base import EngineDelta, GenerationRequest, ToolCallDelta
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.stages.cache import (
    ResponseCache,
    cache_key,
    cacheable,
    decode_entry,
    encode_entry,
    storable,
)
from tokenwire.stages.cache_store import ENTRY_OVERHEAD, MemoryStore

from ..helpers.wait import until

BASE = GenerationRequest(
    request_id="resp_1-1",
    messages=[{"role": "user", "content": "hello"}],
    max_output_tokens=64,
    temperature=0.0,
)
CONTEXT = StageContext("tenant-a", "sess_1", "resp_1")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.parametrize(
    "changed",
    [
        {"messages": [{"role": "user", "content": "hello!"}]},
        {"rendered": (1, 2, 3)},
        {"temperature": 0.5},
        {"max_output_tokens": 65},
        {"ignore_eos": True},
        {"tools": [TOOL]},
        {"tool_choice": "required"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_each_component_changes_the_key(changed: dict) -> None:
    assert cache_key("m", dataclasses.replace(BASE, **changed), "t") != cache_key("m", BASE, "t")


def test_the_model_and_the_tenant_change_the_key() -> None:
    assert cache_key("m", BASE, "t") != cache_key("m2", BASE, "t")
    assert cache_key("m", BASE, "t") != cache_key("m", BASE, "t2")


def test_the_rendered_prompt_decides_when_present() -> None:
    rendered = dataclasses.replace(BASE, rendered=(5, 6))
    other_chat = dataclasses.replace(rendered, messages=[{"role": "user", "content": "x"}])
    assert cache_key("m", rendered, "t") == cache_key("m", other_chat, "t")
    assert cache_key("m", rendered, "t") != cache_key(
        "m", dataclasses.replace(BASE, rendered=(5, 7)), "t"
    )


def test_ids_priority_and_session_leave_the_key_alone() -> None:
    other = dataclasses.replace(BASE, request_id="resp_9-1", priority=5, session_id="sess_9")
    assert cache_key("m", other, "t") == cache_key("m", BASE, "t")


def test_only_fresh_deterministic_first_generations_are_cacheable() -> None:
    assert cacheable(BASE, CONTEXT)
    assert not cacheable(dataclasses.replace(BASE, temperature=0.7), CONTEXT)
    assert not cacheable(dataclasses.replace(BASE, cache=False), CONTEXT)
    assert not cacheable(dataclasses.replace(BASE, resume_token_ids=(1,)), CONTEXT)
    assert not cacheable(dataclasses.replace(BASE, request_id="resp_1-2"), CONTEXT)  # a steer


def test_only_a_stop_without_tool_calls_is_stored() -> None:
    assert storable([EngineDelta("a", 1), EngineDelta("b", 1, "stop")])
    assert not storable([EngineDelta("a", 1), EngineDelta("b", 1, "length")])
    assert not storable([EngineDelta("a", 1)])  # closed early
    assert not storable([])
    call = EngineDelta("", 1, tool_calls=[ToolCallDelta(0, "f", "{}")])
    assert not storable([call, EngineDelta("", 1, "stop")])


def test_an_entry_streams_back_in_chunks_with_its_usage() -> None:
    recorded = [EngineDelta(f" w{i}", 1, token_ids=[i]) for i in range(40)]
    recorded[0].prompt_tokens, recorded[0].cached_tokens = 12, 4
    recorded[-1].finish_reason = "stop"
    replayed = decode_entry(encode_entry(recorded))
    assert len(replayed) == 3  # 16 + 16 + 8 recorded deltas
    assert "".join(d.text for d in replayed) == "".join(d.text for d in recorded)
    assert [t for d in replayed for t in d.token_ids or ()] == list(range(40))
    assert sum(d.output_tokens for d in replayed) == 40
    assert replayed[0].prompt_tokens == 12 and replayed[0].cached_response
    assert [d.finish_reason for d in replayed] == [None, None, "stop"]
    assert not any(d.cached_response for d in replayed[1:])


async def test_the_memory_lru_evicts_the_least_recently_used_past_its_cap() -> None:
    now = [0.0]
    entry = 100 + ENTRY_OVERHEAD  # what an entry of 100 bytes costs
    store = MemoryStore(max_bytes=8 * entry, ttl_s=10, clock=lambda: now[0])
    evictions = metric("tokenwire_response_cache_evictions_total")
    for name in "abcd":
        assert await store.put(name, name.encode() * 100)  # the entry cap is an 8th
    assert not await store.put("big", b"x" * 101)
    assert await store.get("a") == b"a" * 100  # now the most recently used
    for name in "efgh":
        await store.put(name, name.encode() * 100)
    assert store.bytes == 8 * entry
    assert metric("tokenwire_response_cache_evictions_total") == evictions
    await store.put("i", b"i" * 100)  # one over: b goes, a was used since
    assert await store.get("b") is None and await store.get("a") is not None
    assert metric("tokenwire_response_cache_evictions_total") == evictions + 1
    assert metric("tokenwire_response_cache_memory_bytes") == 8 * entry


async def test_short_answers_count_what_their_entries_hold() -> None:
    """An entry's digest, tuple and slot count too (~320 B): ten thousand
    18-byte answers once held 18x the cap."""
    import tracemalloc

    store = MemoryStore(max_bytes=64 * 1024, ttl_s=10)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            await store.put(hashlib.sha256(str(i).encode()).hexdigest(), b"x" * 18)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.bytes <= 64 * 1024
    assert held < 1.5 * 64 * 1024


async def test_memory_entries_expire() -> None:
    now = [0.0]
    store = MemoryStore(max_bytes=8 * (1 + ENTRY_OVERHEAD), ttl_s=10, clock=lambda: now[0])
    await store.put("a", b"a")
    now[0] = 9.9
    assert await store.get("a") == b"a"
    now[0] = 10.0
    assert await store.get("a") is None and store.bytes == 0


class Broken:
    """A backend whose every call fails, as Redis down would."""

    max_entry_bytes = 1 << 20

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, digest: str) -> bytes | None:
        self.calls += 1
        raise ConnectionError("down")

    async def put(self, digest: str, data: bytes) -> bool:
        self.calls += 1
        raise ConnectionError("down")


async def test_a_failing_backend_is_a_miss_never_an_error() -> None:
    backend = Broken()
    cache = ResponseCache(backend, "m")
    engine = ScriptedEngine()

    async def run() -> str:
        stream = cache.stream(BASE, CONTEXT, engine.generate)
        return "".join([d.text async for d in stream])

    assert await run() == "You said: hello"
    await until(lambda: backend.calls == 2 and not cache.flights, "the write tried")
    assert await run() == "You said: hello"


async def test_the_key_has_the_model_the_engine_serves() -> None:
    """Not --model, which may be unset (a remote's served name, vLLM's own
    --model): two engines serving different models never share entries, and
    nothing is cached before the engine knows what it serves."""
    from tokenwire.stages import served_model

    class Remote:
        name, model = "remote", ""

    engine = Remote()
    model = served_model(engine, ServerConfig())  # type: ignore[arg-type]
    assert model() is None
    engine.model = "llama-8b"
    assert model() is not None and model().startswith("remote:llama-8b:")
    request = GenerationRequest("r", [{"role": "user", "content": "hi"}], temperature=0)
    context = StageContext("anonymous", "s", "r")
    assert cache_key("remote:llama-8b", request, "t") != cache_key("remote:llama-70b", request, "t")

    calls: list[GenerationRequest] = []

    async def source(req: GenerationRequest) -> AsyncIterator[EngineDelta]:
        calls.append(req)
        yield EngineDelta("hi", 1, "stop", token_ids=[1])

    engine.model = ""
    cache = ResponseCache(MemoryStore(1 << 20, 60), model)
    out = [d async for d in cache.stream(request, context, source)]
    assert [d.text for d in out] == ["hi"] and len(calls) == 1
    assert not cache.flights and not cache.backend.entries  # type: ignore[attr-defined]


def test_the_key_has_the_flags_that_shape_the_output() -> None:
    """Instances sharing a Redis cache with another --tool-parser, --dtype or
    vLLM argument would split or write text differently: their keys differ."""
    from tokenwire.stages import served_model

    class Vllm:
        name, model = "vllm", "/models/smollm2"

    engine = Vllm()

    def tag(**flags: object) -> str | None:
        return served_model(engine, ServerConfig(**flags))()  # type: ignore[arg-type]

    base = tag()
    assert base == tag()  # stable: instances with the same flags share entries
    others = [
        tag(tool_parser="hermes"),
        tag(dtype="bfloat16"),
        tag(max_model_len=2048),
        tag(vllm_args=("--quantization", "fp8")),
        tag(vllm_args=("--chat-template", "/t.jinja")),
    ]
    assert len({base, *others}) == 1 + len(others)


async def test_a_request_with_tools_runs_its_own_generation_beside_a_twin() -> None:
    """A follower whose leader stops short resumes after its token ids; a tool
    parser or a forced call's grammar cannot start in the middle of a call,
    so a request with tools does not follow (the twin without tools does)."""
    import asyncio

    started: list[str] = []
    gate = asyncio.Event()

    async def source(req: GenerationRequest) -> AsyncIterator[EngineDelta]:
        started.append(req.request_id)
        yield EngineDelta("<tool_call>", 1, None, token_ids=[1])
        await gate.wait()
        yield EngineDelta("", 1, "stop", token_ids=[2], tool_calls=[ToolCallDelta(0, "f", "{}")])

    cache = ResponseCache(MemoryStore(1 << 20, 60), "m")

    async def ask(request: GenerationRequest) -> list[EngineDelta]:
        return [d async for d in cache.stream(request, CONTEXT, source)]

    for tools in ([TOOL], None):
        started.clear()
        gate.clear()
        request = dataclasses.replace(BASE, tools=tools)
        leader = asyncio.create_task(ask(request))
        await until(lambda: started, "the leader running")
        twin = asyncio.create_task(ask(request))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(leader, twin)
        assert len(started) == (2 if tools else 1)
        assert twin.result()[-1].tool_calls == [ToolCallDelta(0, "f", "{}")]
        await until(lambda: not cache.flights, "the flight over")
