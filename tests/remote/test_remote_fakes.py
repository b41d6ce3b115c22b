"""The remote engine against stand-in servers (small aiohttp servers on
loopback ports): what a real vLLM cannot be made to do on demand. Garbage or
an error mid-stream, 5xx answers, the endpoint fallback, what each request
carries. The real tokenizer (the bundled SmolLM2) renders the prompts; no
model runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from tokenwire.config import ServerConfig
from tokenwire.engines.base import (
    ContextLengthExceeded,
    EngineDelta,
    EngineUnavailable,
    GenerationRequest,
    RequestError,
)
from tokenwire.engines.chat_template import ChatTemplate
from tokenwire.engines.remote import RemoteEngine
from tokenwire.engines.remote_http import ReplicaFailed, error_for, parse_chunk
from tokenwire.engines.replicas import Replica, replica_order
from tokenwire.models import resolve_model

from ..conftest import free_port
from ..helpers.template_engine import EncodeRecorder
from ..helpers.wait import until

MODEL = str(resolve_model(None))
TEMPLATE = ChatTemplate(AutoTokenizer.from_pretrained(MODEL))
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def sse(*chunks: dict | str) -> bytes:
    lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    return "".join([*lines, "data: [DONE]\n\n"]).encode()


def token(text: str, tid: int, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": [tid], "finish_reason": finish}]}


def usage(cached: int | None) -> dict:
    details = None if cached is None else {"cached_tokens": cached}
    return {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": details}}


@dataclass
class Reply:
    """A stand-in's answer: a status and a body, whole or streamed."""

    status: int = 200
    content: bytes | AsyncIterator[bytes] = b""
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    async def send(self, request: web.Request) -> web.StreamResponse:
        if isinstance(self.content, bytes):
            body = self.content if self.json is None else json.dumps(self.json).encode()
            return web.Response(status=self.status, body=body, headers=self.headers)
        resp = web.StreamResponse(status=self.status, headers=self.headers)
        await resp.prepare(request)
        async for piece in self.content:
            await resp.write(piece)
        await resp.write_eof()
        return resp


FAKES: list[Fake] = []


@dataclass
class Fake:
    """One stand-in vLLM server on a loopback port: startup routes answer as
    vLLM's do; `stream` answers generation requests."""

    stream: Callable[[dict], Reply]
    generate_endpoint: bool = True
    structured_outputs: bool = True  # honours them, as vLLM 0.32 does
    healthy: bool = True  # what GET /health says
    returns_ids: bool = True  # token ids with the text, as vLLM >= 0.10.2
    tokenize_page: bytes | None = None  # what /tokenize answers instead of JSON
    bodies: list[dict] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    health_checks: int = 0
    aborts: list[tuple[dict, Any]] = field(default_factory=list)
    url: str = ""  # once started
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        # Stopped at once: some handlers stall on purpose.
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        FAKES.append(self)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        reply = await self.answer(request)
        return await reply.send(request)

    async def answer(self, request: web.Request) -> Reply:
        path = request.path
        if path == "/v1/models":
            return Reply(json={"data": [{"id": MODEL, "max_model_len": 2048}]})
        if path == "/health":
            self.health_checks += 1
            return Reply(200 if self.healthy else 503)
        body = await request.json()
        if path == "/inference/v1/abort_requests":
            self.aborts.append((body, request.headers))
            return Reply(json={})
        if path == "/tokenize":
            if self.tokenize_page is not None:
                return Reply(200, content=self.tokenize_page)
            return Reply(json={"tokens": TEMPLATE.render(body["messages"])})
        if path == "/inference/v1/generate" and not self.generate_endpoint:
            return Reply(403)
        if not body.get("stream"):  # the startup probe
            params = body.get("sampling_params", body)
            held = params.get("structured_outputs") and self.structured_outputs
            answer = params["structured_outputs"]["choice"][0][0] if held else "Rome"
            choice = {"text": answer, **({"token_ids": [5]} if self.returns_ids else {})}
            return Reply(json={"choices": [choice], "usage": {"prompt_tokens_details": {}}})
        self.bodies.append(body)
        self.headers.append(request.headers)
        return self.stream(body)


@pytest.fixture(autouse=True)
async def _stop_fakes() -> AsyncIterator[None]:
    yield
    while FAKES:
        runner = FAKES.pop().runner
        assert runner is not None
        await runner.cleanup()


async def started(*fakes: Fake, **config: Any) -> RemoteEngine:
    for fake in fakes:
        if not fake.url:
            await fake.start()
    engine = RemoteEngine(
        ServerConfig(engine="remote", remote_url=tuple(f.url for f in fakes), **config)
    )
    await engine.start()
    return engine


def failures(url: str) -> float:
    return REGISTRY.get_sample_value("tokenwire_remote_failures_total", {"replica": url}) or 0.0


def ask(**kw: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hi"}],
        "request_id": "r1",
        "temperature": 0.0,
        "max_output_tokens": 10,
        **kw,
    }
    return GenerationRequest(**fields)


