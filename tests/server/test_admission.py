"""API key entries with options: the per-key priority floor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenwire.server.admission import KeyFileError, KeyStore, Limiter, key_id


def test_key_entries_carry_a_priority_floor() -> None:
    keys = KeyStore(["# interactive", "key-a", "key-b  min_priority=10", ""])
    assert len(keys) == 2
    assert keys.verify("key-b") == key_id("key-b")
    assert keys.min_priority(key_id("key-a")) is None
    assert keys.min_priority(key_id("key-b")) == 10
    assert keys.has_priority_floors
    usage = Limiter(8, 0.0, keys).usage(key_id("key-b"))
    assert usage.min_priority == 10


@pytest.mark.parametrize("line", ["k max_priority=1", "k min_priority", "k min_priority=high"])
def test_a_bad_option_names_the_key_not_the_secret(line: str) -> None:
    with pytest.raises(KeyFileError) as caught:
        KeyStore([line])
    assert key_id("k") in str(caught.value)
    assert " k " not in f" {caught.value} "


def colliding_keys() -> tuple[str, str]:
    """Two keys whose ids (32 bits) are equal: a birthday search, ~80k tries."""
    seen: dict[str, str] = {}
    for i in range(2_000_000):
        key = f"key-{i}"
        other = seen.setdefault(key_id(key), key)
        if other != key:
            return other, key
    raise AssertionError("no collision found")


def test_two_keys_under_one_id_are_refused_not_merged() -> None:
    """Limits and options are kept per key id: two keys sharing one would share
    them (one tenant's cache_salt given to the other)."""
    a, b = colliding_keys()
    assert a != b and key_id(a) == key_id(b)
    with pytest.raises(KeyFileError, match=f"key {key_id(a)}: listed twice, or another key"):
        KeyStore([f"{a} cache_salt=tenant-a", f"{b} cache_salt=tenant-b"])
    with pytest.raises(KeyFileError, match="listed twice"):
        KeyStore(["key-a min_priority=1", "key-a"])


def test_serve_refuses_a_bad_key_file(tmp_path: object) -> None:
    path = tmp_path / "keys"  # type: ignore[operator]
    path.write_text("secret-key min_priority=soon\n")
    command = ["serve", "--engine", "scripted", "--api-keys-file", str(path)]
    run = subprocess.run(
        [sys.executable, "-m", "tokenwire", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "min_priority must be an integer" in run.stderr
    assert "secret-key" not in run.stderr and "Traceback" not in run.stderr


async def test_a_batch_key_cannot_jump_the_queue() -> None:
    from tokenwire.client import TokenwireError, connect
    from tokenwire.config import ServerConfig

    from ..conftest import _scripted_server

    config = ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=2000,
        api_keys="interactive-key,batch-key min_priority=10",
    )
    async with _scripted_server(config) as running:
        async with await connect(running.url, api_key="batch-key") as batch:
            assert batch.session["priority"] == 10
            with pytest.raises(TokenwireError) as caught:
                await batch.update_session(priority=0)
            assert caught.value.code == "priority_not_allowed"
            with pytest.raises(TokenwireError) as caught:
                await batch.create_response(priority=9)
            assert caught.value.code == "priority_not_allowed"
            assert await batch.ask("still usable") == "You said: still usable"
        async with await connect(running.url, api_key="interactive-key") as interactive:
            assert interactive.session["priority"] == 0
            await interactive.update_session(priority=-5)


def test_key_entries_carry_a_cache_salt() -> None:
    keys = KeyStore(["key-a cache_salt=tenant-a", "key-b"])
    assert keys.cache_salt(key_id("key-a")) == "tenant-a"
    assert keys.cache_salt(key_id("key-b")) is None
    assert Limiter(8, 0.0, keys).usage(key_id("key-a")).cache_salt == "tenant-a"
    with pytest.raises(KeyFileError) as caught:
        KeyStore(["k cache_salt="])
    assert "cache_salt must be 1 to 128 printable characters" in str(caught.value)


async def test_each_keys_requests_carry_its_cache_salt() -> None:
    """The salt reaches every engine request of the key's sessions (the engines
    pass it to vLLM, whose prefix cache it splits: tests/remote/test_remote_vllm.py)."""
    from tokenwire.client import connect
    from tokenwire.config import ServerConfig
    from tokenwire.engines.scripted import ScriptedEngine
    from tokenwire.server import TokenwireServer

    from ..conftest import RunningServer

    seen: list[tuple[str, str | None]] = []

    class Recording(ScriptedEngine):
        def generate(self, request):  # type: ignore[no-untyped-def]
            seen.append((request.messages[-1]["content"], request.cache_salt))
            return super().generate(request)

    config = ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=2000,
        api_keys="key-a cache_salt=tenant-a,key-b cache_salt=tenant-b,key-c",
    )
    server = TokenwireServer(config, Recording(tokens_per_s=2000))
    await server.start()
    try:
        for key in ("key-a", "key-b", "key-c"):
            async with await connect(RunningServer(server).url, api_key=key) as tw:
                assert await tw.ask(key) == f"You said: {key}"
    finally:
        await server.close()
    assert seen == [("key-a", "tenant-a"), ("key-b", "tenant-b"), ("key-c", None)]


def test_a_keys_record_outlives_its_sockets_while_it_holds_anything() -> None:
    """Reconnecting must not reset a key's limits: its record stays while a
    session (awaiting a resume too) holds it, or its token bucket is in debt."""
    from tokenwire.core.limits import TokenBucket

    limiter = Limiter(8, 10.0)
    usage = limiter.usage("k")
    usage.sessions = 1  # a session awaiting its resume
    limiter.forget_idle("k")
    assert limiter.usage("k") is usage
    usage.sessions = 0
    now = [0.0]
    usage.tokens = TokenBucket(10.0, 20.0, clock=lambda: now[0])
    usage.spend_tokens(100)  # 8 s of debt at 10 tokens/s
    limiter.forget_idle("k")
    assert limiter.usage("k") is usage
    assert not usage.tokens.ready()
    now[0] = 100.0  # paid back, and full again: a fresh record is the same
    limiter.forget_idle("k")
    assert "k" not in limiter.keys


def test_a_key_left_in_debt_is_dropped_once_paid_back() -> None:
    """Its last socket went while it owed tokens, and it never came back: the
    next key to arrive after the debt is paid sweeps its record away."""
    from tokenwire.core.limits import TokenBucket

    limiter = Limiter(8, 10.0)
    now = [0.0]
    usage = limiter.usage("gone")
    usage.tokens = TokenBucket(10.0, 20.0, clock=lambda: now[0])
    usage.spend_tokens(100)
    limiter.forget_idle("gone")  # its last socket closed, in debt: kept
    limiter.usage("other")
    assert limiter.keys.get("gone") is usage  # still owed
    now[0] = 100.0
    limiter.usage("other")
    assert "gone" not in limiter.keys


async def test_a_session_awaiting_resume_shares_its_keys_response_limit() -> None:
    import asyncio
    import json

    from websockets.asyncio.client import ClientConnection
    from websockets.asyncio.client import connect as ws_connect

    from tokenwire.config import ServerConfig

    from ..conftest import _scripted_server
    from ..helpers.wait import until

    key = "tw-test-key-0123456789"
    config = ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=50,
        api_keys=key,
        max_responses_per_key=1,
        resume_grace_s=60,
        max_events_per_s=0,
    )
    long = {"type": "response.create", "response": {"ignore_eos": True, "max_output_tokens": 10**6}}

    async def open_ws() -> ClientConnection:
        return await ws_connect(
            running.url,
            subprotocols=["tokenwire.v1.json"],
            additional_headers={"Authorization": f"Bearer {key}"},
        )

    async def reply(ws: ClientConnection) -> dict:
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if event["type"] in ("response.created", "error", "session.resumed"):
                return event

    async with _scripted_server(config) as running:
        server = running.server
        a = await open_ws()
        s1 = json.loads(await a.recv())["session"]["id"]
        a.transport.abort()
        await until(lambda: server.health()["connections"] == 0, "the drop is seen")
        b = await open_ws()
        await b.recv()
        await b.send(json.dumps(long))
        assert (await reply(b))["type"] == "response.created"  # the key's one response
        c = await open_ws()
        await c.recv()
        await c.send(json.dumps({"type": "session.resume", "session_id": s1, "last_seq": 1}))
        assert (await reply(c))["type"] == "session.resumed"
        await c.send(json.dumps(long))
        refused = await reply(c)
        assert refused["type"] == "error" and refused["error"]["code"] == "too_many_responses"
        assert server.registry.busy() == 1
        for ws in (b, c):
            ws.transport.abort()


