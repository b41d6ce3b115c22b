"""What the benchmarks that compare sides over repeated rounds share
(vs_vllm: tokenwire and vLLM's server; engine_ceiling: tokenwire and AsyncLLM;
remote: tokenwire's remote engine and SSE, both to one vLLM server)."""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._server import cpu_snapshot, other_cpu_cores, threads_cpu_seconds

FIELDS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
LATENCIES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
# The columns side_cells and ratio_cells fill, after concurrency and the row's name.
TABLE_COLUMNS = "tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms)"

# One request: (prompt number, start event) -> {"sent", "stamps", "tokens"}.
One = Callable[[int, asyncio.Event], Awaitable[dict[str, Any]]]


# Two-sided 95% Student t quantiles by degrees of freedom (above 30: 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
_T975 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
_T975 += (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95% confidence interval (a t
    interval on their logs: rounds vary by a factor, not an amount)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(low: float, high: float, target: float = 1.0) -> str:
    """What an interval shows against a target ratio."""
    if low >= target:
        return f"at least {target:g}x shown"
    if high < target:
        return f"below {target:g}x"
    return "no difference from it detectable"


def interval_text(ratios: Sequence[float], target: float = 1.0) -> str:
    """`mean [low, high], verdict` of paired ratios, against `target`."""
    mean, low, high = paired_interval(ratios)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}], {verdict(low, high, target)}"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttfts = [(r["stamps"][0] - r["sent"]) * 1000 for r in results]
    itls = [
        (b - a) * 1000 for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)
    ]
    return {
        "requests": len(results),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "itl_p50_ms": statistics.median(itls),
        "itl_p99_ms": percentile(itls, 0.99),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
    }


async def batch(one: One, n: int, first: int = 0) -> tuple[list[dict[str, Any]], float]:
    """`n` requests (prompts first..first+n-1) released at one instant; their
    results and the wall time until the last one finished."""
    start = asyncio.Event()
    tasks = [asyncio.create_task(one(first + i, start)) for i in range(n)]
    await asyncio.sleep(1.0)  # every client connected and waiting
    t0 = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def first_prompt(key: int, b: int, c: int, attempt: int = 0) -> int:
    """The number of the first prompt of batch `b` of `c` requests: its own for
    every key, batch, attempt and level, so no batch gets prefix-cache help."""
    return ((key * 10 + b) * 10 + attempt) * 10_000 + c * 100


