"""The Dialect interface: how one wire protocol maps onto the core's events.

A dialect is chosen per socket at the handshake, from the subprotocols the
client offers. It parses client frames into the core's internal event schema
(`core.schema`, `core.events`) and encodes the core's server events into
frames. It holds no session state, so one instance may serve many sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Dialect(Protocol):
    name: str
    # The subprotocol this socket negotiated (what session.created reports).
    subprotocol: str
    # Binary (True) or text frames.
    binary: bool

    def parse(self, frame: str | bytes) -> Any:
        """One client frame as an internal client event (a map the session
        validates). Raises ProtocolError (malformed_frame) if it is not one."""
        ...

    def encode(self, event: dict[str, Any]) -> str | bytes:
        """One server event, numbered by the outbox, as one frame."""
        ...

    def from_logged(self, frame: str | bytes) -> str | bytes:
        """A logged event (internal schema, JSON text or msgpack bytes) as a frame
        of this dialect: what a resume replays."""
        ...


class DialectFamily(Protocol):
    """The subprotocols one dialect answers to, and a dialect for each."""

    subprotocols: Sequence[str]

    def for_subprotocol(self, subprotocol: str | None) -> Dialect: ...
