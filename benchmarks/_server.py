"""Start a `tokenwire serve` subprocess for a benchmark and wait until it is ready."""

from __future__ import annotations

import argparse
import asyncio
import json
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

SCRATCH = Path(__file__).resolve().parent / "scratch"
RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tokenwire_server(*args: str, timeout: float = 600) -> Iterator[str]:
    """Yields the ws:// URL of a fresh server run with `args`."""
    port = free_port()
    SCRATCH.mkdir(exist_ok=True)
    log = open(SCRATCH / f"server-{port}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenwire", "serve", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited; see {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if json.loads(r.read()).get("ready"):
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {timeout} s; see {log.name}")
            time.sleep(0.5)
        yield f"ws://127.0.0.1:{port}/v1/realtime"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


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
        with tokenwire_server("--engine", "vllm") as url:
            report = asyncio.run(run(url, args.trials))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    return report
