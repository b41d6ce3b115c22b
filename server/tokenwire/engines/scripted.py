"""A deterministic engine for protocol tests and gateway benchmarks.

It is not a model. It echoes the last user message word by word ("You said:
..."), or with `ignore_eos` emits " t0 t1 t2 ..." up to max_output_tokens,
at a fixed token rate, so tests and benchmarks know exactly what to expect.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ..protocol import ErrorCode
from .base import EngineDelta, EngineError, EngineLoad, GenerationRequest

DEFAULT_CONTEXT_TOKENS = 4096


def count_tokens(text: str) -> int:
    return len(text.split())


def reply_tokens(request: GenerationRequest) -> list[str]:
    """The whole deterministic reply, one string per token."""
    if request.ignore_eos:
        return [f" t{i}" for i in range(request.max_output_tokens or 16)]
    last_user = next(
        (m.get("content") or "" for m in reversed(request.messages) if m["role"] == "user"), ""
    )
    words = ["You", " said:"] + [f" {w}" for w in last_user.split()]
    return words if last_user else ["Hello!", " How", " can", " I", " help?"]


class ScriptedEngine:
    name = "scripted"

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

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    def load(self) -> EngineLoad:
        return EngineLoad(running=self._running)

    def check(self, request: GenerationRequest) -> None:
        self._prompt_tokens(request)

    def _prompt_tokens(self, request: GenerationRequest) -> int:
        prompt_tokens = sum(count_tokens(m.get("content") or "") + 3 for m in request.messages)
        if prompt_tokens >= self._max_context_tokens:
            raise EngineError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {prompt_tokens} tokens; the model's context is "
                f"{self._max_context_tokens}",
            )
        return prompt_tokens

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        prompt_tokens = self._prompt_tokens(request)
        tokens = reply_tokens(request)
        if request.continue_final_message and not request.ignore_eos:
            # Resume where the partial assistant text left off.
            done = count_tokens(request.messages[-1].get("content") or "")
            tokens = tokens[done:]
        limit = request.max_output_tokens
        finish = "stop"
        if limit is not None and len(tokens) > limit:
            tokens, finish = tokens[:limit], "length"
        if request.ignore_eos:
            finish = "length"
        interval = 1.0 / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
        start = time.monotonic()
        self._running += 1
        try:
            if not tokens:
                yield EngineDelta("", 0, finish, prompt_tokens, 0)
                return
            for i, tok in enumerate(tokens):
                # Sleep to an absolute schedule so the rate does not drift.
                delay = start + (i + 1) * interval - time.monotonic()
                await asyncio.sleep(delay if delay > 0 else 0)
                last = i == len(tokens) - 1
                yield EngineDelta(
                    tok,
                    1,
                    finish if last else None,
                    prompt_tokens if i == 0 else None,
                    0 if i == 0 else None,
                )
        finally:
            self._running -= 1
