"""structlog setup: JSON lines off a TTY, readable colour on one."""

from __future__ import annotations

import logging
import sys

import structlog

# The level `configure` set; unconfigured, structlog writes every level.
_level = logging.NOTSET


def enabled(level: int) -> bool:
    """Whether lines at `level` are written: a caller on a hot path skips
    building a line's fields (and the call) when they would be dropped."""
    return level >= _level


def configure(level: str = "info") -> None:
    global _level
    _level = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
