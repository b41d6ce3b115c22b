"""The per-token path alone, in one process: engine delta -> frame written, on
a fake transport. CPU microseconds per token, without sockets, clients or
other processes, so two versions of the code compare within a few percent.

    .venv/bin/python -m benchmarks.token_path [--dialect msgpack json openai]
        [--sessions 100] [--tokens 200] [--rounds 5] [--log-level warning]
        [--against SERVER_DIR]

Each round makes `--sessions` `SessionRuntime`s (tokenwire's own, as the server
makes them), attaches each to a fake socket (a real websockets protocol in the
OPEN state; a transport that takes the bytes and never buffers), then times one
`response.create` of `--tokens` tokens (ignore_eos) on every session: parsing
the request, the response's task, each delta through the session, telemetry,
delivery, the log and the framing, and response.done. The engine yields
prepared `EngineDelta`s without awaiting (the scripted engine's per-token
`asyncio.sleep(0)` is left out: it is the same for any version).

`--against DIR` runs every round twice, this tree and the tokenwire package in
DIR (e.g. a baseline worktree's `server/`), alternating which goes first, each
in a fresh subprocess, and reports the paired ratios (this / DIR). Small
responses (`--sessions 2000 --tokens 10`) weigh the per-response cost, as the
gateway benchmark's 10,000-session level does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

SUBPROTOCOLS = {
    "msgpack": "tokenwire.v1.msgpack",
    "json": "tokenwire.v1.json",
    "openai": "realtime",
}


class _Transport:
    """Takes every write at once: the fast path's buffer is always empty."""

    def __init__(self) -> None:
        self.bytes = 0
        self.writes = 0

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16384, 65536)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)

    def writelines(self, chunks: list[bytes]) -> None:
        self.writes += 1
        self.bytes += len(b"".join(chunks))


class _Socket:
    """What delivery touches of a websockets ServerConnection."""

    remote_address = ("127.0.0.1", 0)

    def __init__(self, subprotocol: str) -> None:
        from websockets.protocol import State
        from websockets.server import ServerProtocol

        self.protocol = ServerProtocol()
        self.protocol.state = State.OPEN
        self.transport = _Transport()
        self.subprotocol = subprotocol


class _Engine:
    """Deltas as the scripted engine makes them, without its per-token sleep."""

    name = "token_path"

    def __init__(self) -> None:
        from tokenwire.engines.base import EngineCapabilities

        self.capabilities = EngineCapabilities(resume_from_token_ids=True)

    def preflight(self, request: Any) -> None:
        return None

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        from tokenwire.engines.base import EngineDelta

        n = request.max_output_tokens
        for i in range(n):
            yield EngineDelta(
                f" t{i}",
                1,
                "length" if i == n - 1 else None,
                5 if i == 0 else None,
                0 if i == 0 else None,
                None,
                [i],
            )


async def _round(dialect: str, sessions: int, tokens: int) -> dict[str, float]:
    from tokenwire.config import ServerConfig
    from tokenwire.runtime.session_runtime import SessionRuntime

    try:
        from tokenwire.server.collector import COLLECTOR

        freeze_heap, opened = COLLECTOR.freeze, COLLECTOR.session_opened
    except ImportError:  # an --against tree from before the collector's thresholds
        try:
            from tokenwire.server.app import freeze_heap
        except ImportError:  # from before it was public
            from tokenwire.server.app import _freeze_heap  # type: ignore[attr-defined]

            def freeze_heap() -> None:
                _freeze_heap(None)

        def opened() -> None:
            pass

    from tokenwire.wire import dialect_for

    sub = SUBPROTOCOLS[dialect]
    config = ServerConfig(engine="scripted", log_level="warning")
    engine = _Engine()
    runtimes, sockets = [], []
    for _ in range(sessions):
        rt = SessionRuntime(engine, config, subprotocol=sub)  # type: ignore[arg-type]
        ws = _Socket(sub)
        rt.attach(ws, dialect_for(sub))  # type: ignore[arg-type]
        rt.go_live()
        opened()  # as the server's registry does
        runtimes.append(rt)
        sockets.append(ws)
    await asyncio.sleep(0)  # the writers start and wait
    request = {"type": "response.create", "response": {"ignore_eos": True}}
    request["response"]["max_output_tokens"] = tokens
    frame: str | bytes
    if dialect == "msgpack":
        import msgpack

        frame = msgpack.packb(request)
    else:
        frame = json.dumps(request)
    # The server's collector settings once its engine is up: with Python's
    # defaults, young collections that scan the sessions made above would be
    # most of what is measured.
    freeze_heap()
    cpu, wall = time.process_time(), time.perf_counter()
    for rt in runtimes:
        rt.receive(frame)
    pending = [t for rt in runtimes for t in rt.tasks.values()]
    await asyncio.gather(*pending)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    written = sum(ws.transport.bytes for ws in sockets)
    direct = sum(rt.delivery.sent_directly for rt in runtimes)
    for rt in runtimes:
        await rt.end()
    total = sessions * tokens
    return {
        "us_per_token_cpu": cpu / total * 1e6,
        "us_per_token_wall": wall / total * 1e6,
        "bytes_per_token": written / total,
        "events_sent_directly": direct,
    }


def measure(dialect: str, sessions: int, tokens: int, log_level: str) -> dict[str, float]:
    import uvloop

    from tokenwire import logs

    logs.configure(log_level)  # as `tokenwire serve` does; log lines go to stderr
    uvloop.install()
    return asyncio.run(_round(dialect, sessions, tokens))


def _child(args: argparse.Namespace, server_dir: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if server_dir:
        env["PYTHONPATH"] = server_dir + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", args.dialect]
    cmd += ["--sessions", str(args.sessions), "--tokens", str(args.tokens)]
    cmd += ["--log-level", args.log_level]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dialect", choices=sorted(SUBPROTOCOLS), default="msgpack")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--log-level", default="warning", help="the server's (gateway_ceiling runs it at warning)"
    )
    parser.add_argument("--against", metavar="SERVER_DIR", help="another tokenwire package's dir")
    parser.add_argument("--child", metavar="DIALECT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.sessions, args.tokens, args.log_level)))
        return
    label = f"{args.dialect}, {args.sessions} sessions x {args.tokens} tokens"
    if not args.against:
        runs = [_child(args, None) for _ in range(args.rounds)]
        cpu = [r["us_per_token_cpu"] for r in runs]
        print(f"{label}: {statistics.median(cpu):.2f} us/token CPU (rounds: ", end="")
        print(", ".join(f"{c:.2f}" for c in cpu) + ")")
        return
    ours, theirs, ratios = [], [], []
    for i in range(args.rounds):
        order = [None, args.against] if i % 2 == 0 else [args.against, None]
        got = {side: _child(args, side)["us_per_token_cpu"] for side in order}
        ours.append(got[None])
        theirs.append(got[args.against])
        ratios.append(got[None] / got[args.against])
        print(f"round {i + 1}: this {got[None]:.2f}, other {got[args.against]:.2f} us/token")
    print(
        f"{label}: this {statistics.median(ours):.2f} vs {statistics.median(theirs):.2f} "
        f"us/token CPU; paired ratio median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
