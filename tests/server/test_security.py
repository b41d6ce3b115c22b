"""Auth at the handshake, limits with stable codes, metrics, and key-free logs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tokenwire.client import TokenwireError, connect
from tokenwire.config import ServerConfig
from tokenwire.runtime.ws import inbound_budget
from tokenwire.server.admission import KeyStore, key_id
from tokenwire.wire.close_codes import CLOSE_IDLE

from ..conftest import _scripted_server, free_port, http_json, spawn_server
from ..helpers.wait import until

KEY = "tw-test-key-0123456789"
OTHER = "tw-other-key-9876543210"


def config(**overrides: object) -> ServerConfig:
    return ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=2000,
        api_keys=f"{KEY},{OTHER}",
        **overrides,
    )  # type: ignore[arg-type]


def url_of(running) -> str:
    return running.url


async def test_no_key_is_refused_before_the_upgrade() -> None:
    async with _scripted_server(config()) as running:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            with pytest.raises(InvalidStatus) as info:
                async with ws_connect(running.url, additional_headers=headers):
                    pass
            assert info.value.response.status_code == 401
            assert b"unauthorized" in info.value.response.body
        assert running.server.connections == set()
        assert running.server.engine.load().running == 0


async def test_bearer_and_subprotocol_keys() -> None:
    async with _scripted_server(config()) as running:
        async with await connect(running.url, api_key=KEY) as tw:
            assert await tw.ask("hi") == "You said: hi"
        # Browsers: the key rides as a subprotocol entry; the server never selects it.
        async with ws_connect(
            running.url,
            subprotocols=["tokenwire.v1.json", f"tokenwire.auth.{OTHER}"],  # type: ignore[list-item]
        ) as ws:
            assert ws.subprotocol == "tokenwire.v1.json"
            assert '"session.created"' in await ws.recv()
        with pytest.raises(InvalidStatus):
            async with ws_connect(
                running.url, subprotocols=["tokenwire.v1.json", "tokenwire.auth.nope"]
            ):  # type: ignore[list-item]
                pass


def test_keystore_file_and_env(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n{KEY}\n\n")
    store = KeyStore.load(str(path), f" {OTHER} ,")
    assert len(store) == 2
    assert store.from_request(f"Bearer {KEY}", []) == key_id(KEY)
    assert store.from_request(None, [f"tokenwire.auth.{OTHER}"]) == key_id(OTHER)
    assert store.from_request("Basic abc", ["tokenwire.v1.json"]) is None


def test_non_loopback_without_keys_is_refused() -> None:
    base = [
        sys.executable,
        "-m",
        "tokenwire",
        "serve",
        "--engine",
        "scripted",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2
    assert "--api-keys-file" in refused.stderr and "--insecure" in refused.stderr
    with spawn_server("--engine", "scripted", "--host", "0.0.0.0", "--insecure", env=env) as srv:
        assert http_json(srv.http + "/healthz")[0] == 200


async def test_origin_allow_list() -> None:
    async with _scripted_server(config(allowed_origins="http://app.example")) as running:
        headers = {"Authorization": f"Bearer {KEY}"}
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(
                running.url,
                origin="http://evil.example",  # type: ignore[arg-type]
                additional_headers=headers,
            ):
                pass
        assert info.value.response.status_code == 403
        async with ws_connect(
            running.url,
            origin="http://app.example",  # type: ignore[arg-type]
            additional_headers=headers,
        ) as ws:
            assert '"session.created"' in await ws.recv()
        async with await connect(running.url, api_key=KEY) as tw:  # no Origin: not a browser
            assert await tw.ask("ok") == "You said: ok"


async def test_refused_handshakes_hold_no_connection_slot() -> None:
    """Handshakes websockets refuses after admission (a bad Origin) are not
    counted while their entries wait for the garbage collector."""
    import gc

    overrides = {"allowed_origins": "http://app.example", "max_connections": 5}
    async with _scripted_server(config(**overrides)) as running:
        headers = {"Authorization": f"Bearer {KEY}"}
        gc.disable()  # the entries stay, as between two collections
        try:
            for _ in range(10):
                with pytest.raises(InvalidStatus):
                    async with ws_connect(
                        running.url,
                        origin="http://evil.example",  # type: ignore[arg-type]
                        additional_headers=headers,
                    ):
                        pass
            async with await connect(running.url, api_key=KEY) as tw:
                assert await tw.ask("ok") == "You said: ok"
        finally:
            gc.enable()


async def test_connections_per_key() -> None:
    async with _scripted_server(config(max_connections_per_key=2)) as running:
        a = await connect(running.url, api_key=KEY)
        b = await connect(running.url, api_key=KEY)
        with pytest.raises(InvalidStatus) as info:
            await connect(running.url, api_key=KEY)
        assert info.value.response.status_code == 429
        assert b"too_many_connections" in info.value.response.body
        async with await connect(running.url, api_key=OTHER) as other:  # another key is fine
            assert await other.ask("x") == "You said: x"
        await a.close()
        usages = running.server.admission.limiter.keys
        await until(lambda: sum(u.connections for u in usages.values()) == 1, "a's slot freed")
        c = await connect(running.url, api_key=KEY)  # a slot came free
        await b.close()
        await c.close()


async def test_responses_per_key_across_connections() -> None:
    async with _scripted_server(config(max_responses_per_key=1)) as running:
        async with (
            await connect(running.url, api_key=KEY) as one,
            await connect(running.url, api_key=KEY) as two,
        ):
            long = await one.create_response(ignore_eos=True, max_output_tokens=100_000)
            with pytest.raises(TokenwireError) as info:
                await two.create_response()
            assert info.value.code == "too_many_responses"
            await long.cancel()
            assert await two.ask("now") == "You said: now"


async def test_tokens_per_second_per_key() -> None:
    async with _scripted_server(config(tokens_per_s_per_key=20)) as running:
        async with await connect(running.url, api_key=KEY) as tw:
            burst = await tw.create_response(ignore_eos=True, max_output_tokens=200)
            await burst.done()  # 200 tokens against a bucket of 40
            with pytest.raises(TokenwireError) as info:
                await tw.create_response()
            assert info.value.code == "rate_limit_exceeded"
            assert "retry in" in info.value.error["message"]


async def test_events_per_second() -> None:
    async with _scripted_server(config(max_events_per_s=5)) as running:
        async with await connect(running.url, api_key=KEY) as tw:
            for i in range(40):
                await tw.send(
                    {"type": "conversation.item.retrieve", "item_id": "x", "event_id": f"e{i}"}
                )
            codes = []
            while len(codes) < 40:
                event = await asyncio.wait_for(tw.events.get(), 5)
                if event["type"] == "error":
                    codes.append(event["error"]["code"])
            assert codes.count("rate_limit_exceeded") >= 25
            assert "unknown_item" in codes  # the burst went through
            await asyncio.sleep(0.5)
            assert await tw.ask("later") == "You said: later"


async def test_a_client_over_its_byte_rate_is_read_slower_and_loses_nothing() -> None:
    # 100 kB/s, bursts of 200 kB: a frame is read once the frames before it are
    # paid for, so the 9th of ~50 kB comes 2 s after the first at the earliest.
    limits = config(max_inbound_bytes_per_s=100_000, max_message_bytes=50_000)
    pauses = REGISTRY.get_sample_value("tokenwire_inbound_pauses_total") or 0.0
    async with _scripted_server(limits) as running:
        async with (
            await connect(running.url, api_key=KEY) as fast,
            await connect(running.url, api_key=OTHER) as other,
        ):
            started = time.monotonic()
            for i in range(9):
                item = {"type": "message", "role": "user", "content": str(i) * 49_800}
                await fast.send({"type": "conversation.item.create", "item": item})
            # The paced connection holds no one else up.
            assert await other.ask("meanwhile") == "You said: meanwhile"
            created = []
            while len(created) < 9:
                event = await asyncio.wait_for(fast.events.get(), 30)
                assert event["type"] != "error", event
                if event["type"] == "conversation.item.created":
                    created.append(event["item"]["content"][0])
            elapsed = time.monotonic() - started
            assert created == [str(i) for i in range(9)]  # all of them, in order
        assert elapsed >= 1.9  # (8 x 49.8 kB - 200 kB burst) / 100 kB/s
    assert (REGISTRY.get_sample_value("tokenwire_inbound_pauses_total") or 0.0) > pauses


async def test_tiny_frames_are_charged_a_kib_each() -> None:
    # 20 kB/s, bursts of 40 kB: 60 frames of ~60 bytes are charged 1 KiB each,
    # so the 60th is read 1 s after the first at the earliest.
    limits = config(max_inbound_bytes_per_s=20_000, max_message_bytes=20_000, max_events_per_s=0)
    async with _scripted_server(limits) as running:
        async with await connect(running.url, api_key=KEY) as tw:
            started = time.monotonic()
            for i in range(60):
                await tw.send({"type": "conversation.item.retrieve", "item_id": f"x{i}"})
            answered = []
            while len(answered) < 60:
                event = await asyncio.wait_for(tw.events.get(), 30)
                if event["type"] == "error":
                    assert event["error"]["code"] == "unknown_item"
                    answered.append(event["error"]["message"])
            elapsed = time.monotonic() - started
    assert all(f"x{i}" in message for i, message in enumerate(answered))
    assert elapsed >= 0.95  # (59 x 1024 - 40 kB burst) / 20 kB/s


def test_the_inbound_budget_bursts_to_one_largest_message_at_least() -> None:
    assert inbound_budget(0, 1 << 20) is None
    budget = inbound_budget(1000, 1 << 20)
    assert budget is not None and budget.burst == 1 << 20 and budget.rate == 1000
    budget = inbound_budget(1 << 20, 1000)
    assert budget is not None and budget.burst == 2 << 20


async def test_idle_connection_is_closed() -> None:
    async with _scripted_server(config(idle_timeout_s=0.3)) as running:
        tw = await connect(running.url, api_key=KEY)
        await asyncio.wait_for(tw.ws.wait_closed(), 5)
        assert tw.ws.close_code == CLOSE_IDLE


async def test_metrics_endpoint() -> None:
    async with _scripted_server(config()) as running:
        async with await connect(running.url, api_key=KEY) as tw:
            await tw.ask("measure me")
            r = await tw.create_response(ignore_eos=True, max_output_tokens=10_000)
            async for _ in r.text_deltas():
                break
            await r.cancel()
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(running.http + "/metrics").read().decode()
        )
    for name in (
        "tokenwire_connections",
        "tokenwire_active_responses",
        "tokenwire_ttft_seconds_count",
        "tokenwire_inter_token_seconds_count",
        "tokenwire_cancel_latency_seconds_count",
        "tokenwire_outbound_buffered_bytes",
        'tokenwire_engine_requests{state="running"}',
    ):
        assert name in body, name
    completed = [
        line
        for line in body.splitlines()
        if line.startswith('tokenwire_responses_total{status="completed"}')
    ]
    assert completed and float(completed[0].split()[-1]) >= 1
    cancels = [
        line
        for line in body.splitlines()
        if line.startswith("tokenwire_cancel_latency_seconds_count")
    ]
    assert float(cancels[0].split()[-1]) >= 1


def test_logs_never_contain_keys(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    log_path = tmp_path / "server.log"
    with spawn_server(
        "--engine",
        "scripted",
        "--api-keys-file",
        str(keys),
        "--log-level",
        "debug",
        log_path=log_path,
    ) as srv:

        async def talk() -> None:
            async with await connect(srv.url, api_key=KEY) as tw:
                await tw.ask("secret handshake")
            with pytest.raises(InvalidStatus):
                await connect(srv.url, api_key=KEY + "x")

        asyncio.run(talk())
    text = log_path.read_text()
    assert "response_done" in text and key_id(KEY) in text
    assert KEY not in text


async def test_cancel_latency_times_client_cancels_only() -> None:
    """A steer and a disconnect abort generations too, but only a client's
    response.cancel is what tokenwire_cancel_latency_seconds times."""

    def cancels() -> float:
        return REGISTRY.get_sample_value("tokenwire_cancel_latency_seconds_count") or 0.0

    async with _scripted_server(config()) as running:
        before = cancels()
        async with await connect(running.url, api_key=KEY) as tw:
            await tw.ask("steer me")
            r = await tw.create_response(ignore_eos=True, max_output_tokens=10_000)
            async for _ in r.text_deltas():
                break
            await r.steer("now this")
            async for _ in r.text_deltas():
                break
            await until(lambda: running.server.engine.load().running == 1, "the steered run")
        await until(lambda: running.server.engine.load().running == 0, "the close's abort")
        assert cancels() == before
        async with await connect(running.url, api_key=KEY) as tw:
            await tw.ask("cancel me")
            r = await tw.create_response(ignore_eos=True, max_output_tokens=10_000)
            async for _ in r.text_deltas():
                break
            await r.cancel()
            await until(lambda: cancels() == before + 1, "the cancel timed")
