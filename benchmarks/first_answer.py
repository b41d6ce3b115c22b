"""TTFT and tokens/s of one greedy answer through tokenwire, on the real engine.

    .venv/bin/python -m benchmarks.first_answer [--trials 5] [--url ws://...]

Without --url it starts `tokenwire serve --engine vllm` itself. Each trial is
a new session asking "What is the capital of France?" (temperature 0). The
first trial is cold; later ones hit vLLM's prefix cache. Client-side TTFT is
response.create sent -> first text delta received.
"""

from __future__ import annotations

import statistics
import time

from tokenwire.client import connect

from ._server import RESULTS, run_on_vllm

PROMPT = "What is the capital of France?"


async def one(url: str) -> dict:
    async with await connect(url) as tw:
        await tw.add_message(PROMPT)
        sent = time.perf_counter()
        response = await tw.create_response(temperature=0, max_output_tokens=64)
        stamps = []
        async for _ in response.text_deltas():
            stamps.append(time.perf_counter())
        done = await response.done()
    tokens = done["usage"]["output_tokens"]
    decode = stamps[-1] - stamps[0]
    return {
        "text": await response.text(),
        "ttft_ms": (stamps[0] - sent) * 1000,
        "output_tokens": tokens,
        "tokens_per_s": (tokens - 1) / decode if decode > 0 else None,
        "server_ttft_ms": done["timings"]["ttft_ms"],
        "cached_tokens": done["usage"]["cached_tokens"],
    }


async def run(url: str, trials: int) -> dict:
    results = [await one(url) for _ in range(trials)]
    warm = results[1:] or results
    return {
        "prompt": PROMPT,
        "trials": results,
        "cold_ttft_ms": results[0]["ttft_ms"],
        "warm_ttft_ms_median": statistics.median(r["ttft_ms"] for r in warm),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results),
    }


def main() -> None:
    report = run_on_vllm(__doc__ or "", "first_answer", run)
    lines = [
        "| trial | TTFT (ms) | tokens/s | output tokens | cached tokens |",
        "|---|---|---|---|---|",
        *(
            f"| {i + 1} | {r['ttft_ms']:.0f} | {r['tokens_per_s']:.1f} | {r['output_tokens']} | "
            f"{r['cached_tokens']} |"
            for i, r in enumerate(report["trials"])
        ),
    ]
    (RESULTS / "first_answer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"answer: {report['trials'][0]['text']!r}")


if __name__ == "__main__":
    main()
