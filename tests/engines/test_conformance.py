"""The Engine interface's conformance suite: every engine passes it before
anything else (docs/architecture.md, "Adding an engine").

It runs against the scripted engine, the real vLLM engine (SmolLM2 on the
CPU, in this process; one engine for the module), and the remote engine in
front of a real `vllm serve` (one server for the whole run), through each of
its two endpoints: /inference/v1/generate and /v1/completions. It checks what the
session relies on: deltas with a finish reason on the last, usage on the
first, max_output_tokens, the preflight and its rendered prompt, resuming
after token ids, forced tool calls, and that closing the stream frees the
engine. A capability the engine does not claim is not tested.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from itertools import accumulate

import pytest
import pytest_asyncio

from tokenwire.config import ServerConfig
from tokenwire.engines.base import (
    ContextLengthExceeded,
    Engine,
    EngineCapabilities,
    EngineDelta,
    EngineUnavailable,
    GenerationRequest,
    RequestError,
)
from tokenwire.engines.scripted import ScriptedEngine

from ..helpers.template_engine import EncodeRecorder

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
_counter = iter(range(1_000_000))


def request(text: str = "What is the capital of France?", **kw: object) -> GenerationRequest:
    fields = {"temperature": 0.0, "max_output_tokens": 16, **kw}
    return GenerationRequest(
        request_id=f"conf-{next(_counter)}",
        messages=[{"role": "user", "content": text}],
        **fields,  # type: ignore[arg-type]
    )


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=[
        "scripted",
        pytest.param("vllm", marks=pytest.mark.vllm),
        pytest.param("remote", marks=pytest.mark.vllm),
        pytest.param("remote-completions", marks=pytest.mark.vllm),
    ],
)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    if request.param == "scripted":
        made: Engine = ScriptedEngine(tokens_per_s=2000)
    elif request.param.startswith("remote"):
        from tokenwire.engines.remote import RemoteEngine

        server = request.getfixturevalue("vllm_openai")
        remote = RemoteEngine(ServerConfig(engine="remote", remote_url=(server.url,)))
        await remote.start()
        assert [r.generate_endpoint for r in remote.replicas] == [True]  # --enable-scale-out
        if request.param == "remote-completions":
            # The portable path every server and router offers; the same server serves both.
            for replica in remote.replicas:
                replica.generate_endpoint = False
        try:
            yield remote
        finally:
            await remote.close()
        return
    else:
        from tokenwire.engines.vllm import VllmEngine

        made = VllmEngine(
            ServerConfig(
                engine="vllm", kv_cache_gib=1.0, max_model_len=2048, vllm_args=("--enforce-eager",)
            )
        )
    await made.start()
    try:
        yield made
    finally:
        await made.close()


async def collect(engine: Engine, req: GenerationRequest) -> list[EngineDelta]:
    return [delta async for delta in engine.generate(req)]


def text_of(deltas: list[EngineDelta]) -> str:
    return "".join(d.text for d in deltas)


async def until_idle(engine: Engine, when: str) -> None:
    """The engine holds no request (running, waiting or unfinished) within 10 s."""
    deadline = time.monotonic() + 10
    while True:
        load = engine.load()
        if load.running == 0 and load.waiting == 0 and load.extra.get("unfinished", 0) == 0:
            return
        assert time.monotonic() < deadline, f"still held {when}: {load}"
        await asyncio.sleep(0.02)


async def test_declares_itself(engine: Engine) -> None:
    assert isinstance(engine.name, str) and engine.name
    assert isinstance(engine.capabilities, EngineCapabilities)
    assert engine.ready
    load = engine.load()
    assert load.running >= 0 and load.waiting >= 0


async def test_stream_shape(engine: Engine) -> None:
    deltas = await collect(engine, request())
    assert deltas, "no output at all"
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason in ("stop", "length")
    # Usage comes with the first delta; an engine that learns the cached count
    # only at the end (a remote server) gives it on the last, with a prompt of
    # 0 (usage adds up). Nowhere else.
    assert deltas[0].prompt_tokens is not None and deltas[0].prompt_tokens > 0
    assert all(d.prompt_tokens is None for d in deltas[1:-1])
    assert len(deltas) == 1 or deltas[-1].prompt_tokens in (None, 0)
    cached = [d.cached_tokens for d in deltas if d.prompt_tokens is not None]
    assert [c for c in cached if c is not None], "no cached_tokens reported"
    assert all(c >= 0 for c in cached if c is not None)
    total = sum(d.output_tokens for d in deltas)
    assert 1 <= total <= 16
    assert text_of(deltas).strip()
    # Token ids, when given, are one per output token.
    if any(d.token_ids is not None for d in deltas):
        assert sum(len(d.token_ids or ()) for d in deltas) == total


async def test_max_output_tokens_is_exact_with_ignore_eos(engine: Engine) -> None:
    deltas = await collect(engine, request(max_output_tokens=7, ignore_eos=True))
    assert sum(d.output_tokens for d in deltas) == 7
    assert deltas[-1].finish_reason == "length"


async def test_stream_interval_groups_tokens_and_keeps_the_text(engine: Engine) -> None:
    """The first token at once, then groups of stream_interval, the rest last;
    the same text and token ids as one token per delta."""
    one = await collect(engine, request("Tell me a story.", max_output_tokens=18, ignore_eos=True))
    grouped = await collect(
        engine,
        request("Tell me a story.", max_output_tokens=18, ignore_eos=True, stream_interval=4),
    )
    # Ends of deltas: after token 1, 5, 9, 13, 17, 18 ([1, 4, 4, 4, 4, 1]). A
    # consumer that falls behind may get two as one, so each end is checked.
    ends = list(accumulate(d.output_tokens for d in grouped))
    assert ends[-1] == 18 and len(ends) <= 6, ends
    assert all(end % 4 == 1 for end in ends[:-1]), ends
    assert [d.finish_reason for d in grouped][-2:] == [None, "length"]
    assert text_of(grouped) == text_of(one)
    assert [t for d in grouped for t in d.token_ids or ()] == [
        t for d in one for t in d.token_ids or ()
    ]


async def test_preflight_refuses_what_cannot_fit(engine: Engine) -> None:
    # Every engine here claims it; a claim that went away must fail, not hide.
    assert engine.capabilities.preflight, f"{engine.name} claims no preflight"
    with pytest.raises(ContextLengthExceeded) as caught:
        engine.preflight(request("word " * 20_000))
    assert isinstance(caught.value, RequestError) and caught.value.message


async def test_preflight_rendering_is_what_generate_uses(engine: Engine) -> None:
    # Every engine here claims it; a claim that went away must fail, not hide.
    assert engine.capabilities.preflight, f"{engine.name} claims no preflight"
    req = request(max_output_tokens=12)
    rendered = engine.preflight(req)
    assert rendered is None or (
        isinstance(rendered, tuple) and rendered and all(isinstance(t, int) for t in rendered)
    )
    plain = await collect(engine, req)
    carried = await collect(
        engine, replace(req, request_id=req.request_id + "-r", rendered=rendered)
    )
    assert text_of(carried) == text_of(plain)  # temperature 0: the same prompt, the same answer
    assert carried[0].prompt_tokens == plain[0].prompt_tokens


async def test_a_long_prompt_left_to_generate_is_tokenized_off_the_loop(engine: Engine) -> None:
    """A generation no client event preflighted (a tool round's continuation,
    a takeover) has generate render its prompt: a long one in a worker thread."""
    template = getattr(engine, "_template", None)
    if template is None:
        assert engine.name == "scripted"  # it renders no prompt at all
        return
    long = request("tell me more " * 400, max_output_tokens=4, ignore_eos=True)
    with EncodeRecorder(template.tokenizer) as encodes:
        deltas = await collect(engine, long)
    assert [(e.chars > 4096, encodes.on_loop(e), e.loop_ran) for e in encodes.calls] == [
        (True, False, True)  # once, in a thread, while the loop went on
    ]
    assert sum(d.output_tokens for d in deltas) == 4
    assert deltas[0].prompt_tokens == len(template.prompt_ids(long, 2048))


async def test_resume_from_token_ids_continues_exactly(engine: Engine) -> None:
    assert engine.capabilities.resume_from_token_ids, f"{engine.name} cannot resume"
    whole = await collect(
        engine, request("Tell me a story.", max_output_tokens=20, ignore_eos=True)
    )
    ids = [t for d in whole for t in d.token_ids or ()]
    assert len(ids) == 20
    head: list[EngineDelta] = []
    count = 0
    for d in whole:  # the deltas that made the first ~8 tokens
        if count >= 8:
            break
        head.append(d)
        count += d.output_tokens
    resumed = await collect(
        engine,
        request(
            "Tell me a story.",
            max_output_tokens=20 - count,
            ignore_eos=True,
            resume_token_ids=tuple(ids[:count]),
        ),
    )
    assert sum(d.output_tokens for d in resumed) == 20 - count
    assert text_of(head) + text_of(resumed) == text_of(whole)


async def test_forced_tool_call_streams_valid_arguments(engine: Engine) -> None:
    req = request(
        "What is the weather in Paris?",
        max_output_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    deltas = await collect(engine, req)
    chunks = [c for d in deltas for c in d.tool_calls or ()]
    assert chunks, "a forced call produced no call"
    assert {c.index for c in chunks} == {0}
    assert chunks[0].name == "get_weather"
    assert all(c.name is None for c in chunks[1:])
    arguments = json.loads("".join(c.arguments for c in chunks))
    assert isinstance(arguments, dict) and isinstance(arguments.get("city"), str)
    assert not text_of(deltas)  # a forced call is not text


async def test_closing_the_stream_frees_the_engine(engine: Engine) -> None:
    stream = engine.generate(
        request("Tell me a long story.", max_output_tokens=400, ignore_eos=True)
    )
    first = await anext(stream)
    assert first.finish_reason is None
    await stream.aclose()
    # Its own books let the request go at once (vLLM's output processor, the
    # gateway's count), not once a generator left behind is collected.
    assert engine.load().extra.get("unfinished", 0) == 0
    await until_idle(engine, "after aclose()")


async def test_cancelling_the_consuming_task_frees_the_engine(engine: Engine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(
            request("Count to a thousand.", max_output_tokens=400, ignore_eos=True)
        ):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until_idle(engine, "after cancel")


@pytest.mark.vllm
async def test_an_engine_whose_process_died_is_unavailable_and_not_ready() -> None:
    """vLLM's engine process killed under a running engine: what is in flight
    and what comes after fail as engine_unavailable, and the engine no longer
    reports ready (/readyz), with a failure that says what to do."""
    import signal

    import psutil

    from tokenwire.engines.vllm import DIED, VllmEngine

    engine = VllmEngine(
        ServerConfig(
            engine="vllm", kv_cache_gib=1.0, max_model_len=2048, vllm_args=("--enforce-eager",)
        )
    )
    me = psutil.Process()
    before = {p.pid for p in me.children()}  # other engines' processes: not these
    await engine.start()
    try:
        assert engine.ready and engine.failure is None
        stream = engine.generate(request("Count to a thousand.", max_output_tokens=2000))
        await anext(stream)
        ours = [p for p in me.children() if p.pid not in before]
        ours = [p for p in ours if p.name().startswith("VLLM::")]  # its EngineCore
        killed = [p for c in ours for p in (c, *c.children(recursive=True))]
        assert killed
        for child in killed:
            child.send_signal(signal.SIGKILL)
        with pytest.raises(EngineUnavailable, match="restart tokenwire"):
            async for _ in stream:
                pass
        with pytest.raises(EngineUnavailable):
            await collect(engine, request())
        assert not engine.ready
        assert engine.failure == DIED
    finally:
        await engine.close()


@pytest.mark.vllm
async def test_an_unknown_tool_parser_fails_before_the_engine_is_built() -> None:
    from tokenwire.engines.vllm import VllmEngine

    engine = VllmEngine(ServerConfig(engine="vllm", tool_parser="nope"))
    with pytest.raises(EngineUnavailable, match=r"'nope' is not one of vLLM's .*hermes"):
        await engine.start()
    assert engine._llm is None  # refused before 25 s of building
    assert not engine.ready


@pytest.mark.vllm
async def test_a_failed_engine_is_unavailable_not_a_bad_request() -> None:
    from tokenwire.engines.vllm import VllmEngine

    broken = VllmEngine(ServerConfig(engine="vllm", model="/nonexistent/model"))
    with pytest.raises(Exception):  # noqa: B017 - whatever the start failed with
        await broken.start()
    assert not broken.ready
    with pytest.raises(EngineUnavailable):
        await collect(broken, request())
