"""Prometheus metrics (prometheus_client's default registry, served at /metrics).

vLLM registers its own `vllm:*` metrics in the same registry, so one scrape
shows the gateway and the engine side by side.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

CONNECTIONS = Gauge("tokenwire_connections", "Open WebSocket sessions")
ACTIVE_RESPONSES = Gauge("tokenwire_active_responses", "Responses in progress or waiting for tools")
RESPONSES = Counter("tokenwire_responses_total", "Finished responses by final status", ["status"])
TTFT = Histogram(
    "tokenwire_ttft_seconds", "response.create received to first output", buckets=LATENCY_BUCKETS
)
INTER_TOKEN = Histogram(
    "tokenwire_inter_token_seconds",
    "Time between two output deltas of a response",
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


GUARDRAIL_BLOCKS = Counter(
    "tokenwire_guardrail_blocks_total", "Generations a guardrail filter stopped", ["filter"]
)
GUARDRAIL_REDACTIONS = Counter(
    "tokenwire_guardrail_redactions_total", "Windows a guardrail filter rewrote", ["filter"]
)
GUARDRAIL_FAILURES = Counter(
    "tokenwire_guardrail_failures_total",
    "Guardrail checks that timed out or failed (then --guardrail-on-timeout decides)",
    ["filter", "kind"],
)


def render() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST
