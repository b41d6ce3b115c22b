"""Start a `tokenwire serve` subprocess for a benchmark and wait until it is ready."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Last among a tokenwire command's flags (vLLM takes all after `--`): the
# settings these benchmarks have always used, and give vLLM's own server too.
# A 2048-token context, and eager mode: vLLM's CPU default compiles with
# inductor, about 80 s more per start here.
VLLM_SETTINGS = ("--max-model-len", "2048", "--", "--enforce-eager")

SCRATCH = Path(__file__).resolve().parent / "scratch"
RESULTS = Path(__file__).resolve().parent / "results"


def save_results(name: str, report: dict[str, Any], text: str, directory: Path = RESULTS) -> None:
    """A benchmark's results: NAME.json (every sample) and NAME.md (its table,
    which `benchmarks.readme` copies), and the table on stdout."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(report, indent=2))
    (directory / f"{name}.md").write_text(text)
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tokenwire_server(*args: str, timeout: float = 600) -> Iterator[str]:
    """Yields the ws:// URL of a fresh server run with `args`."""
    with tokenwire_process(*args, timeout=timeout) as (url, _):
        yield url


def run_on_vllm(
    description: str,
    name: str,
    run: Callable[[str, int], Coroutine[Any, Any, dict[str, Any]]],
) -> dict[str, Any]:
    """Parse --url/--trials, run against that server or a fresh vLLM one, and
    save the report as results/NAME.json."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="an already running tokenwire server")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    if args.url:
        report = asyncio.run(run(args.url, args.trials))
    else:
        with tokenwire_server("--engine", "vllm", *VLLM_SETTINGS) as url:
            report = asyncio.run(run(url, args.trials))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    return report


@contextmanager
def server_process(
    cmd: list[str],
    log_name: str,
    ready: Callable[[], bool],
    *,
    what: str = "server",
    timeout: float = 600,
    poll_s: float = 0.2,
    stop_timeout: float = 30,
    **popen: Any,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `cmd` with its output in SCRATCH/`log_name`, yield its process once
    `ready()` is true, and stop it afterwards: SIGTERM, then SIGKILL after
    `stop_timeout` (10k sessions can take long to end; never leave it behind)."""
    SCRATCH.mkdir(exist_ok=True)
    log = open(SCRATCH / log_name, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited; see {log.name}")
            if ready():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready in {timeout} s; see {log.name}")
            time.sleep(poll_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def http_ok(url: str, check: Callable[[Any], bool] = lambda _: True) -> bool:
    """Whether GET `url` answers 200 and `check` likes its body; False while
    the server is not up yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200 and check(r.read())
    except (OSError, ValueError):
        return False


@contextmanager
def tokenwire_process(
    *args: str,
    log_name: str | None = None,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yields the ws:// URL of a fresh server run with `args` (and `env` added
    to this process's environment), and its process (for its pid: RSS, CPU time)."""
    port = free_port()
    with server_process(
        [sys.executable, "-m", "tokenwire", "serve", "--port", str(port), *args],
        log_name or f"server-{port}.log",
        lambda: http_ok(
            f"http://127.0.0.1:{port}/readyz", lambda body: json.loads(body).get("ready")
        ),
        timeout=timeout,
        env={**os.environ, **env} if env else None,
    ) as proc:
        yield f"ws://127.0.0.1:{port}/v1/realtime", proc


def rss_kib(pid: int) -> int:
    """A process's resident set size, KiB; 0 once it has gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def allocator_of(pid: int) -> str:
    """The allocator a tokenwire server process runs on (`--allocator`), read
    off the libraries it mapped and the environment it was executed with."""
    if "libmimalloc" in Path(f"/proc/{pid}/maps").read_text():
        return "mimalloc"
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"PYTHONMALLOC="):
            return item.split(b"=", 1)[1].decode()
    return "pymalloc"


def add_allocator_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--allocator`: the tokenwire server's own option, for a benchmark whose
    results then go to results/<name>-<allocator>.* (`results_name`)."""
    from tokenwire.allocator import CHOICES

    parser.add_argument(
        "--allocator",
        choices=[c for c in CHOICES if c != "auto"],
        help="the server's --allocator (default: its own choice); results then go to "
        f"results/{name}-<allocator>.*",
    )


def results_name(name: str, allocator: str | None) -> str:
    return f"{name}-{allocator}" if allocator else name


def redis_ping(port: int) -> bool:
    """Whether a Redis server answers PING on `port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_process(log_name: str = "redis.log") -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yields the redis:// URL of a fresh redis-server (no persistence), and its process."""
    binary = shutil.which("redis-server")
    if not binary:
        raise RuntimeError("redis-server is missing: `make install-test` installs it")
    port = free_port()
    with server_process(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        log_name,
        lambda: redis_ping(port),
        what="redis-server",
        timeout=10,
        poll_s=0.05,
    ) as proc:
        yield f"redis://127.0.0.1:{port}/0", proc


def http_base(ws_url: str) -> str:
    """http://host:port of a tokenwire ws:// URL, for /healthz and /metrics."""
    scheme, rest = ws_url.split("://", 1)
    return ("https://" if scheme == "wss" else "http://") + rest.split("/", 1)[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its threads, not its children) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def threads_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads, from the scheduler's nanosecond
    counters (/proc tick counts are 10 ms: too coarse for one batch)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total / 1e9


def cpu_snapshot() -> tuple[float, float]:
    """(CPU seconds the machine has been busy, CPU seconds of this process and
    its live descendants). Their difference over a window is the CPU that
    *other* programs took: on 2 shared cores, that is what makes figures noisy."""
    import psutil

    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    ours = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            ours += t.user + t.system  # not children_*: reaped children are gone already
        except psutil.Error:
            pass
    return busy, ours


def other_cpu_cores(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """Cores used by other programs between two cpu_snapshot() calls."""
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


def wait_for_descendants(timeout: float = 30) -> list[int]:
    """Wait until every process this one started has exited (an engine core
    outliving its server would still hold a core); kill stragglers, by pid,
    and return their pids."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        alive = psutil.Process().children(recursive=True)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [p.pid for p in alive]
