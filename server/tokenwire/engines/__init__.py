"""Engines behind one interface: `vllm` (real, in process), `remote` (vLLM
servers over HTTP), `scripted` (deterministic)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import (
    ContextLengthExceeded,
    ConversationRefused,
    Engine,
    EngineCapabilities,
    EngineDelta,
    EngineError,
    EngineLoad,
    EngineUnavailable,
    GenerationRequest,
    RequestError,
)

if TYPE_CHECKING:
    from ..config import ServerConfig

__all__ = [
    "ContextLengthExceeded",
    "ConversationRefused",
    "Engine",
    "EngineCapabilities",
    "EngineDelta",
    "EngineError",
    "EngineLoad",
    "EngineUnavailable",
    "GenerationRequest",
    "RequestError",
    "create_engine",
]


def create_engine(config: ServerConfig) -> Engine:
    # Imported lazily: the vllm engine pulls in torch, the scripted one nothing.
    if config.engine == "scripted":
        from .scripted import ScriptedEngine

        return ScriptedEngine(tokens_per_s=config.scripted_tokens_per_s)
    if config.engine == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(config)
    if config.engine == "remote":
        from .remote import RemoteEngine

        return RemoteEngine(config)
    raise ValueError(f"unknown engine {config.engine!r}; choose vllm, remote or scripted")
