"""Metrics and logs for the events a session sends: the ones that matter
are logged, and deltas only feed the inter-token histogram."""

from __future__ import annotations

import time
from typing import Any

from .. import metrics
from ..core import events as ev


class Telemetry:
    __slots__ = ("_last_delta", "log", "log_content")

    def __init__(self, log: Any, log_content: bool) -> None:
        self.log = log
        self.log_content = log_content
        self._last_delta: dict[str, float] = {}  # response id -> time, for inter-token latency

    def observe(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == ev.RESPONSE_OUTPUT_TEXT_DELTA:
            now = time.perf_counter()
            last = self._last_delta.get(event["response_id"])
            if last is not None:
                metrics.INTER_TOKEN.observe(now - last)
            self._last_delta[event["response_id"]] = now
        elif kind == ev.RESPONSE_DONE:
            r = event["response"]
            self._last_delta.pop(r["id"], None)
            metrics.ACTIVE_RESPONSES.dec()
            metrics.RESPONSES.labels(r["status"]).inc()
            if r.get("timings") and r["timings"]["ttft_ms"] is not None:
                metrics.TTFT.observe(r["timings"]["ttft_ms"] / 1000)
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
            self.log.info("response_created", response_id=event["response"]["id"])
        elif kind == ev.ERROR:
            metrics.ERRORS.labels(event["error"]["code"]).inc()
            self.log.info(
                "client_error", code=event["error"]["code"], event_id=event["error"].get("event_id")
            )
