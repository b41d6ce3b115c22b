"""Steer and tool round-trip latency against cold and warm TTFT, on the real engine.

    .venv/bin/python -m benchmarks.steer_tool_latency [--trials 5] [--url ws://...]

Each trial uses a conversation with a ~800-token system prompt that starts
with a fresh nonce, so the first response is a cold prefill:
- cold TTFT: response.create sent -> first delta, new prefix;
- warm TTFT: the same conversation asked again in a new session (prefix cached);
- steer: response.steer sent -> first delta of the continued generation;
- tool round trip: function_call_output sent -> first delta of the continuation.
All measured by the client, in one run, so the ratios compare like with like.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time

from tokenwire.client import Client, connect

from ._server import RESULTS, run_on_vllm

FILLER = (
    "You are a careful assistant for a travel company. Answer questions about European "
    "cities, their weather, their history and their food. Keep answers short and factual. "
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def instructions(nonce: str) -> str:
    return f"[{nonce}] " + FILLER * 28  # about 800 tokens


async def first_delta_after(response, start: float) -> tuple[float, dict]:
    async for event in response:
        if event["type"] == "response.output_text.delta":
            return (time.perf_counter() - start) * 1000, event
    raise RuntimeError("no text")


async def ttft(tw: Client, prompt: str) -> tuple[float, dict]:
    await tw.add_message(prompt)
    start = time.perf_counter()
    response = await tw.create_response(temperature=0, max_output_tokens=24)
    ms, _ = await first_delta_after(response, start)
    done = await response.done()
    return ms, done


async def trial(url: str) -> dict:
    nonce = secrets.token_hex(4)
    question = "What is the capital of France?"
    async with await connect(url) as tw:
        await tw.update_session(instructions=instructions(nonce))
        cold, cold_done = await ttft(tw, question)
    async with await connect(url) as tw:
        await tw.update_session(instructions=instructions(nonce))
        warm, warm_done = await ttft(tw, question)

        # Steer the next answer after a few tokens.
        await tw.add_message("Tell me a long story about Paris.")
        response = await tw.create_response(temperature=0, max_output_tokens=40)
        seen = 0
        async for event in response:
            if event["type"] == "response.output_text.delta":
                seen += 1
                if seen == 4:
                    break
        start = time.perf_counter()
        await tw.send(
            {
                "type": "response.steer",
                "response_id": response.id,
                "input": "Make it about Rome instead.",
            }
        )
        steer_ms, steered = None, False
        async for event in response:
            # Deltas already in flight before the steer landed don't count.
            steered = steered or event["type"] == "response.steered"
            if steered and event["type"] == "response.output_text.delta":
                steer_ms = (time.perf_counter() - start) * 1000
                break
        steer_done = await response.done()
    async with await connect(url) as tw:
        await tw.update_session(instructions=instructions(nonce), tools=[WEATHER])
        await tw.add_message("What is the weather in Paris?")
        response = await tw.create_response(
            temperature=0, tool_choice="required", max_output_tokens=60
        )
        call_id = None
        async for event in response:
            if event["type"] == "response.requires_action":
                call_id = event["call_ids"][0]
                break
        start = time.perf_counter()
        await tw.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": json.dumps({"temperature_c": 22, "sky": "sunny"}),
                },
            }
        )
        tool_ms, _ = await first_delta_after(response, start)
        tool_done = await response.done()
    return {
        "cold_ttft_ms": cold,
        "warm_ttft_ms": warm,
        "steer_ms": steer_ms,
        "tool_ms": tool_ms,
        "cold_cached_tokens": cold_done["usage"]["cached_tokens"],
        "warm_cached_tokens": warm_done["usage"]["cached_tokens"],
        "prompt_tokens": cold_done["usage"]["input_tokens"],
        "steer_cached_tokens": steer_done["usage"]["cached_tokens"],
        "steer_input_tokens": steer_done["usage"]["input_tokens"],
        "tool_cached_tokens": tool_done["usage"]["cached_tokens"],
    }


async def run(url: str, trials: int) -> dict:
    rows = [await trial(url) for _ in range(trials)]
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in ("cold_ttft_ms", "warm_ttft_ms", "steer_ms", "tool_ms")
    }
    return {
        "trials": rows,
        "median": med,
        "ratios": {
            "steer_vs_cold": med["steer_ms"] / med["cold_ttft_ms"],
            "steer_vs_warm": med["steer_ms"] / med["warm_ttft_ms"],
            "tool_vs_cold": med["tool_ms"] / med["cold_ttft_ms"],
        },
    }


def main() -> None:
    report = run_on_vllm(__doc__ or "", "steer_tool_latency", run)
    m, r = report["median"], report["ratios"]
    t0 = report["trials"][0]
    lines = [
        f"Prompt ~{t0['prompt_tokens']} tokens; medians of {len(report['trials'])} trials.",
        "",
        "| measure | median (ms) | vs cold TTFT |",
        "|---|---|---|",
        f"| cold TTFT (new prefix) | {m['cold_ttft_ms']:.0f} | 1.00 |",
        f"| warm TTFT (prefix cached) | {m['warm_ttft_ms']:.0f} | "
        f"{m['warm_ttft_ms'] / m['cold_ttft_ms']:.2f} |",
        f"| steer sent -> first new token | {m['steer_ms']:.0f} | {r['steer_vs_cold']:.2f} |",
        f"| tool result sent -> first new token | {m['tool_ms']:.0f} | {r['tool_vs_cold']:.2f} |",
        "",
        f"cached tokens: cold {t0['cold_cached_tokens']}, warm {t0['warm_cached_tokens']}, "
        f"steer (both generations) {t0['steer_cached_tokens']} of {t0['steer_input_tokens']}, "
        f"tool continuation {t0['tool_cached_tokens']}",
    ]
    (RESULTS / "steer_tool_latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
