"""What each wire dialect costs the server per token: tokenwire v1 (msgpack and
JSON) and the OpenAI Realtime GA dialect, on one scripted-engine server.

    .venv/bin/python -m benchmarks.dialects [--sessions 50] [--tokens 400] [--rounds 3]

One `tokenwire serve --engine scripted --scripted-tokens-per-s 0` process.
Each round runs every dialect once, in turn (A B C A B C ...): `--sessions`
raw websockets clients connect with that dialect's subprotocol (none for
OpenAI's, as its SDKs do) and each streams one response of `--tokens` tokens
(`ignore_eos`, `conversation: "none"`), all at once. Measured on the server
process: CPU seconds per 1,000 delivered tokens (the scheduler's counters, so the clients,
which run in this process, do not count), and on the wire: frames and bytes
per token. Every response is checked: status completed, the exact text.

The GA dialect sends more per token than tokenwire v1: every delta carries
`event_id`, `response_id`, `item_id`, `output_index` and `content_index`, and
each response adds its lifecycle frames (output_item, content_part).

Writes results/dialects.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import msgpack
from websockets.asyncio.client import connect

from ._server import save_results, threads_cpu_seconds, tokenwire_process

DIALECTS = {
    "tokenwire.v1.msgpack": ["tokenwire.v1.msgpack"],
    "tokenwire.v1.json": ["tokenwire.v1.json"],
    "openai.realtime (GA)": [],
}


def create(dialect: str, tokens: int) -> dict[str, Any]:
    content: Any = "go"
    if dialect.startswith("openai"):
        content = [{"type": "input_text", "text": "go"}]
    item = {"type": "message", "role": "user", "content": content}
    params = {"conversation": "none", "input": [item], "max_output_tokens": tokens}
    return {"type": "response.create", "response": {**params, "ignore_eos": True}}


def decode(frame: str | bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)


async def session(url: str, dialect: str, tokens: int, go: asyncio.Event) -> tuple[int, int, str]:
    """One client: frames and bytes it received for its response, and its text."""
    protocols = DIALECTS[dialect]
    async with connect(url, subprotocols=protocols or None, max_size=None) as ws:  # type: ignore[arg-type]
        await ws.recv()  # session.created
        await go.wait()
        await ws.send(json.dumps(create(dialect, tokens)))
        frames = size = 0
        text: list[str] = []
        while True:
            frame = await ws.recv()
            frames += 1
            size += len(frame)
            event = decode(frame)
            if event["type"] == "response.output_text.delta":
                text.append(event["delta"])
            elif event["type"] == "response.done":
                status = event["response"]["status"]
                if status != "completed":
                    raise RuntimeError(f"{dialect}: response {status}")
                return frames, size, "".join(text)
            elif event["type"] == "error":
                raise RuntimeError(f"{dialect}: {event['error']}")


async def one_run(url: str, pid: int, dialect: str, args: argparse.Namespace) -> dict[str, Any]:
    go = asyncio.Event()
    clients = [
        asyncio.create_task(session(url, dialect, args.tokens, go)) for _ in range(args.sessions)
    ]
    await asyncio.sleep(0.5)  # every client connected and read session.created
    cpu0, t0 = threads_cpu_seconds(pid), time.perf_counter()
    go.set()
    results = await asyncio.gather(*clients)
    wall, cpu = time.perf_counter() - t0, threads_cpu_seconds(pid) - cpu0
    expected = "".join(f" t{i}" for i in range(args.tokens))
    if any(text != expected for _, _, text in results):
        raise RuntimeError(f"{dialect}: a response's text differs from the engine's")
    tokens = args.sessions * args.tokens
    return {
        "server_cpu_ms_per_1k_tokens": cpu / tokens * 1e6,
        "frames_per_token": sum(f for f, _, _ in results) / tokens,
        "bytes_per_token": sum(b for _, b, _ in results) / tokens,
        "tokens_per_s": tokens / wall,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in DIALECTS}
    with tokenwire_process(
        "--engine", "scripted", "--scripted-tokens-per-s", "0", log_name="dialects.log"
    ) as (url, proc):
        for dialect in DIALECTS:  # warm-up, not counted
            await one_run(url, proc.pid, dialect, argparse.Namespace(sessions=4, tokens=20))
        for _ in range(args.rounds):
            for dialect in DIALECTS:
                runs[dialect].append(await one_run(url, proc.pid, dialect, args))
                print(dialect, {k: round(v, 2) for k, v in runs[dialect][-1].items()})
    summary = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    return {"args": vars(args), "summary": summary, "runs": runs}


def markdown(report: dict[str, Any]) -> str:
    args, summary = report["args"], report["summary"]
    base = summary["tokenwire.v1.msgpack"]["server_cpu_ms_per_1k_tokens"]
    lines = [
        f"Server CPU per token by dialect: scripted engine at full speed, {args['sessions']} "
        f"sessions x {args['tokens']} tokens at once, medians of {args['rounds']} rounds "
        "(dialects alternating).",
        "",
        "| dialect | server CPU ms / 1k tokens | vs v1 msgpack | frames / token | bytes / token "
        "| tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        cpu = s["server_cpu_ms_per_1k_tokens"]
        lines.append(
            f"| {name} | {cpu:.1f} | {cpu / base:.2f}x | {s['frames_per_token']:.3f} | "
            f"{s['bytes_per_token']:.0f} | {s['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    save_results("dialects", report, markdown(report))


if __name__ == "__main__":
    main()
