"""The frontend floor: CPU per output token of vLLM's `AsyncLLM` client alone.

    .venv/bin/python -m benchmarks.frontend_floor [--concurrency 1 8 32]
        [--tokens 64] [--batches 2] [--key 0]

Both servers `benchmarks.vs_vllm` compares run this client in their own
process (tokenwire's vLLM engine, and vLLM's api_server): it takes the
engine's outputs off ZMQ, detokenizes them, keeps vLLM's statistics and
`vllm:*` metrics, and wakes each request's stream. Here it runs with nothing
around it: no server, no network, one task per request that only counts what
it gets. The same engine settings as both servers (`VLLM_SETTINGS`: float32,
a 2048-token context, eager mode, 1 GiB KV cache, prefix caching, stats on),
the same chat-templated prompts, the same batches (`measure_batch`'s prompt
numbering for round `--key`). What a server's frontend CPU is above this
floor is that server's own work.

Prints one JSON object: per level, `frontend_us_per_token` (this process's
threads' CPU over the batches' output tokens; the engine core is a child
process and not counted) and `tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from ._compare import first_prompt
from ._server import threads_cpu_seconds


async def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.envs import enable_envs_cache
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from tokenwire.models import resolve_model

    from .vs_vllm import prompt

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(resolve_model(None)),
            dtype="float32",
            max_model_len=2048,
            enforce_eager=True,
            enable_prefix_caching=True,
            disable_log_stats=False,
        )
    )
    enable_envs_cache()  # as both servers do once started
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=0,
        max_tokens=args.tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(i: int) -> int:
        # Templated per request, as a server does for each request it gets.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(i)}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        got = 0
        async for out in llm.generate({"prompt_token_ids": ids}, params, f"floor-{i}"):
            got += len(out.outputs[0].token_ids)
        return got

    async def batch(c: int, first: int) -> tuple[float, int]:
        before = threads_cpu_seconds(os.getpid())
        tokens = sum(await asyncio.gather(*(one(first + i) for i in range(c))))
        return threads_cpu_seconds(os.getpid()) - before, tokens

    try:
        await batch(max(args.concurrency), 1_000_000)  # warm-up, as the servers get
        out: dict[str, dict[str, float]] = {}
        for c in args.concurrency:
            cpu = tokens = 0.0
            for b in range(args.batches):
                # measure_batch's first attempt: the servers' prompts.
                spent, got = await batch(c, first_prompt(args.key, b, c))
                cpu, tokens = cpu + spent, tokens + got
            out[str(c)] = {"frontend_us_per_token": cpu / tokens * 1e6, "tokens": tokens}
        return out
    finally:
        llm.shutdown()


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    made.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    made.add_argument("--tokens", type=int, default=64)
    made.add_argument("--batches", type=int, default=2)
    made.add_argument("--key", type=int, default=0, help="the vs_vllm round whose prompts to use")
    return made


def main() -> None:
    import uvloop  # as both servers run

    result: Any = uvloop.run(measure(parser().parse_args()))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
