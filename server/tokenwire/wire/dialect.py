"""The Dialect interface: how one wire protocol maps onto the core's events.

A dialect is chosen per socket at the handshake, from the subprotocols the
client offers. It parses client frames into the core's internal event schema
(`core.schema`, `core.events`) and encodes the core's server events into
frames. A dialect instance serves one socket: a dialect that must keep
state to translate (positions, lifecycle frames the core does not emit) may.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..core.tools import ToolFlow

Frame = str | bytes


class Dialect(Protocol):
    name: str
    # The subprotocol this socket negotiated (what session.created reports).
    subprotocol: str
    # Binary (True) or text frames.
    binary: bool
    # True: one frame per event, which is the internal event itself, so the log
    # keeps the frame the socket was sent. False: the socket gets `frames()`.
    single_frame: bool
    # What the sessions of this dialect's sockets do after tool calls.
    tool_flow: ToolFlow
    # Whether its clients can send session.resume: if not, a session whose
    # socket is lost ends at once (nothing would ever come back for it).
    resumable: bool

    def parse(self, frame: str | bytes) -> Any:
        """One client frame as an internal client event (a map the session
        validates), every value in it through `schema.check_values`. Raises
        ProtocolError (malformed_frame) if it is not one."""
        ...

    def encode(self, event: dict[str, Any]) -> Frame:
        """One server event, numbered by the outbox, as the frame the event log
        keeps (the internal event); for a single-frame dialect also the one sent."""
        ...

    def frames(self, event: dict[str, Any]) -> Sequence[Frame]:
        """The frames the socket is sent for one numbered server event, in order
        (none, one or several). Events pass in seq order; passing the same event
        again gives the same frames."""
        ...

    def from_logged(self, frame: Frame) -> Sequence[Frame]:
        """A logged event (internal schema, JSON text or msgpack bytes) as this
        dialect's frames: what a resume replays, the very frames sent live."""
        ...


class DialectFamily(Protocol):
    """The subprotocols one dialect answers to, and a dialect for each."""

    subprotocols: Sequence[str]

    def for_subprotocol(self, subprotocol: str | None) -> Dialect: ...
