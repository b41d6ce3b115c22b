"""tokenwire (WebSocket) against vLLM's own OpenAI server (SSE), side by side.

    .venv/bin/python -m benchmarks.vs_vllm [--concurrency 1 8 32] [--tokens 64]

Same machine, same SmolLM2 checkpoint, float32, max_model_len 2048,
enforce_eager, 1 GiB KV cache, prefix caching on both, the same prompts,
temperature 0 and ignore_eos for a fixed length. The two servers run one
after the other (never together: 2 cores), each warmed up first. Clients hold
their connection open before the clock starts; TTFT is request sent -> first
token received, ITL the gaps between tokens, tokens/s the batch's output
tokens over its wall time.
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
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from tokenwire.client import connect
from tokenwire.models import resolve_model

from ._server import RESULTS, SCRATCH, free_port, tokenwire_server


def prompt(i: int) -> str:
    return f"Write a short story about a lighthouse keeper, version {i}."


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def tokenwire_one(url: str, i: int, tokens: int, start: asyncio.Event) -> dict[str, Any]:
    async with await connect(url) as tw:
        await tw.add_message(prompt(i))
        await start.wait()
        sent = time.perf_counter()
        response = await tw.create_response(
            temperature=0, max_output_tokens=tokens, ignore_eos=True
        )
        stamps = [time.perf_counter() async for _ in response.text_deltas()]
        done = await response.done()
    return {"sent": sent, "stamps": stamps, "tokens": done["usage"]["output_tokens"]}


async def vllm_one(
    base: str, http: aiohttp.ClientSession, i: int, tokens: int, start: asyncio.Event
) -> dict[str, Any]:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    await start.wait()
    sent = time.perf_counter()
    stamps: list[float] = []
    count = 0
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps, "tokens": count}


def summarise(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttfts = [(r["stamps"][0] - r["sent"]) * 1000 for r in results]
    itls = [
        (b - a) * 1000 for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)
    ]
    return {
        "requests": len(results),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "itl_p50_ms": statistics.median(itls),
        "itl_p99_ms": percentile(itls, 0.99),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
    }


async def batch(one: Any, n: int) -> dict[str, Any]:
    start = asyncio.Event()
    tasks = [asyncio.create_task(one(i, start)) for i in range(n)]
    await asyncio.sleep(1.0)  # every client connected and waiting
    t0 = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks)
    return summarise(results, time.perf_counter() - t0)


async def run_tokenwire(url: str, levels: list[int], tokens: int) -> dict[int, Any]:
    await batch(lambda i, s: tokenwire_one(url, 10_000 + i, tokens, s), 2)  # warm-up
    return {
        c: await batch(lambda i, s, c=c: tokenwire_one(url, c * 100 + i, tokens, s), c)
        for c in levels
    }


async def run_vllm(base: str, levels: list[int], tokens: int) -> dict[int, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        await batch(lambda i, s: vllm_one(base, http, 10_000 + i, tokens, s), 2)
        return {
            c: await batch(lambda i, s, c=c: vllm_one(base, http, c * 100 + i, tokens, s), c)
            for c in levels
        }


def vllm_server(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    SCRATCH.mkdir(exist_ok=True)
    log = open(SCRATCH / "vllm-openai-server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "smollm2",
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1"),
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited; see {log.name}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM server not ready")
        time.sleep(0.5)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(c) for c in report["tokenwire"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.38
    xs = range(len(levels))
    for offset, side in ((-width / 2, "tokenwire"), (width / 2, "vllm")):
        a.bar(
            [x + offset for x in xs],
            [report[side][str(c)]["tokens_per_s"] for c in levels],
            width,
            label=side,
        )
        b.bar(
            [x + offset for x in xs],
            [report[side][str(c)]["ttft_p50_ms"] for c in levels],
            width,
            label=side,
        )
    for ax, title in (
        (a, "aggregate tokens/s (higher is better)"),
        (b, "TTFT p50, ms (lower is better)"),
    ):
        ax.set_xticks(list(xs), [f"c={c}" for c in levels])
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = str(resolve_model(None))
    with tokenwire_server("--engine", "vllm", "--log-level", "warning") as url:
        tw = asyncio.run(run_tokenwire(url, args.concurrency, args.tokens))
    proc, base = vllm_server(model)
    try:
        vl = asyncio.run(run_vllm(base, args.concurrency, args.tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report = {
        "tokens": args.tokens,
        "tokenwire": {str(c): v for c, v in tw.items()},
        "vllm": {str(c): v for c, v in vl.items()},
    }
    report["ratios"] = {
        str(c): {
            "tokens_per_s": tw[c]["tokens_per_s"] / vl[c]["tokens_per_s"],
            "ttft_p50": tw[c]["ttft_p50_ms"] / vl[c]["ttft_p50_ms"],
        }
        for c in args.concurrency
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vs_vllm.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / "vs_vllm.png")
    lines = [
        f"{args.tokens} tokens per request, ignore_eos, temperature 0; SmolLM2-135M float32 on "
        "2 CPU cores.",
        "",
        "| concurrency | server | tokens/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for c in args.concurrency:
        for side, rows in (("tokenwire (WS)", tw), ("vLLM OpenAI (SSE)", vl)):
            r = rows[c]
            lines.append(
                f"| {c} | {side} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |"
            )
        ratio = report["ratios"][str(c)]
        lines.append(
            f"| {c} | **ratio tw/vLLM** | **{ratio['tokens_per_s']:.2f}x** | "
            f"**{ratio['ttft_p50']:.2f}x** | | |"
        )
    (RESULTS / "vs_vllm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
