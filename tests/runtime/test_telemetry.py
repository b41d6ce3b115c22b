"""The metrics the per-token path feeds: the same exposition as before."""

from __future__ import annotations

import asyncio
import json
import random

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tokenwire import metrics
from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.metrics import LATENCY_BUCKETS, LoopGauge, TokenHistogram
from tokenwire.runtime.session_runtime import SessionRuntime
from tokenwire.runtime.telemetry import GAP_BATCH, Telemetry


def _lines(registry: CollectorRegistry) -> list[str]:
    return [
        line
        for line in generate_latest(registry).decode().splitlines()
        if not line.startswith("#") and "_created" not in line
    ]


def test_token_histogram_exposes_what_a_prometheus_histogram_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram("t_seconds", "t", LATENCY_BUCKETS, registry=ours)
    reference = Histogram("t_seconds", "t", buckets=LATENCY_BUCKETS, registry=theirs)
    rng = random.Random(7)
    # Bounds themselves too: a value equal to a bound counts in that bucket (le).
    values = [*LATENCY_BUCKETS, 0.0, 11.0, *(rng.expovariate(20) for _ in range(500))]
    for value in values[:300]:
        fast.observe(value)
    fast.observe_many(values[300:])
    for value in values:
        reference.observe(value)
    assert _lines(ours) == _lines(theirs)


def test_loop_gauge_exposes_what_a_prometheus_gauge_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast, reference = LoopGauge("g", "g", registry=ours), Gauge("g", "g", registry=theirs)
    for step in (1, 1, -1, 1, -1, -1, 1):
        (fast.inc if step > 0 else fast.dec)()
        (reference.inc if step > 0 else reference.dec)()
    assert _lines(ours) == _lines(theirs)


class _Log:
    def info(self, *args: object, **kwargs: object) -> None:
        pass


async def test_inter_token_gaps_per_generation() -> None:
    """Every text delta after a generation's first adds one gap, including the
    ones a generation holds past a batch (GAP_BATCH) and the rest at its end."""
    runtime = SessionRuntime(ScriptedEngine(), ServerConfig(engine="scripted"))
    tokens = GAP_BATCH + 7
    create = {"type": "response.create", "response": {"ignore_eos": True}}
    create["response"]["max_output_tokens"] = tokens
    before = sum(metrics.INTER_TOKEN.counts)
    for _ in range(2):
        runtime.receive(json.dumps(create))
        await asyncio.gather(*runtime.tasks.values())
    assert sum(metrics.INTER_TOKEN.counts) - before == 2 * (tokens - 1)
    await runtime.end()


def test_response_done_feeds_ttft_and_active_responses() -> None:
    telemetry = Telemetry(_Log(), log_content=False)
    done = {"id": "a", "status": "completed", "output": [], "timings": {"ttft_ms": 12.0}}
    ttft, active = sum(metrics.TTFT.counts), metrics.ACTIVE_RESPONSES.value
    gaps = sum(metrics.INTER_TOKEN.counts)
    telemetry.observe({"type": "response.output_text.delta", "response_id": "a", "delta": "x"})
    telemetry.observe({"type": "response.done", "response": done})
    assert sum(metrics.TTFT.counts) == ttft + 1
    assert metrics.ACTIVE_RESPONSES.value == active - 1
    assert sum(metrics.INTER_TOKEN.counts) == gaps  # a delta alone is not a gap


def test_a_scrape_flushes_what_waits_in_a_batch_first() -> None:
    """Metrics recorded in batches (vLLM's, engines/vllm_stats.py) flush
    before each scrape; a flusher that is gone drops out."""
    registry = CollectorRegistry()
    gauge = Gauge("batched_steps", "steps", registry=registry)

    class Batch:
        def __init__(self) -> None:
            self.pending = 0

        def flush(self) -> None:
            gauge.inc(self.pending)
            self.pending = 0

    batch = Batch()
    metrics.before_scrape(batch.flush)
    batch.pending = 3
    metrics.render()
    assert (batch.pending, gauge._value.get()) == (0, 3)
    hooks = len(metrics._BEFORE_SCRAPE)
    del batch
    metrics.render()
    assert len(metrics._BEFORE_SCRAPE) == hooks - 1
