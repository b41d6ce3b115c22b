"""Cancel and steer latency on the real engine, p50/p99 over many trials.

    .venv/bin/python -m benchmarks.cancel_steer_latency [--trials 100] [--wait-tokens 3 20]
        [--url ws://...] [--seed 1] [--quiet-cores 0.15] [--retries 2]

Each trial starts a long streaming answer (ignore_eos, 400 tokens, temperature
0, a `conversation:"none"` response so trials never grow a history), waits
for a random but recorded number of text deltas (3-20), then:
- cancel trial: sends `response.cancel`, and measures
  - cancel sent -> `response.done` (status cancelled) received by the client;
  - cancel sent -> the engine request gone, seen from outside by polling
    `/healthz` back to back: `engine_load.unfinished` (vLLM's output
    processor: no output of the request can come any more) reaching 0, and
    `engine_load.running` (the scheduler's stats: the engine core has dropped
    it, after the forward step in flight) reaching 0. A poll's time is when
    its reply arrived, so these are upper bounds, by about one poll round trip;
  - the server's own `tokenwire_cancel_latency_seconds` histogram (task
    cancel -> the generate task done, inside the server): /metrics is read
    before and after each trial, and the change of `_sum` is that trial's
    exact value;
- steer trial: sends `response.steer` and measures steer sent ->
  `response.steered`, and steer sent -> the first `response.output_text.delta`
  after `response.steered` (the first token of the new generation; deltas
  in flight before the steer landed do not count). The same histogram gives
  the server-side abort time of the steered generation. The trial then
  cancels the response and waits for the engine to be idle.
Cancel and steer trials alternate, after a few unrecorded warm-up trials. A
trial during which other programs took more than --quiet-cores of the CPU is
run again (up to --retries times; all attempts are kept in the JSON).
For scale, every trial also records its response.create -> first delta, and
each steer trial then sends what a client without steer would: a new
response.create over the steered conversation (prompt, partial answer,
steer input), timed to its first delta.
Writes results/cancel_steer_latency.{json,md} and .png (CDFs) and
cancel_steer_latency_by_tokens.png (latency against tokens waited).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from tokenwire.client import Client, Response, connect

from ._compare import percentile
from ._server import (
    RESULTS,
    VLLM_SETTINGS,
    cpu_snapshot,
    http_base,
    other_cpu_cores,
    save_results,
    tokenwire_server,
)

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."
STEER = "Now make it about a dragon instead."
DELTA = "response.output_text.delta"
HIST = "tokenwire_cancel_latency_seconds"
IDLE_TIMEOUT_S = 5.0

# (key in a trial row, label in the table, what it measures)
MEASURES = (
    ("cancel_to_done_ms", "cancel sent -> response.done received (client)"),
    ("cancel_to_unfinished0_ms", "cancel sent -> /healthz unfinished = 0 (frontend dropped it)"),
    ("cancel_to_running0_ms", "cancel sent -> /healthz running = 0 (scheduler dropped it)"),
    ("cancel_server_ms", "server: task cancel -> generate task done (histogram, cancel)"),
    ("steer_to_steered_ms", "steer sent -> response.steered received"),
    ("steer_to_first_token_ms", "steer sent -> first delta after response.steered"),
    ("steer_abort_server_ms", "server: task cancel -> generate task done (histogram, steer)"),
    ("create_to_first_token_ms", "for scale: response.create sent -> first delta (TTFT)"),
    (
        "fresh_create_first_token_ms",
        "for scale: new response.create of the steered conversation -> first delta",
    ),
)


class Probe:
    """/healthz and /metrics of the server under test, over one HTTP session."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base = http, base
        self.poll_rtts_ms: list[float] = []

    async def load(self) -> dict[str, int]:
        t0 = time.perf_counter()
        async with self.http.get(f"{self.base}/healthz") as r:
            load = (await r.json())["engine_load"]
        self.poll_rtts_ms.append((time.perf_counter() - t0) * 1000)
        return load

    async def cancel_histogram(self) -> tuple[float, float]:
        """(count, sum in seconds) of the server's cancel-latency histogram."""
        async with self.http.get(f"{self.base}/metrics") as r:
            text = await r.text()
        values = dict(re.findall(rf"^{HIST}_(count|sum) (\S+)$", text, re.M))
        return float(values["count"]), float(values["sum"])

    async def watch_gone(self, t0: float) -> dict[str, float | None]:
        """Poll back to back from t0 until unfinished and running are both 0."""
        seen: dict[str, float | None] = {"unfinished": None, "running": None}
        while time.perf_counter() - t0 < IDLE_TIMEOUT_S:
            load = await self.load()
            now = (time.perf_counter() - t0) * 1000
            for key in seen:
                if seen[key] is None and load.get(key, 0) == 0:
                    seen[key] = now
            if all(v is not None for v in seen.values()):
                break
        return seen

    async def wait_idle(self) -> None:
        """Between trials: nothing left in the engine (running is reported late)."""
        await self.watch_gone(time.perf_counter())


