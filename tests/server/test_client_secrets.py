"""POST /v1/realtime/client_secrets: short-lived ek_ keys, minted with a server
API key, accepted at the handshake in every form a key takes, with their
session settings applied; expired, forged and revoked ones refused; in Redis,
valid on every instance."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tokenwire.client import connect
from tokenwire.config import ServerConfig
from tokenwire.server.admission import KeyStore
from tokenwire.server.client_secrets import digest

from ..conftest import (
    RedisServer,
    RunningServer,
    TLSFiles,
    _scripted_server,
    tls_scripted_server,
)
from ..helpers.wait import until

KEY = "tw-test-key-0123456789"
FLOORED = "tw-batch-key-0123456789"
MINT = "/v1/realtime/client_secrets"


def config(**overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = {
        "engine": "scripted",
        "port": 0,
        "scripted_tokens_per_s": 2000,
        "api_keys": f"{KEY},{FLOORED} min_priority=10",
        **overrides,
    }
    return ServerConfig(**settings)


async def post(
    running: RunningServer,
    body: Any = None,
    key: str | None = KEY,
    *,
    path: str = MINT,
    method: str = "POST",
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict]:
    """A request from another thread: the server runs on this event loop."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(running.http + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")

    def send() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    return await asyncio.to_thread(send)


async def mint(running: RunningServer, body: Any = None, key: str = KEY) -> str:
    status, answer = await post(running, {} if body is None else body, key)
    assert status == 200, answer
    return answer["value"]


async def first_event(url: str, **options: Any) -> dict:
    async with ws_connect(url, **options) as ws:
        return json.loads(await ws.recv())


async def refusal(url: str, **options: Any) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(url, **options):
            pass
    return info.value.response.status_code, json.loads(info.value.response.body)


async def test_mint_then_connect_in_every_form_with_the_settings() -> None:
    async with _scripted_server(config()) as running:
        before = time.time()
        status, answer = await post(
            running,
            {
                "expires_after": {"anchor": "created_at", "seconds": 120},
                "session": {"type": "realtime", "model": "gpt-realtime", "instructions": "Arr."},
            },
        )
        assert status == 200
        value = answer["value"]
        assert value.startswith("ek_") and len(value) > 40
        assert before + 119 <= answer["expires_at"] <= time.time() + 121
        assert answer["session"]["instructions"] == "Arr."
        assert answer["session"]["type"] == "realtime"
        # The same secret, presented as a header and as either subprotocol entry.
        forms = [
            {"additional_headers": {"Authorization": f"Bearer {value}"}},
            {"subprotocols": ["realtime", f"openai-insecure-api-key.{value}"]},
            {"subprotocols": ["tokenwire.v1.json", f"tokenwire.auth.{value}"]},
        ]
        for options in forms:
            created = await first_event(running.url, **options)
            assert created["type"] == "session.created"
            assert created["session"]["instructions"] == "Arr."
        # Settings are where a session starts: the client can still change them.
        async with await connect(running.url, api_key=value, protocol="json") as tw:
            assert tw.session["instructions"] == "Arr."
            updated = await tw.update_session(instructions="Plain.")
            assert updated["instructions"] == "Plain."
            assert await tw.ask("hi") == "You said: hi"


async def test_the_openai_sdk_mints_one() -> None:
    async with _scripted_server(config()) as running:
        client = AsyncOpenAI(api_key=KEY, base_url=running.http + "/v1")
        secret = await client.realtime.client_secrets.create(
            expires_after={"anchor": "created_at", "seconds": 30},
            session={
                "type": "realtime",
                "instructions": "Be terse.",
                "output_modalities": ["text"],
            },
        )
        assert secret.value.startswith("ek_")
        assert secret.session.type == "realtime"
        assert secret.session.instructions == "Be terse."
        created = await first_event(
            running.url, additional_headers={"Authorization": f"Bearer {secret.value}"}
        )
        assert created["session"]["instructions"] == "Be terse."


