"""The per-connection queue of server events, numbered as they leave.

Sans-I/O like the session. `seq` is assigned on `pop`, after merging, so
merged deltas never leave a gap. Merging keeps every token and each
response's order: a delta absorbs later deltas of the same item, skipping
over other items' deltas but never past any other event.
"""

from __future__ import annotations

from collections import deque
from typing import Any

DELTA = "response.output_text.delta"


class Outbox:
    def __init__(self, first_seq: int = 1) -> None:
        self._queue: deque[dict[str, Any]] = deque()
        self.next_seq = first_seq
        self.merged = 0  # deltas absorbed into others, for metrics

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, event: dict[str, Any]) -> None:
        self._queue.append(event)

    def extend(self, events: list[dict[str, Any]]) -> None:
        self._queue.extend(events)

    def pop(self, *, merge: bool = False) -> dict[str, Any] | None:
        if not self._queue:
            return None
        event = self._queue.popleft()
        if merge and event["type"] == DELTA and self._queue:
            event = self._absorb(event)
        event["seq"] = self.next_seq
        self.next_seq += 1
        return event

    def _absorb(self, event: dict[str, Any]) -> dict[str, Any]:
        key = event["item_id"]
        parts = [event["delta"]]
        kept: list[dict[str, Any]] = []
        queue = self._queue
        while queue:
            nxt = queue[0]
            if nxt["type"] != DELTA:
                break
            queue.popleft()
            if nxt["item_id"] == key:
                parts.append(nxt["delta"])
            else:
                kept.append(nxt)
        queue.extendleft(reversed(kept))
        if len(parts) > 1:
            self.merged += len(parts) - 1
            event = {**event, "delta": "".join(parts)}
        return event