def server_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The one observation added between two histogram reads, in ms."""
    if after[0] - before[0] != 1:
        return None  # none, or another abort mixed in: no exact value
    return (after[1] - before[1]) * 1000


def user(text: str) -> dict[str, str]:
    return {"type": "message", "role": "user", "content": text}


async def first_delta_ms(
    tw: Client, items: list[dict[str, str]], max_tokens: int, stop: int
) -> tuple[Response, float, list[float]]:
    """Create a response with `items` as its whole context; read `stop` deltas.
    Returns (response, ms to its first delta, arrival times of the deltas read)."""
    sent = time.perf_counter()
    response = await tw.create_response(
        conversation="none",
        input=items,
        temperature=0,
        max_output_tokens=max_tokens,
        ignore_eos=True,
    )
    stamps: list[float] = []
    async for event in response:
        if event["type"] == DELTA:
            stamps.append(time.perf_counter())
            if len(stamps) >= stop:
                break
    return response, (stamps[0] - sent) * 1000, stamps


def step_ms(stamps: list[float]) -> float | None:
    """Median gap between the deltas read: the engine's step time."""
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    return statistics.median(gaps) if gaps else None


async def start(
    tw: Client, wait_tokens: int, max_tokens: int
) -> tuple[Response, float, list[float]]:
    """A long answer, read until `wait_tokens` deltas."""
    return await first_delta_ms(tw, [user(PROMPT)], max_tokens, wait_tokens)


async def cancel_trial(tw: Client, probe: Probe, wait_tokens: int, max_tokens: int) -> dict:
    hist0 = await probe.cancel_histogram()
    response, ttft, stamps = await start(tw, wait_tokens, max_tokens)
    t0 = time.perf_counter()
    await tw.send({"type": "response.cancel", "response_id": response.id})
    # Watch the engine while the client waits for its response.done.
    watcher = asyncio.create_task(probe.watch_gone(t0))
    late = 0
    async for event in response:
        late += event["type"] == DELTA  # already in flight when the cancel landed
    done_ms = (time.perf_counter() - t0) * 1000
    gone = await watcher
    return {
        "kind": "cancel",
        "wait_tokens": len(stamps),
        "step_ms": step_ms(stamps),
        "create_to_first_token_ms": ttft,
        "cancel_to_done_ms": done_ms,
        "cancel_to_unfinished0_ms": gone["unfinished"],
        "cancel_to_running0_ms": gone["running"],
        "cancel_server_ms": server_ms(hist0, await probe.cancel_histogram()),
        "deltas_after_cancel": late,
        "status": response.status,
        "output_tokens": (await response.done())["usage"]["output_tokens"],
    }


