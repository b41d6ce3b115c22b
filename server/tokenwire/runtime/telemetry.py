"""Metrics and logs for the events a session sends: the ones that matter
are logged, and deltas only feed the inter-token histogram."""

from __future__ import annotations

import functools
import time
from logging import INFO
from typing import Any

from .. import logs, metrics
from ..core import events as ev

_DELTA = ev.RESPONSE_OUTPUT_TEXT_DELTA


class Telemetry:
    __slots__ = ("_last_delta", "_observe_gap", "log", "log_content")

    def __init__(self, log: Any, log_content: bool) -> None:
        self.log = log
        self.log_content = log_content
        self._last_delta: dict[str, float] = {}  # response id -> time, for inter-token latency
        self._observe_gap = metrics.INTER_TOKEN.observe

    def observe(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind is _DELTA or kind == _DELTA:  # per token: the same string object, mostly
            now = time.perf_counter()
            rid = event["response_id"]
            last = self._last_delta.get(rid)
            if last is not None:
                self._observe_gap(now - last)
            self._last_delta[rid] = now
        elif kind == ev.RESPONSE_DONE:
            r = event["response"]
            self._last_delta.pop(r["id"], None)
            metrics.ACTIVE_RESPONSES.dec()
            _by_status(r["status"]).inc()
            if r.get("timings") and r["timings"]["ttft_ms"] is not None:
                metrics.TTFT.observe(r["timings"]["ttft_ms"] / 1000)
            if not logs.enabled(INFO):
                return  # per response: the fields are not built for nothing
            fields: dict[str, Any] = {
                "response_id": r["id"],
                "status": r["status"],
                "usage": r.get("usage"),
                "timings": r.get("timings"),
            }
            if self.log_content:
                fields["text"] = "".join(i.get("content", "") for i in r["output"])
            self.log.info("response_done", **fields)
        elif kind == ev.RESPONSE_CREATED:
            metrics.ACTIVE_RESPONSES.inc()
            if logs.enabled(INFO):
                self.log.info("response_created", response_id=event["response"]["id"])
        elif kind == ev.ERROR:
            metrics.ERRORS.labels(event["error"]["code"]).inc()
            self.log.info(
                "client_error", code=event["error"]["code"], event_id=event["error"].get("event_id")
            )


@functools.cache
def _by_status(status: str) -> Any:
    """RESPONSES' child for a status: `labels()` takes a lock and builds a key."""
    return metrics.RESPONSES.labels(status)
