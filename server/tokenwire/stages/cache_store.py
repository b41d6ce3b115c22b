"""Where the response cache (stages.cache) keeps its entries: an in-memory LRU
with a byte cap, or Redis shared by every instance. An entry is opaque bytes
(msgpack of a generation's deltas) under a hex digest; both expire after a TTL."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from .. import metrics
from ..storage.redis import RedisStore

# No entry may take more than this share of the cap: one long answer must not
# flush the whole cache.
ENTRY_SHARE = 8
# What an in-memory entry holds besides its data, counted against the cap
# (measured: its hex digest 113 B, the bytes object's header 33 B, the tuple,
# float and OrderedDict slot 171 B): short answers stay under the cap too.
ENTRY_OVERHEAD = 320


class CacheStore(Protocol):
    max_entry_bytes: int

    async def get(self, digest: str) -> bytes | None: ...

    async def put(self, digest: str, data: bytes) -> bool:
        """Store it; False if it is over `max_entry_bytes`."""
        ...


class MemoryStore:
    """An LRU bounded by `max_bytes` (entries' sizes), each entry living `ttl_s`."""

    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_bytes // ENTRY_SHARE
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    async def get(self, digest: str) -> bytes | None:
        found = self.entries.get(digest)
        if found is None:
            return None
        expires, data = found
        if expires <= self.clock():
            self._drop(digest)
            return None
        self.entries.move_to_end(digest)
        return data

    async def put(self, digest: str, data: bytes) -> bool:
        if len(data) + ENTRY_OVERHEAD > self.max_entry_bytes:
            return False
        if digest in self.entries:
            self._drop(digest)
        self.entries[digest] = (self.clock() + self.ttl_s, data)
        self.bytes += len(data) + ENTRY_OVERHEAD
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            metrics.CACHE_EVICTIONS.inc()
        metrics.CACHE_MEMORY_BYTES.set(self.bytes)
        return True

    def _drop(self, digest: str) -> None:
        _, data = self.entries.pop(digest)
        self.bytes -= len(data) + ENTRY_OVERHEAD
        metrics.CACHE_MEMORY_BYTES.set(self.bytes)


class RedisCacheStore:
    """Entries in Redis (`tw:rc:{digest}`), shared by every instance; Redis
    expires them. Only the per-entry cap applies here: the TTL (and Redis's own
    maxmemory policy) bounds the total."""

    def __init__(self, store: RedisStore, max_bytes: int, ttl_s: float) -> None:
        self.store = store
        self.max_entry_bytes = max_bytes // ENTRY_SHARE
        self.ttl_s = ttl_s

    async def get(self, digest: str) -> bytes | None:
        return await self.store.response(digest)

    async def put(self, digest: str, data: bytes) -> bool:
        if len(data) > self.max_entry_bytes:
            return False
        await self.store.put_response(digest, data, self.ttl_s)
        return True