async def test_expired_forged_and_revoked_secrets_get_401() -> None:
    async with _scripted_server(config()) as running:
        value = await mint(running, {"expires_after": {"seconds": 10}})
        headers = {"Authorization": f"Bearer {value}"}
        created = await first_event(running.url, additional_headers=headers)
        assert created["type"] == "session.created"
        secrets = running.server.admission.secrets
        start = time.time()
        secrets.clock = lambda: start + 11  # past its 10 s
        status, body = await refusal(running.url, additional_headers=headers)
        assert status == 401 and "expired" in body["error"]["message"]
        secrets.clock = time.time
        forged = "ek_" + "A" * 43
        status, body = await refusal(
            running.url, additional_headers={"Authorization": f"Bearer {forged}"}
        )
        assert status == 401 and body["error"]["code"] == "unauthorized"
        # Its minting key removed from the server: the secret goes with it.
        fresh = await mint(running)
        running.server.admission.keys = KeyStore([FLOORED])
        status, _ = await refusal(
            running.url, subprotocols=["realtime", f"openai-insecure-api-key.{fresh}"]
        )
        assert status == 401
        assert running.server.connections == set()


async def test_minting_needs_a_server_key() -> None:
    async with _scripted_server(config()) as running:
        for key in (None, "wrong"):
            status, body = await post(running, {}, key)
            assert status == 401 and body["error"]["code"] == "unauthorized"
        value = await mint(running)
        status, body = await post(running, {}, value)  # a secret cannot mint another
        assert status == 401 and "cannot mint another" in body["error"]["message"]


async def test_without_api_keys_minting_is_anonymous() -> None:
    async with _scripted_server(config(api_keys=None)) as running:
        value = await mint(running, {"session": {"instructions": "Open server."}}, key="")
        created = await first_event(
            running.url, subprotocols=["tokenwire.v1.json", f"tokenwire.auth.{value}"]
        )
        assert created["session"]["instructions"] == "Open server."
        # A secret is checked even here: its settings would silently be missing.
        status, _ = await refusal(
            running.url, additional_headers={"Authorization": "Bearer ek_forged"}
        )
        assert status == 401
        # Any other bearer is ignored, as before.
        plain = await first_event(running.url, additional_headers={"Authorization": "Bearer x"})
        assert plain["type"] == "session.created"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        ([1, 2], "invalid_json", None),
        ({"expires_in": 60}, "unknown_parameter", "expires_in"),
        ({"expires_after": {"seconds": 5}}, "invalid_value", "expires_after.seconds"),
        ({"expires_after": {"seconds": 7201}}, "invalid_value", "expires_after.seconds"),
        ({"expires_after": {"seconds": "60"}}, "invalid_value", "expires_after.seconds"),
        ({"expires_after": {"anchor": "now"}}, "invalid_value", "expires_after.anchor"),
        ({"session": {"type": "transcription"}}, "invalid_value", "session.type"),
        ({"session": {"output_modalities": ["audio"]}}, "invalid_value", None),
        ({"session": {"voice": "alloy"}}, "unknown_parameter", "session.voice"),
        ({"session": {"instructions": 7}}, "invalid_value", "session.instructions"),
        ({"session": {"tool_choice": "required"}}, "invalid_value", "session.tool_choice"),
        (
            {"session": {"tools": [{"type": "function", "name": "bad name!"}]}},
            "invalid_value",
            "session.tools[0].name",
        ),
    ],
)
async def test_bad_requests_get_400_with_a_stable_code(
    body: Any, code: str, param: str | None
) -> None:
    async with _scripted_server(config()) as running:
        status, answer = await post(running, body)
        assert status == 400, answer
        assert answer["error"]["code"] == code
        if param is not None:
            assert answer["error"]["param"] == param
        assert answer["error"]["message"]


