"""Priority lanes: interactive TTFT under a batch load, with and without lanes.

    .venv/bin/python -m benchmarks.priority [--rounds 2] [--seconds 45]
        [--batch-sessions 4] [--interactive-sessions 2] [--max-num-seqs 2]

The real engine (SmolLM2 on the CPU) with `--max-num-seqs` small enough that
requests queue. Batch sessions (priority 10) keep the engine full with long
answers; interactive sessions (priority 0) ask a short question every
`--interval` seconds. The same load runs against two servers, one at a time,
alternating per round (A B A B): vLLM's `--scheduling-policy priority` (lanes)
and `fcfs` (no lanes; the priorities are sent but ignored). Measured:
interactive TTFT (response.create sent -> first text delta), p50 and p99,
and the batch tokens/s, the cost of the lanes.

Writes results/priority.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from tokenwire.client import connect

from ._server import RESULTS, VLLM_SETTINGS, tokenwire_server

BATCH_PROMPT = "Write a long story about a lighthouse keeper and the sea."
QUESTION = "What is the capital of France?"


async def batch_worker(url: str, stop: asyncio.Event, tokens: list[int], n: int) -> None:
    async with await connect(url) as tw:
        await tw.update_session(priority=10, temperature=0)
        await tw.add_message(BATCH_PROMPT)
        while not stop.is_set():
            response = await tw.create_response(
                conversation="none",
                input=[{"type": "message", "role": "user", "content": BATCH_PROMPT}],
                max_output_tokens=n,
                ignore_eos=True,
            )
            done = await response.done()
            tokens.append(done["usage"]["output_tokens"])


async def interactive_worker(
    url: str, stop: asyncio.Event, ttfts: list[float], waits: list[float], interval: float
) -> None:
    async with await connect(url) as tw:
        await tw.update_session(priority=0, temperature=0)
        while not stop.is_set():
            sent = time.perf_counter()
            response = await tw.create_response(
                conversation="none",
                input=[{"type": "message", "role": "user", "content": QUESTION}],
                max_output_tokens=8,
            )
            first = None
            async for _ in response.text_deltas():
                first = first or time.perf_counter()
            done = await response.done()
            if first is not None and done["status"] == "completed":
                ttfts.append((first - sent) * 1000)
                waits.append(done["timings"]["queue_wait_ms"])
            await asyncio.sleep(max(interval - (time.perf_counter() - sent), 0))


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    tokens: list[int] = []
    ttfts: list[float] = []
    waits: list[float] = []
    batch = [
        asyncio.create_task(batch_worker(url, stop, tokens, args.batch_tokens))
        for _ in range(args.batch_sessions)
    ]
    await asyncio.sleep(args.warmup)  # the batch fills the engine first
    tokens.clear()
    started = time.perf_counter()
    interactive = [
        asyncio.create_task(interactive_worker(url, stop, ttfts, waits, args.interval))
        for _ in range(args.interactive_sessions)
    ]
    await asyncio.sleep(args.seconds)
    stop.set()
    wall = time.perf_counter() - started
    await asyncio.gather(*interactive, *batch)
    return {"ttft_ms": ttfts, "queue_wait_ms": waits, "batch_tokens": sum(tokens), "wall_s": wall}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [t for r in runs for t in r["ttft_ms"]]
    waits = [t for r in runs for t in r["queue_wait_ms"]]
    return {
        "requests": len(ttft),
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": pct(ttft, 0.99),
        "queue_wait_p50_ms": statistics.median(waits),
        "batch_tokens_per_s": sum(r["batch_tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=45.0, help="measured, per run")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--batch-sessions", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=96)
    parser.add_argument("--interactive-sessions", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.5)
    parser.add_argument("--max-num-seqs", type=int, default=2)
    args = parser.parse_args()
    policies = {"lanes": "priority", "no lanes": "fcfs"}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    for _ in range(args.rounds):
        for name, policy in policies.items():
            engine_flags = ["--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy]
            with tokenwire_server("--engine", "vllm", *VLLM_SETTINGS, *engine_flags) as url:
                runs[name].append(asyncio.run(measure(url, args)))
            print(name, {k: round(v, 1) for k, v in summary(runs[name][-1:]).items()})
    table = {name: summary(r) for name, r in runs.items()}
    lanes, plain = table["lanes"], table["no lanes"]
    ratios = {
        "ttft_p50": lanes["ttft_p50_ms"] / plain["ttft_p50_ms"],
        "ttft_p99": lanes["ttft_p99_ms"] / plain["ttft_p99_ms"],
        "batch_tokens_per_s": lanes["batch_tokens_per_s"] / plain["batch_tokens_per_s"],
    }
    report = {"args": vars(args), "summary": table, "ratios": ratios, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "priority.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"Interactive (priority 0) TTFT under a batch load (priority 10, "
        f"{args.batch_sessions} sessions x {args.batch_tokens} tokens), real engine, "
        f"`--max-num-seqs {args.max_num_seqs}`, {args.rounds} rounds of {args.seconds:g} s "
        "per server, alternating.",
        "",
        "| lanes | interactive requests | TTFT p50 (ms) | TTFT p99 (ms) | queue wait p50 (ms) "
        "| batch tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in table.items():
        lines.append(
            f"| {name} | {s['requests']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
            f"{s['queue_wait_p50_ms']:.0f} | {s['batch_tokens_per_s']:.1f} |"
        )
    lines.append(
        f"| **lanes / no lanes** | | **{ratios['ttft_p50']:.2f}x** | **{ratios['ttft_p99']:.2f}x** "
        f"| | {ratios['batch_tokens_per_s']:.2f}x |"
    )
    text = "\n".join(lines) + "\n"
    (RESULTS / "priority.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
