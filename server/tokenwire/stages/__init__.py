"""Stages between the engine and the session (core.stages): the response
cache and the streaming guardrails. asyncio code; the server builds them once
from its configuration and every session's generations pass through them."""

from __future__ import annotations

from ..config import ServerConfig
from ..core.stages import Stage
from ..storage.redis import RedisStore


def build_stages(config: ServerConfig, store: RedisStore | None) -> tuple[Stage, ...]:
    """The configured stages, innermost (nearest the engine) first."""
    stages: list[Stage] = []
    return tuple(stages)
