"""The per-connection queue of server events, numbered as they leave.

Sans-I/O like the session. `seq` is assigned on `pop`, after merging, so
merged deltas never leave a gap. Merging keeps every token and each
response's order: a delta absorbs later deltas of the same item, skipping
over other items' deltas but never past any other event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from .events import RESPONSE_OUTPUT_TEXT_DELTA as DELTA

# The queue of an outbox that has not queued yet: most never do (the fast
# path skips them), and an empty deque is about 600 bytes.
_NONE: Any = ()


class Outbox:
    __slots__ = ("merged", "next_seq", "pending_bytes", "queue")

    def __init__(self, first_seq: int = 1) -> None:
        # Read-only outside: truthy while events wait (what `len` tells, without
        # a Python call; the per-token path asks).
        self.queue: deque[dict[str, Any]] = _NONE
        self.next_seq = first_seq
        self.merged = 0  # deltas absorbed into others, for metrics
        # Estimated encoded size of what is queued; the accounting needs it
        # before encoding, which waits for seq.
        self.pending_bytes = 0

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The queued events, in order (read-only: they are not numbered yet)."""
        return iter(self.queue)

    def push(self, event: dict[str, Any]) -> None:
        if self.queue is _NONE:
            self.queue = deque()
        self.queue.append(event)
        self.pending_bytes += estimate_size(event)

    def push_front(self, event: dict[str, Any]) -> None:
        if self.queue is _NONE:
            self.queue = deque()
        self.queue.appendleft(event)
        self.pending_bytes += estimate_size(event)

    def extend(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.push(event)

    def clear(self) -> None:
        self.queue = _NONE
        self.pending_bytes = 0

    def discard(self, kind: str) -> None:
        """Drop the queued (not yet numbered) events of type `kind`."""
        if any(e["type"] == kind for e in self.queue):
            kept = [e for e in self.queue if e["type"] != kind]
            self.queue = deque(kept)
            self.pending_bytes = sum(estimate_size(e) for e in kept)

    def pop(self, *, merge: bool = False) -> dict[str, Any] | None:
        if not self.queue:
            return None
        event = self.queue.popleft()
        self.pending_bytes -= estimate_size(event)
        if merge and event["type"] == DELTA and self.queue:
            event = self._absorb(event)
        self.number(event)
        return event

    def number(self, event: dict[str, Any]) -> int:
        """Give `event` the next seq: for one that leaves without being queued."""
        seq = event["seq"] = self.next_seq
        self.next_seq += 1
        return seq

    def compact(self) -> None:
        """Merge every mergeable delta now (same rules as pop(merge=True)), so a
        backlog held for a slow client costs its text, not an object per token."""
        out: deque[dict[str, Any]] = deque()
        segment: dict[str, dict[str, Any]] = {}  # item_id -> merged delta, in order
        for event in self.queue:
            if event["type"] != DELTA:
                out.extend(segment.values())
                segment.clear()
                out.append(event)
            elif (held := segment.get(event["item_id"])) is None:
                segment[event["item_id"]] = event
            else:
                segment[event["item_id"]] = {**held, "delta": held["delta"] + event["delta"]}
                self.merged += 1
        out.extend(segment.values())
        self.queue = out
        self.pending_bytes = sum(estimate_size(e) for e in out)

    def _absorb(self, event: dict[str, Any]) -> dict[str, Any]:
        key = event["item_id"]
        parts = [event["delta"]]
        kept: list[dict[str, Any]] = []
        queue = self.queue
        while queue:
            nxt = queue[0]
            if nxt["type"] != DELTA:
                break
            queue.popleft()
            if nxt["item_id"] == key:
                self.pending_bytes -= estimate_size(nxt)
                parts.append(nxt["delta"])
            else:
                kept.append(nxt)
        queue.extendleft(reversed(kept))
        if len(parts) > 1:
            self.merged += len(parts) - 1
            event = {**event, "delta": "".join(parts)}
        return event


# Bytes a delta event costs beyond its text, encoded (type, ids, seq).
DELTA_OVERHEAD = 120


def estimate_size(event: dict[str, Any]) -> int:
    if event["type"] == DELTA:
        return len(event["delta"].encode()) + DELTA_OVERHEAD
    return len(repr(event))  # rare and small, except response.done with its output
