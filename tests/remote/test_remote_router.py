"""The remote engine through a real vllm-router (PyPI, a Rust binary) with
consistent hashing, in front of the real `vllm serve`: the startup checks,
a generation, and a cancel that frees the slot behind the router."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenwire.config import ServerConfig
from tokenwire.engines.remote import RemoteEngine

from ..conftest import ARTIFACTS, free_port
from .test_remote_vllm import server_idle_after, story, wait_server_busy
from .vllm_serve import VllmOpenAI

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def router(vllm_openai: VllmOpenAI) -> Iterator[str]:
    # Installed beside this Python (the venv's bin), which need not be on PATH.
    binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    assert binary, "vllm-router is missing: pip install vllm-router (a test dependency)"
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    with open(ARTIFACTS / "vllm-router.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                vllm_openai.url,
                "--policy",
                "consistent_hash",
                # A retried POST could run a generation twice; tokenwire fails over itself.
                "--disable-retries",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (ARTIFACTS / "vllm-router.log").read_text()[-3000:]
                try:
                    with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                assert time.monotonic() < deadline, "vllm-router did not come up"
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)


async def test_through_the_router(router: str, vllm_openai: VllmOpenAI) -> None:
    engine = RemoteEngine(ServerConfig(engine="remote", remote_url=(router,)))
    await engine.start()  # /v1/models, /tokenize and the endpoint probe, all via the router
    try:
        endpoint = engine.replicas[0].describe()["endpoint"]
        deltas = [d async for d in engine.generate(story("routed", 8, "sess-1"))]
        assert sum(d.output_tokens for d in deltas) == 8
        assert deltas[-1].finish_reason == "length"
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(story("routed-cancel", 1000, "sess-1")):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 60)
        await wait_server_busy(vllm_openai)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        freed = await server_idle_after(vllm_openai, t0)
        print(f"\nvia vllm-router ({endpoint}): cancel -> slot free in {freed * 1000:.0f} ms")
        assert freed < 10.0  # 1000 tokens would take over 20 s here: aborted
    finally:
        await engine.close()
