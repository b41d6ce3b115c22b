"""The seam between an engine's deltas and the session: stages.

A stage wraps a generation's stream of `EngineDelta`s. The response cache
serves a stored answer instead of calling the engine (or stores what the
engine said); guardrails hold back and check text before the session sees
it. The runtime chains the server's stages around `Engine.generate`; the
session only sees deltas, with two marks a stage may set:
- `EngineDelta.cached_response` on a delta that came from a cache
  (`usage.cached_response` in response.done);
- `finish_reason` `"content_filter"`: a guardrail stopped the generation (the
  response ends `incomplete` with that reason).

Closing a stage's stream must close the stream it wraps, so that a cancel or
a block frees the engine at once. Typing only here: stages are asyncio code
(`tokenwire.stages`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..engines.base import EngineDelta, GenerationRequest

CONTENT_FILTER = "content_filter"

# What a stage wraps: a generation's deltas for a request (the engine's
# `generate`, or the next stage).
Source = Callable[[GenerationRequest], AsyncIterator[EngineDelta]]


@dataclass(frozen=True, slots=True)
class StageContext:
    """Who a generation is for: stages key, isolate and choose by it."""

    tenant: str  # the API key's id ("anonymous" without keys)
    session_id: str
    response_id: str


class Stage(Protocol):
    name: str

    def session_info(self, tenant: str) -> dict[str, Any]:
        """What session.created tells this tenant's clients of the stage (for
        guardrails: the filters that apply); merged into the session object."""
        ...

    def stream(
        self, request: GenerationRequest, context: StageContext, source: Source
    ) -> AsyncIterator[EngineDelta]:
        """The deltas the session gets for `request`, drawn from `source`."""
        ...