async def run(engine: RemoteEngine, req: GenerationRequest) -> list[EngineDelta]:
    try:
        return [d async for d in engine.generate(req)]
    finally:
        await engine.close()


async def test_a_replica_sending_garbage_hands_over_with_the_ids_so_far() -> None:
    a = Fake(
        lambda b: Reply(200, content=sse(token("Hel", 11), token("lo", 12), "this is not json")),
    )
    b = Fake(
        lambda b: Reply(200, content=sse(token(" there", 13), token("!", 14, "stop"), usage(20))),
    )
    engine = await started(a, b)
    failed_before = failures(a.url), failures(b.url)
    deltas = await run(engine, ask(session_id=None))  # no session: replica order as given
    assert (failures(a.url), failures(b.url)) == (
        failed_before[0] + 1,
        failed_before[1],
    )
    assert REGISTRY.get_sample_value("tokenwire_remote_up", {"replica": a.url}) == 0.0
    assert REGISTRY.get_sample_value("tokenwire_remote_up", {"replica": b.url}) == 1.0
    assert "".join(d.text for d in deltas) == "Hello there!"
    assert [t for d in deltas for t in d.token_ids or ()] == [11, 12, 13, 14]
    prompt = TEMPLATE.render([{"role": "user", "content": "Hi"}])
    assert a.bodies[0]["token_ids"] == prompt
    # b continued after what a produced, with what was left of the budget.
    assert b.bodies[0]["token_ids"] == [*prompt, 11, 12]
    assert b.bodies[0]["sampling_params"]["max_tokens"] == 8
    assert b.bodies[0]["request_id"] == "r1-retry1"
    assert engine.replicas[0].failures == 1 and not engine.replicas[0].up
    # Usage: the prompt once, on the first delta; the cached count at the end.
    assert deltas[0].prompt_tokens == len(prompt)
    assert [d.prompt_tokens for d in deltas[1:]] == [None, None, 0]
    assert deltas[-1].cached_tokens == 20 and deltas[-1].finish_reason == "stop"


async def test_an_error_about_the_request_does_not_fail_over() -> None:
    error = {"error": {"message": "bad logits", "type": "BadRequestError", "code": 400}}
    a = Fake(lambda b: Reply(200, content=sse(token("x", 1), error)))
    b = Fake(lambda b: Reply(200, content=sse(token("y", 2, "stop"))))
    engine = await started(a, b)
    with pytest.raises(RequestError, match="bad logits"):
        await run(engine, ask())
    assert b.bodies == [] and engine.replicas[0].up


async def test_every_replica_failing_is_engine_unavailable() -> None:
    down = lambda b: Reply(503, json={"error": {"message": "overloaded"}})  # noqa: E731
    a, b = Fake(down), Fake(down)
    engine = await started(a, b)
    with pytest.raises(EngineUnavailable) as caught:
        await run(engine, ask())
    assert f"{a.url} answered 503: overloaded" in caught.value.message
    assert f"{b.url} answered 503: overloaded" in caught.value.message


async def test_a_context_error_is_the_requests_fault() -> None:
    too_long = {"error": {"message": "This model's maximum context length is 2048 tokens"}}
    a = Fake(lambda b: Reply(400, json=too_long))
    engine = await started(a)
    with pytest.raises(ContextLengthExceeded):
        await run(engine, ask())
    assert engine.replicas[0].up


async def test_a_stream_that_ends_unfinished_fails_over() -> None:
    a = Fake(
        lambda b: Reply(200, content=b"data: " + json.dumps(token("A", 1)).encode() + b"\n\n"),
    )  # no finish, no [DONE]: the server died
    b = Fake(lambda b: Reply(200, content=sse(token("B", 2, "length"))))
    engine = await started(a, b)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "AB"
    assert b.bodies[0]["token_ids"][-1] == 1


async def test_cached_tokens_never_exceed_the_prompt_after_a_resubmission() -> None:
    """A lone replica's stream breaks; the resubmission (prompt + ids so far)
    hits its warm cache, which counts the ids too."""
    replies = [
        Reply(200, content=b"data: " + json.dumps(token("A", 1)).encode() + b"\n\n"),
        Reply(200, content=sse(token("B", 2, "stop"), usage(5000))),
    ]
    a = Fake(lambda b: replies.pop(0))
    engine = await started(a)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "AB"
    prompt = deltas[0].prompt_tokens
    assert prompt is not None and deltas[-1].cached_tokens == prompt


async def test_requests_carry_session_priority_and_a_forced_tool_schema() -> None:
    a = Fake(
        lambda b: Reply(
            200, content=sse(token('{"city": ', 1), token('"Paris"}', 2, "stop"), usage(0))
        ),
    )
    engine = await started(a, remote_session_header="X-Affinity")
    deltas = await run(
        engine,
        ask(
            session_id="sess-9",
            priority=5,
            cache_salt="tenant-1",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
        ),
    )
    body, headers = a.bodies[0], a.headers[0]
    assert headers["X-Affinity"] == "sess-9" and "X-Session-ID" not in headers
    # vLLM names the request by X-Request-Id when there is one: the abort's id.
    assert headers["X-Request-Id"] == body["request_id"] == "r1"
    assert body["priority"] == 5 and body["cache_salt"] == "tenant-1"
    schema = body["sampling_params"]["structured_outputs"]["json"]
    assert schema["type"] == "object" and "city" in schema["properties"]
    calls = [c for d in deltas for c in d.tool_calls or ()]
    assert calls[0].name == "get_weather"
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris"}
    assert not "".join(d.text for d in deltas)


