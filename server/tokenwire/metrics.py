"""Prometheus metrics (prometheus_client's default registry, served at /metrics).

vLLM registers its own `vllm:*` metrics in the same registry, so one scrape
shows the gateway and the engine side by side.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from weakref import WeakMethod

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class TokenHistogram(Collector):
    """A histogram observed on the event loop's hot paths (per token, per
    response): an observation is a bisect and two additions, where
    prometheus_client's Histogram takes a lock and a call per bucket object
    (about 1.3 µs). Only the event loop's thread observes; a scrape from
    another thread may see a count one ahead of the sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(buckets)
        # In arrays: a list would hold a new int or float object per update,
        # and the last ones made during a wave of sessions pin the allocator's
        # arenas after it (server/memory.py).
        self.counts = array("q", bytes(8 * (len(self.bounds) + 1)))  # the last one: +Inf
        self._sum = array("d", [0.0])
        registry.register(self)

    @property
    def sum(self) -> float:
        return self._sum[0]

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self._sum[0] += value

    def observe_many(self, values: Sequence[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self._sum[0] += sum(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            cumulative.append((bound, total))
        family.add_metric([], cumulative, self.sum)
        yield family


class LoopGauge(Collector):
    """A gauge the event loop moves per session or response: an integer in an
    array (no object per update, as in TokenHistogram), where
    prometheus_client's Gauge takes a lock for each inc and dec."""

    def __init__(
        self, name: str, documentation: str, registry: CollectorRegistry = REGISTRY
    ) -> None:
        self.name, self.documentation = name, documentation
        self._value = array("q", [0])
        registry.register(self)

    @property
    def value(self) -> int:
        return self._value[0]

    def inc(self, n: int = 1) -> None:
        self._value[0] += n

    def dec(self, n: int = 1) -> None:
        self._value[0] -= n

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

CONNECTIONS = LoopGauge("tokenwire_connections", "Open WebSocket sessions")
ACTIVE_RESPONSES = LoopGauge(
    "tokenwire_active_responses", "Responses in progress or waiting for tools"
)
RESPONSES = Counter("tokenwire_responses_total", "Finished responses by final status", ["status"])
TTFT = TokenHistogram(
    "tokenwire_ttft_seconds", "response.create received to first output", buckets=LATENCY_BUCKETS
)
INTER_TOKEN = TokenHistogram(
    "tokenwire_inter_token_seconds",
    "Time between two text deltas of one generation",
    buckets=LATENCY_BUCKETS,
)
CANCEL_LATENCY = Histogram(
    "tokenwire_cancel_latency_seconds",
    "response.cancel received to the engine request gone",
    buckets=LATENCY_BUCKETS,
)
OUTBOUND_BUFFERED = Gauge(
    "tokenwire_outbound_buffered_bytes", "Bytes waiting for clients (socket buffers plus queues)"
)
ENGINE_QUEUE = Gauge("tokenwire_engine_requests", "Engine requests by state", ["state"])
ERRORS = Counter("tokenwire_client_errors_total", "error events sent, by code", ["code"])
REJECTED = Counter(
    "tokenwire_handshakes_rejected_total", "Handshakes refused, by reason", ["reason"]
)
CLIENT_SECRETS = Counter(
    "tokenwire_client_secrets_minted_total", "Client secrets (ek_ keys) minted"
)
PAUSES = Counter(
    "tokenwire_generation_pauses_total", "Generations paused because a client fell behind"
)
INBOUND_PAUSES = Counter(
    "tokenwire_inbound_pauses_total",
    "Times a connection's reading paused: its client sent more than --max-inbound-bytes-per-s",
)
TAKEOVERS = Counter(
    "tokenwire_session_takeovers_total", "Sessions continued here after their owner was gone"
)

CACHE_HITS = Counter(
    "tokenwire_response_cache_hits_total",
    "Generations the response cache answered: from a stored entry, or by following an "
    "identical generation in flight",
    ["source"],
)
CACHE_MISSES = Counter(
    "tokenwire_response_cache_misses_total", "Cacheable generations the engine had to run"
)
CACHE_STORED_BYTES = Counter(
    "tokenwire_response_cache_stored_bytes_total", "Bytes of entries written to the response cache"
)
CACHE_MEMORY_BYTES = Gauge(
    "tokenwire_response_cache_memory_bytes", "Bytes the in-memory response cache holds"
)
CACHE_EVICTIONS = Counter(
    "tokenwire_response_cache_evictions_total",
    "Entries the in-memory response cache dropped to stay under its size cap",
)


LOOP_LAG = TokenHistogram(
    "tokenwire_event_loop_lag_seconds",
    "How late the event loop ran a timer due every 0.5 s: what every session waited",
    buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 1.0, 2.5, 5.0, 10.0),
)


GUARDRAIL_BLOCKS = Counter(
    "tokenwire_guardrail_blocks_total", "Generations a guardrail filter stopped", ["filter"]
)
GUARDRAIL_REDACTIONS = Counter(
    "tokenwire_guardrail_redactions_total", "Windows a guardrail filter rewrote", ["filter"]
)
GUARDRAIL_FAILURES = Counter(
    "tokenwire_guardrail_failures_total",
    "Guardrail checks that timed out, failed or stayed undecided (--guardrail-on-timeout decides)",
    ["filter", "kind"],
)


# Called before each scrape: metrics recorded in batches flush their last one.
# Weak, so an engine that is gone leaves no hook behind.
_BEFORE_SCRAPE: list[WeakMethod[Callable[[], None]]] = []


def before_scrape(flush: Callable[[], None]) -> None:
    """Have `flush` (a bound method) called before each scrape."""
    _BEFORE_SCRAPE.append(WeakMethod(flush))  # type: ignore[arg-type]


def render() -> tuple[bytes, str]:
    for ref in list(_BEFORE_SCRAPE):
        flush = ref()
        if flush is None:
            _BEFORE_SCRAPE.remove(ref)
        else:
            flush()
    return generate_latest(), CONTENT_TYPE_LATEST
