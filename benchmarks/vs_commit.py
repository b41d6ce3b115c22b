"""tokenwire against itself at another commit, on the real engine: did a change
make the frontend cheaper?

    .venv/bin/python -m benchmarks.vs_commit BASE [--concurrency 1 8 32]
        [--tokens 64] [--repeats 5] [--batches 2]

Two `tokenwire serve --engine vllm` processes are up at once, with the
settings of benchmarks.vs_vllm: this checkout's, and BASE's (a git worktree
under benchmarks/scratch, run with PYTHONPATH=WORKTREE/server on this venv).
An idle server takes next to no CPU, so each level's batches alternate between
the two (A B B A, as vs_vllm's), and a drift of this machine's speed hits both
alike. That pairing is what makes a few percent visible here, where
vs_vllm's rounds against a different server swing by more.

Per round and level: this/BASE of frontend CPU per output token (the server
process's CPU over a batch, connecting included) and of tokens/s; over the
rounds, their geometric mean with a 95% confidence interval.
Writes results/vs_commit.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._compare import (
    code_note,
    code_state,
    measure_round,
    paired_report,
    paired_rows,
    round_parser,
)
from ._server import SCRATCH, VLLM_SETTINGS, save_results, tokenwire_process
from .vs_vllm import tokenwire_one

SIDES = ("this", "base")


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[tuple[Path, str]]:
    """BASE checked out on its own; yields its directory and short commit."""
    repo = SCRATCH.parent.parent

    def git(*a: str, check: bool = True) -> str:
        run = subprocess.run(["git", *a], capture_output=True, text=True, check=check, cwd=repo)
        return run.stdout.strip()

    sha = git("rev-parse", "--short", commit)
    where = SCRATCH / f"base-{sha}"
    SCRATCH.mkdir(exist_ok=True)
    git("worktree", "add", "--force", "--detach", str(where), sha)
    try:
        yield where, sha
    finally:
        git("worktree", "remove", "--force", str(where), check=False)


def build_report(
    args: argparse.Namespace, rounds: list[dict[str, Any]], meta: dict[str, Any], wall: float
) -> dict[str, Any]:
    return paired_report(args, rounds, meta, wall, SIDES)


def markdown(report: dict[str, Any]) -> str:
    rows = [
        f"This checkout ({code_note(report['code'])}) against commit {report['base']}, "
        f"`tokenwire serve --engine vllm`, {report['tokens']} tokens per request, "
        f"{report['repeats']} rounds of {report['batches']} batches a side and level, "
        "batches alternating between the two servers. Frontend CPU: the server "
        "process's CPU per output token (median of rounds). Ratios this/base: "
        "geometric mean of the rounds' ratios [95% interval].",
        "",
        *paired_rows(report["levels"], SIDES),
    ]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = round_parser(__doc__, repeats=5, repeats_help="rounds over every level", retries=1)
    parser.add_argument("base", help="the commit to measure against")
    parser.add_argument("--batches", type=int, default=2, help="per level, side and round")
    args = parser.parse_args()
    meta: dict[str, Any] = {"code": code_state()}
    flags = ("--engine", "vllm", "--log-level", "warning", *VLLM_SETTINGS)
    t0 = time.perf_counter()
    with worktree(args.base) as (where, sha), contextlib.ExitStack() as stack:
        meta["base"] = sha
        this_url, this = stack.enter_context(
            tokenwire_process(*flags, log_name="vs-commit-this.log")
        )
        base_url, base = stack.enter_context(
            tokenwire_process(
                *flags, log_name="vs-commit-base.log", env={"PYTHONPATH": str(where / "server")}
            )
        )
        urls = {"this": this_url, "base": base_url}
        ones = {s: (lambda i, e, u=u: tokenwire_one(u, i, args.tokens, e)) for s, u in urls.items()}
        pids = {"this": [this.pid], "base": [base.pid]}
        rounds = []
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}:", flush=True)
            warm = max(args.concurrency) if r == 0 else None
            rounds.append(asyncio.run(measure_round(ones, pids, args, r, warm)))
    report = build_report(args, rounds, meta, time.perf_counter() - t0)
    save_results("vs_commit", report, markdown(report))


if __name__ == "__main__":
    main()
