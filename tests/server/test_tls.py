"""TLS on the server's one port: wss:// for /v1/realtime and https:// for the
HTTP routes, from --ssl-certfile and --ssl-keyfile, with no proxy in front."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import structlog
from cryptography.hazmat.primitives import serialization
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidMessage

from tokenwire.client import connect
from tokenwire.config import ServerConfig
from tokenwire.server.tls import TLSError, server_context

from ..conftest import RunningServer, TLSFiles, free_port, tls_scripted_server


async def https_json(url: str, context: ssl.SSLContext) -> tuple[int, dict]:
    def get() -> tuple[int, dict]:
        with urllib.request.urlopen(url, timeout=5, context=context) as r:
            return r.status, json.loads(r.read())

    return await asyncio.to_thread(get)  # the server runs on this event loop


async def test_wss_with_the_ca_trusted(tls_scripted: RunningServer, tls_files: TLSFiles) -> None:
    assert tls_scripted.url.startswith("wss://")
    context = tls_files.client_context()
    async with ws_connect(
        tls_scripted.url,
        ssl=context,
        subprotocols=["tokenwire.v1.json"],  # type: ignore[list-item]
    ) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
    async with await connect(tls_scripted.url, ssl=context) as tw:  # the Python client too
        assert await tw.ask("over TLS") == "You said: over TLS"
    # The HTTP routes share the port, so they are https:// now.
    status, health = await https_json(tls_scripted.http + "/healthz", context)
    assert status == 200 and health["engine"] == "scripted"


async def test_plain_and_untrusted_clients_fail(tls_scripted: RunningServer) -> None:
    with pytest.raises(InvalidMessage):  # ws:// to a TLS port: no HTTP answer
        async with ws_connect(tls_scripted.url.replace("wss://", "ws://", 1)):
            pass
    with pytest.raises(ssl.SSLCertVerificationError):  # the system CAs do not know ours
        async with ws_connect(tls_scripted.url):
            pass
    assert tls_scripted.server.connections == set()


async def test_the_listening_line_names_wss(tls_files: TLSFiles) -> None:
    with structlog.testing.capture_logs() as logs:
        async with tls_scripted_server(tls_files) as running:
            port = running.server.port
    [line] = [entry for entry in logs if entry["event"] == "listening"]
    assert line["url"] == f"wss://127.0.0.1:{port}/v1/realtime"


def test_one_file_without_the_other_is_refused(tls_files: TLSFiles) -> None:
    with pytest.raises(TLSError, match="--ssl-certfile was given without --ssl-keyfile"):
        server_context(ServerConfig(ssl_certfile=str(tls_files.certfile)))
    with pytest.raises(TLSError, match="--ssl-keyfile was given without --ssl-certfile"):
        server_context(ServerConfig(ssl_keyfile=str(tls_files.keyfile)))
    assert server_context(ServerConfig()) is None


def test_unusable_files_are_refused(tls_files: TLSFiles, tmp_path: Path) -> None:
    with pytest.raises(TLSError, match="no such file"):
        server_context(ServerConfig(ssl_certfile="/nonexistent.pem", ssl_keyfile="/x.key"))
    # The key of another certificate.
    with pytest.raises(TLSError, match="cannot load"):
        server_context(
            ServerConfig(ssl_certfile=str(tls_files.ca_file), ssl_keyfile=str(tls_files.keyfile))
        )
    # An encrypted key: refused with a message instead of a passphrase prompt.
    key = serialization.load_pem_private_key(tls_files.keyfile.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(TLSError, match="encrypted"):
        server_context(
            ServerConfig(ssl_certfile=str(tls_files.certfile), ssl_keyfile=str(encrypted))
        )


def test_serve_refuses_half_a_tls_setup(tls_files: TLSFiles) -> None:
    run = subprocess.run(
        [
            *(sys.executable, "-m", "tokenwire", "serve", "--engine", "scripted"),
            *("--port", str(free_port()), "--ssl-certfile", str(tls_files.certfile)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "error: TLS: --ssl-certfile was given without --ssl-keyfile" in run.stderr
    assert "Traceback" not in run.stderr


async def test_serve_takes_the_files_from_the_environment(tls_files: TLSFiles) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    env |= {
        "TOKENWIRE_SSL_CERTFILE": str(tls_files.certfile),
        "TOKENWIRE_SSL_KEYFILE": str(tls_files.keyfile),
        "TOKENWIRE_LOG_LEVEL": "info",
    }
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "tokenwire", "serve", "--engine", "scripted", "--port", str(port)),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(60):
            while b'"listening"' not in (line := await proc.stderr.readline()):
                assert line, "tokenwire serve exited before listening"
        assert json.loads(line)["url"] == f"wss://127.0.0.1:{port}/v1/realtime"
        async with ws_connect(
            f"wss://127.0.0.1:{port}/v1/realtime",
            ssl=tls_files.client_context(),
            subprotocols=["tokenwire.v1.json"],  # type: ignore[list-item]
        ) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
    finally:
        proc.terminate()
        await proc.wait()