async def test_without_the_generate_endpoint_it_uses_completions() -> None:
    a = Fake(
        lambda b: Reply(200, content=sse(token("ok", 7, "stop"), usage(None))),
        generate_endpoint=False,
    )
    engine = await started(a)
    assert engine.replicas[0].generate_endpoint is False
    deltas = await run(engine, ask())
    body = a.bodies[0]
    assert body["prompt"] == TEMPLATE.render([{"role": "user", "content": "Hi"}])
    assert body["model"] == MODEL and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 10
    assert "priority" not in body and "cache_salt" not in body  # vLLM's defaults: not sent
    # No --enable-prompt-tokens-details: the cached count is unknown, not 0.
    assert deltas[-1].cached_tokens is None


def test_chunks_and_errors_are_classified() -> None:
    with pytest.raises(ReplicaFailed):
        parse_chunk("{not json", "http://x")
    assert parse_chunk(json.dumps(usage(64)), "http://x").cached_tokens == 64
    assert isinstance(error_for(502, "", "http://x"), ReplicaFailed)
    assert isinstance(error_for(429, "", "http://x"), EngineUnavailable)
    assert type(error_for(400, '{"error": {"message": "no"}}', "http://x")) is RequestError
    # Chunks of the wrong shape fail the attempt, so another replica is tried.
    for wrong in (
        {"error": {"code": "oops"}},
        {"choices": ["text"]},
        {"usage": {"prompt_tokens_details": 5}},
        {"choices": [{"token_ids": 7}]},
        # Ids go back to a server on a resume or failover: only ints >= 0.
        {"choices": [{"text": "x", "token_ids": "12"}]},
        {"choices": [{"text": "x", "token_ids": {"a": 1}}]},
        *({"choices": [{"text": "x", "token_ids": [bad]}]} for bad in (None, -3, 1.5, True)),
        {"choices": [{"text": 5, "token_ids": [1]}]},
        {"choices": [{"text": "x", "token_ids": [1], "finish_reason": 7}]},
        *({"usage": {"prompt_tokens_details": {"cached_tokens": bad}}} for bad in ("lots", -5)),
    ):
        with pytest.raises(ReplicaFailed, match="malformed chunk"):
            parse_chunk(json.dumps(wrong), "http://x")
    with pytest.raises(ReplicaFailed, match="not JSON"):
        parse_chunk(b'{"choices": [{"text": "\xff", "token_ids": [1]}]}', "http://x")
    # A missing endpoint, auth or routing, any other 4xx (as documented) or an
    # unexpected 2xx is the server's fault: another replica may do.
    for status in (401, 403, 404, 405, 409, 410, 415, 421, 431, 451, 201, 204):
        assert isinstance(error_for(status, '{"detail": "Not Found"}', "http://x"), ReplicaFailed)
    for status in (400, 413, 422):
        assert type(error_for(status, "", "http://x")) is RequestError


@pytest.mark.parametrize("generate_endpoint", [True, False])
async def test_a_server_that_returns_no_token_ids_is_refused_at_start(
    generate_endpoint: bool,
) -> None:
    """Text without ids would repeat text on a failover or a resume."""
    fake = Fake(lambda b: Reply(500), generate_endpoint=generate_endpoint, returns_ids=False)
    with pytest.raises(EngineUnavailable, match="without its token ids"):
        await started(fake)


async def test_a_page_instead_of_json_at_start_is_named_not_a_traceback() -> None:
    fake = Fake(lambda b: Reply(500), tokenize_page=b"<html>Bad gateway</html>")
    with pytest.raises(EngineUnavailable, match=r"did not answer with a JSON object.*Bad gateway"):
        await started(fake)


async def test_a_missing_endpoint_fails_over() -> None:
    """A replica restarted without --enable-scale-out answers 404 on the
    endpoint found at startup: the next replica serves the request."""
    a = Fake(lambda b: Reply(404, json={"detail": "Not Found"}))
    b = Fake(lambda b: Reply(200, content=sse(token("B", 2, "stop"))))
    engine = await started(a, b)
    deltas = await run(engine, ask(session_id=None))
    assert "".join(d.text for d in deltas) == "B" and not engine.replicas[0].up


async def test_an_endless_line_or_error_body_is_cut_short_and_fails_over() -> None:
    """Bytes with no end of line (a proxy's binary page, say), or an error
    answer that never ends: read up to a bound, then the next replica."""

    sent = [0]

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"x" * 65536
            sent[0] += 65536
            await asyncio.sleep(0)

    for status in (200, 503):
        sent[0] = 0
        a = Fake(lambda b, status=status: Reply(status, content=endless()))
        b = Fake(lambda b: Reply(200, content=sse(token("B", 2, "stop"))))
        engine = await started(a, b)
        deltas = await run(engine, ask(session_id=None))
        assert "".join(d.text for d in deltas) == "B" and not engine.replicas[0].up
        # What was read (4 MiB of a line, 64 KiB of an error) and what the
        # sockets' buffers took before the gateway hung up.
        assert sent[0] < 24 << 20, f"{sent[0] >> 20} MiB read for status {status}"


