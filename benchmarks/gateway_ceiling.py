"""The gateway's own ceiling: tokenwire on the scripted engine (no model) against
a bare `websockets` server sending the same frames, at 100, 1,000 and 10,000
concurrent sessions.

    .venv/bin/python -m benchmarks.gateway_ceiling [--sessions 100 1000 10000]
        [--workers 2] [--modes max paced] [--max-total-tokens 100000]
        [--paced-rate 1] [--paced-tokens 10] [--repeats 3]
        [--allocator mimalloc|pymalloc|malloc]

Two modes, each run on both servers, one server at a time:
- max: the engine runs flat out (`--scripted-tokens-per-s 0`); every session
  starts its response at the same instant and streams `--max-total-tokens /
  sessions` tokens. Measured: tokens/s and frames/s delivered to the clients
  (first request sent -> last `response.done` received) and TTFT.
- paced: the engine emits `--paced-rate` tokens/s per response, for
  `--paced-tokens` tokens; session starts are spread evenly over one token
  interval, as independent users would be. Measured: the lag of every token
  behind its schedule (arrival - (request sent + (i+1)/rate)), TTFT and the
  delivered tokens/s.
Each level connects its sessions, runs a one-token warm-up on each, then the
measured response. Each level runs `--repeats` times on both servers, a fresh
server per run, the two in turns; a ratio is the median of the paired
ratios tokenwire / bare (their range in brackets).

The bare server (`--serve-bare`, in this file) is one uvloop process like
tokenwire, with the same websockets settings (no compression, 20 s pings).
It answers a `response.create` with the same events, encoded the same way
(msgpack by default), at the same rate on the same absolute schedule as the
scripted engine: the transport's ceiling, with no session logic.

`--allocator` starts tokenwire on that allocator (`tokenwire serve
--allocator`: its default, mimalloc, frees memory after a wave; pymalloc costs
less CPU per token) and writes results/gateway_ceiling-<allocator>.*; every
report names the allocator the server ran on (read from /proc).

Clients are raw `websockets` connections in `--workers` separate processes
(uvloop each). Every response is checked: status `completed`, the exact text
" t0 t1 ...", the right usage; anything else counts as a failure.

Also recorded per run: the CPU each side used (cores = CPU seconds / wall
seconds, from /proc), the CPU everything else on the machine used meanwhile,
the server's peak RSS, and its garbage collections, full (generation 2) and
young (0 and 1), which stop its event loop: a sitecustomize hook on the
servers' PYTHONPATH logs each one (`trace_gc`). Before each measurement the
benchmark waits up to `--quiet-wait` seconds for other processes to leave the
cores alone, and measures again (`--retries`) if they took more than 0.25
cores meanwhile.

Honesty note: the machine has 2 cores. The server uses at most one (a single
event loop); the client processes share both cores with it. A flat-out run
where the server used less than ~0.85 of a core was limited by the clients,
not by that server: its real ceiling is higher than the number shown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import itertools
import json
import math
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ._server import (
    RESULTS,
    SCRATCH,
    add_allocator_option,
    allocator_of,
    cpu_seconds,
    free_port,
    results_name,
    rss_kib,
    save_results,
    server_process,
    tokenwire_process,
)

DELTA = "response.output_text.delta"
PROTOCOLS = {"msgpack": "tokenwire.v1.msgpack", "json": "tokenwire.v1.json"}
REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")

BUSY = 0.25  # cores used by other processes above which a run is flagged
SATURATED = 0.85  # server cores from which a flat-out run counts as server-bound
# Limits high enough that the only limits met are the machine's.
LIMIT_FLAGS = (
    "--max-connections",
    "20000",
    "--max-connections-per-key",
    "20000",
    "--max-responses-per-key",
    "20000",
)


# -- measuring processes -------------------------------------------------------


def busy_cpu_seconds() -> float:
    """CPU time the whole machine spent busy (all processes, kernel included)."""
    jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / TICK  # all but idle and iowait


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full
    (system-wide; the client then retries its SYN after 1 s)."""
    lines = [x.split() for x in Path("/proc/net/netstat").read_text().splitlines()]
    for names, values in itertools.pairwise(lines):
        if names[0] == "TcpExt:" and values[0] == "TcpExt:":
            return int(dict(zip(names, values, strict=True))["ListenOverflows"])
    return 0


def other_cores(ours: list[int], seconds: float = 1.0) -> float:
    """Cores busy with anything but `ours` (other users of the machine) over `seconds`."""
    busy, mine = busy_cpu_seconds(), sum(cpu_seconds(pid) for pid in ours)
    time.sleep(seconds)
    spent = busy_cpu_seconds() - busy - (sum(cpu_seconds(pid) for pid in ours) - mine)
    return max(0.0, spent) / seconds


