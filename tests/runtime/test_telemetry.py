"""The metrics the per-token path feeds: the same exposition as before."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tokenwire import metrics
from tokenwire.metrics import LATENCY_BUCKETS, LoopGauge, TokenHistogram
from tokenwire.runtime.telemetry import Telemetry


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
    for value in [*LATENCY_BUCKETS, 0.0, 11.0, *(rng.expovariate(20) for _ in range(500))]:
        fast.observe(value)
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


def test_inter_token_gaps_per_response() -> None:
    telemetry = Telemetry(_Log(), log_content=False)
    before = sum(metrics.INTER_TOKEN.counts)
    for rid in ("a", "b", "a", "b", "a"):
        telemetry.observe({"type": "response.output_text.delta", "response_id": rid, "delta": "x"})
    assert sum(metrics.INTER_TOKEN.counts) - before == 3  # the first delta of each has no gap
    done = {"id": "a", "status": "completed", "output": [], "timings": {"ttft_ms": 12.0}}
    ttft, active = sum(metrics.TTFT.counts), metrics.ACTIVE_RESPONSES.value
    telemetry.observe({"type": "response.done", "response": done})
    assert sum(metrics.TTFT.counts) == ttft + 1
    assert metrics.ACTIVE_RESPONSES.value == active - 1
    telemetry.observe({"type": "response.output_text.delta", "response_id": "a", "delta": "x"})
    assert sum(metrics.INTER_TOKEN.counts) - before == 3  # a finished response starts over
