"""tokenwire's remote engine in front of a vLLM server, against SSE straight to it.

    .venv/bin/python -m benchmarks.remote [--concurrency 1 8 32] [--tokens 64]
        [--repeats 3] [--batches 2] [--cancel-trials 10] [--quiet-cores 0.15]
        [--retries 1] [--quick] [--report-only]

One `vllm serve` (vLLM's OpenAI server with --enable-scale-out, SmolLM2
float32, enforce_eager, 1 GiB KV cache; tests/remote/vllm_serve.py starts it)
for the whole run, and three ways to reach it, side by side:
- tokenwire: `tokenwire serve --engine remote --remote-url VLLM` (token ids in
  and out over /inference/v1/generate), clients on its WebSocket;
- vllm: clients speaking SSE to vLLM's /v1/chat/completions directly;
- tokenwire_x2: two `tokenwire serve --engine remote` instances sharing a
  redis-server (--redis-url: every session's events go to a Redis stream),
  the clients spread over both.
The same prompts, temperature 0, `--tokens` per request with ignore_eos.

Throughput: `--repeats` rounds (the first warms each side up with one batch at
the highest concurrency); a round runs `--batches` batches per level on each
side, the order rotating by one side per batch, so every side's batch has the
others' seconds before or after it. Only one side works at a time (2 cores).
Figures per batch, round and level as in benchmarks.vs_vllm (TTFT: request
sent -> first non-empty text; a level's figure is the median over rounds).
Compared with SSE: the tokens/s ratio and the TTFT difference, each also paired
per round. Frontend CPU per output token: every process between the client and
vLLM's engine core (vLLM's API server, plus tokenwire and redis-server). Split
out of it, the gateway's own CPU (tokenwire, and redis-server for the pair)
against vLLM's whole API server answering SSE, paired per round: what putting
tokenwire in front of a vLLM fleet costs, next to what vLLM's server costs.

Cancel -> slot freed: `--cancel-trials` trials per side, interleaved. A trial
streams a long answer, and after `--wait-deltas` text chunks cancels it
(tokenwire: `response.cancel`; SSE: closing the HTTP stream); measured from
the cancel until vLLM's /metrics shows running + waiting back at 0, polled
back to back (an upper bound, by one poll's round trip).

`--quick` (1 round, 1 batch, levels 1 and 8, 3 cancel trials) checks that it
all runs; it writes scratch/remote.{json,md}, never results/. A full run takes
about 12 minutes and writes results/remote.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from tests.remote.vllm_serve import VllmOpenAI, vllm_serve

from tokenwire.client import connect
from tokenwire.models import resolve_model

from ._compare import (
    TABLE_COLUMNS,
    One,
    code_note,
    code_state,
    interval_text,
    level_summary,
    measure_round,
    percentile,
    ratios,
    round_parser,
    side_cells,
)
from ._server import (
    RESULTS,
    SCRATCH,
    cpu_snapshot,
    free_port,
    other_cpu_cores,
    redis_process,
    save_results,
    tokenwire_process,
    wait_for_descendants,
)
from .vs_vllm import chat_body, chunk_text, sse_chunks, tokenwire_one, vllm_one, vllm_version

SIDES = ("tokenwire", "vllm", "tokenwire_x2")
GATEWAYS = ("tokenwire", "tokenwire_x2")  # each compared with the SSE side
LABELS = {
    "tokenwire": "tokenwire remote (WS)",
    "vllm": "vLLM direct (SSE)",
    "tokenwire_x2": "2 tokenwire + Redis (WS)",
}
CANCEL_PROMPT = "Tell me a long story about a lighthouse keeper and a storm."
CANCEL_MAX_TOKENS = 1000  # far more than a trial waits for: it is cancelled mid-stream
IDLE_TIMEOUT_S = 10.0
# Counters read before and after the throughput rounds: requests of one side
# must not reuse KV blocks another side computed for the same prompt.
PREFIX_CACHE = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


# -- cancel -> slot freed ------------------------------------------------------------


async def slot_freed_ms(server: VllmOpenAI, t0: float) -> float:
    """Milliseconds from t0 until vLLM holds no request, running or waiting."""
    while await asyncio.to_thread(server.running) > 0:
        if time.perf_counter() - t0 > IDLE_TIMEOUT_S:
            raise RuntimeError(f"vLLM still runs a request {IDLE_TIMEOUT_S} s after the cancel")
    return (time.perf_counter() - t0) * 1000


async def tokenwire_cancel(url: str, server: VllmOpenAI, wait: int) -> dict[str, float]:
    async with await connect(url) as tw:
        await tw.add_message(CANCEL_PROMPT)
        response = await tw.create_response(
            temperature=0, max_output_tokens=CANCEL_MAX_TOKENS, ignore_eos=True
        )
        seen = 0
        async for _ in response.text_deltas():
            seen += 1
            if seen == wait:
                break
        t0 = time.perf_counter()
        # The cancel's reply (response.done) and the slot are awaited side by side.
        cancel = asyncio.create_task(response.cancel())
        done_at: list[float] = []
        cancel.add_done_callback(lambda _: done_at.append(time.perf_counter()))
        freed = await slot_freed_ms(server, t0)
        assert (await cancel)["status"] == "cancelled"
    return {"slot_freed_ms": freed, "done_ms": (done_at[0] - t0) * 1000}


async def sse_cancel(
    server: VllmOpenAI, http: aiohttp.ClientSession, wait: int
) -> dict[str, float]:
    body = chat_body(CANCEL_PROMPT, CANCEL_MAX_TOKENS, server.model)
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        seen = 0
        async with contextlib.aclosing(sse_chunks(resp)) as chunks:
            async for chunk in chunks:
                seen += bool(chunk_text(chunk))
                if seen == wait:
                    break
        t0 = time.perf_counter()
        resp.close()  # drop the connection: all an SSE client can do to cancel
        return {"slot_freed_ms": await slot_freed_ms(server, t0)}


async def cancel_trials(
    trials: dict[str, Callable[[int], Coroutine[Any, Any, dict[str, float]]]],
    server: VllmOpenAI,
    n: int,
) -> dict[str, list[dict[str, float]]]:
    """`n` trials per side, the order rotating by one side per trial; each
    starts with vLLM idle."""
    sides = list(trials)
    out: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for t in range(n):
        k = t % len(sides)
        for side in sides[k:] + sides[:k]:
            await slot_freed_ms(server, time.perf_counter())
            before, t0 = cpu_snapshot(), time.perf_counter()
            trial = await trials[side](t)
            trial["other_cores"] = other_cpu_cores(before, cpu_snapshot(), time.perf_counter() - t0)
            out[side].append(trial)
            print(
                f"  cancel {side:12s} trial {t + 1}: slot freed in {trial['slot_freed_ms']:.0f} ms",
                flush=True,
            )
    return out


# -- the run ---------------------------------------------------------------------------


async def measure(
    server: VllmOpenAI, urls: list[str], pids: dict[str, list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """Throughput rounds, then the cancel trials, on servers already running:
    urls[0] is the lone tokenwire, urls[1:] the pair sharing Redis."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        ones: dict[str, One] = {
            "tokenwire": lambda i, s: tokenwire_one(urls[0], i, args.tokens, s),
            "vllm": lambda i, s: vllm_one(server.url, http, i, args.tokens, s, server.model),
            "tokenwire_x2": lambda i, s: tokenwire_one(urls[1 + i % 2], i, args.tokens, s),
        }
        cache_before = [await asyncio.to_thread(server.metric, m) for m in PREFIX_CACHE]
        rounds = []
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}:", flush=True)
            warm = max(args.concurrency) if r == 0 else None  # the servers stay up
            rounds.append(await measure_round(ones, pids, args, r, warm))
        cache_after = [await asyncio.to_thread(server.metric, m) for m in PREFIX_CACHE]
        print("cancel trials:", flush=True)
        cancels = await cancel_trials(
            {
                "tokenwire": lambda t: tokenwire_cancel(urls[0], server, args.wait_deltas),
                "vllm": lambda t: sse_cancel(server, http, args.wait_deltas),
                "tokenwire_x2": lambda t: tokenwire_cancel(
                    urls[1 + t % 2], server, args.wait_deltas
                ),
            },
            server,
            args.cancel_trials,
        )
    hits, queries = (a - b for a, b in zip(cache_after, cache_before, strict=True))
    return {"rounds": rounds, "cancel": cancels, "prefix_cache": {"hits": hits, "queries": queries}}