def test_handshakes_rejected_counts_handshakes_only_and_the_1013_race() -> None:
    """A refused mint (a POST, not a handshake) counted as a refused handshake,
    and a handshake that lost the race for the last slot (closed 1013) did not."""
    from prometheus_client import REGISTRY
    from websockets.datastructures import Headers
    from websockets.http11 import Request

    from tokenwire.config import ServerConfig
    from tokenwire.server.admission import Admission

    def rejected(reason: str) -> float:
        sample = "tokenwire_handshakes_rejected_total"
        return REGISTRY.get_sample_value(sample, {"reason": reason}) or 0.0

    class Conn:
        transport = None

    admission = Admission(ServerConfig(api_keys="secret-key", max_connections=1))
    bad = Request("/v1/realtime", Headers({"Authorization": "Bearer wrong"}))
    before = rejected("unauthorized")
    assert admission.mint(bad, b"{}").status_code == 401  # type: ignore[union-attr]
    assert rejected("unauthorized") == before
    assert admission.admit(Conn(), bad, 0, False).status_code == 401  # type: ignore[arg-type,union-attr]
    assert rejected("unauthorized") == before + 1
    good = Request("/v1/realtime", Headers({"Authorization": "Bearer secret-key"}))
    full = rejected("too_many_connections")
    winner, loser = Conn(), Conn()
    assert admission.admit(winner, good, 0, False) is None  # type: ignore[arg-type]
    assert admission.admit(loser, good, 0, False) is None  # type: ignore[arg-type]
    assert admission.connect(winner, 0) is not None  # type: ignore[arg-type]
    assert admission.connect(loser, 1) is None  # type: ignore[arg-type]
    assert rejected("too_many_connections") == full + 1
