"""Shared fixtures: an in-process scripted server, and one real vLLM server per run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.server import TokenwireServer

from .remote.vllm_serve import VllmOpenAI, vllm_serve

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"


# The CPU engine in eager mode: vLLM's CPU default compiles with inductor,
# which adds about 80 s to every start here for no decode gain measured.
VLLM_ENGINE_FLAGS = ["--", "--enforce-eager"]

# A client that stops reading answers no ping either, while a busy machine
# generates: neither keepalive (1011, 20 s after a ping) nor the slow-client
# close (4008, 30 s) may end it before the test reads again. Both have their
# own tests with the scripted engine.
STALLED_CLIENT_FLAGS = ["--ping-interval-s", "0", "--slow-client-timeout-s", "300"]

VLLM_BACKPRESSURE_FLAGS = [
    *STALLED_CLIENT_FLAGS,
    "--sndbuf",
    "4608",
    "--outbound-high-water",
    "1024",
    "--outbound-hard-cap",
    "4096",
    "--stall-s",
    "1",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """A process's resident set size, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def log_tail(path: Path, lines: int = 25) -> str:
    """A server log's last lines, its stalls first, without vLLM's teardown noise."""
    if not path.exists():
        return f"({path} missing)"
    kept = [
        line
        for line in path.read_text(errors="replace").splitlines()
        if "leaked" not in line and "nanobind" not in line
    ]
    stalls = [line for line in kept if "event_loop_stalled" in line]
    return "\n".join([*stalls[-5:], "...", *kept[-lines:]])


@dataclass
class Spawned:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def spawn_server(
    *args: str,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    ready_timeout: float = 60.0,
) -> Iterator[Spawned]:
    """`tokenwire serve ARGS --port FREE` in a subprocess, until /readyz says 200."""
    port = free_port()
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenwire", "serve", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    tail = (lambda: log_tail(log_path)) if log_path else (lambda: "(no log)")
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenwire serve exited:\n{tail()}")
            try:
                status, body = http_json(f"http://127.0.0.1:{port}/readyz", timeout=2)
                if status == 200:
                    break
                if body.get("error"):
                    raise RuntimeError(f"engine failed: {body['error']}")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tokenwire serve not ready:\n{tail()}")
            time.sleep(0.1)
        yield Spawned(proc, port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()  # type: ignore[union-attr]


class RunningServer:
    def __init__(self, server: TokenwireServer) -> None:
        self.server = server
        self.tls = bool(server.config.ssl_certfile)

    @property
    def url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.server.port}/v1/realtime"

    @property
    def http(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.server.port}"


@pytest.fixture
async def scripted() -> AsyncIterator[RunningServer]:
    """A scripted-engine server in this process, 1000 tokens/s."""
    async with _scripted_server(
        ServerConfig(
            engine="scripted", port=0, max_message_bytes=64 * 1024, scripted_tokens_per_s=1000.0
        )
    ) as s:
        yield s


class _scripted_server:
    def __init__(self, config: ServerConfig) -> None:
        self.server = TokenwireServer(
            config,
            ScriptedEngine(tokens_per_s=config.scripted_tokens_per_s, max_context_tokens=512),
        )

    async def __aenter__(self) -> RunningServer:
        await self.server.start()
        return RunningServer(self.server)

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()


@dataclass(frozen=True)
class TLSFiles:
    """A throwaway CA and a certificate it issued for 127.0.0.1 and localhost."""

    ca_file: Path  # the CA certificate (PEM): what a client trusts; Node: NODE_EXTRA_CA_CERTS
    certfile: Path  # the server's certificate chain (PEM), for --ssl-certfile
    keyfile: Path  # its private key (PEM), for --ssl-keyfile

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts the test CA (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.ca_file))


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    folder = tmp_path_factory.mktemp("tls")
    files = TLSFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    ca.cert_pem.write_to_path(str(files.ca_file))
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(files.certfile), append=i > 0)
    cert.private_key_pem.write_to_path(str(files.keyfile))
    return files


def tls_scripted_server(tls_files: TLSFiles, **overrides: object) -> _scripted_server:
    """`async with tls_scripted_server(tls_files, api_keys=...) as running:` a
    scripted server in this process on wss:// and https://."""
    settings: dict[str, object] = {
        "engine": "scripted",
        "port": 0,
        "max_message_bytes": 64 * 1024,
        "scripted_tokens_per_s": 1000.0,
        "ssl_certfile": str(tls_files.certfile),
        "ssl_keyfile": str(tls_files.keyfile),
        **overrides,
    }
    return _scripted_server(ServerConfig(**settings))  # type: ignore[arg-type]


@pytest.fixture
async def tls_scripted(tls_files: TLSFiles) -> AsyncIterator[RunningServer]:
    """A scripted server in this process with TLS: `.url` is wss://127.0.0.1:PORT/v1/realtime,
    `.http` https://...; trust `tls_files.ca_file`. The server runs on the test's event
    loop: run a client process with asyncio.create_subprocess_exec, never subprocess.run."""
    async with tls_scripted_server(tls_files) as running:
        yield running


class VllmServer:
    def __init__(self, port: int, proc: subprocess.Popen, log_path: Path) -> None:
        self.port = port
        self.proc = proc
        self.log_path = log_path
        self.url = f"ws://127.0.0.1:{port}/v1/realtime"
        self.http = f"http://127.0.0.1:{port}"

    def health(self) -> dict:
        return http_json(self.http + "/healthz")[1]

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the engine holds no request; return the last health report."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            load = h["engine_load"]
            if (load["running"], load["waiting"], load.get("unfinished", 0)) == (0, 0, 0):
                return h
            if time.monotonic() > deadline:
                return h
            time.sleep(0.05)


@pytest.fixture(scope="session")
def vllm_server(redis_server: RedisServer) -> Iterator[VllmServer]:
    """One real `tokenwire serve --engine vllm` (SmolLM2 on the CPU) for the whole
    run; with Redis, so every real-engine test goes through the shared log."""
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / "vllm-server.log"
    env = dict(os.environ, TOKENWIRE_KV_CACHE_GIB="1", TOKENWIRE_LOG_LEVEL="info")
    # Small socket buffer and caps, so a client that stops reading trips the
    # pause on loopback within seconds (see test_vllm_backpressure).
    with spawn_server(
        "--engine",
        "vllm",
        *VLLM_BACKPRESSURE_FLAGS,
        "--redis-url",
        redis_server.url,
        "--max-model-len",
        "2048",
        *VLLM_ENGINE_FLAGS,
        env=env,
        log_path=log_path,
        ready_timeout=600,
    ) as spawned:
        yield VllmServer(spawned.port, spawned.proc, log_path)


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_redis(port: int) -> subprocess.Popen:
    """A real redis-server (the Debian package `make test` installs) on `port`,
    answering PING."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing: run `make test`, which installs it"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free port, for the whole run."""
    port = free_port()
    proc = start_redis(port)
    try:
        yield RedisServer(proc, port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def vllm_openai() -> Iterator[VllmOpenAI]:
    """One real `vllm serve` (vLLM's OpenAI server, SmolLM2 on the CPU, with
    --enable-scale-out) for the whole run: what `--engine remote` drives."""
    from tokenwire.models import resolve_model

    ARTIFACTS.mkdir(exist_ok=True)
    with vllm_serve(str(resolve_model(None)), free_port(), ARTIFACTS / "vllm-openai.log") as server:
        yield server