@pytest.mark.parametrize("filler", [b": ping\n\n", b"data: {}\n\n"])
async def test_keep_alives_alone_do_not_keep_a_stream_alive(filler: bytes) -> None:
    """A server (or a proxy) that sends SSE comments, or empty chunks, and
    nothing else resets the read timeout with every one: after
    --remote-timeout-s of them, the next replica continues the generation."""

    async def pinging() -> AsyncIterator[bytes]:
        yield b"data: " + json.dumps(token("A", 1)).encode() + b"\n\n"
        while True:
            await asyncio.sleep(0.05)
            yield filler

    a = Fake(lambda b: Reply(200, content=pinging()))
    b = Fake(lambda b: Reply(200, content=sse(token("B", 2, "stop"))))
    engine = await started(a, b, remote_timeout_s=0.5)
    deltas = await asyncio.wait_for(run(engine, ask(session_id=None)), 30)  # else: forever
    assert "".join(d.text for d in deltas) == "AB"
    assert b.bodies[0]["token_ids"][-1] == 1 and not engine.replicas[0].up


async def test_a_stream_that_goes_on_after_its_end_is_left() -> None:
    """After the finishing chunk only the usage may come: chunks without end
    do not hold the finish back."""

    async def endless() -> AsyncIterator[bytes]:
        yield b"data: " + json.dumps(token("A", 1, "stop")).encode() + b"\n\n"
        while True:
            await asyncio.sleep(0.01)
            yield b"data: " + json.dumps(token("x", 9)).encode() + b"\n\n"

    a = Fake(lambda b: Reply(200, content=endless()))
    engine = await started(a)
    deltas = await asyncio.wait_for(run(engine, ask()), 30)  # else: forever
    assert "".join(d.text for d in deltas) == "A" and deltas[-1].finish_reason == "stop"


async def test_a_server_that_ignores_max_tokens_is_cut_at_it() -> None:
    async def runaway() -> AsyncIterator[bytes]:
        for i in range(1000):
            yield b"data: " + json.dumps(token(f" w{i}", 100 + i)).encode() + b"\n\n"

    a = Fake(lambda b: Reply(200, content=runaway()))
    engine = await started(a)
    deltas = await asyncio.wait_for(run(engine, ask(max_output_tokens=3)), 30)
    assert "".join(d.text for d in deltas) == " w0 w1 w2"
    assert sum(d.output_tokens for d in deltas) == 3
    assert deltas[-1].finish_reason == "length"


async def test_nothing_after_the_finishing_chunk_is_passed_on() -> None:
    a = Fake(lambda b: Reply(200, content=sse(token("A", 1, "stop"), token("B", 2), usage(0))))
    engine = await started(a)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "A"
    assert [t for d in deltas for t in d.token_ids or ()] == [1]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].cached_tokens == 0


def test_sessions_keep_their_replica() -> None:

    replicas = [Replica(f"http://r{i}") for i in range(3)]
    firsts = {replica_order(replicas, f"s{i}")[0].url for i in range(30)}
    assert firsts == {r.url for r in replicas}  # spread over all of them
    assert all(replica_order(replicas, "s7")[0] is replica_order(replicas, "s7")[0] for _ in "ab")
    pinned = replica_order(replicas, "s7")[0]
    pinned.state = "down"
    assert replica_order(replicas, "s7")[-1] is pinned  # down: tried last


async def test_an_unreachable_server_is_unavailable_and_named() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(url,)))
    with pytest.raises(EngineUnavailable, match=f"cannot reach {url}"):
        await engine.start()
    assert not engine.ready and engine.failure
    with pytest.raises(EngineUnavailable):
        await run(engine, ask())


