"""The servers behind `--engine remote`: each one's circuit breaker and
metrics, and the order a session tries them in.

A replica that fails an attempt (unreachable, 5xx, garbage, stalled, no first
token in time) is marked down: sessions try it only when nothing else is
left, and a `GET /health` probe, not a client's request, finds out when it
is back (half-open). A request that succeeds on a down replica brings it back
too.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from ..logs import get_logger, redact_url
from .remote_http import COMPLETIONS_PATH, GENERATE_PATH

if TYPE_CHECKING:
    import aiohttp

log = get_logger("tokenwire.engines.remote")

# Per replica, beside the gateway's own metrics at /metrics.
REQUESTS = Counter("tokenwire_remote_requests_total", "Attempts sent to a server", ["replica"])
FAILURES = Counter(
    "tokenwire_remote_failures_total",
    "Attempts a server failed: unreachable, 5xx, garbage, stalled, no first token",
    ["replica"],
)
TTFT = Histogram(
    "tokenwire_remote_ttft_seconds",
    "Request sent to first token, per server",
    ["replica"],
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
UP = Gauge("tokenwire_remote_up", "1: in service; 0: skipped after a failure", ["replica"])

# A down replica is probed this long after its failure (twice as long for
# each failure in a row before it), then twice as long each time the probe
# fails, up to PROBE_MAX_S.
DOWN_FOR_S = 5.0
PROBE_MAX_S = 60.0
PROBE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class Replica:
    url: str  # as logs, metrics and errors show it: without credentials
    model: str = ""
    max_model_len: int = 0
    generate_endpoint: bool = False  # offers /inference/v1/generate
    reports_cached: bool = False  # --enable-prompt-tokens-details
    # "up" (closed), "down" (open) or "probing" (half-open).
    state: str = "up"
    probe: asyncio.Task[None] | None = None
    in_flight: int = 0
    failures: int = 0
    requests: int = 0
    base: str = ""  # what requests go to: the URL as given, user:password@ included
    # Attempts failed in a row, probes between them or not: a server whose
    # /health says 200 while its requests fail is tried less and less often.
    streak: int = 0
    health_failed: bool = False  # its /health probe failed since it went down

    def __post_init__(self) -> None:
        self.base, self.url = self.url, redact_url(self.url)

    @property
    def up(self) -> bool:
        return self.state == "up"

    def error_text(self, exc: BaseException) -> str:
        """An exception as errors and logs show it: aiohttp's name the URL
        requested, credentials included."""
        return f"{type(exc).__name__}: {str(exc).replace(self.base, self.url)}"

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "endpoint": GENERATE_PATH if self.generate_endpoint else COMPLETIONS_PATH,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "failures": self.failures,
        }

    def watch(self) -> None:
        UP.labels(self.url).set_function(lambda: float(self.up))

    def failed(self, client: aiohttp.ClientSession) -> None:
        """An attempt failed: down, with a probe to bring it back."""
        self.failures += 1
        self.streak += 1
        FAILURES.labels(self.url).inc()
        if self.state == "up":
            log.warning("remote_replica_down", url=self.url)
        self.state = "down"
        # Not once the engine closed its client (a request that failed as it shut down).
        if not client.closed and (self.probe is None or self.probe.done()):
            self.probe = asyncio.get_running_loop().create_task(self._probe(client))

    def served(self, probe: bool = False) -> None:
        """A request succeeded on it (or, `probe`, its /health answered)."""
        if not probe:
            self.streak = 0
        if self.state == "up":
            return
        log.info("remote_replica_up", url=self.url)
        self.state, self.health_failed = "up", False
        if self.probe is not None and self.probe is not asyncio.current_task():
            self.probe.cancel()
        self.probe = None

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.cancel()

    async def _probe(self, client: aiohttp.ClientSession) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        wait = min(DOWN_FOR_S * 2 ** max(self.streak - 1, 0), PROBE_MAX_S)
        while not self.up:
            await asyncio.sleep(wait)
            self.state = "probing"
            try:
                async with client.get(self.base + "/health", timeout=timeout) as resp:
                    healthy = resp.status == 200
            except Exception:  # any failure to answer is a failed probe
                healthy = False
            if healthy:
                self.served(probe=True)
                return
            self.state, self.health_failed = "down", True
            wait = min(wait * 2, PROBE_MAX_S)


def replica_order(replicas: list[Replica], session_id: str | None) -> list[Replica]:
    """The session's own replica first (stable across processes), then the
    rest in ring order; replicas marked down go last, still a last resort."""
    if not replicas:
        return []
    start = zlib.crc32(session_id.encode()) % len(replicas) if session_id else 0
    ring = replicas[start:] + replicas[:start]
    return [r for r in ring if r.up] + [r for r in ring if not r.up]
