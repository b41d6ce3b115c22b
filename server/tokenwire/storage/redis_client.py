"""The Redis client: redis-py's asyncio client, with its commands packed by
hiredis in C, as redis-py's sync client already packs them. Its asyncio
connections pack in Python (redis/redis-py#4176), which was the largest item
of a Redis-logged token's profile."""

from __future__ import annotations

from functools import cache
from typing import Any

import redis.asyncio as redis
from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer

_pack = HiredisRespSerializer().pack


@cache
def _hiredis_packing(base: type[AbstractConnection]) -> type[AbstractConnection]:
    def pack_command(self: AbstractConnection, *args: Any) -> list[bytes]:
        return _pack(*args)

    return type(f"Hiredis{base.__name__}", (base,), {"pack_command": pack_command})


def from_url(url: str, timeout_s: float | None = None) -> redis.Redis:
    """As `redis.Redis.from_url`, bytes in and out; any scheme (redis, rediss,
    unix) keeps its connection class, packing with hiredis. `timeout_s`: how
    long a read or a connect may wait (a network that silently drops packets
    would otherwise hang a follower's blocking read and every write); TCP
    keepalive is on."""
    options: dict[str, Any] = {"decode_responses": False}
    if timeout_s is not None:
        options.update(
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, socket_keepalive=True
        )
    client = redis.Redis.from_url(url, **options)
    pool = client.connection_pool
    pool.connection_class = _hiredis_packing(pool.connection_class)
    return client
