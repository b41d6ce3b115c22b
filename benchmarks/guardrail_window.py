"""The guardrail stage alone, in one process: CPU per token of `blocklist` +
`pii` over the window, for text with spaces and for text with nowhere to cut
(a run of `-=`, one endless word). The window is bounded, so the cost per
token must not grow with the answer: the ratio of the long answer's cost per
token to the short one's stays near 1 (it grew with the length before the
bound: 8,000 tokens of one word cost 347 s of loop).

    .venv/bin/python -m benchmarks.guardrail_window [--tokens 2000 8000] [--rounds 3]

Writes benchmarks/results/guardrail_window.md.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tokenwire.core.stages import StageContext
from tokenwire.engines.base import EngineDelta, GenerationRequest
from tokenwire.stages.filters import Blocklist, Pii
from tokenwire.stages.guardrails import GuardrailPolicy, GuardrailStage

RESULTS = Path(__file__).parent / "results" / "guardrail_window.md"
TEXTS = {"words": " word", "no space": "-=", "one word": "a"}  # one token's text


async def per_token_us(piece: str, tokens: int, rounds: int) -> float:
    """The best round's CPU per token, in microseconds."""

    async def engine(request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        for i in range(tokens):
            yield EngineDelta(piece, 1, "stop" if i == tokens - 1 else None, token_ids=[i])

    filters = [Blocklist(["zebra", r"re:secret\d+"]), Pii()]
    stage = GuardrailStage(filters, {}, GuardrailPolicy(0.5, True), 32)
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        request, context = GenerationRequest("r-1", []), StageContext("a", "s", "r")
        async for _ in stage.stream(request, context, engine):
            pass
        best = min(best, time.process_time() - started)
    return best / tokens * 1e6


async def main(args: argparse.Namespace) -> None:
    short, long = args.tokens
    rows = [
        f"| text | µs/token at {short} | µs/token at {long} | long / short |",
        "|---|---|---|---|",
    ]
    for name, piece in TEXTS.items():
        a = await per_token_us(piece, short, args.rounds)
        b = await per_token_us(piece, long, args.rounds)
        rows.append(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    table = "\n".join(rows)
    print(table)
    command = f"python -m benchmarks.guardrail_window --tokens {short} {long}"
    RESULTS.write_text(f"# Guardrail window: CPU per token\n\n`{command}`\n\n{table}\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs=2, default=[2000, 8000])
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
