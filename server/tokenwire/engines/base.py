"""The one small interface every engine implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import ErrorCode


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One engine request: a chat rendered by the engine, plus sampling params."""

    request_id: str
    messages: list[dict[str, Any]]
    max_output_tokens: int | None = None
    temperature: float = 1.0
    ignore_eos: bool = False
    # Chat-completions shape: [{"type": "function", "function": {name, description,
    # parameters}}]. None when tool_choice is "none".
    tools: list[dict[str, Any]] | None = None
    # "auto" | "required" | {"type": "function", "name": ...}
    tool_choice: str | dict[str, Any] = "auto"
    # Tokens this generation already produced before a pause: the engine
    # appends them to the prompt and continues after them (prefix-cache hit).
    resume_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A chunk of the index-th tool call of one generation; `name` on its first chunk."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class EngineDelta:
    """What one engine step produced for a request (DELTA semantics)."""

    text: str
    output_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Set on the first delta of a request.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # The engine's ids for this delta's tokens; what a resume resubmits.
    token_ids: list[int] | None = None


@dataclass(slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(Exception):
    """A request the engine refused or failed; carries a protocol error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Engine(Protocol):
    name: str

    async def start(self) -> None:
        """Load the model; `generate` waits for this to finish."""

    async def close(self) -> None: ...

    @property
    def ready(self) -> bool: ...

    def check(self, request: GenerationRequest) -> None:
        """Pre-flight, synchronous: raise EngineError (context_length_exceeded)
        before any engine work. May do nothing if the engine is not ready."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        """Stream deltas. Cancelling the consuming task aborts the request."""
        ...

    def load(self) -> EngineLoad:
        """Requests the engine holds right now (running and waiting)."""
        ...