def wait_quiet(ours: list[int], max_wait_s: float, threshold: float = 0.15) -> float:
    """Wait (up to max_wait_s) until other processes leave the cores alone.
    Returns the last load seen; the benchmark records it next to its numbers."""
    deadline = time.monotonic() + max_wait_s
    load = other_cores(ours)
    while load > threshold and time.monotonic() < deadline:
        load = other_cores(ours)
    return load


# Put on the servers' PYTHONPATH as sitecustomize: logs every full (generation 2)
# garbage collection of the process, as "end_time pause_s" on CLOCK_MONOTONIC
# (time.perf_counter on Linux), so the benchmark can line them up with its runs.
GC_HOOK = """\
import gc, os, time
_dir = os.environ.get("BENCH_GC_LOG_DIR")
if _dir:
    _log = open(os.path.join(_dir, f"{os.getpid()}.log"), "a", buffering=1)
    _start = [0.0]

    def _gc_pause(phase, info):
        now = time.perf_counter()
        if phase == "start":
            _start[0] = now
        else:
            _log.write(f"{now:.6f} {now - _start[0]:.6f} {info['generation']}\\n")

    gc.callbacks.append(_gc_pause)
"""


def trace_gc() -> Path:
    """Make every Python process started from now on log its GC pauses."""
    hook, logs = SCRATCH / "gc_hook", SCRATCH / "gc_logs"
    hook.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    (hook / "sitecustomize.py").write_text(GC_HOOK)
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{hook}{os.pathsep}{path}" if path else str(hook)
    os.environ["BENCH_GC_LOG_DIR"] = str(logs)
    return logs


def gc_pauses(pid: int, since: float, until: float) -> dict[str, Any]:
    """The GC pauses process `pid` logged between two perf_counter times:
    full (generation 2) and young (0 and 1) collections."""
    log = Path(os.environ.get("BENCH_GC_LOG_DIR", SCRATCH / "gc_logs")) / f"{pid}.log"
    full, young = [], []
    if log.exists():
        for line in log.read_text().splitlines():
            end, pause, generation = line.split()
            if since <= float(end) <= until:
                (full if generation == "2" else young).append(float(pause) * 1000)
    return {
        "full_gc_count": len(full),
        "full_gc_max_ms": max(full, default=0.0),
        "full_gc_total_ms": sum(full),
        "young_gc_count": len(young),
        "young_gc_total_ms": sum(young),
    }


