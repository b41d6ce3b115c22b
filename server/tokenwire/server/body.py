"""Request bodies on the WebSocket port, for `POST /v1/realtime/client_secrets`.

websockets parses handshakes only: a request with a body (a Content-Length
above 0, or Transfer-Encoding) fails in its parser, and the client gets no
answer at all. The endpoint must share the port and URL base of /v1/realtime
(OpenAI's SDKs derive both from one base URL), so `BodyConnection`, a subclass
given to websockets' `serve(create_connection=...)` (its hook for customising
connections), reads the body itself: it holds a POST's bytes back until head
and body are in, keeps the body (`body`), and hands websockets the head without
its body headers. websockets then parses the request and calls
`process_request` as for any other, which answers from `conn.body`; TLS, the
open timeout and connection accounting stay websockets'. Anything but a POST
passes through untouched. No pipelining: websockets closes after an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from websockets.asyncio.server import ServerConnection

POST = b"POST "
MAX_HEAD_BYTES = 64 * 1024  # beyond this websockets sees the head and answers 431
_BODY_HEADERS = (b"content-length", b"transfer-encoding", b"expect")


class BodyError(StrEnum):
    """Why a POST's body was not read; process_request answers with it."""

    LENGTH_REQUIRED = "length_required"  # chunked (no Content-Length): 411
    TOO_LARGE = "too_large"  # more than max_body bytes: 413
    BAD_LENGTH = "bad_length"  # a Content-Length that is not one number: 400


class BodyConnection(ServerConnection):
    """A websockets connection that also reads a POST's body."""

    max_body = 1 << 20  # set by `with_max_body`
    # Whether a POST's body is read, from its path and Authorization header:
    # no body is held for a route that takes none or a client it will refuse.
    reads: Callable[[str, str | None], bool] = staticmethod(lambda path, authorization: True)
    # Class-level defaults, set on the instance only for a POST: websockets'
    # connection has 27 attributes, and past 30 an instance dict stops sharing
    # its keys (about 1.3 KiB more for every WebSocket connection).
    _head: bytes | None = None  # the POST head for websockets, body headers gone
    _length = 0
    _scanned = 0  # bytes of the held head searched for its end already
    _dropping = False  # the body of a POST that is not read: ignored
    body: bytes | None = None
    body_error: BodyError | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: bytearray | None = bytearray()  # None once passing through

    @classmethod
    def with_max_body(
        cls, max_body: int, reads: Callable[[str, str | None], bool] | None = None
    ) -> type[BodyConnection]:
        attrs: dict[str, Any] = {"max_body": max_body}
        if reads is not None:
            attrs["reads"] = staticmethod(reads)
        return type(cls.__name__, (cls,), attrs)

    def data_received(self, data: bytes) -> None:
        held = self._held
        if held is None:  # every WebSocket frame: one check, then websockets
            if not self._dropping:
                super().data_received(data)
            return
        held += data
        if self._head is None:
            if not held.startswith(POST):
                if len(held) < len(POST) and POST.startswith(held):
                    return  # too short to tell yet
                self._pass(bytes(held))
                return
            # From where the last search stopped: a head trickled a byte at
            # a time must not cost a search of all of it per byte.
            end = held.find(b"\r\n\r\n", max(self._scanned - 3, 0))
            if end < 0:
                self._scanned = len(held)
                if len(held) > MAX_HEAD_BYTES:
                    self._pass(bytes(held))
                return
            head = _read_head(bytes(held[: end + 2]), self.max_body)
            self._head, self._length, self.body_error, expect = head[:4]
            del held[: end + 4]
            if self._length and not self.reads(*head[4:]):
                # websockets answers from the head; the body is not kept.
                self._length, self._dropping = 0, True
            if self.body_error is not None or self._length == 0:
                self._pass(self._head)
                return
            if expect:  # curl waits for this before sending a body over 1 KiB
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if len(held) >= self._length:
            self.body = bytes(held[: self._length])
            self._pass(self._head)

    def _pass(self, data: bytes) -> None:
        self._held = None
        super().data_received(data)


_Head = tuple[bytes, int, BodyError | None, bool, str, str | None]


def _read_head(head: bytes, max_body: int) -> _Head:
    """The head without its body headers (ending in the blank line), the body's
    length, what is wrong with it, whether the client waits for 100 Continue,
    the path, and the Authorization header."""
    kept: list[bytes] = []
    lengths: set[bytes] = set()
    chunked = expect = False
    lines = head.split(b"\r\n")[:-1]
    target = lines[0].split(b" ")[1] if lines[0].count(b" ") >= 2 else b""
    path = target.split(b"?", 1)[0].decode("latin-1")
    authorization: str | None = None
    for i, line in enumerate(lines):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name == b"authorization" and i:
            authorization = value.decode("latin-1")
        if i == 0 or name not in _BODY_HEADERS:
            kept.append(line)
        elif name == b"content-length":
            lengths.add(value)
        elif name == b"transfer-encoding":
            chunked = True
        else:
            expect = value.lower() == b"100-continue"
    out = b"\r\n".join(kept) + b"\r\n\r\n"
    who = (path, authorization)
    if chunked:
        return out, 0, BodyError.LENGTH_REQUIRED, False, *who
    if not lengths:
        return out, 0, None, False, *who
    [length, *others] = lengths
    if others or not length.isdigit() or len(length) > 18:
        return out, 0, BodyError.BAD_LENGTH, False, *who
    if int(length) > max_body:
        return out, 0, BodyError.TOO_LARGE, False, *who
    return out, int(length), None, expect, *who