async def test_a_priority_below_the_minting_keys_floor_is_refused() -> None:
    async with _scripted_server(config()) as running:
        status, answer = await post(running, {"session": {"priority": 0}}, FLOORED)
        assert status == 400
        assert answer["error"]["code"] == "priority_not_allowed"
        assert answer["error"]["param"] == "session.priority"
        value = await mint(running, {"session": {"priority": 12}}, FLOORED)
        created = await first_event(
            running.url, subprotocols=["tokenwire.v1.json", f"tokenwire.auth.{value}"]
        )
        assert created["session"]["priority"] == 12


async def test_a_secret_counts_against_its_minting_key() -> None:
    async with _scripted_server(config(max_connections_per_key=1)) as running:
        value = await mint(running)
        async with await connect(running.url, api_key=KEY):
            status, body = await refusal(
                running.url, additional_headers={"Authorization": f"Bearer {value}"}
            )
            assert status == 429 and body["error"]["code"] == "too_many_connections"
            # The other key's slot is its own.
            other = await first_event(
                running.url, additional_headers={"Authorization": f"Bearer {FLOORED}"}
            )
            assert other["type"] == "session.created"
        usages = running.server.admission.limiter.keys
        await until(lambda: not any(u.connections for u in usages.values()), "the slots freed")
        async with ws_connect(
            running.url, additional_headers={"Authorization": f"Bearer {value}"}
        ) as ws:
            await ws.recv()
            [usage] = [u for u in running.server.admission.limiter.keys.values() if u.connections]
            assert usage.key_id == running.server.admission.keys.verify(KEY)


