"""What a guardrail costs the token stream: inter-token latency (ITL) on the
scripted engine at 1,000 sessions, without and with `--guardrail blocklist`,
in the same run (two servers in turn, the same load).

    .venv/bin/python -m benchmarks.guardrail [--sessions 1000] [--rate 10]
        [--tokens 50] [--words 500] [--workers 2]

Every session streams one paced response (`--rate` tokens/s, `--tokens`
tokens, " t0 t1 ...", starts spread over one token interval); clients are raw
`websockets` connections (msgpack) in `--workers` processes, as in
gateway_ceiling. ITL = the gap between two consecutive text-delta frames of
one response, at the client; TTFT = response.create sent to the first delta.
The blocklist has `--words` words and two `re:` lines, none of which the text
triggers: the cost measured is the window and the checks, not a block. The
window holds back `--guardrail-lookahead-chars` (32: about 8 tokens here), so
TTFT rises by that many token intervals by design; ITL is the per-token cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection as PipeEnd
from typing import Any

import msgpack
import numpy as np

from ._server import RESULTS, SCRATCH, tokenwire_process
from .gateway_ceiling import DELTA, LIMIT_FLAGS, PROTOCOLS, _decode, expected_text, percentile


async def _session(url: str, tokens: int, rate: float, at: Any, out: dict[str, Any]) -> None:
    from websockets.asyncio.client import connect

    packer = msgpack.Packer(use_bin_type=True)
    async with out["gate"]:  # bounded handshakes in flight
        ws = await connect(
            url, subprotocols=[PROTOCOLS["msgpack"]], compression=None, ping_interval=None,
            open_timeout=60, max_size=None,
        )  # fmt: skip
    async with ws:
        assert _decode(await ws.recv())["type"] == "session.created"
        out["ready"].release()
        await out["go"].wait()
        await asyncio.sleep(max(0.0, at() - time.perf_counter()))
        sent = time.perf_counter()
        await ws.send(packer.pack({"type": "response.create", "response": {
            "ignore_eos": True, "max_output_tokens": tokens}}))  # fmt: skip
        arrivals: list[float] = []
        parts: list[str] = []
        while True:
            event = _decode(await ws.recv())
            if event["type"] == DELTA:
                arrivals.append(time.perf_counter())
                parts.append(event["delta"])
            elif event["type"] == "response.done":
                break
        if "".join(parts) != expected_text(tokens):
            out["failed"] += 1
            return
        out["ttft"].append(arrivals[0] - sent)
        out["itl"].extend(np.diff(arrivals).tolist())
        out["frames"] += len(arrivals)


async def _worker_main(pipe: PipeEnd, url: str, n: int, offset: int, total: int) -> None:
    loop = asyncio.get_running_loop()
    tokens, rate = pipe.recv()
    out: dict[str, Any] = {"ttft": [], "itl": [], "frames": 0, "failed": 0}
    out["ready"], out["go"], out["gate"] = (
        asyncio.Semaphore(0),
        asyncio.Event(),
        asyncio.Semaphore(32),
    )
    start = [0.0]

    async def one(i: int) -> None:
        # Session k of the run starts k/total of one token interval after the start.
        at = lambda: start[0] + (offset + i) / total / rate  # noqa: E731
        try:
            await _session(url, tokens, rate, at, out)
        except Exception:
            out["failed"] += 1
            out["ready"].release()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    for _ in range(n):
        await out["ready"].acquire()
    pipe.send("connected")
    start[0] = await loop.run_in_executor(None, pipe.recv)
    out["go"].set()
    await asyncio.gather(*tasks)
    pipe.send({k: out[k] for k in ("ttft", "itl", "frames", "failed")})


def _worker(pipe: PipeEnd, url: str, n: int, offset: int, total: int) -> None:
    import uvloop

    uvloop.run(_worker_main(pipe, url, n, offset, total))


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    sizes = [args.sessions // args.workers + (i < args.sessions % args.workers)
             for i in range(args.workers)]  # fmt: skip
    pipes, procs = [], []
    for i, size in enumerate(sizes):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(there, url, size, sum(sizes[:i]), args.sessions))
        proc.start()
        pipes.append(here)
        procs.append(proc)
    for pipe in pipes:
        pipe.send((args.tokens, args.rate))
    for pipe in pipes:
        assert pipe.recv() == "connected"
    start = time.perf_counter() + 0.5  # every worker has it by then (same clock)
    for pipe in pipes:
        pipe.send(start)
    replies = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(timeout=30)
    itl = np.asarray([x for r in replies for x in r["itl"]]) * 1000
    ttft = np.asarray([x for r in replies for x in r["ttft"]]) * 1000
    return {
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "frames": sum(r["frames"] for r in replies),
        "failed": sum(r["failed"] for r in replies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=10.0, help="tokens/s per response")
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--words", type=int, default=500, help="blocklist size")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    SCRATCH.mkdir(exist_ok=True)
    blocklist = SCRATCH / "guardrail_blocklist.txt"
    lines = [f"forbiddenword{i}" for i in range(args.words)]
    blocklist.write_text("\n".join([*lines, r"re:\bpassword\s*[:=]", r"re:\d{4}-\d{4}-\d{4}"]))
    base = ("--engine", "scripted", "--scripted-tokens-per-s", str(args.rate), *LIMIT_FLAGS)
    runs = {}
    for name, extra in (("none", ()), ("blocklist", ("--guardrail", f"blocklist:{blocklist}"))):
        with tokenwire_process(*base, *extra, log_name=f"guardrail-{name}.log") as (url, _):
            runs[name] = measure(url, args)
        print(name, json.dumps(runs[name]), flush=True)
    off, on = runs["none"], runs["blocklist"]
    report = {
        "sessions": args.sessions,
        "rate": args.rate,
        "tokens": args.tokens,
        "blocklist_words": args.words,
        "runs": runs,
        "itl_p50_ratio": on["itl_p50_ms"] / off["itl_p50_ms"],
        "itl_p99_ratio": on["itl_p99_ms"] / off["itl_p99_ms"],
        "itl_p99_added_ms": on["itl_p99_ms"] - off["itl_p99_ms"],
        "ttft_p50_added_ms": on["ttft_p50_ms"] - off["ttft_p50_ms"],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "guardrail.json").write_text(json.dumps(report, indent=2))
    md = (
        f"Scripted engine, {args.sessions:,} sessions, {args.rate:g} tokens/s each, "
        f"{args.tokens} tokens; blocklist of {args.words} words + 2 regexes (never triggered). "
        "Same run, two servers in turn.\n\n"
        "| guardrail | ITL p50 (ms) | ITL p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | failed |\n"
        "|---|---|---|---|---|---|\n"
        + "".join(
            f"| {k} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['ttft_p50_ms']:.1f} | "
            f"{r['ttft_p99_ms']:.1f} | {r['failed']} |\n"
            for k, r in runs.items()
        )
        + f"\nITL p50 ratio {report['itl_p50_ratio']:.3f}x, p99 ratio "
        f"{report['itl_p99_ratio']:.3f}x ({report['itl_p99_added_ms']:+.2f} ms; goal: at most "
        f"+1 ms). TTFT p50 {report['ttft_p50_added_ms']:+.0f} ms: the lookahead window "
        "(32 characters held back) by design.\n"
    )
    (RESULTS / "guardrail.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
