"""How little a client of vLLM's engine core could cost: a bound, not a path.

    .venv/bin/python -m benchmarks.client_bound [--concurrency 8 32]
        [--tokens 64] [--rounds 10]

tokenwire's process runs vLLM's `AsyncLLM` client, as vLLM's API server does
(benchmarks.frontend_floor measures it alone). Could a hand-written client do
much better? Here one engine, in this process, serves alternating batches
(A B B A) two ways:
- `asyncllm`: the client as tokenwire runs it (its stat loggers,
  server/tokenwire/engines/vllm_stats.py), each request iterated with
  `AsyncLLM.generate`, counting what it gets;
- `lean`: the same engine core, link and detokenizer, but vLLM's output
  processing swapped, for those batches, for the least that still streams
  text: per output, the detokenizer's step and a direct call to the request's
  consumer. No RequestOutput, no statistics (so no `vllm:*` metrics and no
  load figures), no per-request queue, event or generator. It drops what a
  server needs (stop strings, logprobs, n > 1, errors), so it only bounds
  what replacing vLLM's output processing could save.
Both count this process's threads' CPU over the batches' output tokens (the
engine core is a child process and not counted) and must get every token.

Writes results/client_bound.{json,md}: per level the medians and the median
of the rounds' paired ratios lean / asyncllm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

from ._server import save_results, threads_cpu_seconds
from .frontend_floor import engine_args
from .vs_vllm import prompt

SIDES = ("asyncllm", "lean")


class Direct:
    """A request's consumer in the lean batches: vLLM's output processor hands
    its outputs to `req_state.queue.put`; the lean one calls `take`."""

    def __init__(self, done: asyncio.Future[int]) -> None:
        self.done = done
        self.tokens = 0

    def take(self, text: str, tokens: int, finished: bool) -> None:
        self.tokens += tokens
        if finished:
            self.done.set_result(self.tokens)


def lean_process_outputs(processor: Any) -> Callable[..., Any]:
    """A stand-in for `OutputProcessor.process_outputs` (vLLM 0.32)."""
    from vllm.v1.engine.output_processor import OutputProcessorOutput

    nothing = OutputProcessorOutput(request_outputs=[], reqs_to_abort=[])

    def process_outputs(outputs: list[Any], *_: Any, **__: Any) -> Any:
        states = processor.request_states
        for out in outputs:
            state = states.get(out.request_id)
            if state is None:
                continue
            finished = out.finish_reason is not None
            state.detokenizer.update(out.new_token_ids, False)
            text = state.detokenizer.get_next_output_text(finished, True)
            state.queue.take(text, len(out.new_token_ids), finished)
            if finished:
                processor._finish_request(state)
        return nothing

    return process_outputs


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import vllm.v1.engine.async_llm as async_llm_module
    from vllm.envs import enable_envs_cache
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from tokenwire.engines.vllm_stats import async_llm, load_tracker_class

    llm = async_llm(engine_args(), load_tracker_class())
    enable_envs_cache()
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=0, max_tokens=args.tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    processor, manager = llm.output_processor, llm.logger_manager
    loggers, stats = list(manager.stat_loggers), async_llm_module.IterationStats
    vllms, lean = processor.process_outputs, lean_process_outputs(processor)

    def use(side: str) -> None:
        is_lean = side == "lean"
        processor.process_outputs = lean if is_lean else vllms
        processor.log_stats = not is_lean  # request states made without stats
        manager.stat_loggers = [] if is_lean else loggers
        # The output handler makes IterationStats per step; None skips them.
        async_llm_module.IterationStats = (lambda: None) if is_lean else stats

    async def one(i: int, side: str) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(i)}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        if side == "lean":
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            collector = await llm.add_request(f"bound-{i}", {"prompt_token_ids": ids}, params)
            processor.request_states[collector.request_id].queue = Direct(done)
            return await done
        got = 0
        async for out in llm.generate({"prompt_token_ids": ids}, params, f"bound-{i}"):
            got += len(out.outputs[0].token_ids)
        return got

    numbered = iter(range(1_000_000))

    async def batch(c: int, side: str) -> float:
        use(side)
        before = threads_cpu_seconds(os.getpid())
        got = sum(await asyncio.gather(*(one(next(numbered), side) for _ in range(c))))
        spent = threads_cpu_seconds(os.getpid()) - before
        if got != c * args.tokens:
            raise RuntimeError(f"{side} got {got} tokens of {c * args.tokens}")
        return spent / got * 1e6

    try:
        for side in SIDES:  # warm-up
            await batch(max(args.concurrency), side)
        levels: dict[str, Any] = {}
        for c in args.concurrency:
            per: dict[str, list[float]] = {side: [] for side in SIDES}
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    per[side].append(await batch(c, side))
            paired = [lo / full for full, lo in zip(per["asyncllm"], per["lean"], strict=True)]
            levels[str(c)] = {
                **{f"{side}_us_per_token": statistics.median(per[side]) for side in SIDES},
                "lean_over_asyncllm": statistics.median(paired),
                "rounds": per,
            }
            print(f"c={c}: {json.dumps(levels[str(c)])}", flush=True)
        return {"tokens": args.tokens, "rounds": args.rounds, "levels": levels}
    finally:
        use("asyncllm")
        llm.shutdown()


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"vLLM's AsyncLLM client as tokenwire runs it, against the same engine with vLLM's "
        f"output processing swapped for the least that streams text (a bound, "
        f"`benchmarks.client_bound`). {report['tokens']} tokens per request, "
        f"{report['rounds']} alternating rounds a level in one process; this process's CPU "
        "per output token, medians.",
        "",
        "| concurrency | AsyncLLM (µs/token) | lean (µs/token) | lean / AsyncLLM, paired |",
        "|---|---|---|---|",
    ]
    for c, q in report["levels"].items():
        lines.append(
            f"| {c} | {q['asyncllm_us_per_token']:.1f} | {q['lean_us_per_token']:.1f} | "
            f"{q['lean_over_asyncllm']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    import uvloop  # as both servers run

    report = uvloop.run(measure(args))
    save_results("client_bound", report, markdown(report))


if __name__ == "__main__":
    main()