def test_serve_refuses_an_unreachable_server_with_code_2() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "tokenwire", "serve", "--engine", "remote", "--remote-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"error: --engine remote: cannot reach {url}" in done.stderr
    assert "Traceback" not in done.stderr
    orphan = subprocess.run(
        [sys.executable, "-m", "tokenwire", "serve", "--engine", "scripted", "--remote-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert orphan.returncode == 2 and "--remote-url needs --engine remote" in orphan.stderr


async def test_no_first_token_in_time_goes_to_the_next_replica() -> None:
    async def silent() -> AsyncIterator[bytes]:
        await asyncio.sleep(30)  # queued forever, as an overloaded server would
        yield b""

    a = Fake(lambda b: Reply(200, content=silent()))
    b = Fake(lambda b: Reply(200, content=sse(token("hi", 5, "stop"))))
    # 1 s: the healthy replica's first token, a new connection's, must come in time too.
    engine = await started(a, b, remote_ttft_timeout_s=1.0)
    t0 = time.monotonic()
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "hi"
    assert 1.0 <= time.monotonic() - t0 < 10.0  # not the 30 s the first replica holds it
    assert engine.replicas[0].failures == 1 and len(b.bodies) == 1
    assert b.bodies[0]["token_ids"] == a.bodies[0]["token_ids"]


async def test_a_prompt_slow_everywhere_is_served_by_the_last_replica_tried() -> None:
    """A first token later than the TTFT limit on every replica (a long
    prefill): the last replica of the round waits for it, rather than the
    request going round until every replica is marked down. Empty chunks
    (`data: {}`) are no first token."""

    async def slow() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"
        await asyncio.sleep(1.5)
        yield sse(token("late", 9, "stop"))

    a, b = Fake(lambda b: Reply(200, content=slow())), Fake(lambda b: Reply(200, content=slow()))
    engine = await started(a, b, remote_ttft_timeout_s=1.0)
    deltas = await run(engine, ask(session_id=None))
    assert "".join(d.text for d in deltas) == "late"
    assert (len(a.bodies), len(b.bodies)) == (1, 1)
    assert not engine.replicas[0].up and engine.replicas[1].up


async def test_the_last_replica_up_waits_for_its_first_token() -> None:
    """One of two replicas is down (it goes last): the one that is up is the
    last that works, so a slow prefill there is waited for, not cut off and
    done again after the down one failed."""

    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(1.5)
        yield sse(token("late", 9, "stop"))

    a, b = Fake(lambda b: Reply(200, content=slow())), Fake(lambda b: Reply(500))
    engine = await started(a, b, remote_ttft_timeout_s=1.0)
    engine.replicas[1].state = "down"  # failed earlier; its probe has not run yet
    deltas = await run(engine, ask(session_id=None))
    assert "".join(d.text for d in deltas) == "late"
    assert (len(a.bodies), len(b.bodies)) == (1, 0)
    assert engine.replicas[0].up and engine.replicas[0].failures == 0


async def test_one_replica_waits_for_its_first_token() -> None:
    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.5)
        yield sse(token("late", 5, "stop"))

    a = Fake(lambda b: Reply(200, content=slow()))
    engine = await started(a, remote_ttft_timeout_s=0.1)  # nowhere else to go: no limit
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "late"


def test_several_urls_from_flags_or_the_environment() -> None:
    first, second = (f"http://127.0.0.1:{free_port()}" for _ in "ab")
    serve = [sys.executable, "-m", "tokenwire", "serve", "--engine", "remote"]
    by_flags = subprocess.run(
        [*serve, "--remote-url", first, "--remote-url", second],
        capture_output=True,
        text=True,
        timeout=60,
    )
    by_env = subprocess.run(
        serve,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TOKENWIRE_REMOTE_URL": f"{first}, {second}"},
    )
    for done in (by_flags, by_env):
        assert done.returncode == 2
        assert f"cannot reach {first}" in done.stderr  # the first one is probed first
    none = subprocess.run(serve, capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "needs at least one --remote-url" in none.stderr


async def test_a_stream_broken_after_its_last_token_is_not_resubmitted() -> None:
    broken = sse(token("done", 3, "stop"), "garbage where the usage should be")
    a = Fake(lambda b: Reply(200, content=broken))
    b = Fake(lambda b: Reply(200, content=sse(token("more", 4, "stop"))))
    engine = await started(a, b)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "done"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].cached_tokens is None
    assert b.bodies == []  # finished: going on elsewhere would run past its end


async def test_a_down_replica_comes_back_through_a_health_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tokenwire.engines.replicas.DOWN_FOR_S", 0.05)
    monkeypatch.setattr("tokenwire.engines.replicas.PROBE_MAX_S", 0.1)
    a = Fake(lambda b: Reply(500, json={"error": {"message": "oom"}}))
    b = Fake(lambda b: Reply(200, content=sse(token("ok", 3, "stop"))))
    a.healthy = False
    engine = await started(a, b)
    try:
        assert "".join([d.text async for d in engine.generate(ask())]) == "ok"
        assert engine.replicas[0].state in ("down", "probing")
        await until(lambda: a.health_checks >= 2, "two probes")  # probed, and probed again
        assert not engine.replicas[0].up
        # Down, it is tried last: b serves the next request without a's 500.
        assert "".join([d.text async for d in engine.generate(ask())]) == "ok"
        assert len(a.bodies) == 1
        a.healthy = True
        a.stream = b.stream
        await until(lambda: engine.replicas[0].up, "a back up")
        assert engine.load().extra["replicas"][a.url]["state"] == "up"
        assert "".join([d.text async for d in engine.generate(ask())]) == "ok"
        assert len(a.bodies) == 2  # back in service, first in line again
        # Both fail a request: still ready while their /health answers (one
        # session's failure through a router must not take the gateway out).
        assert engine.ready and engine.failure is None
        a.stream = b.stream = lambda body: Reply(503, json={"error": {"message": "down"}})
        with pytest.raises(EngineUnavailable):
            [d async for d in engine.generate(ask())]
        assert engine.ready
        # Their /health fails too: not ready (/readyz 503), and it says why.
        a.healthy = b.healthy = False
        with pytest.raises(EngineUnavailable):
            [d async for d in engine.generate(ask())]
        await until(lambda: not engine.ready, "both known down")
        assert "every --remote-url server is down" in engine.failure
        b.healthy = True
        b.stream = lambda body: Reply(200, content=sse(token("ok", 3, "stop")))
        await until(lambda: engine.ready, "b back up")
    finally:
        await engine.close()


async def test_a_chunk_from_another_model_fails_the_attempt() -> None:
    wrong = {**token("Bonjour", 7), "model": "some-other-model"}
    a = Fake(lambda b: Reply(200, content=sse(wrong)))
    b = Fake(lambda b: Reply(200, content=sse(token("Hi", 8, "stop"))))
    engine = await started(a, b)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "Hi"  # nothing of the misrouted answer
    assert engine.replicas[0].failures == 1
    with pytest.raises(ReplicaFailed, match="for model 'some-other-model'"):
        parse_chunk(json.dumps(wrong), a.url, MODEL)


async def test_startup_warns_of_each_silent_no_op() -> None:
    quiet = Fake(lambda b: Reply(500))
    quiet.structured_outputs = False
    with structlog.testing.capture_logs() as logs:
        engine = await started(quiet)
        await engine.close()
    warned = {e["event"] for e in logs if e["log_level"] == "warning"}
    assert {"remote_structured_outputs_ignored", "remote_priority_off"} <= warned
    with structlog.testing.capture_logs() as logs:
        engine = await started(Fake(lambda b: Reply(500)))
        await engine.close()
    assert "remote_structured_outputs_ignored" not in {e["event"] for e in logs}


async def test_an_abort_goes_where_the_session_went_and_no_cookie_is_kept() -> None:
    async def endless() -> AsyncIterator[bytes]:
        for i in range(1000):
            yield f"data: {json.dumps(token('x', i))}\n\n".encode()
            await asyncio.sleep(0.01)

    a = Fake(
        lambda b: Reply(200, headers={"set-cookie": "route=pod-a; Path=/"}, content=endless()),
    )
    engine = await started(a)
    try:
        for rid in ("r1", "r2"):
            stream = engine.generate(
                ask(session_id="sess_1", request_id=rid, max_output_tokens=1000)
            )
            await anext(stream)
            await stream.aclose()  # a cancel
        await until(lambda: len(a.aborts) == 2, "two aborts")
    finally:
        await engine.close()
    body, headers = a.aborts[0]
    assert body == {"request_ids": ["generate-tokens-r1"]}
    # A router hashes the abort by the session, as it did the request.
    assert headers["x-session-id"] == "sess_1"
    # The pod's cookie was not sent back on the session's next request, nor
    # would it be on any other session's.
    assert "cookie" not in a.headers[1]


async def test_auto_tool_calls_go_through_the_configured_vllm_parser() -> None:
    """tool_choice auto with --tool-parser hermes: vLLM's own parser runs here,
    on the streamed text and ids, and asks for the special tokens it needs."""
    said = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    pieces = [said[i : i + 4] for i in range(0, len(said), 4)] + ["</tool_call>"]
    chunks = [token(p, TEMPLATE.tokenizer.encode(p, add_special_tokens=False)[0]) for p in pieces]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    a = Fake(lambda b: Reply(200, content=sse(*chunks, usage(0))))
    engine = await started(a, tool_parser="hermes")
    deltas = await run(engine, ask(tools=[WEATHER], tool_choice="auto", max_output_tokens=100))
    assert a.bodies[0]["sampling_params"]["skip_special_tokens"] is False
    assert "".join(d.text for d in deltas).strip() == "Let me check."
    calls = [c for d in deltas for c in d.tool_calls or ()]
    assert {c.name for c in calls if c.name} == {"get_weather"}
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris"}


FIRST_TOOL_REQUESTS = """
import asyncio, json, sys
from tests.remote.test_remote_fakes import WEATHER, Fake, Reply, ask, sse, started, token, usage

async def main():
    args = token('{"city": "Rome"}', 1, "stop")
    a = Fake(lambda b: Reply(200, content=sse(args, usage(0))))
    engine = await started(a, tool_parser="hermes")
    before = set(sys.modules)
    named = {"type": "function", "name": "get_weather"}
    for choice in (named, "auto"):
        async for _ in engine.generate(ask(tools=[WEATHER], tool_choice=choice)):
            pass
    await engine.close()
    print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith("vllm"))))

asyncio.run(main())
"""


def test_a_first_request_with_tools_imports_no_vllm_on_the_event_loop() -> None:
    """vLLM's modules take seconds of CPU to import; the remote engine imports
    them at startup, in a thread, not when the first request with tools
    arrives and would hold every session that long. In a fresh interpreter:
    this one may have imported vLLM already."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_TOOL_REQUESTS],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_gateway_without_vllm_starts_unless_it_needs_a_tool_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `remote` extra installs no vLLM: the preload passes, and only a
    --tool-parser (vLLM's code) is refused, saying what to install."""
    from tokenwire.engines.toolcalls import import_vllm_side

    for name in ("vllm", "vllm.entrypoints.openai.chat_completion", "vllm.tool_parsers"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    import_vllm_side(None)
    with pytest.raises(EngineUnavailable, match=r"--tool-parser needs vLLM installed"):
        import_vllm_side("hermes")


async def test_an_unknown_tool_parser_fails_the_start_and_names_the_known_ones() -> None:
    a = Fake(lambda b: Reply(200, content=sse(token("hi", 1, "stop"), usage(0))))
    await a.start()
    engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(a.url,), tool_parser="nope"))
    try:
        with pytest.raises(EngineUnavailable, match=r"'nope' is not one of vLLM's .*hermes"):
            await engine.start()
        assert not engine.ready and "'nope'" in (engine.failure or "")
    finally:
        await engine.close()


