"""What several tokens per delta save: one tokenwire server, the same requests
with `response.stream_interval` N and with 1 (every token), on the real engine.

    .venv/bin/python -m benchmarks.stream_interval [--interval 4]
        [--concurrency 1 8 32] [--tokens 64] [--repeats 5] [--batches 2]

One `tokenwire serve --engine vllm` with the settings of benchmarks.vs_vllm.
Each level's batches alternate between the two kinds of request (A B B A, as
vs_vllm's), so a drift of this machine's speed hits both alike. Per round and
level: N/1 of frontend CPU per output token (the server process's CPU over a
batch, connecting included) and of tokens/s; over the rounds, their geometric
mean with a 95% confidence interval. Writes results/stream_interval.{json,md}.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ._compare import code_note, code_state, measure_round, paired_report, paired_rows, round_parser
from ._server import VLLM_SETTINGS, save_results, tokenwire_process
from .vs_vllm import tokenwire_one


def markdown(report: dict[str, Any], sides: tuple[str, str]) -> str:
    rows = [
        f"`response.stream_interval` {report['interval']} against 1 (every token), one "
        f"`tokenwire serve --engine vllm` ({code_note(report['code'])}), "
        f"{report['tokens']} tokens per request, {report['repeats']} rounds of "
        f"{report['batches']} batches a side and level, batches alternating. Frontend CPU: "
        "the server process's CPU per output token (median of rounds). Ratios: geometric "
        "mean of the rounds' ratios [95% interval].",
        "",
        *paired_rows(report["levels"], sides),
    ]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = round_parser(__doc__, repeats=5, repeats_help="rounds over every level", retries=1)
    parser.add_argument("--interval", type=int, default=4, help="tokens per delta, against 1")
    parser.add_argument("--batches", type=int, default=2, help="per level, side and round")
    args = parser.parse_args()
    if args.interval < 2:
        parser.error("--interval must be at least 2")
    sides = (f"interval {args.interval}", "interval 1")
    meta: dict[str, Any] = {"code": code_state(), "interval": args.interval}
    t0 = time.perf_counter()
    with tokenwire_process(
        "--engine", "vllm", "--log-level", "warning", *VLLM_SETTINGS, log_name="stream-interval.log"
    ) as (url, proc):
        ones = {
            side: (lambda i, e, n=n: tokenwire_one(url, i, args.tokens, e, n))
            for side, n in zip(sides, (args.interval, 1), strict=True)
        }
        pids = {side: [proc.pid] for side in sides}
        rounds = []
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}:", flush=True)
            warm = max(args.concurrency) if r == 0 else None
            rounds.append(asyncio.run(measure_round(ones, pids, args, r, warm)))
    report = paired_report(args, rounds, meta, time.perf_counter() - t0, sides)
    save_results("stream_interval", report, markdown(report, sides))


if __name__ == "__main__":
    main()
