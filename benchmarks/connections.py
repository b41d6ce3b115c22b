"""Connections and memory: 10,000 concurrent streaming sessions against one
`tokenwire serve --engine scripted` process.

    .venv/bin/python -m benchmarks.connections [--sessions 10000] [--workers 2]
        [--rate 1] [--tokens 20] [--rounds 2] [--allocator mimalloc|pymalloc|malloc]

Steps, all on one server:
1. idle: the server's RSS (from /proc/<pid>/status) after start-up and a
   warm-up of a few sessions, so one-time costs (imports, first-use caches)
   are not counted per connection;
2. connect: every session opened at once (in-flight handshakes bounded per
   client process, as websockets' listen backlog is 100); measured: the time
   until the last `session.created`, handshake latency, and the kernel's
   listen-queue overflow count;
3. connected: RSS with every session open and idle;
4. streaming: every session runs one `ignore_eos` response of `--tokens`
   tokens at `--rate` tokens/s (starts spread over one token interval). RSS
   is sampled all along, and `/healthz` polled to confirm that the server had
   every session open and every generation running at once;
5. closed: every client closes; RSS after, and 5 s later, once the server
   has handed a wave's memory back (target: within 15% of the idle RSS).
Steps 2-5 run `--rounds` times on the same server: if the second round ends
where the first did, memory kept after close is reused, not leaked.

Per connection = (RSS - idle RSS) / sessions. A failure is a session that
could not connect, a stream error, or a response that did not complete with
exactly " t0 t1 ... t{N-1}" and the right usage. Target: 0 failures. The
server's full (generation-2) garbage collections are logged through a
sitecustomize hook (see gateway_ceiling.trace_gc) and counted per round.

The clients run in `--workers` separate processes (raw `websockets`, uvloop)
on the same 2 cores as the server.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ._server import (
    RESULTS,
    add_allocator_option,
    allocator_of,
    cpu_seconds,
    results_name,
    rss_kib,
    save_results,
    tokenwire_process,
)
from .gateway_ceiling import (
    BUSY,
    LIMIT_FLAGS,
    Clients,
    busy_cpu_seconds,
    code_note,
    fmt,
    gc_pauses,
    machine,
    trace_gc,
    wait_quiet,
)


class Sampler:
    """RSS and /healthz of the server every `every_s`, in a thread."""

    def __init__(self, pid: int, port: int, every_s: float = 0.5) -> None:
        self.pid, self.every_s = pid, every_s
        self.health_url = f"http://127.0.0.1:{port}/healthz"
        self.t0 = time.perf_counter()
        self.rss: list[tuple[float, int]] = []  # (s, KiB)
        self.health: list[tuple[float, dict[str, Any]]] = []
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.perf_counter() - self.t0
            self.rss.append((now, rss_kib(self.pid)))
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as r:
                    self.health.append((now, json.loads(r.read())))
            except OSError:
                pass  # a busy server may answer late; RSS is what matters here
            self._stop.wait(self.every_s)

    def mark(self, label: str) -> float:
        t = time.perf_counter() - self.t0
        self.marks.append((t, label))
        return t

    def peak_kib(self, since: float, until: float) -> int:
        return max((k for t, k in self.rss if since <= t <= until), default=0)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def settled_rss(pid: int, seconds: float = 1.5) -> int:
    """RSS after a short pause, so freed memory and late allocations show."""
    time.sleep(seconds)
    return rss_kib(pid)


def one_round(
    args: argparse.Namespace, url: str, pid: int, sampler: Sampler, label: str
) -> dict[str, Any]:
    """Connect every session, stream one response on each, close them all."""
    n = args.sessions
    rss_before = rss_kib(pid)
    with Clients(url, n, args.workers, concurrency=args.connect_concurrency) as clients:
        t_connect = sampler.mark(f"{label} connect")
        connected = clients.connect()
        rss_connected = settled_rss(pid)
        ours = [pid, *clients.pids]
        quiet = wait_quiet(ours, args.quiet_wait)
        t_stream = sampler.mark(f"{label} stream")
        busy, cpu = busy_cpu_seconds(), sum(cpu_seconds(p) for p in ours)
        server_cpu, client_cpu = cpu_seconds(pid), clients.cpu_seconds()
        # Generous: a stream on a loaded machine may fall behind its schedule.
        timeout = 120 + 3 * args.tokens / args.rate
        stream = clients.run(args.tokens, args.rate, 1.0 / args.rate, timeout)
        t_end = sampler.mark(f"{label} close")
        wall = t_end - t_stream
        stream.update(gc_pauses(pid, sampler.t0 + t_stream, sampler.t0 + t_end))
        stream["server_cores"] = (cpu_seconds(pid) - server_cpu) / wall
        # Server and clients share the cores: clients near the rest of them
        # means lag comes from the machine, not the server.
        stream["client_cores"] = (clients.cpu_seconds() - client_cpu) / wall
        ours_cpu = sum(cpu_seconds(p) for p in ours) - cpu
        stream["other_cores"] = max(0.0, busy_cpu_seconds() - busy - ours_cpu) / wall
        stream["other_cores_before"] = quiet
    rss_closed = settled_rss(pid)
    # The server hands memory back once a wave is over (server/memory.py: at
    # most 2 s after the sessions end); wait past that.
    rss_returned = settled_rss(pid, 5.0)
    with urllib.request.urlopen(sampler.health_url, timeout=10) as resp:
        after = json.loads(resp.read())  # every session gone, nothing running?
    mid = [h for t, h in sampler.health if t_stream <= t <= t_end]
    return {
        "rss_before_kib": rss_before,
        "rss_connect_peak_kib": sampler.peak_kib(t_connect, t_stream),
        "rss_connected_kib": rss_connected,
        "rss_streaming_peak_kib": sampler.peak_kib(t_stream, t_end),
        "rss_closed_kib": rss_closed,
        "rss_returned_kib": rss_returned,
        "connect": connected,
        "stream": stream,
        # What the server itself saw while streaming: every session open, all running?
        "healthz_max_connections": max((h["connections"] for h in mid), default=None),
        "healthz_max_running": max((h["engine_load"]["running"] for h in mid), default=None),
        "healthz_max_paused": max((h["paused_connections"] for h in mid), default=None),
        "healthz_samples": len(mid),
        "healthz_after_close": after,
        "failures": {**connected["failures"], **stream["failures"]},
        "failed": (n - connected["connected"]) + stream["failed"],
        "completed_exact": stream["completed"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.sessions
    code = machine()  # before the server starts: the code it loads
    with tokenwire_process(
        "--engine",
        "scripted",
        "--scripted-tokens-per-s",
        str(args.rate),
        *LIMIT_FLAGS,
        "--log-level",
        "warning",
        *(("--allocator", args.allocator) if args.allocator else ()),
        log_name="connections-tokenwire.log",
    ) as (url, proc):
        allocator = allocator_of(proc.pid)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        rss_start = settled_rss(proc.pid, 0.5)
        with Clients(url, 20, 1) as warm:
            warm.connect()
            warm.run(2, args.rate, 0, 60)
        rss_idle = settled_rss(proc.pid)
        with Sampler(proc.pid, port) as sampler:
            # A second round on the same server tells retained memory from a leak.
            rounds = [
                one_round(args, url, proc.pid, sampler, f"round {i + 1}")
                for i in range(args.rounds)
            ]
    for r in rounds:
        r["kib_per_connection_connected"] = (r["rss_connected_kib"] - rss_idle) / n
        r["kib_per_connection_streaming"] = (r["rss_streaming_peak_kib"] - rss_idle) / n
    return {
        "machine": code,
        "code_changed_during_run": machine()["commit"] != code["commit"],
        "allocator": allocator,
        "sessions": n,
        "workers": args.workers,
        "rate": args.rate,
        "tokens": args.tokens,
        "rss_start_kib": rss_start,
        "rss_idle_kib": rss_idle,
        "rounds": rounds,
        "failed": sum(r["failed"] for r in rounds),
        "rss_series": sampler.rss,
        "marks": sampler.marks,
    }


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    n = report["sessions"]
    rounds = report["rounds"]

    def row(name: str, render: Any) -> str:
        return f"| {name} | " + " | ".join(render(r) for r in rounds) + " |"

    def mib(kib: int) -> str:
        return f"{kib / 1024:.1f} MiB"

    lines = [
        f"{n:,} sessions on one `tokenwire serve --engine scripted` process, each streaming "
        f"{report['tokens']} tokens at {report['rate']:g} tokens/s"
        + f", allocator {report.get('allocator', 'pymalloc')}; {len(rounds)} rounds of "
        "connect, stream and close on the same server. Clients in "
        f"{report['workers']} processes on the same {m['cpus']} cores ({m['cpu']}); "
        f"{code_note(m, report['code_changed_during_run'])}. Server RSS at start "
        f"{mib(report['rss_start_kib'])}, idle after a warm-up {mib(report['rss_idle_kib'])}; "
        "per connection = (RSS - idle RSS) / sessions.",
        "",
        "| measure | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " |",
        "|---|" + "---|" * len(rounds),
        row("server RSS before the round", lambda r: mib(r["rss_before_kib"])),
        row("server RSS, all connected, idle", lambda r: mib(r["rss_connected_kib"])),
        row("server RSS, all streaming (peak)", lambda r: mib(r["rss_streaming_peak_kib"])),
        row("server RSS after all closed", lambda r: mib(r["rss_closed_kib"])),
        row("server RSS 5 s later", lambda r: mib(r["rss_returned_kib"])),
        row(
            "**RSS 5 s after close / idle RSS**",
            lambda r: f"**{r['rss_returned_kib'] / report['rss_idle_kib']:.2f}x**",
        ),
        row(
            "**RSS per connection, connected**",
            lambda r: f"**{r['kib_per_connection_connected']:.1f} KiB**",
        ),
        row(
            "**RSS per connection, streaming**",
            lambda r: f"**{r['kib_per_connection_streaming']:.1f} KiB**",
        ),
        row("time to connect all", lambda r: f"{r['connect']['connect_all_s']:.2f} s"),
        row(
            "handshake p50 / p99 / max",
            lambda r: (
                f"{fmt(r['connect']['handshake_p50_ms'], 0)} / "
                f"{fmt(r['connect']['handshake_p99_ms'], 0)} / "
                f"{fmt(r['connect']['handshake_max_ms'], 0)} ms"
            ),
        ),
        row(
            "listen-queue overflows while connecting (kernel)",
            lambda r: str(r["connect"]["listen_overflows"]),
        ),
        row("sessions connected", lambda r: f"{r['connect']['connected']:,} / {n:,}"),
        row(
            "server saw open / running at once (/healthz)",
            lambda r: f"{r['healthz_max_connections']} / {r['healthz_max_running']}",
        ),
        row(
            "responses completed with the exact text",
            lambda r: f"{r['completed_exact']:,} / {n:,}",
        ),
        row(
            "tokens delivered",
            lambda r: f"{r['stream']['tokens']:,} ({r['stream']['tokens_per_s']:,.0f} tokens/s)",
        ),
        row(
            "token lag p50 / p99 / max",
            lambda r: (
                f"{fmt(r['stream']['lag_p50_ms'], 0)} / "
                f"{fmt(r['stream']['lag_p99_ms'], 0)} / {fmt(r['stream']['lag_max_ms'], 0)} ms"
            ),
        ),
        row("server cores while streaming", lambda r: f"{r['stream']['server_cores']:.2f}"),
        row(
            "client processes' cores while streaming",
            lambda r: fmt(r["stream"].get("client_cores"), 2),
        ),
        row(
            "server full GCs while streaming (longest pause)",
            lambda r: f"{r['stream']['full_gc_count']} ({r['stream']['full_gc_max_ms']:.0f} ms)",
        ),
        row(
            "client full GCs while streaming (longest pause)",
            lambda r: (
                f"{r['stream']['client_full_gc_count']} "
                f"({r['stream']['client_full_gc_max_ms']:.0f} ms)"
            ),
        ),
        row(
            "other processes' cores while streaming",
            lambda r: (
                f"{r['stream']['other_cores']:.2f}"
                + (" (busy machine)" if r["stream"]["other_cores"] > BUSY else "")
            ),
        ),
        row(
            "server after close: connections / running (/healthz)",
            lambda r: (
                f"{r['healthz_after_close']['connections']} / "
                f"{r['healthz_after_close']['engine_load']['running']}"
            ),
        ),
        row("**failures**", lambda r: f"**{r['failed']}**"),
    ]
    reasons = sorted({why for r in rounds for why in r["failures"]})
    for why in reasons:
        lines.append(row(f"failure: {why}", lambda r, why=why: str(r["failures"].get(why, 0))))
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, kib = zip(*r["rss_series"], strict=True)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(t, [k / 1024 for k in kib])
    for at, label in r["marks"]:
        ax.axvline(at, linestyle="--", color="grey", linewidth=0.8)
        ax.text(at, max(kib) / 1024, f" {label}", color="grey", fontsize=7, va="top", rotation=90)
    ax.axhline(r["rss_idle_kib"] / 1024, color="black", linewidth=0.6)
    ax.text(0, r["rss_idle_kib"] / 1024, "idle", fontsize=7, va="bottom")
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"Server memory, {r['sessions']:,} streaming sessions", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2, help="client processes")
    parser.add_argument("--rate", type=float, default=1.0, help="tokens/s per response")
    parser.add_argument("--tokens", type=int, default=20, help="tokens per response")
    parser.add_argument("--rounds", type=int, default=2, help="connect/stream/close rounds")
    parser.add_argument(
        "--connect-concurrency", type=int, default=32, help="handshakes in flight per worker"
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=30,
        help="seconds to wait, before streaming, for other processes to go idle",
    )
    add_allocator_option(parser, "connections")
    args = parser.parse_args()
    trace_gc()
    report = run(args)
    RESULTS.mkdir(exist_ok=True)
    name = results_name("connections", args.allocator)
    plot(report, RESULTS / f"{name}_rss.png")
    save_results(name, report, table(report))


if __name__ == "__main__":
    main()
