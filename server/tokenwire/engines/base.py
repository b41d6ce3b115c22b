"""The one small interface every engine implements."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

# How much of a paused generation's text its resume carries (resumed_text).
RESUMED_TEXT_CHARS = 4096


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
    # The end of the text those tokens gave, as the client got it (at most
    # RESUMED_TEXT_CHARS): a stage that checks text (guardrails) sees it too.
    resumed_text: str = ""
    # The prompt as the engine's preflight rendered it, so generate() does
    # not render it again; None: generate() renders it.
    rendered: tuple[int, ...] | None = None
    # Scheduling priority, vLLM's convention: a lower value runs first.
    priority: int = 0
    # The session it belongs to: engines keep a session on one rank or
    # replica (its prefix cache), by this key.
    session_id: str | None = None
    # vLLM's cache_salt: requests share prefix-cache blocks only with requests
    # of the same salt (one per tenant keeps tenants' caches apart). None: no salt.
    cache_salt: str | None = None
    # False: a response cache must neither serve nor store it (`cache: false`).
    cache: bool = True
    # The sampler's seed (None: random); with one, the output is reproducible.
    seed: int | None = None
    # Tokens per delta: the engine emits the first and last at once, the rest
    # in groups of this many (vLLM's stream_interval).
    stream_interval: int = 1


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
    # Usage, which consumers add up wherever prompt_tokens is set: the prompt
    # and cached counts on the first delta. An engine that learns the cached
    # count only at the end (a remote server reports it with the final usage)
    # gives it on the last delta instead, with prompt_tokens 0.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # The engine's ids for this delta's tokens; what a resume resubmits.
    token_ids: list[int] | None = None
    # Set on the first delta: how long the request waited for the scheduler.
    queue_wait_s: float | None = None
    # Set on the first delta by a response cache that served this generation.
    cached_response: bool = False


@dataclass(slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What the session may ask of an engine, instead of assuming it."""

    # generate() continues after `resume_token_ids` exactly as if never
    # stopped: a slow client's generation can be paused and resumed.
    resume_from_token_ids: bool = False
    # preflight() knows the prompt's size: a request that cannot fit is
    # refused before a response exists.
    preflight: bool = False
    # The request's priority reaches the engine's scheduler.
    priority: bool = False


class EngineError(Exception):
    """A request the engine failed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EngineUnavailable(EngineError):
    """The engine cannot serve anything now (failed to start, or died); the
    request itself may be fine."""


class RequestError(EngineError):
    """This request cannot run; others may."""


class ContextLengthExceeded(RequestError):
    """The prompt does not fit the model's context."""


# True while a client event (from a socket, or forwarded by a follower) is
# handed to its session: a preflight may then raise TokenizeOffLoop rather
# than tokenize a long prompt on the event loop. `generate` goes to a thread
# by itself (ChatTemplate.prompt_ids_async).
TOKENIZE_OFF_LOOP: ContextVar[bool] = ContextVar("tokenize_off_loop", default=False)
_T = TypeVar("_T")


class TokenizeOffLoop(Exception):
    """A prompt too long to tokenize on the event loop. The caller runs
    `tokenize(text)` in a thread, gives the ids to `remember`, and hands the
    event over again: the preflight finds them."""

    def __init__(
        self,
        text: str,
        tokenize: Callable[[str], list[int]],
        remember: Callable[[list[int]], None],
    ) -> None:
        super().__init__("tokenize off the event loop")
        self.text = text
        self.tokenize = tokenize
        self.remember = remember


def asking_off_loop(call: Callable[[], _T], off_loop: bool = True) -> _T | TokenizeOffLoop:
    """`call()` with TOKENIZE_OFF_LOOP set to `off_loop`: what it returns, or
    the TokenizeOffLoop its preflight raised instead of tokenizing on the loop."""
    token = TOKENIZE_OFF_LOOP.set(off_loop)
    try:
        return call()
    except TokenizeOffLoop as off:
        return off
    finally:
        TOKENIZE_OFF_LOOP.reset(token)


class ConversationRefused(RequestError):
    """The model's chat template refuses the conversation's shape (strict
    templates want user and assistant turns to alternate)."""


class Engine(Protocol):
    name: str
    capabilities: EngineCapabilities
    # What it serves once started ("" before): the model's path or served
    # name. The response cache keys by it.
    model: str

    async def start(self) -> None:
        """Load the model; `generate` waits for this to finish."""

    async def close(self) -> None: ...

    @property
    def ready(self) -> bool: ...

    def preflight(self, request: GenerationRequest) -> tuple[int, ...] | None:
        """Synchronous, before any engine work: raise RequestError if the request
        cannot run. Returns the rendered prompt for `GenerationRequest.rendered`,
        or None. May check nothing while the engine is not ready."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        """Stream deltas; the last has a finish_reason. Cancelling the consuming
        task (or closing the iterator) aborts the request. Raises EngineError."""
        ...

    def load(self) -> EngineLoad:
        """Requests the engine holds right now (running and waiting)."""
        ...