async def test_a_server_error_mid_stream_hands_over() -> None:
    """vLLM reports an engine failure mid-stream as an error chunk (code 500):
    the replica's fault, so the next one continues after the ids so far."""
    crash = {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}
    a = Fake(lambda b: Reply(200, content=sse(token("Hel", 11), crash)))
    b = Fake(lambda b: Reply(200, content=sse(token("lo", 12, "stop"))))
    engine = await started(a, b)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "Hello"
    assert b.bodies[0]["token_ids"][-1] == 11 and engine.replicas[0].failures == 1


async def test_a_request_the_replica_aborted_goes_on_elsewhere() -> None:
    """vLLM shutting down (SIGTERM: docker stop, a rolling restart) ends its
    requests with finish_reason "abort": not the answer's end. The next
    replica continues after every id so far, the aborting chunk's included."""
    aborted = {"choices": [{"index": 0, "text": "l", "token_ids": [12], "finish_reason": "abort"}]}
    a = Fake(lambda b: Reply(200, content=sse(token("He", 11), aborted, usage(0))))
    b = Fake(lambda b: Reply(200, content=sse(token("lo", 13, "stop"), usage(0))))
    engine = await started(a, b)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "Hello"
    assert [d.finish_reason for d in deltas][-1] == "stop"
    assert b.bodies[0]["token_ids"][-2:] == [11, 12]
    assert engine.replicas[0].failures == 1


