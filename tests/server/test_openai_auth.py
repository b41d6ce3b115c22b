"""OpenAI clients at the handshake: the API key in the subprotocol entry
`openai-insecure-api-key.<key>`, never selected as the subprotocol, and the beta
Realtime dialect refused before the upgrade while GA clients pass."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tokenwire.config import ServerConfig
from tokenwire.server.admission import AUTH_PREFIXES, presented_key
from tokenwire.wire import FAMILIES, select_subprotocol

from ..conftest import RunningServer, _scripted_server

KEY = "tw-test-key-0123456789"


def keyed() -> _scripted_server:
    return _scripted_server(
        ServerConfig(engine="scripted", port=0, scripted_tokens_per_s=2000, api_keys=KEY)
    )


async def refused(url: str, **options: object) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(url, **options):  # type: ignore[arg-type]
            pass
    response = info.value.response
    return response.status_code, json.loads(response.body)


async def test_the_openai_subprotocol_entry_carries_the_key() -> None:
    async with keyed() as running:
        # What OpenAI's JS SDK offers in a browser: the dialect, then the key.
        offered = ["tokenwire.v1.json", f"openai-insecure-api-key.{KEY}"]
        async with ws_connect(running.url, subprotocols=offered) as ws:  # type: ignore[arg-type]
            assert ws.subprotocol == "tokenwire.v1.json"
            assert json.loads(await ws.recv())["type"] == "session.created"
        # Alone, the entry authenticates and is not taken for a dialect.
        async with ws_connect(
            running.url,
            subprotocols=[f"openai-insecure-api-key.{KEY}"],  # type: ignore[list-item]
        ) as ws:
            assert ws.subprotocol is None
            assert json.loads(await ws.recv())["type"] == "session.created"
        status, body = await refused(
            running.url,
            subprotocols=["tokenwire.v1.json", "openai-insecure-api-key.wrong"],
        )
        assert status == 401
        assert body["error"]["code"] == "unauthorized"
        assert "openai-insecure-api-key.<key>" in body["error"]["message"]
        assert running.server.connections == set()


def test_presented_key_reads_every_form() -> None:
    assert presented_key(f"Bearer {KEY}", ["openai-insecure-api-key.other"]) == KEY
    assert presented_key(None, ["realtime", f"openai-insecure-api-key.{KEY}"]) == KEY
    assert presented_key("Basic abc", [f"tokenwire.auth.{KEY}"]) == KEY
    assert presented_key(None, ["realtime", "tokenwire.v1.json"]) is None


@pytest.mark.parametrize("key", [KEY, "realtime", "tokenwire.v1.json", "ek_abc"])
def test_the_handshake_never_selects_an_auth_entry(key: str) -> None:
    # Even a key spelled like a dialect's name stays behind its prefix.
    for prefix in AUTH_PREFIXES:
        assert select_subprotocol([prefix + key]) is None
        for family in FAMILIES:
            for name in family.subprotocols:
                assert select_subprotocol([prefix + key, name]) == name


@pytest.mark.parametrize(
    "options",
    [
        {"additional_headers": {"OpenAI-Beta": "realtime=v1"}},
        {"additional_headers": {"OpenAI-Beta": "assistants=v2, Realtime=v1"}},
        {"subprotocols": ["realtime", f"openai-insecure-api-key.{KEY}", "openai-beta.realtime-v1"]},
    ],
)
async def test_the_beta_dialect_is_refused_before_the_upgrade(options: dict) -> None:
    async with keyed() as running:
        headers = {"Authorization": f"Bearer {KEY}", **options.get("additional_headers", {})}
        status, body = await refused(running.url, **{**options, "additional_headers": headers})
        assert status == 400
        assert body["error"]["code"] == "beta_not_supported"
        assert "client.beta.realtime" in body["error"]["message"]
        assert running.server.connections == set()


async def test_another_beta_header_is_not_the_realtime_beta(scripted: RunningServer) -> None:
    async with ws_connect(
        scripted.url,
        additional_headers={"OpenAI-Beta": "assistants=v2"},
        subprotocols=["tokenwire.v1.json"],  # type: ignore[list-item]
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"


async def test_the_openai_sdk_ga_connects_and_its_beta_is_refused() -> None:
    """What the installed SDK sends: GA `client.realtime` no OpenAI-Beta header
    (admitted); `client.beta.realtime` sends `OpenAI-Beta: realtime=v1` (refused)."""
    async with keyed() as running:
        client = AsyncOpenAI(api_key=KEY, websocket_base_url=running.url.removesuffix("/realtime"))
        async with client.realtime.connect(model="gpt-realtime") as conn:
            event = json.loads(await conn.recv_bytes())
            assert event["type"] == "session.created"
        with pytest.raises(InvalidStatus) as info:
            async with client.beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
                pass
        assert info.value.response.status_code == 400
        assert json.loads(info.value.response.body)["error"]["code"] == "beta_not_supported"
