"""Slow-client isolation: healthy clients' inter-token latency with and
without stalled clients beside them, and server RSS over time.

    .venv/bin/python -m benchmarks.backpressure [--healthy 90] [--stalled 10]

The server runs the scripted engine at a model-like 20 tokens/s per stream
with a 16 KiB SO_SNDBUF (on loopback the kernel would otherwise absorb
megabytes before any client looks slow). Phase A: only healthy clients.
Phase B: the same healthy load plus stalled clients that never read. Both
phases run in one process, back to back, and the ratios compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from tokenwire.client import connect

from ._server import rss_kib, tokenwire_process

RESULTS = Path(__file__).resolve().parent / "results"
RATE = 20.0
TOKENS = 200  # 10 s per healthy stream


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def healthy(url: str, gaps: list[float]) -> None:
    async with await connect(url) as tw:
        response = await tw.create_response(ignore_eos=True, max_output_tokens=TOKENS)
        last = None
        async for _ in response.text_deltas():
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1000)
            last = now


async def stalled(url: str, port: int) -> ClientConnection:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    ws = await ws_connect(url, sock=sock, max_queue=1, subprotocols=["tokenwire.v1.json"])
    await ws.send(
        json.dumps(
            {
                "type": "response.create",
                "response": {"ignore_eos": True, "max_output_tokens": 10**7},
            }
        )
    )
    return ws


async def sample_rss(
    pid: int, t0: float, out: list[tuple[float, int]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        out.append((time.perf_counter() - t0, rss_kib(pid)))
        await asyncio.sleep(0.25)


async def phase(
    url: str,
    port: int,
    pid: int,
    n_healthy: int,
    n_stalled: int,
    t0: float,
    rss: list[tuple[float, int]],
) -> dict:
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, t0, rss, stop))
    stalled_ws = [await stalled(url, port) for _ in range(n_stalled)]
    await asyncio.sleep(2.0 if n_stalled else 0)  # let them fall behind and pause
    gaps: list[float] = []
    await asyncio.gather(*(healthy(url, gaps) for _ in range(n_healthy)))
    peak = max(r for _, r in rss[-40:])
    for ws in stalled_ws:
        ws.transport.abort()
    stop.set()
    await sampler
    return {
        "healthy": n_healthy,
        "stalled": n_stalled,
        "intervals": len(gaps),
        "itl_p50_ms": statistics.median(gaps),
        "itl_p99_ms": percentile(gaps, 0.99),
        "itl_mean_ms": statistics.fmean(gaps),
        "peak_rss_kib": peak,
    }


async def run(n_healthy: int, n_stalled: int) -> dict:
    with tokenwire_process(
        "--engine",
        "scripted",
        "--scripted-tokens-per-s",
        str(RATE),
        "--sndbuf",
        "16384",
        "--log-level",
        "warning",
        log_name="backpressure-server.log",
    ) as (url, proc):
        port = urlsplit(url).port
        assert port is not None
        t0 = time.perf_counter()
        rss: list[tuple[float, int]] = []
        base_rss = rss_kib(proc.pid)
        a = await phase(url, port, proc.pid, n_healthy, 0, t0, rss)
        mark = time.perf_counter() - t0
        b = await phase(url, port, proc.pid, n_healthy, n_stalled, t0, rss)
    return {
        "rate_tokens_per_s": RATE,
        "tokens": TOKENS,
        "base_rss_kib": base_rss,
        "baseline": a,
        "with_stalled": b,
        "phase_b_starts_s": mark,
        "p99_ratio": b["itl_p99_ms"] / a["itl_p99_ms"],
        "p50_ratio": b["itl_p50_ms"] / a["itl_p50_ms"],
        "rss": rss,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, kib = zip(*report["rss"], strict=True)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(t, [k / 1024 for k in kib])
    ax.axvline(report["phase_b_starts_s"], linestyle="--", color="grey")
    ax.text(report["phase_b_starts_s"], min(kib) / 1024, " + stalled clients", color="grey")
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title("Server memory: healthy clients, then healthy + stalled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--healthy", type=int, default=90)
    parser.add_argument("--stalled", type=int, default=10)
    args = parser.parse_args()
    report = asyncio.run(run(args.healthy, args.stalled))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "backpressure.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / "backpressure_rss.png")
    a, b = report["baseline"], report["with_stalled"]
    lines = [
        f"{a['healthy']} healthy clients at {RATE:g} tokens/s each; then the same plus "
        f"{b['stalled']} stalled clients (scripted engine, SO_SNDBUF 16 KiB).",
        "",
        "| phase | ITL p50 (ms) | ITL p99 (ms) | peak RSS (MiB) |",
        "|---|---|---|---|",
        f"| healthy only | {a['itl_p50_ms']:.1f} | {a['itl_p99_ms']:.1f} | "
        f"{a['peak_rss_kib'] / 1024:.1f} |",
        f"| healthy + stalled | {b['itl_p50_ms']:.1f} | {b['itl_p99_ms']:.1f} | "
        f"{b['peak_rss_kib'] / 1024:.1f} |",
        f"| ratio | {report['p50_ratio']:.3f} | {report['p99_ratio']:.3f} | |",
    ]
    (RESULTS / "backpressure.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
