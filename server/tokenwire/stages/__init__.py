"""Stages between the engine and the session (core.stages): the response
cache and the streaming guardrails. asyncio code; the server builds them once
from its configuration and every session's generations pass through them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from ..config import ServerConfig
from ..core.stages import Stage
from ..engines.base import Engine
from ..storage.redis import RedisStore
from .cache import ResponseCache
from .cache_store import MemoryStore, RedisCacheStore
from .guardrails import KeyGuardrails, build_guardrails


def served_model(engine: Engine, config: ServerConfig) -> Callable[[], str | None]:
    """What identifies the model in a cache key: the engine's kind and what it
    serves (a path, or a remote's served name), as the engine found it at
    start: `--model` may be unset, or given to vLLM alone. None before the
    engine is ready: nothing is cached then.

    Then a digest of the flags that shape what the model writes (`--dtype`,
    `--tool-parser`, `--max-model-len`, vLLM's own arguments after `--`):
    instances that share a Redis cache share entries only when they would
    generate alike (a shorter context truncates where a longer one stops)."""
    shaping = json.dumps(
        [config.dtype, config.tool_parser, config.max_model_len, list(config.vllm_args)]
    )
    flags = hashlib.sha256(shaping.encode()).hexdigest()[:16]

    def model() -> str | None:
        return f"{engine.name}:{engine.model}:{flags}" if engine.model else None

    return model


def response_cache(
    config: ServerConfig, store: RedisStore | None, model: Callable[[], str | None]
) -> Stage:
    """In Redis with --redis-url (shared by every instance), else in memory."""
    max_bytes, ttl_s = config.response_cache_max_bytes, config.response_cache_ttl_s
    backend = RedisCacheStore(store, max_bytes, ttl_s) if store else MemoryStore(max_bytes, ttl_s)
    return ResponseCache(backend, model)


def build_stages(
    config: ServerConfig,
    store: RedisStore | None,
    engine: Engine,
    keys: KeyGuardrails | None = None,
) -> tuple[Stage, ...]:
    """The configured stages, innermost (nearest the engine) first."""
    stages: list[Stage] = []
    if config.response_cache:
        stages.append(response_cache(config, store, served_model(engine, config)))
    # Outside the cache: a cached answer is checked too, under this tenant's filters.
    guardrails = build_guardrails(config, keys)
    if guardrails is not None:
        stages.append(guardrails)
    return tuple(stages)