async def test_a_stream_stalled_mid_answer_hands_over_after_the_read_timeout() -> None:
    """aiohttp's read timeout is a TimeoutError too: it must count as the
    replica failing mid-stream (ids so far go on elsewhere), not as a missing
    first token."""

    async def stalls() -> AsyncIterator[bytes]:
        yield sse(token("Hel", 11))[: -len(b"data: [DONE]\n\n")]
        await asyncio.sleep(30)
        yield b""

    a = Fake(lambda b: Reply(200, content=stalls()))
    b = Fake(lambda b: Reply(200, content=sse(token("lo", 12, "stop"), usage(0))))
    engine = await started(a, b, remote_timeout_s=0.5)
    with structlog.testing.capture_logs() as logs:
        deltas = await run(engine, ask(session_id=None))
    assert "".join(d.text for d in deltas) == "Hello"
    assert b.bodies[0]["token_ids"][-1] == 11
    failed = [e for e in logs if e["event"] == "remote_replica_failed"]
    assert len(failed) == 1 and failed[0]["produced"] == 1
    assert "first token" not in failed[0]["error"]


async def test_a_chunk_larger_than_the_read_buffer_arrives_whole() -> None:
    """At a high stream_interval one chunk holds much text: above aiohttp's
    default line limit (twice its read buffer: 512 KiB in aiohttp 3.14)."""
    text = "word " * 200_000  # 1 MB in one SSE line
    a = Fake(lambda b: Reply(200, content=sse(token(text, 7, "stop"), usage(0))))
    engine = await started(a)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == text


async def test_a_long_prompt_no_client_event_rendered_is_tokenized_off_the_loop() -> None:
    """A generation started without a client event (a tool round's
    continuation, a takeover) arrives unrendered: a long prompt is tokenized
    in a worker thread (the loop serves others meanwhile), and sent whole."""
    a = Fake(lambda b: Reply(200, content=sse(token("ok", 5, "stop"))))
    engine = await started(a)
    assert engine._template is not None
    long = [{"role": "user", "content": "tell me more " * 400}]
    try:
        with EncodeRecorder(engine._template.tokenizer) as encodes:
            deltas = [d async for d in engine.generate(ask(messages=long))]
            short = [d async for d in engine.generate(ask(request_id="r2"))]
    finally:
        await engine.close()
    assert "".join(d.text for d in deltas) == "ok" and short[-1].finish_reason == "stop"
    first, second = encodes.calls
    assert first.chars > 4096 and not encodes.on_loop(first) and first.loop_ran  # in a thread
    assert encodes.on_loop(second)  # a short one costs less than the hop
    assert a.bodies[0]["token_ids"] == TEMPLATE.render(long)


