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


def from_url(url: str) -> redis.Redis:
    """As `redis.Redis.from_url`, bytes in and out; any scheme (redis, rediss,
    unix) keeps its connection class, packing with hiredis."""
    client = redis.Redis.from_url(url, decode_responses=False)
    pool = client.connection_pool
    pool.connection_class = _hiredis_packing(pool.connection_class)
    return client
