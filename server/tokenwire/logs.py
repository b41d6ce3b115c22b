"""structlog setup: JSON lines off a TTY, readable colour on one."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import structlog

# The level `configure` set; unconfigured, structlog writes every level.
_level = logging.NOTSET


def redact_url(url: str) -> str:
    """A URL fit for logs, metrics and error messages: scheme://user:password@host
    becomes scheme://***@host."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        # A password with an unencoded "/" ends the netloc early ("user:pa/ss@host");
        # "host:8000/path@x" is a port and a path.
        scheme, sep, rest = url.partition("://")
        userinfo, at, host = rest.split("?")[0].split("#")[0].rpartition("@")
        _, colon, after = userinfo.split("/")[0].partition(":")
        if sep and at and colon and not after.isdigit():
            return f"{scheme}://***@{host}"
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def enabled(level: int) -> bool:
    """Whether lines at `level` are written: a caller on a hot path skips
    building a line's fields (and the call) when they would be dropped."""
    return level >= _level


class IsoTimeStamper:
    """`timestamp` as structlog's `TimeStamper(fmt="iso", utc=True)` writes it,
    for a third of its cost: the date and time of day are formatted once a
    second, not through a datetime per line (whose `utcoffset` call also
    leaves a new name string in the type cache each time)."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second, self._prefix = -1, ""

    def __call__(self, logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
        second, ns = divmod(time.time_ns(), 1_000_000_000)  # floored, as datetime.now
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event["timestamp"] = f"{self._prefix}.{ns // 1000:06d}Z"
        return event


_encoder = msgspec.json.Encoder(enc_hook=repr)


def dumps(event: dict[str, Any], **_: Any) -> bytes:
    """A log line's JSON, by msgspec; what it cannot encode (a key that is not a
    string or number) goes through the json module, with repr for the rest."""
    try:
        return _encoder.encode(event)
    except (TypeError, msgspec.EncodeError):
        return json.dumps(event, default=repr).encode()


def configure(level: str = "info") -> None:
    global _level
    _level = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor
    factory: Any
    stream = getattr(sys.stderr, "buffer", None)
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(sys.stderr)
    elif stream is not None:
        renderer = structlog.processors.JSONRenderer(serializer=dumps)
        factory = structlog.BytesLoggerFactory(stream)
    else:  # a text-only stderr (a test's StringIO)
        renderer = structlog.processors.JSONRenderer(serializer=lambda e, **_: dumps(e).decode())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            IsoTimeStamper(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