async def steer_trial(tw: Client, probe: Probe, wait_tokens: int, max_tokens: int) -> dict:
    hist0 = await probe.cancel_histogram()
    response, ttft, stamps = await start(tw, wait_tokens, max_tokens)
    t0 = time.perf_counter()
    await tw.send({"type": "response.steer", "response_id": response.id, "input": STEER})
    steered_ms = first_ms = None
    late, partial = 0, ""
    async with asyncio.timeout(30):  # an error event would go to tw.events, not here
        async for event in response:
            if event["type"] == "response.steered":
                steered_ms = (time.perf_counter() - t0) * 1000
            elif event["type"] == "response.output_text.done" and steered_ms is None:
                partial = event["text"]  # the interrupted answer, as the history keeps it
            elif event["type"] == DELTA:
                if steered_ms is None:
                    late += 1  # from the old generation, in flight
                else:
                    first_ms = (time.perf_counter() - t0) * 1000
                    break
    # The steered generation's abort is in the histogram by now; the cancel below is not.
    abort_ms = server_ms(hist0, await probe.cancel_histogram())
    done = await response.cancel()
    await probe.wait_idle()
    # What a client without steer would do instead: a new response over the
    # same conversation (the steered generation's prompt), cancelled at once.
    items = [user(PROMPT), {"type": "message", "role": "assistant", "content": partial}]
    fresh, fresh_ms, _ = await first_delta_ms(tw, [*items, user(STEER)], max_tokens, 1)
    fresh_done = await fresh.cancel()
    await probe.wait_idle()
    return {
        "kind": "steer",
        "wait_tokens": len(stamps),
        "step_ms": step_ms(stamps),
        "create_to_first_token_ms": ttft,
        "steer_to_steered_ms": steered_ms,
        "steer_to_first_token_ms": first_ms,
        "steer_abort_server_ms": abort_ms,
        "deltas_before_steered": late,
        "status": done["status"],
        "input_tokens": done["usage"]["input_tokens"],
        "cached_tokens": done["usage"]["cached_tokens"],
        "fresh_create_first_token_ms": fresh_ms,
        "fresh_input_tokens": fresh_done["usage"]["input_tokens"],
    }


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lo, hi = args.wait_tokens
    rows: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []  # attempts run again because others took the CPU
    async with aiohttp.ClientSession() as http, await connect(url) as tw:
        probe = Probe(http, http_base(url))
        for _ in range(args.warmup):  # first steers and cancels pay one-off costs
            await cancel_trial(tw, probe, lo, args.max_tokens)
            await steer_trial(tw, probe, lo, args.max_tokens)
        probe.poll_rtts_ms.clear()
        for i in range(args.trials):
            for trial in (cancel_trial, steer_trial):
                wait = rng.randint(lo, hi)
                for attempt in range(args.retries + 1):
                    before, t0 = cpu_snapshot(), time.perf_counter()
                    row = await trial(tw, probe, wait, args.max_tokens)
                    # Only meaningful when the server is our child: else it counts as other.
                    other = None
                    if not args.url:
                        other = other_cpu_cores(before, cpu_snapshot(), time.perf_counter() - t0)
                    row = {"trial": i, "attempt": attempt, **row, "other_cores": other}
                    if other is None or other <= args.quiet_cores:
                        break
                    discarded.append(row)  # disturbed: run it again
                rows.append(row)
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{args.trials} trials, {len(discarded)} rerun", flush=True)
        rtts = probe.poll_rtts_ms
    return {
        "trials": args.trials,
        "wait_tokens": [lo, hi],
        "max_output_tokens": args.max_tokens,
        "seed": args.seed,
        "quiet_cores": args.quiet_cores,
        "retries": args.retries,
        "healthz_poll_rtt_ms": {"p50": statistics.median(rtts), "p99": percentile(rtts, 0.99)},
        "summary": summarise(rows),
        "rows": rows,
        "discarded": discarded,
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for key, _ in MEASURES:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = {
                "n": len(values),
                "p50": statistics.median(values),
                "p90": percentile(values, 0.90),
                "p99": percentile(values, 0.99),
                "max": max(values),
                "mean": statistics.fmean(values),
            }
    return out


def plot(report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, label in MEASURES:
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("ms (log scale)")
    ax.set_ylabel("fraction of trials")
    ax.set_title(f"Cancel and steer latency, {report['trials']} trials each", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "cancel_steer_latency.png", dpi=110)

    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (
        ("cancel_to_done_ms", "cancel -> response.done"),
        ("steer_to_first_token_ms", "steer -> first new token"),
        ("cancel_to_running0_ms", "cancel -> running = 0"),
    ):
        points = [(r["wait_tokens"], r[key]) for r in rows if r.get(key) is not None]
        ax.scatter(*zip(*points, strict=True), s=10, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("text deltas received before the cancel / steer")
    ax.set_ylabel("ms (log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "cancel_steer_latency_by_tokens.png", dpi=110)


def markdown(report: dict[str, Any]) -> str:
    s, rows = report["summary"], report["rows"]
    steers = [r for r in rows if r["kind"] == "steer"]
    cancels = [r for r in rows if r["kind"] == "cancel"]
    lo, hi = report["wait_tokens"]
    lines = [
        f"SmolLM2-135M float32 on {os.cpu_count()} CPU cores, `tokenwire serve --engine vllm`; "
        f"{report['trials']} cancel and {report['trials']} steer trials, each after {lo}-{hi} "
        f"text deltas (random, seed {report['seed']}) of a {report['max_output_tokens']}-token "
        "ignore_eos answer. Times from the client's send unless marked server.",
        "",
        "| measure | n | p50 (ms) | p90 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in MEASURES:
        if key in s:
            m = s[key]
            lines.append(
                f"| {label} | {m['n']} | {m['p50']:.1f} | {m['p90']:.1f} | {m['p99']:.1f} | "
                f"{m['max']:.1f} |"
            )
    lines += ["", *(f"- {line}" for line in ratio_lines(s))]
    rtt = report["healthz_poll_rtt_ms"]
    excess = [r["steer_to_first_token_ms"] - r["fresh_create_first_token_ms"] for r in steers]
    steps = [r["step_ms"] for r in rows if r["step_ms"] is not None]
    late = [r["deltas_before_steered"] for r in steers]
    cached = statistics.median(r["cached_tokens"] / r["input_tokens"] for r in steers)
    statuses = sorted({r["status"] for r in cancels})
    lines += [
        "",
        f"- Cancelled responses ended with status {', '.join(statuses)}; a median of "
        f"{statistics.median(r['deltas_after_cancel'] for r in cancels):.0f} deltas (max "
        f"{max(r['deltas_after_cancel'] for r in cancels)}) were already in flight after the "
        "cancel was sent.",
        f"- /healthz poll round trip p50 {rtt['p50']:.2f} ms, p99 {rtt['p99']:.2f} ms: the "
        "resolution of the two /healthz rows. `running` comes from vLLM's scheduler stats, "
        "published when the engine step in flight ends (the cancel is sent as a delta "
        "arrives, so just after a step began): it includes about one step.",
        "- The server rows are `tokenwire_cancel_latency_seconds` (task.cancel() -> the "
        "generate task done, which includes AsyncLLM's abort of the request), one exact "
        "value per trial from the change of the histogram's `_sum`.",
        f"- Steered generations: a median {cached:.0%} of their prompt tokens (both "
        "generations) came from the prefix cache (prompts this short fill no whole KV block, "
        "128 tokens on vLLM's CPU backend); the new response.create of the same conversation "
        f"had a median {statistics.median(r['fresh_input_tokens'] for r in steers):.0f} "
        f"prompt tokens. A median {statistics.median(late):.0f} old deltas arrived between "
        "the steer and `response.steered`.",
        f"- Steer -> first new token exceeds the new response.create of the same conversation "
        f"by a median {statistics.median(excess):.0f} ms per trial; the engine step (the gap "
        f"between deltas before the action) was a median {statistics.median(steps):.0f} ms. "
        "The action is sent as a delta arrives, i.e. just after the engine began its next "
        "step, and the engine takes the abort and the new request only once that step ends.",
    ]
    others = [r["other_cores"] for r in rows if r["other_cores"] is not None]
    if others:
        q = report["quiet_cores"]
        lines.append(
            f"- Other programs on the machine took a median {statistics.median(others):.2f} "
            f"cores (of {os.cpu_count()}) during a trial. A trial during which they took more "
            f"than {q} was run again (at most {report['retries']} times, the last attempt "
            f"counts): {len(report['discarded'])} reruns; "
            f"{sum(o > q for o in others)} counted trials stayed above {q}."
        )
    if "code" in report:
        lines.append(f"- Code: {report['code']}.")
    return "\n".join(lines) + "\n"


def ratio_lines(s: dict[str, dict[str, float]]) -> list[str]:
    pairs = (
        (
            "steer_to_first_token_ms",
            "fresh_create_first_token_ms",
            "steer -> first new token",
            "a new response.create of the same conversation -> first delta",
        ),
        (
            "cancel_to_running0_ms",
            "cancel_to_done_ms",
            "cancel -> scheduler running 0",
            "cancel -> response.done",
        ),
    )
    lines = []
    for a, b, name_a, name_b in pairs:
        if a in s and b in s:
            for q in ("p50", "p99"):
                lines.append(f"{name_a} / {name_b} ({q}): {s[a][q] / s[b][q]:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="an already running tokenwire server (vllm engine)")
    parser.add_argument("--trials", type=int, default=100, help="of each kind")
    parser.add_argument("--wait-tokens", type=int, nargs=2, default=[3, 20], metavar=("LO", "HI"))
    parser.add_argument("--max-tokens", type=int, default=400, help="of each answer")
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded trials of each kind")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.15,
        help="run a trial again if other programs took more cores than this meanwhile",
    )
    parser.add_argument("--retries", type=int, default=2, help="at most, per trial")
    args = parser.parse_args()
    if args.url:
        report = asyncio.run(run(args.url, args))
    else:
        with tokenwire_server("--engine", "vllm", "--log-level", "warning", *VLLM_SETTINGS) as url:
            report = asyncio.run(run(url, args))
    import tokenwire

    report["code"] = f"tokenwire from {Path(tokenwire.__file__).resolve().parent}"
    RESULTS.mkdir(exist_ok=True)
    plot(report)
    save_results("cancel_steer_latency", report, markdown(report))
    for line in ratio_lines(report["summary"]):
        print(line)


if __name__ == "__main__":
    main()