async def test_credentials_in_a_url_reach_the_server_but_no_log_metric_or_error() -> None:
    """`--remote-url http://user:password@proxy:8000` (basic auth through a
    proxy): every request carries the credentials; the replica's name in
    /metrics, logs, /healthz and errors is `http://***@proxy:8000`."""
    import base64

    a = Fake(lambda b: Reply(500, json={"error": {"message": "boom", "code": 500}}))
    await a.start()
    with_password = a.url.replace("http://", "http://user:s3cret@")
    engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(with_password,)))
    with structlog.testing.capture_logs() as logs:
        await engine.start()
        with pytest.raises(EngineUnavailable) as failed:
            await run(engine, ask())
    expected = "Basic " + base64.b64encode(b"user:s3cret").decode()
    assert a.headers and all(h["Authorization"] == expected for h in a.headers)
    shown = a.url.replace("http://", "http://***@")
    assert [r.url for r in engine.replicas] == [shown]
    assert failures(shown) >= 1  # the metric is labelled with the shown name
    said = [str(failed.value), json.dumps(logs, default=str), json.dumps(engine.load().extra)]
    from prometheus_client import generate_latest

    said.append(generate_latest(REGISTRY).decode())
    assert not [s for s in said if "s3cret" in s]
    assert shown in said[0]


async def test_a_slow_consumer_is_no_silence_of_the_server() -> None:
    """The time a consumer held a chunk (a guardrail's async check, a busy
    loop) counted as the server's silence: a healthy replica "sent no data"."""

    async def steady() -> AsyncIterator[bytes]:
        for i in range(4):
            yield f"data: {json.dumps(token(f' t{i}', i, 'stop' if i == 3 else None))}\n\n".encode()
            await asyncio.sleep(0.05)
        yield b"data: [DONE]\n\n"

    a = Fake(lambda b: Reply(200, content=steady()))
    b = Fake(lambda b: Reply(200, content=sse(token("other", 9, "stop"))))
    engine = await started(a, b, remote_timeout_s=0.5)
    try:
        texts = []
        async for delta in engine.generate(ask()):
            texts.append(delta.text)
            await asyncio.sleep(0.8)  # the consumer, not the server, is slow
        assert "".join(texts) == " t0 t1 t2 t3"
        assert engine.replicas[0].failures == 0 and not b.bodies
    finally:
        await engine.close()


async def test_the_generate_endpoint_names_the_model_so_another_one_is_refused() -> None:
    """/inference/v1/generate chunks name no model: a server that came back
    with another one streamed its answer. Named, vLLM answers 404."""

    def strict(body: dict) -> Reply:
        if body.get("model") != MODEL:
            return Reply(404, json={"error": {"message": f"model {body.get('model')!r}"}})
        return Reply(200, content=sse(token("Hi", 8, "stop")))

    a = Fake(strict)
    engine = await started(a)
    assert "".join(d.text for d in await run(engine, ask())) == "Hi"
    assert a.bodies[-1]["model"] == MODEL


async def test_the_breaker_backs_off_a_replica_whose_health_lies() -> None:
    """/health says 200 while its requests fail: each failure probed it back
    after the same 5 s, and a client paid for it every time."""
    a = Fake(lambda b: Reply(500, json={"error": {"message": "broken"}}))
    engine = await started(a)
    client = engine._client
    try:
        [replica] = engine.replicas
        for expected in (1, 2, 3):
            replica.failed(engine._client)  # type: ignore[arg-type]
            assert replica.streak == expected
        replica.served(probe=True)  # /health answered: up, the streak stays
        assert replica.up and replica.streak == 3 and engine.ready
        replica.served()  # a request went through
        assert replica.streak == 0
    finally:
        await engine.close()
    # A request that fails as the engine shuts down starts no probe that
    # would loop on the closed client.
    replica.failed(client)  # type: ignore[arg-type]
    assert replica.probe is None or replica.probe.done()


def test_credentials_stay_out_of_errors_even_in_urls_that_do_not_parse() -> None:
    from tokenwire.logs import redact_url

    assert redact_url("http://user:s3/cret@proxy:8000") == "http://***@proxy:8000"
    assert redact_url("http://user:s3cret@proxy:8000/v1") == "http://***@proxy:8000/v1"
    assert redact_url("http://proxy:8000/a@b") == "http://proxy:8000/a@b"  # no credentials
    replica = Replica("http://user:s3cret@127.0.0.1:99999")
    said = replica.error_text(ValueError("http://user:s3cret@127.0.0.1:99999/v1/models"))
    assert "s3cret" not in said and "***@127.0.0.1:99999" in said


async def test_an_error_chunk_after_the_finishing_token_keeps_the_answer() -> None:
    """Only the usage is lost after the last token: a 400-coded error chunk
    there raised the request's error and threw the whole answer away."""
    late = {"error": {"message": "bad usage", "code": 400}}
    a = Fake(lambda b: Reply(200, content=sse(token("Hi", 8, "stop"), late)))
    engine = await started(a)
    deltas = await run(engine, ask())
    assert "".join(d.text for d in deltas) == "Hi" and deltas[-1].finish_reason == "stop"
