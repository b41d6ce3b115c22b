"""The remote engine against a real `vllm serve` (SmolLM2 on the CPU), at the
engine seam: a cancel frees the server's slot (its own /metrics say so), a
replica that dies mid-stream hands the generation to another one with no
token lost or repeated, and a rendering mismatch refuses to start."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
import zlib
from pathlib import Path

import pytest

from tokenwire.config import ServerConfig
from tokenwire.engines.base import EngineDelta, EngineUnavailable, GenerationRequest
from tokenwire.engines.remote import RemoteEngine
from tokenwire.models import resolve_model

from ..helpers.proxy import Proxy
from .vllm_serve import VllmOpenAI

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

STORY = "Tell me a long story about a lighthouse keeper."


def story(rid: str, tokens: int, session_id: str | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        messages=[{"role": "user", "content": STORY}],
        max_output_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        session_id=session_id,
    )


async def server_idle_after(server: VllmOpenAI, since: float, timeout: float = 10.0) -> float:
    """Seconds from `since` until the server runs and queues nothing."""
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(server.running) > 0:
        assert time.monotonic() < deadline, "the server still holds the request"
        await asyncio.sleep(0.005)
    return time.monotonic() - since


async def wait_server_busy(server: VllmOpenAI) -> None:
    for _ in range(400):
        if await asyncio.to_thread(server.running) > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never ran the request")


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
async def test_cancel_frees_the_server_slot(vllm_openai: VllmOpenAI, endpoint: str) -> None:
    engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(vllm_openai.url,)))
    await engine.start()
    try:
        if endpoint == "completions":  # closing the stream is the only abort there
            engine.replicas[0].generate_endpoint = False
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(story(f"cancel-{endpoint}", 1000)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 60)
        await wait_server_busy(vllm_openai)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        freed = await server_idle_after(vllm_openai, t0)
        print(f"\n{endpoint}: cancel -> server slot free in {freed * 1000:.0f} ms")
        assert freed < 10.0  # 1000 tokens would take over 20 s here: aborted
        assert engine.load().running == 0
    finally:
        await engine.close()


def session_pinned_to(index: int, replicas: int) -> str:
    return next(
        sid
        for sid in (f"s{i}" for i in range(1000))
        if zlib.crc32(sid.encode()) % replicas == index
    )


async def test_a_replica_dying_mid_stream_loses_and_repeats_nothing(
    vllm_openai: VllmOpenAI,
) -> None:
    """Replica 0 is a TCP proxy to the server that the test cuts mid-stream;
    replica 1 is the server itself. The generation continues on replica 1 from
    prompt + generated ids: the same tokens as a run never interrupted."""
    port = int(vllm_openai.url.rsplit(":", 1)[1])
    async with Proxy(port) as proxy:
        dying = f"http://127.0.0.1:{proxy.port}"
        engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(dying, vllm_openai.url)))
        await engine.start()
        try:
            sid = session_pinned_to(0, 2)
            whole = [d async for d in engine.generate(story("whole", 60, sid))]
            assert engine.replicas[0].requests == 1 and engine.replicas[1].requests == 0
            parts: list[EngineDelta] = []
            async for delta in engine.generate(story("failover", 60, sid)):
                parts.append(delta)
                if sum(d.output_tokens for d in parts) == 20:
                    proxy.cut()  # the replica dies, mid-stream
            assert engine.replicas[0].failures == 1 and engine.replicas[1].requests == 1
        finally:
            await engine.close()
    ids = [t for d in parts for t in d.token_ids or ()]
    assert ids == [t for d in whole for t in d.token_ids or ()]
    assert "".join(d.text for d in parts) == "".join(d.text for d in whole)
    assert sum(d.output_tokens for d in parts) == 60
    assert [d.finish_reason for d in parts].count("length") == 1
    assert parts[-1].finish_reason == "length"
    await server_idle_after(vllm_openai, time.monotonic())


async def test_a_rendering_mismatch_refuses_to_start(
    vllm_openai: VllmOpenAI, tmp_path: Path
) -> None:
    """tokenwire's tokenizer renders the chat differently from the server's:
    token ids would mean different things, so the engine does not start."""
    model = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / name, tmp_path / name)
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_start|> "))
    engine = RemoteEngine(
        ServerConfig(engine="remote", remote_url=(vllm_openai.url,), model=str(tmp_path))
    )
    with pytest.raises(EngineUnavailable) as caught:
        await engine.start()
    await engine.close()
    message = caught.value.message
    assert "renders the chat template differently" in message
    assert "tokenwire (" in message and "server    (" in message
    assert "<|im_start|> system" in message and "<|im_start|>system" in message
    assert not engine.ready
    with pytest.raises(EngineUnavailable):
        await anext(engine.generate(story("after-refusal", 4)))


async def test_a_stalled_replica_times_out_and_the_generation_moves_on(
    vllm_openai: VllmOpenAI,
) -> None:
    """Replica 0 goes silent mid-stream (the proxy swallows what the server
    sends): after --remote-timeout-s the generation continues on replica 1,
    never waited on forever, with the same tokens."""
    port = int(vllm_openai.url.rsplit(":", 1)[1])
    async with Proxy(port) as proxy:
        config = ServerConfig(
            engine="remote", remote_url=(f"http://127.0.0.1:{proxy.port}", vllm_openai.url)
        )
        # Above what the real server may stay silent on a busy machine.
        config.remote_timeout_s = 3.0
        engine = RemoteEngine(config)
        await engine.start()
        try:
            sid = session_pinned_to(0, 2)
            before = proxy.forwarded_down
            whole = [d async for d in engine.generate(story("steady", 30, sid))]
            # A third of the same stream's bytes pass, then the replica is alive
            # but says nothing more. Set in bytes, not on seeing tokens: on a
            # busy loop the whole answer can be through before a test reacts.
            size = proxy.forwarded_down - before
            proxy.drop_downstream_after = proxy.forwarded_down + size // 3
            # Counted from here: on a loaded machine the steady stream may
            # itself have waited past the timeout and moved.
            failures, moved = engine.replicas[0].failures, engine.replicas[1].requests
            parts: list[EngineDelta] = []
            t0 = time.monotonic()
            async for delta in engine.generate(story("stalled", 30, sid)):
                parts.append(delta)
            took = time.monotonic() - t0
        finally:
            await engine.close()
    assert engine.replicas[0].failures == failures + 1
    assert engine.replicas[1].requests == moved + 1
    assert proxy.dropped > 0
    assert [t for d in parts for t in d.token_ids or ()] == [
        t for d in whole for t in d.token_ids or ()
    ]
    assert took < 3.0 + 20.0  # the timeout, plus 30 tokens at a busy machine's pace
    await server_idle_after(vllm_openai, time.monotonic())


async def test_cache_salt_keeps_prefix_caches_apart(vllm_openai: VllmOpenAI) -> None:
    """Same prompt, same salt: a prefix-cache hit. Another salt (another
    tenant): nothing cached, though the blocks are there."""
    words = " ".join(f"{uuid.uuid4().hex[:6]} item{i}" for i in range(40))  # ~360 fresh tokens
    engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(vllm_openai.url,)))
    await engine.start()

    async def cached(rid: str, salt: str) -> int:
        req = GenerationRequest(
            request_id=rid,
            messages=[{"role": "user", "content": f"Summarise: {words}"}],
            max_output_tokens=1,
            temperature=0.0,
            cache_salt=salt,
        )
        deltas = [d async for d in engine.generate(req)]
        return sum(d.cached_tokens or 0 for d in deltas)

    try:
        assert await cached("salt-a1", "tenant-a") == 0
        assert await cached("salt-a2", "tenant-a") >= 128  # whole blocks of the prompt
        assert await cached("salt-b1", "tenant-b") == 0
    finally:
        await engine.close()
