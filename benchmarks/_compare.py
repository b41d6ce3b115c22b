"""What the benchmarks that compare two sides over repeated rounds share
(vs_vllm: tokenwire and vLLM's server; engine_ceiling: tokenwire and AsyncLLM)."""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIELDS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def level_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each figure, with the spread of tokens/s."""
    out: dict[str, Any] = {f: statistics.median(r[f] for r in runs) for f in FIELDS}
    rates = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = min(rates), max(rates)
    out["other_cores_max"] = max(r["other_cores"] for r in runs)
    out["attempts"] = sum(len(r["attempts"]) for r in runs)
    return out


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
