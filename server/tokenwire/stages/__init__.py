"""Stages between the engine and the session (core.stages): the response
cache and the streaming guardrails. asyncio code; the server builds them once
from its configuration and every session's generations pass through them."""

from __future__ import annotations

from ..config import ServerConfig
from ..core.stages import Stage
from ..storage.redis import RedisStore
from .cache import ResponseCache
from .cache_store import MemoryStore, RedisCacheStore
from .guardrails import KeyGuardrails, build_guardrails


def response_cache(config: ServerConfig, store: RedisStore | None) -> Stage:
    """In Redis with --redis-url (shared by every instance), else in memory."""
    max_bytes, ttl_s = config.response_cache_max_bytes, config.response_cache_ttl_s
    backend = RedisCacheStore(store, max_bytes, ttl_s) if store else MemoryStore(max_bytes, ttl_s)
    # What identifies the model: the engine and its model directory (ids differ by tokenizer).
    return ResponseCache(backend, f"{config.engine}:{config.model or 'bundled'}")


def build_stages(
    config: ServerConfig, store: RedisStore | None, keys: KeyGuardrails | None = None
) -> tuple[Stage, ...]:
    """The configured stages, innermost (nearest the engine) first."""
    stages: list[Stage] = []
    if config.response_cache:
        stages.append(response_cache(config, store))
    # Outside the cache: a cached answer is checked too, under this tenant's filters.
    guardrails = build_guardrails(config, keys)
    if guardrails is not None:
        stages.append(guardrails)
    return tuple(stages)
