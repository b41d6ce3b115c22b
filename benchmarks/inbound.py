"""What a client frame costs the server's event loop, by the frame's shape:
decoding, the value checks and the session's handling, in one process.

    .venv/bin/python -m benchmarks.inbound [--rounds 5] [--against SERVER_DIR]

Each shape is one frame a client may send, as JSON (tokenwire.v1.json) and
msgpack (tokenwire.v1.msgpack) where both apply: a small `session.update`, a
`conversation.item.create` of 1 MiB of text (ASCII and not), and two hostile
frames of about 1 MiB made of tiny values (the session refuses them, after
decoding). Measured: process CPU per frame, through the dialect's `parse` and
`Session.receive_client_event`, a fresh session per large frame, with the
garbage collector set as the server sets it.

`--against DIR` runs every round twice, this tree and the tokenwire package
in DIR (e.g. a worktree's `server/`), in fresh subprocesses, alternating
which goes first, and reports the paired ratios (this / DIR).

The last line bounds one connection: a connection is read at most at the
default `--max-inbound-bytes-per-s`, each frame charged its size or 1 KiB,
whichever is more, so the costliest shape's CPU per charged byte times that
rate is the share of a core one client can make the loop spend on its frames.
Writes results/inbound.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._compare import code_state
from ._server import save_results

MiB = 1 << 20
SUBPROTOCOLS = {"JSON": "tokenwire.v1.json", "msgpack": "tokenwire.v1.msgpack"}


def _shapes() -> dict[str, tuple[dict[str, Any], int]]:
    """name -> (event, repetitions)."""
    text = "word " * (MiB // 5)
    accented = "déjà vu " * (MiB // 10)  # 8 characters, 10 bytes
    return {
        "session.update, small": (
            {
                "type": "session.update",
                "session": {"instructions": "Be brief.", "temperature": 0.2},
            },
            20_000,
        ),
        "item of 1 MiB ASCII text": (
            {"type": "conversation.item.create", "item": {"role": "user", "content": text}},
            40,
        ),
        "item of 1 MiB accented text": (
            {"type": "conversation.item.create", "item": {"role": "user", "content": accented}},
            40,
        ),
        "hostile: 1 MiB of tiny lists": (
            {"type": "session.update", "session": {"tools": [[0]] * (MiB // 5)}},
            5,
        ),
        "hostile: 1 MiB of floats": (
            {"type": "session.update", "session": {"tools": [1.5] * (MiB // 10)}},
            5,
        ),
        # Taken: pydantic validates every value of a tool's parameters.
        "hostile: a tool's parameters of tiny lists": (
            {
                "type": "session.update",
                "session": {"tools": [{"name": "f", "parameters": {"a": [[]] * (MiB // 3)}}]},
            },
            5,
        ),
    }


def _frame(codec: str, event: dict[str, Any]) -> str | bytes:
    if codec == "JSON":
        return json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    import msgpack

    return msgpack.packb(event, use_bin_type=True)


def measure() -> dict[str, dict[str, float]]:
    """us of CPU per frame and the frame's size, per shape and codec."""
    from tokenwire.core.session import Session
    from tokenwire.server.collector import COLLECTOR
    from tokenwire.wire import dialect_for

    COLLECTOR.freeze()  # the collector's thresholds as the server runs them
    out: dict[str, dict[str, float]] = {}
    for name, (event, reps) in _shapes().items():
        for codec, subprotocol in SUBPROTOCOLS.items():
            frame = _frame(codec, event)
            dialect = dialect_for(subprotocol)
            small = reps > 100
            sessions = [Session()] if small else [Session() for _ in range(reps)]
            started = time.process_time()
            for i in range(reps):
                session = sessions[0 if small else i]
                try:
                    obj = dialect.parse(frame)
                except Exception as err:  # a ProtocolError: the session answers it
                    session.receive_protocol_error(err)
                else:
                    session.receive_client_event(obj, checked=True)
                session.events_to_send()
            spent = time.process_time() - started
            out[f"{name} ({codec})"] = {"us": spent / reps * 1e6, "bytes": len(frame)}
    return out


def _child(server_dir: str | None) -> dict[str, dict[str, float]]:
    env = dict(os.environ)
    if server_dir:
        env["PYTHONPATH"] = server_dir + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks.inbound", "--child"]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _report(runs: list[dict[str, Any]], against: str | None) -> tuple[dict[str, Any], str]:
    from tokenwire.config import ServerConfig
    from tokenwire.runtime.ws import FRAME_MIN_CHARGE

    rate = ServerConfig().max_inbound_bytes_per_s
    shapes = list(runs[0]["this"])
    head = "| frame | size | CPU per frame (ms) | CPU per MiB charged (ms) |"
    rule = "|---|---|---|---|"
    if against:
        head += " before (ms) | this / before, paired |"
        rule += "---|---|"
    lines = [head, rule]
    worst = 0.0
    rows = {}
    for shape in shapes:
        us = statistics.median(r["this"][shape]["us"] for r in runs)
        size = runs[0]["this"][shape]["bytes"]
        per_mib = us / max(size, FRAME_MIN_CHARGE) * MiB
        worst = max(worst, per_mib)
        rows[shape] = {"us": us, "bytes": size, "us_per_mib": per_mib}
        size_text = f"{size / MiB:.2f} MiB" if size > 10_000 else f"{size} B"
        line = f"| {shape} | {size_text} | {us / 1e3:.3f} | {per_mib / 1e3:.1f} |"
        if against:
            before = statistics.median(r["other"][shape]["us"] for r in runs)
            paired = statistics.median(
                r["this"][shape]["us"] / r["other"][shape]["us"] for r in runs
            )
            rows[shape] |= {"before_us": before, "paired_ratio": paired}
            line += f" {before / 1e3:.3f} | {paired:.3f}x |"
        lines.append(line)
    share = worst / 1e6 * rate / MiB
    state = code_state()
    dirty = " with uncommitted changes" if state["uncommitted_server_files"] else ""
    vs = ""
    if against:
        run = ["git", "-C", against, "rev-parse", "--short", "HEAD"]
        base = subprocess.run(run, capture_output=True, text=True).stdout.strip()
        vs = f", before: commit {base or against}"
    lines += [
        "",
        f"tokenwire at commit {state['commit']}{dirty}{vs}. "
        f"Median of {len(runs)} rounds, process CPU through the dialect's parse and the "
        "session. At the default --max-inbound-bytes-per-s "
        f"({rate / MiB:g} MiB/s), one connection can make the loop spend at most "
        f"{share:.0%} of a core on its frames (the costliest shape per MiB charged).",
    ]
    report = {
        "code": state,
        "rounds": runs,
        "rows": rows,
        "against": against,
        "one_connection_core_share": share,
    }
    return report, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", metavar="SERVER_DIR", help="another tokenwire package's dir")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    runs = []
    for i in range(args.rounds):
        if args.against:
            order = [None, args.against] if i % 2 == 0 else [args.against, None]
            got = {side: _child(side) for side in order}
            runs.append({"this": got[None], "other": got[args.against]})
        else:
            runs.append({"this": _child(None)})
        print(f"round {i + 1} done", file=sys.stderr)
    report, text = _report(runs, args.against)
    save_results("inbound", report, text)


if __name__ == "__main__":
    main()