class RssPeak:
    """Samples a process's RSS in a thread; `peak` is the highest seen."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_kib(self.pid))
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def expected_text(tokens: int) -> str:
    return "".join(f" t{i}" for i in range(tokens))


# -- client worker processes ---------------------------------------------------


def _decode(frame: str | bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:160]


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _stream(
    ws: Any, encode: Any, tokens: int, rate: float, start_at: float, out: dict[str, Any]
) -> None:
    """One response on an open session; appends its measurements to `out`."""
    await _sleep_until(start_at)
    sent = time.perf_counter()
    await ws.send(
        encode(
            {
                "type": "response.create",
                "response": {"ignore_eos": True, "max_output_tokens": tokens},
            }
        )
    )
    parts: list[str] = []
    got = frames = 0
    first: float | None = None
    lags = out["lag"]
    while True:
        event = _decode(await ws.recv())
        now = time.perf_counter()
        kind = event["type"]
        if kind == DELTA:
            delta = event["delta"]
            count = delta.count(" t")  # a merged delta carries several tokens
            if first is None:
                first = now
            if rate > 0:
                # Every token's lag behind the engine's schedule, merged ones too.
                lags.extend(now - sent - (j + 1) / rate for j in range(got, got + count))
            got += count
            frames += 1
            parts.append(delta)
        elif kind == "response.done":
            break
        elif kind == "error":
            raise RuntimeError(f"error event {event['error'].get('code')}")
    response = event["response"]
    want = out["expected"]
    if response["status"] != "completed":
        raise RuntimeError(f"status {response['status']}")
    if "".join(parts) != want or response["output"][0]["content"] != want:
        raise RuntimeError("text differs from the expected ' t0 t1 ...'")
    if response["usage"]["output_tokens"] != tokens:
        raise RuntimeError("usage.output_tokens differs")
    out["ttft"].append(first - sent)
    out["end"].append(now)
    out["tokens"] += got
    out["frames"] += frames


async def _phase(
    conns: list[Any],
    encode: Any,
    tokens: int,
    rate: float,
    start_at: float,
    spread_s: float,
    offset: int,
    total: int,
    timeout: float,
) -> dict[str, Any]:
    """One response on every session of this worker, measured."""
    out: dict[str, Any] = {
        "lag": [],
        "ttft": [],
        "end": [],
        "tokens": 0,
        "frames": 0,
        "expected": expected_text(tokens),
    }
    failures: Counter[str] = Counter()

    async def one(i: int, ws: Any) -> None:
        # Session k of the whole run starts at start_at + k/total of the spread.
        at = start_at + spread_s * (offset + i) / total
        try:
            await _stream(ws, encode, tokens, rate, at, out)
        except Exception as exc:
            failures["stream " + _why(exc)] += 1

    tasks = [asyncio.create_task(one(i, ws)) for i, ws in enumerate(conns)]
    _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    if pending:
        failures["stream timeout"] += len(pending)
    return {
        "lag": np.asarray(out["lag"], dtype=np.float64),
        "ttft": np.asarray(out["ttft"], dtype=np.float64),
        "end": max(out["end"], default=None),
        "tokens": out["tokens"],
        "frames": out["frames"],
        "completed": len(out["ttft"]),
        "failures": dict(failures),
    }


async def _worker_main(pipe: PipeEnd, url: str, n: int, subprotocol: str, concurrency: int) -> None:
    import websockets
    from websockets.asyncio.client import connect

    loop = asyncio.get_running_loop()

    async def command() -> Any:
        return await loop.run_in_executor(None, pipe.recv)

    packer = msgpack.Packer(use_bin_type=True)
    binary = subprotocol.endswith("msgpack")

    def encode(event: dict[str, Any]) -> bytes | str:
        return packer.pack(event) if binary else json.dumps(event)

    conns: list[Any] = []
    failures: Counter[str] = Counter()
    connect_s: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def open_one() -> None:
        # Bounded in-flight handshakes: the listen backlog is small (websockets'
        # default is 100), and overflowing it only adds SYN retries.
        async with gate:
            t = time.perf_counter()
            try:
                ws = await connect(
                    url,
                    subprotocols=[subprotocol],
                    compression=None,
                    ping_interval=None,  # the server pings; the client only answers
                    max_size=None,
                    open_timeout=30,
                    close_timeout=10,
                )
                first = _decode(await asyncio.wait_for(ws.recv(), 30))
                if first["type"] != "session.created":
                    raise RuntimeError(f"first event {first['type']}")
            except (OSError, TimeoutError, RuntimeError, websockets.WebSocketException) as exc:
                failures["connect " + _why(exc)] += 1
                return
            connect_s.append(time.perf_counter() - t)
            conns.append(ws)

    pipe.send("ready")
    cmd = await command()
    assert cmd[0] == "connect"
    await _sleep_until(cmd[1])
    tasks = [asyncio.create_task(open_one()) for _ in range(n)]
    _, pending = await asyncio.wait(tasks, timeout=cmd[2])
    for task in pending:
        task.cancel()
    if pending:
        failures["connect not done within the phase deadline"] += len(pending)
    pipe.send(
        {
            "done_at": time.perf_counter(),
            "connected": len(conns),
            "connect_s": connect_s,
            "failures": dict(failures),
        }
    )
    # The sessions live as long as the worker: keep them out of the client's
    # full garbage collections, which would stall it and show up as lag.
    gc.collect()
    gc.freeze()
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    while True:
        cmd = await command()
        if cmd[0] == "close":
            break
        pauses.clear()
        result = await _phase(conns, encode, *cmd[1:])
        result["client_full_gc_max_ms"] = max(pauses, default=0.0) * 1000
        result["client_full_gc_count"] = len(pauses)
        pipe.send(result)

    async def close_one(ws: Any) -> None:
        async with gate:
            with contextlib.suppress(Exception):
                await ws.close()

    await asyncio.gather(*(close_one(ws) for ws in conns))
    pipe.send("closed")


def _worker(pipe: PipeEnd, url: str, n: int, subprotocol: str, concurrency: int) -> None:
    import uvloop

    uvloop.run(_worker_main(pipe, url, n, subprotocol, concurrency))


class Clients:
    """`n` sessions held by `workers` client processes, driven one phase at a time."""

    def __init__(
        self, url: str, n: int, workers: int, protocol: str = "msgpack", concurrency: int = 32
    ) -> None:
        self.n = n
        # Not fork: the caller may run threads (samplers) whose locks a fork would copy.
        ctx = mp.get_context("spawn")
        sizes = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        self.offsets = [sum(sizes[:i]) for i in range(workers)]
        self.pipes: list[PipeEnd] = []
        self.procs: list[Any] = []
        for size in sizes:
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(there, url, size, PROTOCOLS[protocol], concurrency),
                daemon=True,
            )
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"  # imports done: connect() times only connecting

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)

    def connect(self, timeout: float = 180) -> dict[str, Any]:
        """Open every session at once; the time runs until the last session.created."""
        overflows = listen_overflows()
        start = time.perf_counter() + 0.05  # every worker has the command by then
        for pipe in self.pipes:
            pipe.send(("connect", start, timeout))
        replies = [pipe.recv() for pipe in self.pipes]
        overflows = listen_overflows() - overflows
        times = np.asarray([t for r in replies for t in r["connect_s"]])
        failures: Counter[str] = Counter()
        for r in replies:
            failures.update(r["failures"])
        return {
            "connected": sum(r["connected"] for r in replies),
            "connect_all_s": max(r["done_at"] for r in replies) - start,
            "handshake_p50_ms": percentile(times * 1000, 50),
            "handshake_p99_ms": percentile(times * 1000, 99),
            "handshake_max_ms": float(times.max() * 1000) if len(times) else None,
            "listen_overflows": overflows,
            "failures": dict(failures),
        }

    def run(self, tokens: int, rate: float, spread_s: float, timeout: float) -> dict[str, Any]:
        """One response per session; returns the merged measurements."""
        start = time.perf_counter() + 0.2
        for pipe, offset in zip(self.pipes, self.offsets, strict=True):
            pipe.send(("run", tokens, rate, start, spread_s, offset, self.n, timeout))
        replies = [pipe.recv() for pipe in self.pipes]
        failures: Counter[str] = Counter()
        for r in replies:
            failures.update(r["failures"])
        ends = [r["end"] for r in replies if r["end"] is not None]
        wall = (max(ends) - start) if ends else float("nan")
        ttft = np.concatenate([r["ttft"] for r in replies]) * 1000
        lag = np.concatenate([r["lag"] for r in replies]) * 1000
        delivered = sum(r["tokens"] for r in replies)
        frames = sum(r["frames"] for r in replies)
        return {
            "completed": sum(r["completed"] for r in replies),
            "failures": dict(failures),
            "failed": sum(failures.values()),
            "wall_s": wall,
            "tokens": delivered,
            "frames": frames,
            "tokens_per_s": delivered / wall,
            "frames_per_s": frames / wall,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "lag_p50_ms": percentile(lag, 50),
            "lag_p99_ms": percentile(lag, 99),
            "lag_max_ms": float(lag.max()) if len(lag) else None,
            # The clients' own stop-the-world pauses (they would show up as lag).
            "client_full_gc_count": sum(r["client_full_gc_count"] for r in replies),
            "client_full_gc_max_ms": max(r["client_full_gc_max_ms"] for r in replies),
        }

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("close",))
        for pipe in self.pipes:
            with contextlib.suppress(EOFError, OSError):
                pipe.recv()
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the bare websockets server ------------------------------------------------


def _session_info(subprotocol: str) -> dict[str, Any]:
    # The same fields tokenwire's session.created carries.
    return {
        "id": "sess_" + secrets.token_hex(8),
        "object": "realtime.session",
        "engine": "scripted",
        "subprotocol": subprotocol,
        "max_message_bytes": 1 << 20,
        "default_max_output_tokens": 1024,
        "instructions": None,
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "max_output_tokens": None,
        "tool_timeout_s": 60.0,
    }


async def bare_serve(port: int, rate: float) -> None:
    """The transport alone: the same events at the same schedule, no session logic."""
    from websockets.asyncio.server import ServerConnection, serve

    interval = 1.0 / rate if rate > 0 else 0.0

    async def handler(ws: ServerConnection) -> None:
        subprotocol = ws.subprotocol or PROTOCOLS["json"]
        binary = subprotocol == PROTOCOLS["msgpack"]
        packer = msgpack.Packer(use_bin_type=True)
        seq = 0

        def frame(event: dict[str, Any]) -> bytes | str:
            nonlocal seq
            seq += 1
            event["seq"] = seq
            if binary:
                return packer.pack(event)
            return json.dumps(event, ensure_ascii=False, separators=(",", ":"))

        await ws.send(frame({"type": "session.created", "session": _session_info(subprotocol)}))
        async for raw in ws:
            request = _decode(raw)
            if request.get("type") != "response.create":
                continue
            tokens = int(request["response"]["max_output_tokens"])
            rid, iid = "resp_" + secrets.token_hex(8), "item_" + secrets.token_hex(8)
            t0 = time.perf_counter()
            response: dict[str, Any] = {
                "id": rid,
                "object": "realtime.response",
                "status": "in_progress",
                "status_details": None,
                "conversation": "auto",
                "metadata": None,
                "output": [],
            }
            await ws.send(frame({"type": "response.created", "response": dict(response)}))
            start = time.monotonic()
            parts = []
            for i in range(tokens):
                # The scripted engine's absolute schedule, and its yield at rate 0.
                delay = start + (i + 1) * interval - time.monotonic()
                await asyncio.sleep(delay if delay > 0 else 0)
                if i == 0:
                    ttft = time.perf_counter() - t0
                token = f" t{i}"
                parts.append(token)
                await ws.send(
                    frame({"type": DELTA, "response_id": rid, "item_id": iid, "delta": token})
                )
            text = "".join(parts)
            await ws.send(
                frame(
                    {
                        "type": "response.output_text.done",
                        "response_id": rid,
                        "item_id": iid,
                        "text": text,
                    }
                )
            )
            total = time.perf_counter() - t0
            response["status"] = "completed"
            response["output"] = [
                {
                    "id": iid,
                    "object": "realtime.item",
                    "type": "message",
                    "role": "assistant",
                    "content": text,
                    "status": "completed",
                }
            ]
            response["usage"] = {
                "input_tokens": 0,
                "output_tokens": tokens,
                "cached_tokens": 0,
                "total_tokens": tokens,
            }
            response["timings"] = {
                "ttft_ms": round(ttft * 1000, 2),
                "total_ms": round(total * 1000, 2),
                "output_tokens_per_s": round(tokens / total, 2) if total > 0 else None,
            }
            await ws.send(frame({"type": "response.done", "response": response}))

    def choose(ws: ServerConnection, offered: Any) -> str | None:
        return next((p for p in offered if p in PROTOCOLS.values()), None)

    async with serve(
        handler,
        "127.0.0.1",
        port,
        select_subprotocol=choose,
        compression=None,
        ping_interval=20,
        ping_timeout=20,
        max_queue=4,
        close_timeout=2,
        max_size=1 << 20,
    ):
        await asyncio.get_running_loop().create_future()


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


@contextmanager
def bare_process(rate: float) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    with server_process(
        [
            *(sys.executable, "-m", "benchmarks.gateway_ceiling"),
            *("--serve-bare", str(port), "--rate", str(rate)),
        ],
        "gateway_ceiling-bare.log",
        lambda: listening(port),
        what="bare server",
        timeout=30,
        poll_s=0.1,
        cwd=REPO,
    ) as proc:
        yield f"ws://127.0.0.1:{port}/v1/realtime", proc


@contextmanager
def server(
    kind: str, rate: float, allocator: str | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    if kind == "bare":
        with bare_process(rate) as found:
            yield found
        return
    with tokenwire_process(
        "--engine",
        "scripted",
        "--scripted-tokens-per-s",
        str(rate),
        *LIMIT_FLAGS,
        *(("--allocator", allocator) if allocator else ()),
        "--log-level",
        "warning",
        log_name="gateway_ceiling-tokenwire.log",
    ) as found:
        yield found


# -- the benchmark -------------------------------------------------------------


def measure(
    clients: Clients, proc: subprocess.Popen[bytes], spec: tuple[int, float, float, float]
) -> dict[str, Any]:
    """One measured response per session, with the CPU and memory it cost."""
    cpu_server, cpu_clients = cpu_seconds(proc.pid), clients.cpu_seconds()
    busy, t0 = busy_cpu_seconds(), time.perf_counter()
    with RssPeak(proc.pid) as rss:
        result = clients.run(*spec)
    wall = time.perf_counter() - t0
    result.update(gc_pauses(proc.pid, t0, t0 + wall))
    server_cpu = cpu_seconds(proc.pid) - cpu_server
    client_cpu = clients.cpu_seconds() - cpu_clients
    result["server_cores"] = server_cpu / wall
    result["client_cores"] = client_cpu / wall
    # Anything else that ran meanwhile (other users of the machine, kernel).
    result["other_cores"] = max(0.0, busy_cpu_seconds() - busy - server_cpu - client_cpu) / wall
    result["server_peak_rss_mib"] = rss.peak / 1024
    return result


def one_level(
    url: str, proc: subprocess.Popen[bytes], n: int, args: argparse.Namespace, mode: str
) -> dict[str, Any]:
    if mode == "max":
        tokens, rate, spread = max(1, args.max_total_tokens // n), 0.0, 0.0
    else:
        tokens, rate, spread = args.paced_tokens, args.paced_rate, 1.0 / args.paced_rate
    # Generous: 10k sessions flat out on a busy machine can take a while.
    timeout = 120 + 3 * tokens / (rate or 1000)
    discarded: list[dict[str, Any]] = []
    with Clients(url, n, args.workers, args.protocol, args.connect_concurrency) as clients:
        connected = clients.connect()
        # Warm-up: every code path once. Not timed, but its failures count.
        warmup = clients.run(1, rate, spread, timeout)
        for attempt in range(1 + args.retries):
            before = wait_quiet([proc.pid, *clients.pids], args.quiet_wait)
            result = measure(clients, proc, (tokens, rate, spread, timeout))
            result["other_cores_before"] = before
            if result["other_cores"] <= BUSY or attempt == args.retries:
                break
            # Someone else took the cores meanwhile: measure again on the same
            # sessions, but keep what this attempt saw (its failures count too).
            discarded.append(result)
    result.update(
        sessions=n,
        tokens_per_session=tokens,
        rate=rate,
        offered_tokens_per_s=n * rate if rate else None,
        connect=connected,
        warmup_failures=warmup["failures"],
        discarded_attempts=[
            {k: v for k, v in d.items() if k in ("other_cores", "tokens_per_s", "failures")}
            for d in discarded
        ],
    )
    result["failed"] += (
        warmup["failed"] + sum(d["failed"] for d in discarded) + n - connected["connected"]
    )
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    code = machine()  # before any server starts: the code they load
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        rate = 0.0 if mode == "max" else args.paced_rate
        for i, n in enumerate(args.sessions):
            for rep in range(args.repeats):
                # One server at a time (2 cores), a fresh one per run, the two
                # side by side and in turns, so a drift of the machine's speed
                # falls on both sides of each paired ratio.
                kinds = ("tokenwire", "bare") if (i + rep) % 2 == 0 else ("bare", "tokenwire")
                for kind in kinds:
                    with server(kind, rate, args.allocator) as (url, proc):
                        row = one_level(url, proc, n, args, mode)
                        if kind == "tokenwire":
                            row["allocator"] = allocator_of(proc.pid)
                    row.update(mode=mode, server=kind, repeat=rep)
                    rows.append(row)
                    print(summary_line(row), flush=True)
    ratios = []
    for mode in args.modes:
        for n in args.sessions:
            pairs = [
                tuple(
                    next(
                        r
                        for r in rows
                        if (r["mode"], r["server"], r["sessions"], r["repeat"]) == (mode, k, n, rep)
                    )
                    for k in ("tokenwire", "bare")
                )
                for rep in range(args.repeats)
            ]
            ratio: dict[str, Any] = {"mode": mode, "sessions": n, "repeats": args.repeats}
            keys = ["tokens_per_s", "frames_per_s", "ttft_p50_ms", "ttft_p99_ms"]
            if mode == "paced":
                keys += ["lag_p50_ms", "lag_p99_ms"]
                for key in ("lag_p50_ms", "lag_p99_ms"):
                    added = [tw[key] - bare[key] for tw, bare in pairs]
                    ratio[key.replace("_ms", "_added_ms")] = statistics.median(added)
            for key in keys:
                each = [tw[key] / bare[key] for tw, bare in pairs if tw[key] and bare[key]]
                ratio[key] = statistics.median(each) if each else None
                ratio[f"{key}_each"] = each
            ratios.append(ratio)
    return {
        "machine": code,
        "allocator": ", ".join(sorted({r["allocator"] for r in rows if "allocator" in r})),
        # Others may commit while this runs; the servers started at different times.
        "code_changed_during_run": machine()["commit"] != code["commit"],
        "workers": args.workers,
        "protocol": args.protocol,
        "max_total_tokens": args.max_total_tokens,
        "paced_rate": args.paced_rate,
        "paced_tokens": args.paced_tokens,
        "runs": rows,
        "ratios": ratios,
    }


def machine() -> dict[str, Any]:
    """The machine, and which tokenwire code the server subprocesses run."""
    # The subprocesses inherit our environment (PYTHONPATH included): same lookup.
    spec = importlib.util.find_spec("tokenwire")
    source = Path(spec.origin).parent if spec and spec.origin else REPO

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", *cmd], cwd=source, capture_output=True, text=True, check=False
        ).stdout.strip()

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "python": sys.version.split()[0],
        "tokenwire_source": str(source),
        "commit": git("rev-parse", "--short", "HEAD"),
        # Say if the server's code was not exactly the commit's.
        "server_dirty": bool(git("status", "--porcelain", ".")),
    }


def code_note(m: dict[str, Any], changed: bool = False) -> str:
    return (
        f"server code: commit {m['commit']}"
        + (" + uncommitted changes" if m["server_dirty"] else "")
        + (" (a new commit landed during the run)" if changed else "")
    )


def summary_line(r: dict[str, Any]) -> str:
    text = (
        f"{r['mode']:6} {r['server']:9} n={r['sessions']:<6} tokens/s {r['tokens_per_s']:9.0f} "
        f"frames/s {r['frames_per_s']:9.0f} TTFT p50/p99 {fmt(r['ttft_p50_ms'])}/"
        f"{fmt(r['ttft_p99_ms'])} ms"
    )
    if r["mode"] == "paced":
        text += f" lag p50/p99 {fmt(r['lag_p50_ms'])}/{fmt(r['lag_p99_ms'])} ms"
    return text + (
        f" cores srv/cli/other {r['server_cores']:.2f}/{r['client_cores']:.2f}/"
        f"{r['other_cores']:.2f}"
        f" full GCs {gcs(r)} connect {r['connect']['connect_all_s']:.1f} s failed {r['failed']}"
    )


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(report: dict[str, Any]) -> str:
    rows = report["runs"]
    m = report["machine"]
    lines = [
        f"Scripted engine (no model) against a bare `websockets` server sending the same "
        f"{report['protocol']} frames. {m['cpus']} cores ({m['cpu']}), shared by the server "
        f"(one event loop) and {report['workers']} client processes; "
        f"{code_note(m, report['code_changed_during_run'])}; tokenwire's allocator "
        f"{report.get('allocator') or 'pymalloc'}. "
        "Cores = CPU seconds / wall seconds during the measured run; `other` is everything "
        "else on the machine meanwhile (other users' processes). GCs: garbage collections "
        "during the measured run, each a stop-the-world pause of that process: the "
        "server's full ones (generation 2: how many, the longest) and young ones "
        "(generations 0 and 1: how many, their total), the clients' full ones.",
        "",
    ]
    retried = [r for r in rows if r["discarded_attempts"]]
    if retried:
        lines += [
            f"{len(retried)} of {len(rows)} runs were measured again on the same sessions "
            f"because other processes took more than {BUSY} cores during the first attempt "
            "(kept in the JSON as `discarded_attempts`; their failures are counted).",
            "",
        ]
    busy = [r for r in rows if r["other_cores"] > BUSY]
    if busy:
        lines += [
            f"**Warning**: other processes used more than {BUSY} cores during "
            f"{len(busy)} of {len(rows)} runs (up to {max(r['other_cores'] for r in busy):.2f}); "
            "those numbers understate both servers.",
            "",
        ]
    if any(r["mode"] == "max" for r in rows):
        lines += [
            f"**max**: engine flat out, {report['max_total_tokens']:,} tokens in all per level, "
            "every response started at once (TTFT here is mostly queueing). `limited by`: "
            f"`server` when the server process used at least {SATURATED} of a core, else the "
            "clients sharing the cores were the limit, and that server's ceiling is higher "
            "than shown.",
            "",
            "| sessions | tokens/session | server | tokens/s | frames/s | TTFT p50 (ms) | "
            "TTFT p99 (ms) | server cores | client cores | other cores | limited by | "
            "GCs: server full (longest ms), young (all ms); clients full (longest ms) | "
            "peak RSS (MiB) | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += _rows(report, "max", max_row)
    if any(r["mode"] == "paced" for r in rows):
        lines += [
            "",
            f"**paced**: {report['paced_rate']:g} tokens/s per response, "
            f"{report['paced_tokens']} tokens, starts spread over one token interval. Lag = "
            "token arrival - (request sent + (i+1)/rate), over every token.",
            "",
            "| sessions | offered tokens/s | server | delivered tokens/s | lag p50 (ms) | "
            "lag p99 (ms) | lag max (ms) | TTFT p50 (ms) | TTFT p99 (ms) | server cores | "
            "client cores | other cores | GCs: server full (longest ms), young (all ms); "
            "clients full (longest ms) | "
            "peak RSS (MiB) | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += _rows(report, "paced", paced_row)
    return "\n".join(lines) + "\n"


def _rows(report: dict[str, Any], mode: str, render: Any) -> list[str]:
    """Per level: each server's median run (by tokens/s, or by lag p50 when
    paced), then the median of the paired ratios."""
    out = []
    key = "tokens_per_s" if mode == "max" else "lag_p50_ms"
    for ratio in (x for x in report["ratios"] if x["mode"] == mode):
        n = ratio["sessions"]
        for kind in ("tokenwire", "bare"):
            runs = sorted(
                (
                    x
                    for x in report["runs"]
                    if (x["mode"], x["server"], x["sessions"]) == (mode, kind, n)
                ),
                key=lambda x: x[key] if x[key] is not None else math.inf,
            )
            out.append(render(runs[(len(runs) - 1) // 2]))
        out.append(render(ratio, ratio=True))
    return out


def spread(ratio: dict[str, Any], key: str) -> str:
    """ " [min-max]" of the paired ratios behind a median, when there are several."""
    each = ratio.get(f"{key}_each") or []
    return f" [{min(each):.2f}-{max(each):.2f}]" if len(each) > 1 else ""


def gcs(r: dict[str, Any]) -> str:
    # Young collections: not in reports from before they were logged.
    young = ""
    if "young_gc_count" in r:
        young = f", {r['young_gc_count']} ({r['young_gc_total_ms']:.0f})"
    return (
        f"{r['full_gc_count']} ({r['full_gc_max_ms']:.0f}){young}; "
        f"{r['client_full_gc_count']} ({r['client_full_gc_max_ms']:.0f})"
    )


def max_row(r: dict[str, Any], ratio: bool = False) -> str:
    if ratio:
        return (
            f"| {r['sessions']:,} | | **tokenwire/bare** | **{fmt(r['tokens_per_s'], 2)}x**"
            f"{spread(r, 'tokens_per_s')} | "
            f"**{fmt(r['frames_per_s'], 2)}x** | {fmt(r['ttft_p50_ms'], 2)}x | "
            f"{fmt(r['ttft_p99_ms'], 2)}x | | | | | | | |"
        )
    if r["other_cores"] > BUSY:
        limit = "other processes"
    else:
        limit = "server" if r["server_cores"] >= SATURATED else "clients"
    return (
        f"| {r['sessions']:,} | {r['tokens_per_session']} | {r['server']} | "
        f"{r['tokens_per_s']:,.0f} | {r['frames_per_s']:,.0f} | {fmt(r['ttft_p50_ms'])} | "
        f"{fmt(r['ttft_p99_ms'])} | {r['server_cores']:.2f} | {r['client_cores']:.2f} | "
        f"{r['other_cores']:.2f} | {limit} | {gcs(r)} | {r['server_peak_rss_mib']:.0f} | "
        f"{r['failed']} |"
    )


def paced_row(r: dict[str, Any], ratio: bool = False) -> str:
    if ratio:
        return (
            f"| {r['sessions']:,} | | **tokenwire/bare** | {fmt(r['tokens_per_s'], 2)}x | "
            f"**{fmt(r['lag_p50_ms'], 2)}x**{spread(r, 'lag_p50_ms')} "
            f"({r['lag_p50_added_ms']:+.1f} ms) | "
            f"**{fmt(r['lag_p99_ms'], 2)}x** ({r['lag_p99_added_ms']:+.1f} ms) | | "
            f"{fmt(r['ttft_p50_ms'], 2)}x | {fmt(r['ttft_p99_ms'], 2)}x | | | | | | |"
        )
    return (
        f"| {r['sessions']:,} | {r['offered_tokens_per_s']:,.0f} | {r['server']} | "
        f"{r['tokens_per_s']:,.0f} | {fmt(r['lag_p50_ms'])} | {fmt(r['lag_p99_ms'])} | "
        f"{fmt(r['lag_max_ms'])} | {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | "
        f"{r['server_cores']:.2f} | {r['client_cores']:.2f} | {r['other_cores']:.2f} | "
        f"{gcs(r)} | {r['server_peak_rss_mib']:.0f} | {r['failed']} |"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("max", "paced") if any(r["mode"] == m for r in report["runs"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        sessions = sorted({r["sessions"] for r in report["runs"] if r["mode"] == mode})
        width = 0.38
        for offset, kind in ((-width / 2, "tokenwire"), (width / 2, "bare")):
            rows = [
                next(
                    r
                    for r in report["runs"]
                    if (r["mode"], r["server"], r["sessions"]) == (mode, kind, n)
                )
                for n in sessions
            ]
            xs = [i + offset for i in range(len(sessions))]
            if mode == "max":
                ax.bar(xs, [r["tokens_per_s"] for r in rows], width, label=kind)
            else:
                ax.bar(xs, [r["lag_p99_ms"] for r in rows], width, label=f"{kind} p99")
                ax.scatter(xs, [r["lag_p50_ms"] for r in rows], color="black", s=12, zorder=3)
        ax.set_xticks(range(len(sessions)), [f"{n:,}" for n in sessions])
        ax.set_xlabel("concurrent sessions")
        if mode == "max":
            ax.set_title("max: tokens/s delivered (higher is better)", fontsize=10)
        else:
            ax.set_yscale("log")
            ax.set_title(
                f"paced {report['paced_rate']:g} tok/s: token lag, ms (dots p50)", fontsize=10
            )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument(
        "--repeats", type=int, default=3, help="paired runs per level, in turns; ratios: median"
    )
    parser.add_argument("--workers", type=int, default=2, help="client processes")
    parser.add_argument("--modes", nargs="+", choices=["max", "paced"], default=["max", "paced"])
    parser.add_argument("--max-total-tokens", type=int, default=100_000)
    parser.add_argument("--paced-rate", type=float, default=1.0)
    parser.add_argument("--paced-tokens", type=int, default=10)
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="msgpack")
    parser.add_argument(
        "--connect-concurrency", type=int, default=32, help="handshakes in flight per worker"
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=15,
        help="seconds to wait, before each measurement, for other processes to go idle",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="measure again when other processes took more than 0.25 cores meanwhile",
    )
    add_allocator_option(parser, "gateway_ceiling")
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        import uvloop

        uvloop.run(bare_serve(args.serve_bare, args.rate))
        return
    trace_gc()
    report = run(args)
    RESULTS.mkdir(exist_ok=True)
    name = results_name("gateway_ceiling", args.allocator)
    plot(report, RESULTS / f"{name}.png")
    print()
    save_results(name, report, table(report))


if __name__ == "__main__":
    main()
