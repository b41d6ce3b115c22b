"""The Redis client packs commands with hiredis, whatever the URL's scheme,
into the bytes redis-py's own packing makes."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

from tokenwire.storage import redis_client

from ..conftest import RedisServer

XADD = ("XADD", "tw:sess_1:log", "MAXLEN", "~", 10_000, "0-7", "e", b"\x81\xa4type", "c", b"3")


@pytest.mark.parametrize(
    ("url", "scheme_class"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://127.0.0.1:6380/0", SSLConnection),
        ("unix:///tmp/redis.sock?db=0", UnixDomainSocketConnection),
    ],
)
async def test_every_scheme_keeps_its_connection_and_packs_in_c(
    url: str, scheme_class: type[Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis_client.from_url(url)
    made = client.connection_pool.connection_class
    assert issubclass(made, scheme_class) and made is not scheme_class
    packed = []
    pack = redis_client._pack
    monkeypatch.setattr(redis_client, "_pack", lambda *a: packed.append(a) or pack(*a))
    connection = made(**client.connection_pool.connection_kwargs)
    by_python = scheme_class(**client.connection_pool.connection_kwargs).pack_command(*XADD)
    assert b"".join(connection.pack_command(*XADD)) == b"".join(by_python)
    assert packed == [XADD]
    await client.aclose()


async def test_commands_round_trip_through_a_real_server(redis_server: RedisServer) -> None:
    client = redis_client.from_url(redis_server.url)
    await client.xadd("tw:sess_rt:log", {"e": b"\x00\xff", "c": "3"}, id="0-1")
    assert await client.xrange("tw:sess_rt:log") == [(b"0-1", {b"e": b"\x00\xff", b"c": b"3"})]
    assert await client.delete("tw:sess_rt:log") == 1
    await client.aclose()


async def test_the_store_waits_on_redis_for_a_bounded_time(redis_server: RedisServer) -> None:
    """A network that silently drops packets must not hang a follower's
    blocking read (half the lease) or a write: reads and connects time out
    above the longest block, and TCP keepalive is on."""
    from tokenwire.storage.redis import RedisStore

    store = RedisStore(redis_server.url, ttl_s=60, maxlen=100, lease_s=5)
    try:
        kwargs = store.redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 10.0
        assert kwargs["socket_keepalive"] is True
        assert await store.redis.ping()
    finally:
        await store.redis.aclose()
    slow = RedisStore(redis_server.url, ttl_s=60, maxlen=100, lease_s=30)
    assert slow.redis.connection_pool.connection_kwargs["socket_timeout"] == 60.0
    await slow.redis.aclose()
