"""The gateway-efficiency targets (issue #19), each against its measured
value, from the results the benchmarks last wrote; no figure is typed.

    .venv/bin/python -m benchmarks.efficiency [--before DIR]

Reads `results/{connections,gateway_ceiling,vs_vllm}.json` (and the runs on
other allocators and at 4 tokens per delta, `SOURCES`), and the same files in
`--before DIR` (default `results/before-19`: the code before the work,
measured on the same kind of machine) for a column to compare. Writes
`results/efficiency.md`, which `benchmarks.readme` copies into the README.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._compare import paired_interval
from ._server import RESULTS

Report = dict[str, Any]


def load(directory: Path) -> dict[str, Report]:
    found = {}
    for name in SOURCES:
        path = directory / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def worst_round(key: str) -> Callable[[dict[str, Report]], float]:
    def get(reports: dict[str, Report]) -> float:
        return max(r[key] for r in reports["connections"]["rounds"])

    return get


def after_wave(name: str) -> Callable[[dict[str, Report]], float]:
    """RSS once a wave has closed over the idle RSS before it, worst round.
    Older reports have no reading 5 s after close: the one at close then."""

    def get(reports: dict[str, Report]) -> float:
        c = reports[name]
        return max(
            r.get("rss_returned_kib", r["rss_closed_kib"]) / c["rss_idle_kib"] for r in c["rounds"]
        )

    return get


def ceiling(sessions: int, name: str = "gateway_ceiling") -> Callable[[dict[str, Report]], float]:
    def get(reports: dict[str, Report]) -> float:
        [ratio] = [
            r["tokens_per_s"]
            for r in reports[name]["ratios"]
            if r["mode"] == "max" and r["sessions"] == sessions
        ]
        return float(ratio)

    return get


def frontend_cpu(
    concurrency: int, key: str = "frontend_us_per_token", name: str = "vs_vllm"
) -> Callable[[dict[str, Report]], float]:
    def get(reports: dict[str, Report]) -> float:
        q = reports[name]["ratios"][str(concurrency)]
        # Paired per round where the report has them: on a machine whose speed
        # swings between rounds, the ratio of the sides' medians mixes states.
        rounds = q.get(f"{key}_rounds")
        return paired_interval(rounds)[0] if rounds else float(q[key])

    return get


def gateway_cpu(concurrency: int, side: str) -> Callable[[dict[str, Report]], float]:
    """`--engine remote`: the gateway's own CPU against vLLM's SSE server, paired per round."""

    def get(reports: dict[str, Report]) -> float:
        return paired_interval(
            reports["remote"]["vs_sse"][side][str(concurrency)]["gateway_vs_api_rounds"]
        )[0]

    return get


# (what, target, at most (True) or at least, unit, getter)
TARGETS: list[tuple[str, float, bool, str, Callable[[dict[str, Report]], float]]] = [
    (
        "RSS per connected idle session, 10k sessions",
        20,
        True,
        "KiB",
        worst_round("kib_per_connection_connected"),
    ),
    (
        "RSS per streaming session, 10k sessions",
        28,
        True,
        "KiB",
        worst_round("kib_per_connection_streaming"),
    ),
    ("RSS after a wave closes / idle RSS before it", 1.15, True, "x", after_wave("connections")),
    *(
        (
            f"the same, server on {name} (`--allocator {key}`)",
            1.15,
            True,
            "x",
            after_wave(f"connections-{key}"),
        )
        for key, name in (("pymalloc", "pymalloc"), ("malloc", "glibc malloc"))
    ),
    *(
        (
            f"gateway ceiling, tokenwire / bare websockets, {n:,} sessions",
            0.9,
            False,
            "x",
            ceiling(n),
        )
        for n in (100, 1000, 10_000)
    ),
    *(
        (
            f"the same, {n:,} sessions, server on pymalloc (`--allocator pymalloc`)",
            0.9,
            False,
            "x",
            ceiling(n, "gateway_ceiling-pymalloc"),
        )
        for n in (100, 1000, 10_000)
    ),
    *(
        (
            f"frontend CPU per output token, tokenwire / vLLM, c={c} (paired per round)",
            0.5,
            True,
            "x",
            frontend_cpu(c),
        )
        for c in (8, 32)
    ),
    # Not the target. Above the floor: without vLLM's AsyncLLM client,
    # which both servers run in their process (benchmarks.frontend_floor).
    # The written floor (not tokenwire): that client plus one socket write per
    # delta, the least any server with it in its process costs, against vLLM's.
    *(
        (f"{label}, c={c}", 0.5, True, "x", frontend_cpu(c, key))
        for key, label in (
            ("frontend_above_floor", "the same above the floor (each server's own work)"),
            ("written_floor", "the written floor (AsyncLLM + a socket write per token) / vLLM"),
            (
                "frontend_above_written_floor",
                "each server's own work above the written floor, tokenwire / vLLM",
            ),
        )
        for c in (8, 32)
    ),
    # Not the target either: both servers asked for 4 tokens per delta
    # (response.stream_interval; vLLM's stream_interval), which clients that
    # need not see each token can choose.
    *(
        (
            f"the same, both servers at 4 tokens per delta (`stream_interval`), c={c}",
            0.5,
            True,
            "x",
            frontend_cpu(c, name="vs_vllm-interval4"),
        )
        for c in (8, 32)
    ),
    # Not the target: tokenwire as a gateway in front of vLLM servers
    # (`--engine remote`), its own process against vLLM's whole API server.
    *(
        (f"{label}, c={c}", 0.5, True, "x", gateway_cpu(c, side))
        for side, label in (
            ("tokenwire", "gateway CPU per token, `--engine remote` / vLLM's SSE server"),
            ("tokenwire_x2", "the same, two instances logging to Redis (and redis-server)"),
        )
        for c in (8, 32)
    ),
]

SOURCES = {
    "connections": "benchmarks.connections",
    "connections-pymalloc": "benchmarks.connections --allocator pymalloc",
    "connections-malloc": "benchmarks.connections --allocator malloc",
    "gateway_ceiling": "benchmarks.gateway_ceiling",
    "gateway_ceiling-pymalloc": "benchmarks.gateway_ceiling --allocator pymalloc",
    "vs_vllm": "benchmarks.vs_vllm",
    "vs_vllm-interval4": "benchmarks.vs_vllm --stream-interval 4",
    "remote": "benchmarks.remote",
}


def value(getter: Callable[[dict[str, Report]], float], reports: dict[str, Report]) -> str:
    try:
        return f"{getter(reports):.2f}"
    except (KeyError, ValueError):  # that benchmark has not run, or not at that level
        return "-"


def code(report: Report) -> str:
    where = report.get("machine") or report.get("code") or {}
    cpu = f", {where['cpu']}" if "cpu" in where else ""
    allocator = f", allocator {report['allocator']}" if "allocator" in report else ""
    return f"{where.get('commit', '?')}{cpu}{allocator}"


def table(after: dict[str, Report], before: dict[str, Report]) -> str:
    lines = [
        "| target | at most / at least | measured | met | before |",
        "|---|---|---|---|---|",
    ]
    for what, target, at_most, unit, getter in TARGETS:
        now = value(getter, after)
        met = "-" if now == "-" else ("yes" if (float(now) <= target) == at_most else "**no**")
        bound = f"{'<=' if at_most else '>='} {target:g} {unit}"
        then = value(getter, before)
        lines.append(f"| {what} | {bound} | {now} {unit} | {met} | {then} {unit} |")
    lines.append("")
    for name, module in SOURCES.items():
        now = code(after[name]) if name in after else "not run"
        then = code(before[name]) if name in before else "not run"
        lines.append(f"- `{module}`: measured at {now}; before: {then}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, default=RESULTS / "before-19")
    args = parser.parse_args()
    text = table(load(RESULTS), load(args.before))
    (RESULTS / "efficiency.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