def run(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start vLLM, Redis and the three tokenwire instances, measure, stop them all."""
    SCRATCH.mkdir(exist_ok=True)
    startup: dict[str, float] = {}
    remote = ("--engine", "remote", "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        server = stack.enter_context(
            vllm_serve(model, free_port(), SCRATCH / "remote-vllm.log", ready_timeout=600)
        )
        startup["vllm"] = time.perf_counter() - t0
        redis_url, redis = stack.enter_context(redis_process("remote-redis.log"))
        t0 = time.perf_counter()
        url, proc = stack.enter_context(
            tokenwire_process(*remote, "--remote-url", server.url, log_name="remote-tokenwire.log")
        )
        startup["tokenwire"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pair = [
            stack.enter_context(
                tokenwire_process(
                    *remote,
                    "--remote-url",
                    server.url,
                    "--redis-url",
                    redis_url,
                    log_name=f"remote-tokenwire-redis-{n}.log",
                )
            )
            for n in range(2)
        ]
        startup["tokenwire_x2"] = time.perf_counter() - t0
        print(
            "  started: " + ", ".join(f"{s} in {v:.0f} s" for s, v in startup.items()), flush=True
        )
        # vLLM's API server, last in every list (the gateway is all before it);
        # its engine core is a child.
        api = server.proc.pid
        pids = {
            "tokenwire": [proc.pid, api],
            "vllm": [api],
            "tokenwire_x2": [p.pid for _, p in pair] + [redis.pid, api],
        }
        out = asyncio.run(measure(server, [url, *(u for u, _ in pair)], pids, args))
    leftovers = wait_for_descendants()
    if leftovers:
        print(f"  killed leftover processes {leftovers}", flush=True)
    return {"startup_s": startup, **out}


# -- report ------------------------------------------------------------------------------


def cancel_summary(trials: list[dict[str, float]]) -> dict[str, Any]:
    freed = [t["slot_freed_ms"] for t in trials]
    return {
        "trials": trials,
        "slot_freed_p50_ms": statistics.median(freed),
        "slot_freed_p90_ms": percentile(freed, 0.9),
        "slot_freed_max_ms": max(freed),
    }


def build_report(
    args: argparse.Namespace, measured: dict[str, Any], meta: dict[str, Any], wall: float
) -> dict[str, Any]:
    """Medians over rounds per side and level, and each gateway against SSE."""
    rounds = measured["rounds"]
    report: dict[str, Any] = {
        **{k: getattr(args, k) for k in ("tokens", "concurrency", "repeats", "batches")},
        **{k: getattr(args, k) for k in ("cancel_trials", "wait_deltas", "quiet_cores")},
        "retries": args.retries,
        **meta,
        "wall_s": wall,
        "startup_s": measured["startup_s"],
        "prefix_cache": measured["prefix_cache"],
        "rounds": rounds,
        "cancel": {side: cancel_summary(t) for side, t in measured["cancel"].items()},
    }
    for side in SIDES:
        report[side] = {
            str(c): level_summary([rd[side][str(c)] for rd in rounds]) for c in args.concurrency
        }
    report["vs_sse"] = {}
    for gw in GATEWAYS:
        report["vs_sse"][gw] = {}
        for c in map(str, args.concurrency):
            tw, sse = report[gw][c], report["vllm"][c]
            report["vs_sse"][gw][c] = {
                **ratios(tw, sse),
                "frontend_us_per_token": tw["frontend_us_per_token"] / sse["frontend_us_per_token"],
                "ttft_p50_diff_ms": tw["ttft_p50_ms"] - sse["ttft_p50_ms"],
                "ttft_p99_diff_ms": tw["ttft_p99_ms"] - sse["ttft_p99_ms"],
                # Paired within a round (the sides ran seconds apart).
                "tokens_per_s_rounds": [
                    rd[gw][c]["tokens_per_s"] / rd["vllm"][c]["tokens_per_s"] for rd in rounds
                ],
                "ttft_p50_diff_ms_rounds": [
                    rd[gw][c]["ttft_p50_ms"] - rd["vllm"][c]["ttft_p50_ms"] for rd in rounds
                ],
            }
            if all("frontend_us_per_token_each" in rd[gw][c] for rd in rounds):
                report["vs_sse"][gw][c].update(
                    gateway_split([rd[gw][c] for rd in rounds], [rd["vllm"][c] for rd in rounds])
                )
    return report


def gateway_split(runs: list[dict[str, Any]], sse: list[dict[str, Any]]) -> dict[str, Any]:
    """A gateway's rounds split into its own CPU and vLLM's API server behind
    it (the last process), and its own against vLLM's whole SSE server."""
    own = [sum(r["frontend_us_per_token_each"][:-1]) for r in runs]
    return {
        "gateway_us_per_token": statistics.median(own),
        "api_behind_us_per_token": statistics.median(
            r["frontend_us_per_token_each"][-1] for r in runs
        ),
        "gateway_vs_api_rounds": [
            g / r["frontend_us_per_token"] for g, r in zip(own, sse, strict=True)
        ],
    }


def split_table(report: dict[str, Any]) -> list[str]:
    """The gateway's own CPU against vLLM's server, where the run has it."""
    levels = [str(c) for c in report["concurrency"]]
    if "gateway_us_per_token" not in report["vs_sse"]["tokenwire"][levels[0]]:
        return []  # measured before the split
    lines = [
        "The gateway's own frontend CPU (tokenwire, and redis-server for the pair), split "
        "from vLLM's API server behind it, against vLLM's whole API server answering SSE; "
        "µs per output token, medians over rounds, and the paired ratio per round "
        "(geometric mean, 95% confidence interval):",
        "",
        "| concurrency | path | gateway | vLLM API server behind it | vLLM API server (SSE) "
        "| gateway / vLLM API server (SSE) |",
        "|---|---|---|---|---|---|",
    ]
    for c in levels:
        for gw in GATEWAYS:
            q = report["vs_sse"][gw][c]
            lines.append(
                f"| {c} | {LABELS[gw].removesuffix(' (WS)')} | {q['gateway_us_per_token']:.0f} | "
                f"{q['api_behind_us_per_token']:.0f} | "
                f"{report['vllm'][c]['frontend_us_per_token']:.0f} | "
                f"{interval_text(q['gateway_vs_api_rounds'], 0.5)} |"
            )
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    """Caption, throughput table, cancel table: copied verbatim into the README."""
    levels, repeats = report["concurrency"], report["repeats"]
    rounds = "1 round" if repeats == 1 else f"{repeats} rounds"
    pooled = f", each pooling {report['batches']} batches" if report["batches"] > 1 else ""
    lines = [
        f"One vLLM OpenAI server (vLLM {report['vllm_version']}, SmolLM2-135M float32 on "
        f"{os.cpu_count()} CPU cores) reached three ways, side by side in one run: "
        "tokenwire's remote engine (`--engine remote`, token ids over "
        "/inference/v1/generate), SSE straight to /v1/chat/completions, and two tokenwire "
        f"instances sharing Redis with the clients spread over both. {report['tokens']} "
        f"tokens per request, ignore_eos, temperature 0. Median of {rounds} per "
        f"level{pooled}, tokens/s range over rounds in brackets; one side measured at a "
        f"time, the order rotating. {code_note(report['code'])}.",
        "",
        f"| concurrency | path | {TABLE_COLUMNS} | frontend CPU (µs/token) | other cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in map(str, levels):
        for side in SIDES:
            r = report[side][c]
            lines.append(
                f"| {c} | {LABELS[side]} | {side_cells(r)} | "
                f"{r['frontend_us_per_token']:.0f} | {r['other_cores_max']:.2f} |"
            )
        for gw in GATEWAYS:
            q = report["vs_sse"][gw][c]
            lines.append(
                f"| {c} | **{LABELS[gw].removesuffix(' (WS)')} vs SSE** | "
                f"**{q['tokens_per_s']:.3f}x** | **{q['ttft_p50_diff_ms']:+.0f}** | "
                f"{q['ttft_p99_diff_ms']:+.0f} | {q['itl_p50']:.2f}x | {q['itl_p99']:.2f}x | "
                f"{q['frontend_us_per_token']:.2f}x | |"
            )
    lines += [
        "",
        "Against SSE: tokens/s and ITL as ratios, TTFT as a difference in ms. Paired "
        "tokens/s ratios, one per round, geometric mean and 95% confidence interval: "
        + "; ".join(
            f"{LABELS[gw].removesuffix(' (WS)')} c={c}: "
            + ", ".join(f"{x:.3f}" for x in report["vs_sse"][gw][str(c)]["tokens_per_s_rounds"])
            + f" ({interval_text(report['vs_sse'][gw][str(c)]['tokens_per_s_rounds'])})"
            for gw in GATEWAYS
            for c in levels
        )
        + ". Frontend CPU: all processes between the client and vLLM's engine core (vLLM's "
        "API server; plus tokenwire, and redis-server for the pair) over a batch, per output "
        "token. Other cores: the most CPU other programs on the machine took during a "
        f"counted batch. vLLM's prefix cache: {report['prefix_cache']['hits']:.0f} hits in "
        f"{report['prefix_cache']['queries']:.0f} prompt tokens over the throughput rounds.",
        "",
        *split_table(report),
        f"Cancel -> slot freed, {report['cancel_trials']} trials per path: a streamed answer "
        f"is cancelled after {report['wait_deltas']} text chunks (tokenwire: "
        "`response.cancel`; SSE: the client closes the HTTP stream), timed until vLLM's "
        "/metrics shows running + waiting at 0 (polled back to back).",
        "",
        "| path | cancel -> slot freed p50 (ms) | p90 (ms) | max (ms) |",
        "|---|---|---|---|",
    ]
    for side in SIDES:
        q = report["cancel"][side]
        lines.append(
            f"| {LABELS[side]} | {q['slot_freed_p50_ms']:.0f} | "
            f"{q['slot_freed_p90_ms']:.0f} | {q['slot_freed_max_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = round_parser(__doc__, repeats=3, repeats_help="rounds over every level", retries=1)
    parser.set_defaults(concurrency=None)  # 1 8 32, or 1 8 with --quick
    parser.add_argument("--batches", type=int, default=2, help="per level, side and round")
    parser.add_argument("--cancel-trials", type=int, default=10, help="per side")
    parser.add_argument(
        "--wait-deltas", type=int, default=5, help="text chunks a cancel trial waits for"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 round, 1 batch, levels 1 and 8, 3 cancel trials; "
        "writes scratch/remote.{json,md}",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: rewrite results/remote.md from results/remote.json",
    )
    args = parser.parse_args()
    out = SCRATCH if args.quick else RESULTS
    if args.report_only:
        (out / "remote.md").write_text(markdown(json.loads((out / "remote.json").read_text())))
        return
    if args.quick:
        args.repeats, args.batches, args.cancel_trials = 1, 1, 3
    args.concurrency = args.concurrency or ([1, 8] if args.quick else [1, 8, 32])
    if min(args.repeats, args.batches, args.cancel_trials) < 1:
        parser.error("--repeats, --batches and --cancel-trials must be at least 1")
    model = str(resolve_model(None))
    # Before measuring: nothing that can fail may come after minutes of it.
    meta = {"code": code_state(), "vllm_version": vllm_version()}
    t0 = time.perf_counter()
    measured = run(model, args)
    report = build_report(args, measured, meta, time.perf_counter() - t0)
    save_results("remote", report, markdown(report), out)
    print(f"total {report['wall_s']:.0f} s; written to {out / 'remote.md'}")


if __name__ == "__main__":
    main()
