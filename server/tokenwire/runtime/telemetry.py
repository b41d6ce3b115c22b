"""Metrics and logs for the events a session sends: the ones that matter
are logged. Deltas need nothing here (`SessionRuntime.pump` skips them): a
generation's loop times them and feeds the inter-token histogram in batches
(`observe_gaps`)."""

from __future__ import annotations

import functools
from collections.abc import MutableSequence
from logging import INFO
from typing import Any

from .. import logs, metrics
from ..core import events as ev

GAP_BATCH = 64  # gaps a generation holds before the histogram takes them


def observe_gaps(gaps: MutableSequence[float]) -> None:
    """Put a generation's inter-token gaps in the histogram; empties `gaps`."""
    if gaps:
        metrics.INTER_TOKEN.observe_many(gaps)
        del gaps[:]


class Telemetry:
    __slots__ = ("log", "log_content")

    def __init__(self, log: Any, log_content: bool) -> None:
        self.log = log
        self.log_content = log_content

    def observe(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == ev.RESPONSE_DONE:
            r = event["response"]
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
