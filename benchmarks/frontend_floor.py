"""The frontend floor: CPU per output token of vLLM's `AsyncLLM` client alone.

    .venv/bin/python -m benchmarks.frontend_floor [--concurrency 1 8 32]
        [--tokens 64] [--batches 2] [--key 0] [--stream-interval 1]

Both servers `benchmarks.vs_vllm` compares run this client in their own
process (tokenwire's vLLM engine, and vLLM's api_server): it takes the
engine's outputs off ZMQ, detokenizes them, keeps vLLM's statistics and
`vllm:*` metrics, and wakes each request's stream. Here it runs as vLLM's
api_server runs it, with vLLM's own stat loggers, and with nothing around it:
no server, no network, one task per request that only counts what it gets.
(tokenwire gives the client lighter loggers, server/tokenwire/engines/
vllm_stats.py: what it saves there counts as less work of its own.)
The same engine settings as both servers (`VLLM_SETTINGS`: float32,
a 2048-token context, eager mode, 1 GiB KV cache, prefix caching, stats on),
the same chat-templated prompts, the same batches (`measure_batch`'s prompt
numbering for round `--key`). What a server's frontend CPU is above this
floor is that server's own work.

Beside each of those batches runs a *written* one: the same, and each delta's
text is written as it comes to a loopback TCP connection that another process
reads (one connection per request slot, opened before the batches). That is
the least any server in front of this client does per token: one socket write
(the kernel's loopback delivery counts to the writer, as it does for both
servers). The two kinds of batch alternate (A B B A), so drifts of this
machine's speed hit both alike.

Prints one JSON object: per level, `frontend_us_per_token` (this process's
threads' CPU over the batches' output tokens; the engine core is a child
process and not counted), `written_us_per_token` (the same for the written
batches) and `tokens` (per kind).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from typing import Any

from ._compare import first_prompt
from ._server import threads_cpu_seconds

# The reading end of the written batches: `n` connections to `port`, each
# drained by a thread until the floor closes it.
SINK = """
import socket, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
def drain(s):
    while s.recv(1 << 16):
        pass
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
threads = [threading.Thread(target=drain, args=(s,)) for s in conns]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


async def sink(n: int) -> tuple[asyncio.Queue[asyncio.StreamWriter], subprocess.Popen[bytes]]:
    """`n` writable loopback connections whose far ends another process reads."""
    writers: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()
    all_in = asyncio.Event()

    async def accepted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.put_nowait(writer)
        if writers.qsize() == n:
            all_in.set()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader = subprocess.Popen([sys.executable, "-c", SINK, str(port), str(n)])
    await asyncio.wait_for(all_in.wait(), 60)
    server.close()
    return writers, reader


def engine_args() -> Any:
    """`VLLM_SETTINGS`, as vLLM's engine args; sets the environment they need."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import AsyncEngineArgs

    from tokenwire.models import resolve_model

    return AsyncEngineArgs(
        model=str(resolve_model(None)),
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        disable_log_stats=False,
    )


async def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from vllm.envs import enable_envs_cache
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from .vs_vllm import prompt

    llm = AsyncLLM.from_engine_args(engine_args())
    enable_envs_cache()  # as both servers do once started
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=0,
        max_tokens=args.tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=args.stream_interval if args.stream_interval > 1 else None,
    )

    writers, reader = await sink(max(args.concurrency))

    async def one(i: int, written: bool) -> int:
        # Templated per request, as a server does for each request it gets.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(i)}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        got = 0
        writer = await writers.get() if written else None
        try:
            async for out in llm.generate({"prompt_token_ids": ids}, params, f"floor-{i}"):
                got += len(out.outputs[0].token_ids)
                if writer is not None:
                    writer.write(out.outputs[0].text.encode())
        finally:
            if writer is not None:
                writers.put_nowait(writer)
        return got

    async def batch(c: int, first: int, written: bool) -> tuple[float, int]:
        before = threads_cpu_seconds(os.getpid())
        tokens = sum(await asyncio.gather(*(one(first + i, written) for i in range(c))))
        return threads_cpu_seconds(os.getpid()) - before, tokens

    try:
        await batch(max(args.concurrency), 1_000_000, True)  # warm-up, as the servers get
        out: dict[str, dict[str, float]] = {}
        for c in args.concurrency:
            cpu = {False: 0.0, True: 0.0}
            tokens = {False: 0, True: 0}
            for b in range(args.batches):
                for written in (False, True) if b % 2 == 0 else (True, False):
                    # The bare batch has the servers' prompts (measure_batch's
                    # first attempt), the written one prompts of its own.
                    first = first_prompt(args.key, b, c, attempt=int(written))
                    spent, got = await batch(c, first, written)
                    cpu[written] += spent
                    tokens[written] += got
            out[str(c)] = {
                "frontend_us_per_token": cpu[False] / tokens[False] * 1e6,
                "written_us_per_token": cpu[True] / tokens[True] * 1e6,
                "tokens": tokens[False],
            }
        return out
    finally:
        llm.shutdown()
        while not writers.empty():
            writers.get_nowait().close()
        reader.kill()  # nothing to wait for: it only drains
        reader.wait()


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    made.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    made.add_argument("--tokens", type=int, default=64)
    made.add_argument("--batches", type=int, default=2)
    made.add_argument("--key", type=int, default=0, help="the vs_vllm round whose prompts to use")
    made.add_argument("--stream-interval", type=int, default=1, help="tokens per delta")
    return made


def main() -> None:
    import uvloop  # as both servers run

    result: Any = uvloop.run(measure(parser().parse_args()))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
