"""The protocol edge: frames, and the dialects that map them onto the core.

Holds no session state. `select_subprotocol` answers the handshake;
`dialect_for` gives the socket its dialect.
"""

from __future__ import annotations

from collections.abc import Sequence

from .dialect import Dialect, DialectFamily, Frame, ToolFlow
from .openai_realtime import OpenAIRealtimeFamily
from .tokenwire_v1 import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, TokenwireV1Family

FAMILIES: tuple[DialectFamily, ...] = (TokenwireV1Family(), OpenAIRealtimeFamily())
# A client that offers none of ours by name: OpenAI's SDKs offer no subprotocol
# outside browsers, and tokenwire's own clients always name theirs.
DEFAULT: DialectFamily = FAMILIES[1]

__all__ = [
    "SUBPROTOCOL_JSON",
    "SUBPROTOCOL_MSGPACK",
    "Dialect",
    "DialectFamily",
    "Frame",
    "ToolFlow",
    "dialect_for",
    "select_subprotocol",
]


def select_subprotocol(offered: Sequence[str]) -> str | None:
    """The client's order wins; with none of ours offered, the default dialect
    (OpenAI Realtime) serves the socket without a subprotocol."""
    for name in offered:
        for family in FAMILIES:
            if name in family.subprotocols:
                return name
    return None


def dialect_for(subprotocol: str | None) -> Dialect:
    for family in FAMILIES:
        if subprotocol in family.subprotocols:
            return family.for_subprotocol(subprotocol)
    return DEFAULT.for_subprotocol(None)
