"""Session-pinned data parallelism and priority lanes on the real engine.

One server for the module (two data-parallel ranks start in about a minute
here): `-- --data-parallel-size 2 --scheduling-policy priority --max-num-seqs 1`.
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.request
from collections.abc import Iterator

import pytest

from tokenwire.client import connect

from ..conftest import ARTIFACTS, Spawned, http_json, spawn_server

pytestmark = pytest.mark.vllm

# Long enough to fill a 128-token prefix-cache block on its own.
INSTRUCTIONS = " ".join(
    f"Rule {i}: answer briefly, politely and in plain English, without lists." for i in range(20)
)


@pytest.fixture(scope="module")
def lanes() -> Iterator[Spawned]:
    ARTIFACTS.mkdir(exist_ok=True)
    env = dict(os.environ, TOKENWIRE_KV_CACHE_GIB="1")
    with spawn_server(
        "--engine",
        "vllm",
        "--max-model-len",
        "2048",
        "--",
        "--data-parallel-size",
        "2",
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--enforce-eager",  # as VLLM_ENGINE_FLAGS: startup time
        env=env,
        log_path=ARTIFACTS / "vllm-lanes-server.log",
        ready_timeout=600,
    ) as spawned:
        yield spawned


async def two_turns(url: str) -> tuple[int, int]:
    async with await connect(url) as tw:
        await tw.update_session(instructions=INSTRUCTIONS, temperature=0)
        await tw.add_message("What is the capital of France?")
        first = await (await tw.create_response(max_output_tokens=8)).done()
        await tw.add_message("And of Italy?")
        second = await (await tw.create_response(max_output_tokens=8)).done()
    return first["usage"]["cached_tokens"], second["usage"]["cached_tokens"]


async def test_a_sessions_turns_meet_its_own_prefix_cache(lanes: Spawned) -> None:
    # Four sessions: without pinning each second turn had an even chance of
    # landing on the other rank, with an empty cache (0 cached tokens).
    results = [await two_turns(lanes.url) for _ in range(4)]
    assert all(second >= 128 for _, second in results), results


def engines_that_ran_requests(http: str) -> set[str]:
    with urllib.request.urlopen(http + "/metrics", timeout=5) as r:
        text = r.read().decode()
    engines = set()
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine and float(line.rsplit(" ", 1)[1]) > 0:
                engines.add(engine.group(1))
    return engines


async def test_sessions_spread_over_both_ranks(lanes: Spawned) -> None:
    async def one(i: int) -> None:
        async with await connect(lanes.url) as tw:
            await tw.ask(f"Say the number {i}.", max_output_tokens=4)

    await asyncio.gather(*(one(i) for i in range(10)))
    by_rank = http_json(lanes.http + "/healthz")[1]["engine_load"]["requests_by_rank"]
    assert set(by_rank) == {"0", "1"} and min(by_rank.values()) >= 2, by_rank
    # vLLM's own counters agree: both engine cores finished requests.
    assert engines_that_ran_requests(lanes.http) == {"0", "1"}


async def test_interactive_priority_goes_ahead_of_queued_batch_work(lanes: Spawned) -> None:
    """One slot per rank, one session (so one rank). A batch response holds the
    slot and a second one waits; an interactive response sent after it, at a
    better priority, is scheduled first when the slot frees (fcfs would run
    the second batch response first)."""

    def ask(text: str, priority: int, tokens: int, **kw: object) -> dict[str, object]:
        return {
            "conversation": "none",
            "input": [{"type": "message", "role": "user", "content": text}],
            "priority": priority,
            "max_output_tokens": tokens,
            "temperature": 0,
            **kw,
        }

    async with await connect(lanes.url) as tw:
        running = await tw.create_response(**ask("Write a long story.", 10, 60, ignore_eos=True))
        await anext(running.text_deltas())  # it holds the slot
        queued = await tw.create_response(**ask("Write another story.", 10, 60, ignore_eos=True))
        interactive = await tw.create_response(**ask("Say hi.", 0, 4))
        quick = await interactive.done()
        # Four tokens of an answer: it ends at its cap, not by itself.
        assert quick["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
        assert quick["usage"]["output_tokens"] == 4
        assert running.status == "completed"
        second = await queued.done()
    assert second["status"] == "completed" and second["usage"]["output_tokens"] == 60
    # By seq, not by what this process had read when `quick` came: the
    # queued response may start one engine step after it.
    first_queued = min(e["seq"] for e in queued.events if e["type"] == "response.output_text.delta")
    assert first_queued > interactive.events[-1]["seq"], "the batch queued first went first"
    # It waited for the running one and for the interactive one.
    assert second["timings"]["queue_wait_ms"] > quick["timings"]["queue_wait_ms"] > 0
