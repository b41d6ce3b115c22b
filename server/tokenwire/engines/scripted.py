"""A deterministic engine for protocol tests and gateway benchmarks.

It is not a model. It echoes the last user message word by word ("You said:
..."), or with `ignore_eos` emits " t0 t1 t2 ..." up to max_output_tokens,
at a fixed token rate, so tests and benchmarks know exactly what to expect.
With a forced tool_choice it emits the same structured-output text a real
model would, run through the same scanner; after tool results it answers
"Tool said: ...".
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from itertools import islice
from typing import Any

from .base import (
    ContextLengthExceeded,
    EngineCapabilities,
    EngineDelta,
    EngineLoad,
    GenerationRequest,
    ToolCallDelta,
)
from .toolcalls import ArrayCallScanner, NamedCallScanner, forced_call_text

DEFAULT_CONTEXT_TOKENS = 4096
CALL_CHUNK = 4  # characters of call JSON per "token"


@types.coroutine
def _yield_to_loop() -> Generator[None, None, None]:
    """What `asyncio.sleep(0)` does, without the coroutine around it."""
    yield


def count_tokens(text: str) -> int:
    return len(text.split())


def _last_user_words(messages: list[dict[str, Any]]) -> list[str]:
    last = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "user"), "")
    return last.split()


class CountingTokens(Sequence[str]):
    """ " t0", " t1", ...: made on demand, as max_output_tokens may be huge."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[str]:
        return map(" t{}".format, range(self.n))  # no Python call per token

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # Sequence's overloads
        if isinstance(i, slice):
            return CountingTokens(len(range(self.n)[i]))  # only prefixes are sliced
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f" t{i}"


def reply_tokens(request: GenerationRequest) -> Sequence[str]:
    """The whole deterministic text reply, one string per token."""
    if request.ignore_eos:
        return CountingTokens((request.max_output_tokens or 16) + len(request.resume_token_ids))
    messages = request.messages
    if messages and messages[-1]["role"] == "tool":
        outputs = []
        for m in reversed(messages):
            if m["role"] != "tool":
                break
            outputs.insert(0, m["content"])
        return ["Tool", " said:"] + [f" {w}" for w in " ".join(outputs).split()]
    words = _last_user_words(messages)
    if not words:
        return ["Hello!", " How", " can", " I", " help?"]
    return ["You", " said:"] + [f" {w}" for w in words]


def example_arguments(schema: dict[str, Any], word: str) -> dict[str, Any]:
    """Arguments that satisfy a simple JSON schema, built from `word`."""
    out: dict[str, Any] = {}
    for key, prop in (schema.get("properties") or {}).items():
        if "enum" in prop:
            out[key] = prop["enum"][0]
            continue
        out[key] = {
            "string": word,
            "integer": 1,
            "number": 1,
            "boolean": True,
            "array": [],
            "object": {},
        }.get(prop.get("type", "string"), word)
    return out


class ScriptedEngine:
    name = "scripted"
    model = "scripted"
    capabilities = EngineCapabilities(resume_from_token_ids=True, preflight=True)

    def __init__(
        self, tokens_per_s: float = 0.0, max_context_tokens: int = DEFAULT_CONTEXT_TOKENS
    ) -> None:
        self.tokens_per_s = tokens_per_s
        self._max_context_tokens = max_context_tokens
        self._running = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    @property
    def ready(self) -> bool:
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(running=self._running)

    def preflight(self, request: GenerationRequest) -> None:
        self._prompt_tokens(request)

    def _prompt_tokens(self, request: GenerationRequest) -> int:
        prompt_tokens = sum(count_tokens(m.get("content") or "") + 3 for m in request.messages)
        if prompt_tokens >= self._max_context_tokens:
            raise ContextLengthExceeded(
                f"the prompt has {prompt_tokens} tokens; the model's context is "
                f"{self._max_context_tokens}",
            )
        return prompt_tokens

    def _plan(self, request: GenerationRequest) -> tuple[Sequence[str], Any]:
        """The tokens to emit, and a scanner if they are a forced tool call."""
        choice = request.tool_choice
        if request.tools and choice != "auto":
            tools = [t["function"] for t in request.tools]
            word = (_last_user_words(request.messages) or ["x"])[-1].strip("?.!,")
            if isinstance(choice, dict):
                tool = next(t for t in tools if t["name"] == choice["name"])
                scanner: Any = NamedCallScanner(tool["name"])
                calls = [tool]
            else:
                scanner = ArrayCallScanner()
                calls = tools[:1] if choice == "required_single" else tools
            text = forced_call_text(
                [(t["name"], example_arguments(t.get("parameters") or {}, word)) for t in calls],
                named=isinstance(choice, dict),
            )
            return [text[i : i + CALL_CHUNK] for i in range(0, len(text), CALL_CHUNK)], scanner
        return reply_tokens(request), None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        prompt_tokens = self._prompt_tokens(request)
        tokens, scanner = self._plan(request)
        # A resumed generation continues after the tokens it already produced.
        skip = len(request.resume_token_ids)
        limit = None if request.max_output_tokens is None else request.max_output_tokens + skip
        finish = "stop"
        if limit is not None and len(tokens) > limit:
            tokens, finish = tokens[:limit], "length"
        if request.ignore_eos:
            finish = "length"
        interval = 1.0 / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
        start = time.monotonic()
        last = len(tokens) - 1
        self._running += 1
        try:
            if last < skip:
                yield EngineDelta("", 0, finish, prompt_tokens, 0)
                return
            group = request.stream_interval
            held: list[str] = []  # tokens made but not yet emitted (stream_interval)
            for i, tok in enumerate(islice(tokens, skip, None), skip):
                if interval:
                    # Sleep to an absolute schedule so the rate does not drift.
                    delay = start + (i + 1 - skip) * interval - time.monotonic()
                    await asyncio.sleep(delay if delay > 0 else 0)
                else:
                    await _yield_to_loop()
                ids = [i]
                if group > 1:
                    # As vLLM: the first and last at once, the rest in groups.
                    held.append(tok)
                    if i != skip and i != last and len(held) < group:
                        continue
                    tok, ids, held = "".join(held), list(range(i + 1 - len(held), i + 1)), []
                calls: list[ToolCallDelta] | None = None
                if scanner is not None:
                    calls, tok = scanner.feed(tok), ""
                yield EngineDelta(
                    tok,
                    len(ids),
                    finish if i == last else None,
                    prompt_tokens if i == skip else None,
                    0 if i == skip else None,
                    calls or None,
                    ids,
                )
        finally:
            self._running -= 1
