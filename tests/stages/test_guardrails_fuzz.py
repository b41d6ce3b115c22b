"""Fuzz: however the same text is split into deltas, the window delivers the
same text as one big delta: redactions included, and when a blocklist entry
triggers, the same prefix (the text before it)."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwire.core.stages import CONTENT_FILTER, StageContext
from tokenwire.engines.base import EngineDelta, GenerationRequest
from tokenwire.stages.filters import Blocklist, Pii
from tokenwire.stages.guardrails import GuardrailPolicy, GuardrailStage

WORDS = ["hello", "world", "bob@example.com", "a.b@x.org", "555-123-4567", "+1 555 123 4567",
         "(555) 123-4567", "call", "me", "at", "2024", "ok.", "sec", "ret", "Secrets"]  # fmt: skip


def stage() -> GuardrailStage:
    filters = (Blocklist(["secret", "top secret plan"]), Pii())
    return GuardrailStage(filters, {}, GuardrailPolicy(1.0, True), 16)


async def deliver(pieces: list[str]) -> tuple[str, str | None]:
    async def source(request: GenerationRequest):  # type: ignore[no-untyped-def]
        for i, p in enumerate(pieces):
            yield EngineDelta(p, 1, "stop" if i == len(pieces) - 1 else None, token_ids=[i])

    out = [
        d
        async for d in stage().stream(
            GenerationRequest("r", []), StageContext("t", "s", "r"), source
        )
    ]
    assert sum(d.output_tokens for d in out) <= len(pieces)
    return "".join(d.text for d in out), out[-1].finish_reason


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = " ".join(draw(st.lists(st.sampled_from([*WORDS, "secret"]), min_size=1, max_size=30)))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    bounds = [0, *[c for c in cuts if 0 < c < len(text)], len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(split_text())
def test_any_split_delivers_what_one_delta_does(case: tuple[str, list[str]]) -> None:
    text, pieces = case
    whole, whole_finish = asyncio.run(deliver([text]))
    split, split_finish = asyncio.run(deliver(pieces))
    assert (split, split_finish) == (whole, whole_finish)
    if "secret" in text.split():  # the blocked word: stopped before it, none of it sent
        assert whole_finish == CONTENT_FILTER and "secret " not in whole + " "
    else:
        assert whole_finish == "stop"
    assert "@" not in whole and "4567" not in whole  # every address and number redacted