async def raw(running: RunningServer, request: bytes, *, then: bytes = b"") -> bytes:
    """Bytes over a bare socket: what urllib would not send."""
    reader, writer = await asyncio.open_connection("127.0.0.1", running.server.port)
    writer.write(request)
    if then:
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
        writer.write(then)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_bodies_websockets_would_drop_are_answered() -> None:
    async with _scripted_server(config(max_message_bytes=4096)) as running:
        head = f"POST {MINT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        answer = await raw(
            running, (head + "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n").encode()
        )
        assert answer.startswith(b"HTTP/1.1 411") and b'"length_required"' in answer
        answer = await raw(running, (head + "Content-Length: 5000\r\n\r\n").encode())
        assert answer.startswith(b"HTTP/1.1 413") and b'"too_large"' in answer
        answer = await raw(
            running, (head + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}").encode()
        )
        assert answer.startswith(b"HTTP/1.1 400") and b'"bad_length"' in answer
        # curl's way with bodies over 1 KiB: wait for 100 Continue, then send it.
        body = json.dumps({"session": {"instructions": "x" * 1500}}).encode()
        answer = await raw(
            running,
            (head + f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n").encode(),
            then=body,
        )
        assert answer.startswith(b"HTTP/1.1 200") and b'"value": "ek_' in answer
        # A body arriving in pieces, one byte at a time.
        body = b'{"session": {"instructions": "pieces"}}'
        request = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        reader, writer = await asyncio.open_connection("127.0.0.1", running.server.port)
        for i in range(len(request)):
            writer.write(request[i : i + 1])
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"instructions": "pieces"' in answer


async def test_no_body_is_read_for_a_refused_client_or_another_route() -> None:
    """A mint without a valid key, or a POST elsewhere, is answered from its
    head: no 100 Continue, no body held (up to --max-message-bytes each)."""
    async with _scripted_server(config()) as running:
        for path, auth in ((MINT, "Bearer wrong-key"), (MINT, None), ("/v1/other", KEY)):
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\n"
            if auth:
                head += f"Authorization: {auth}\r\n"
            head += "Expect: 100-continue\r\nContent-Length: 900000\r\n\r\n"
            answer = await raw(running, head.encode())
            status = b"401" if path == MINT else b"405"
            assert answer.startswith(b"HTTP/1.1 " + status), (path, auth, answer[:80])
            assert b"100 Continue" not in answer


async def test_routes_and_methods(scripted: RunningServer) -> None:
    status, body = await post(scripted, method="GET")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = await post(scripted, {"x": 1}, path="/healthz")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = await post(scripted, {}, path="/v1/realtime/sessions")
    assert status == 400 and body["error"]["code"] == "beta_not_supported"
    assert "client_secrets" in body["error"]["message"]
    status, body = await post(scripted, {}, path="/v1/realtime")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = await post(scripted, method="GET", path="/healthz")
    assert status == 200 and body["status"] == "ok"  # GETs as before
    # Requests in pieces: a "P" waits to tell POST from PUT, others pass at once.
    for method in (b"GET", b"PUT"):
        reader, writer = await asyncio.open_connection("127.0.0.1", scripted.server.port)
        for byte in method + b" /healthz HTTP/1.1\r\nHost: x\r\n\r\n":
            writer.write(bytes([byte]))
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200" if method == b"GET" else b"HTTP/1.1 405"), answer


async def test_over_tls(tls_files: TLSFiles) -> None:
    async with tls_scripted_server(tls_files, api_keys=KEY) as running:
        context = tls_files.client_context()
        status, answer = await post(
            running, {"session": {"instructions": "Secure."}}, context=context
        )
        assert status == 200
        created = await first_event(
            running.url,
            ssl=context,
            subprotocols=["realtime", f"openai-insecure-api-key.{answer['value']}"],
        )
        assert created["session"]["instructions"] == "Secure."


async def test_with_redis_any_instance_takes_a_secret(redis_server: RedisServer) -> None:
    shared = config(redis_url=redis_server.url)
    async with _scripted_server(shared) as a, _scripted_server(shared) as b:
        status, answer = await post(
            a, {"expires_after": {"seconds": 60}, "session": {"instructions": "From A."}}
        )
        assert status == 200
        value = answer["value"]
        created = await first_event(b.url, additional_headers={"Authorization": f"Bearer {value}"})
        assert created["session"]["instructions"] == "From A."
        # Kept under its digest, never the secret itself, expiring with it.
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            name = f"tw:ek:{digest(value)}"
            assert await client.exists(name)
            assert 55_000 < await client.pttl(name) <= 60_000
            assert not [k async for k in client.scan_iter(match=f"*{value}*")]
        finally:
            await client.aclose()
        status, _ = await refusal(b.url, additional_headers={"Authorization": "Bearer ek_forged"})
        assert status == 401


async def test_secrets_in_memory_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenwire.server import client_secrets

    monkeypatch.setattr(client_secrets, "MEMORY_BUDGET", 4096)
    monkeypatch.setattr(client_secrets, "KEY_SHARE", 1)  # the whole store for one key
    async with _scripted_server(config()) as running:
        body = {"session": {"instructions": "x" * 1000}}
        for _ in range(3):
            await mint(running, body)
        status, answer = await post(running, body)
        assert status == 429 and answer["error"]["code"] == "too_many_client_secrets"
        start = time.time()
        running.server.admission.secrets.clock = lambda: start + 601  # all have expired
        await mint(running, body)  # the expired ones made room


async def test_one_key_cannot_take_the_whole_memory_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its share, one key's mints get 429 while another key still mints."""
    from tokenwire.server import client_secrets

    monkeypatch.setattr(client_secrets, "MEMORY_BUDGET", 8 * 4096)
    async with _scripted_server(config()) as running:
        body = {"session": {"instructions": "x" * 1000}}
        minted = 0
        while (answer := await post(running, body))[0] == 200:
            minted += 1  # about 1.3 KiB each: alone, the key may fill half the store
        assert minted == 12
        status, error = answer
        assert status == 429 and error["error"]["code"] == "too_many_client_secrets"
        assert "for one API key" in error["error"]["message"]
        await mint(running, body, key=FLOORED)