async def measure_batch(
    one: One,
    c: int,
    key: int,
    b: int,
    quiet: float,
    retries: int,
    label: str,
    frontend_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """Batch `b` of `c` requests. One during which other programs took more
    than `quiet` cores is run again, up to `retries` times; the last attempt
    counts, all are kept. Every batch, retries too, has prompts of its own (no
    prefix-cache help); the same `key` and `b` give the same prompts, so both
    sides of a round get them. With `frontend_pids`, the CPU those processes
    (not their children: the engine) took during the batch is recorded, in
    all and per process."""
    attempts: list[dict[str, Any]] = []
    for attempt in range(retries + 1):
        before, t0 = cpu_snapshot(), time.perf_counter()
        frontend = list(map(threads_cpu_seconds, frontend_pids))
        results, wall = await batch(one, c, first_prompt(key, b, c, attempt))
        other = other_cpu_cores(before, cpu_snapshot(), time.perf_counter() - t0)
        attempts.append({**summarise(results, wall), "other_cores": other})
        if frontend_pids:
            now = map(threads_cpu_seconds, frontend_pids)
            each = [after - start for after, start in zip(now, frontend, strict=True)]
            attempts[-1]["frontend_cpu_s"] = sum(each)
            attempts[-1]["frontend_cpu_s_each"] = each
        print(
            f"{label}c={c} batch {b + 1}: {attempts[-1]['tokens_per_s']:.1f} tokens/s, "
            f"TTFT p50 {attempts[-1]['ttft_p50_ms']:.0f} ms, other programs {other:.2f} cores",
            flush=True,
        )
        if other <= quiet:
            break
    return {"results": results, "wall": wall, "attempts": attempts, **attempts[-1]}


def pooled(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Counted batches as one: tokens/s is all their tokens over all their
    wall time, the latencies are percentiles over every request."""
    results = [r for b in batches for r in b["results"]]
    attempts = [a for b in batches for a in b["attempts"]]
    extra = {}
    if all("frontend_cpu_s" in b for b in batches):
        # CPU of the frontend process per output token, in microseconds.
        tokens = sum(r["tokens"] for r in results)
        extra["frontend_us_per_token"] = sum(b["frontend_cpu_s"] for b in batches) / tokens * 1e6
        if all("frontend_cpu_s_each" in b for b in batches):  # per process, in pid order
            each = zip(*(b["frontend_cpu_s_each"] for b in batches), strict=True)
            extra["frontend_us_per_token_each"] = [sum(e) / tokens * 1e6 for e in each]
    return {
        **summarise(results, sum(b["wall"] for b in batches)),
        **extra,
        "other_cores": max(b["other_cores"] for b in batches),
        "batch_tokens_per_s": [summarise(b["results"], b["wall"])["tokens_per_s"] for b in batches],
        "attempts": attempts,
        "reruns": len(attempts) - len(batches),
    }


async def measure_level(
    one: One, c: int, key: int, batches: int, quiet: float, retries: int, label: str
) -> dict[str, Any]:
    """`batches` batches of `c` requests (see measure_batch), pooled."""
    return pooled(
        [await measure_batch(one, c, key, b, quiet, retries, label) for b in range(batches)]
    )


async def measure_round(
    ones: dict[str, One],
    pids: Mapping[str, Sequence[int]],
    args: argparse.Namespace,
    r: int,
    warm: int | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Round `r`: a warm-up batch of `warm` requests on each side (None: none),
    then per level (`args.concurrency`) `args.batches` batches on each side,
    the order rotating by one side per batch and round (two sides: A B B A
    ...), so each side's batch has the others' seconds before or after it.
    Each side's batches of a level are pooled; `pids` are its frontend processes."""
    sides = list(ones)
    width = max(map(len, sides))
    if warm:
        for side in sides:
            await batch(ones[side], warm, 1_000_000)
    out: dict[str, dict[str, dict[str, Any]]] = {side: {} for side in sides}
    for c in args.concurrency:
        done: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for b in range(args.batches):
            k = (r + b) % len(sides)
            for side in sides[k:] + sides[:k]:
                done[side].append(
                    await measure_batch(
                        ones[side],
                        c,
                        r,
                        b,
                        args.quiet_cores,
                        args.retries,
                        f"  {side:{width}s} ",
                        frontend_pids=pids[side],
                    )
                )
        for side in sides:
            out[side][str(c)] = pooled(done[side])
    return out


PAIRED = ("frontend_us_per_token", "tokens_per_s")


def paired_levels(
    rounds: list[dict[str, Any]], concurrency: Sequence[int], sides: tuple[str, str]
) -> dict[str, Any]:
    """Per level and PAIRED figure: each side's median over rounds, and the
    rounds' ratios first side / second (measure_round's rounds)."""
    num, den = sides
    levels: dict[str, Any] = {}
    for c in map(str, concurrency):
        levels[c] = {}
        for field in PAIRED:
            per = {s: [rd[s][c][field] for rd in rounds] for s in sides}
            levels[c][field] = {
                **{s: statistics.median(v) for s, v in per.items()},
                "ratios": [a / b for a, b in zip(per[num], per[den], strict=True)],
            }
    return levels


def paired_report(
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    meta: dict[str, Any],
    wall: float,
    sides: tuple[str, str],
) -> dict[str, Any]:
    """A two-sided run's report: its settings, paired_levels and every round."""
    return {
        **meta,
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "batches": args.batches,
        "wall_s": wall,
        "levels": paired_levels(rounds, args.concurrency, sides),
        "rounds": rounds,
    }


def paired_rows(levels: dict[str, Any], sides: tuple[str, str]) -> list[str]:
    """paired_levels as a table: per PAIRED figure both sides and the ratio."""
    num, den = sides
    rows = [
        f"| concurrency | frontend CPU {num} (µs/token) | {den} | {num}/{den} "
        f"| tokens/s {num} | {den} | {num}/{den} |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, level in levels.items():
        cells = []
        for field in PAIRED:
            m = level[field]
            cells += [f"{m[num]:.1f}", f"{m[den]:.1f}", interval_text(m["ratios"])]
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    return rows


def level_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each figure, with the spread of tokens/s."""
    out: dict[str, Any] = {f: statistics.median(r[f] for r in runs) for f in FIELDS}
    rates = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = min(rates), max(rates)
    out["other_cores_max"] = max(r["other_cores"] for r in runs)
    out["attempts"] = sum(len(r["attempts"]) for r in runs)
    if all("frontend_us_per_token" in r for r in runs):
        out["frontend_us_per_token"] = statistics.median(r["frontend_us_per_token"] for r in runs)
    return out


def ratios(num: dict[str, Any], den: dict[str, Any]) -> dict[str, float]:
    """num / den for tokens/s and each latency figure of two level summaries."""
    return {
        "tokens_per_s": num["tokens_per_s"] / den["tokens_per_s"],
        **{f: num[f"{f}_ms"] / den[f"{f}_ms"] for f in LATENCIES},
    }


def side_cells(r: dict[str, Any]) -> str:
    """A level summary's TABLE_COLUMNS cells: tokens/s [range over rounds], latencies."""
    return (
        f"{r['tokens_per_s']:.1f} [{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}] | "
        f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | "
        f"{r['itl_p99_ms']:.1f}"
    )


def ratio_cells(q: dict[str, float]) -> str:
    """The latency cells of a ratio row (the tokens/s cell is each caller's own)."""
    return " | ".join(f"{q[f]:.2f}x" for f in LATENCIES)


def round_parser(
    doc: str | None, *, repeats: int, repeats_help: str, retries: int
) -> argparse.ArgumentParser:
    """The command line every side-by-side benchmark starts from: levels,
    tokens per request, rounds, and the reruns of disturbed batches."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.15,
        help="run a batch again if other programs took more cores than this meanwhile",
    )
    parser.add_argument("--retries", type=int, default=retries, help="at most, per batch")
    return parser


def code_state() -> dict[str, Any]:
    """Which tokenwire was measured: others edit the server while benchmarks
    run, and a snapshot can be measured instead with PYTHONPATH=SNAPSHOT/server."""
    import tokenwire

    src = Path(tokenwire.__file__).resolve().parent

    def git(*a: str) -> str:
        run = subprocess.run(["git", *a], capture_output=True, text=True, cwd=src)
        return run.stdout.strip()

    return {
        "tokenwire_source": str(src),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_server_files": git("status", "--porcelain", ".").splitlines(),
    }


def code_note(code: dict[str, Any]) -> str:
    if not code["commit"]:
        return f"tokenwire from {code['tokenwire_source']} (a snapshot outside the repository)"
    dirty = code["uncommitted_server_files"]
    extra = f" plus uncommitted changes in {len(dirty)} server files" if dirty else ""
    return f"tokenwire at commit {code['commit']}{extra}"


def plot_sides(
    axes: Any,
    report: dict[str, Any],
    sides: Sequence[str],
    labels: dict[str, str],
    latency_note: str = "",
) -> None:
    """The first three panels: tokens/s (whiskers: rounds), TTFT and ITL p50, side by side."""
    levels = report["concurrency"]
    xs = list(range(len(levels)))
    width = 0.38
    panels = (
        ("tokens_per_s", "aggregate tokens/s (higher is better)"),
        ("ttft_p50_ms", f"TTFT p50, ms{latency_note}"),
        ("itl_p50_ms", f"ITL p50, ms{latency_note}"),
    )
    for ax, (field, title) in zip(axes, panels, strict=False):
        for offset, side in zip((-width / 2, width / 2), sides, strict=True):
            rows = [report[side][str(c)] for c in levels]
            values = [r[field] for r in rows]
            err = None
            if field == "tokens_per_s":  # min..max over rounds
                err = [
                    [v - r["tokens_per_s_min"] for v, r in zip(values, rows, strict=True)],
                    [r["tokens_per_s_max"] - v for v, r in zip(values, rows, strict=True)],
                ]
            ax.bar([x + offset for x in xs], values, width, yerr=err, capsize=3, label=labels[side])
        ax.set_xticks(xs, [f"c={c}" for c in levels])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
