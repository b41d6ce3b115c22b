"""Log lines: one JSON object each, with an ISO UTC timestamp, whatever the fields."""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import structlog

from tokenwire import logs


@pytest.fixture
def logging_to_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[], tuple[io.BytesIO, Any]]]:
    """Call it in the test: a logger at info whose lines land in the BytesIO.
    pytest puts its own sys.stderr back before the test body, so one a fixture
    set would be gone."""

    def install() -> tuple[io.BytesIO, Any]:
        raw = io.BytesIO()
        monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))
        logs.configure("info")
        return raw, logs.get_logger("t")

    yield install
    structlog.reset_defaults()


def lines(raw: io.BytesIO) -> list[dict]:
    return [json.loads(line) for line in raw.getvalue().splitlines()]


def test_a_line_is_json_with_level_and_a_utc_timestamp(
    logging_to_bytes: Callable[[], tuple[io.BytesIO, Any]],
) -> None:
    raw, log = logging_to_bytes()
    before = datetime.now(UTC)
    log.info("response_done", session_id="sess_1", usage={"output_tokens": 2}, key_id=None)
    log.debug("dropped", x=1)
    after = datetime.now(UTC)
    [line] = lines(raw)
    stamp = datetime.fromisoformat(line.pop("timestamp"))
    assert before <= stamp <= after
    assert line == {
        "session_id": "sess_1",
        "usage": {"output_tokens": 2},
        "key_id": None,
        "event": "response_done",
        "level": "info",
    }


@pytest.mark.parametrize(
    "ns",
    [0, 1_763_913_469_000_000_000, 1_763_913_469_999_999_999, 1_763_913_470_000_001_000],
)
def test_the_timestamp_is_what_datetime_would_write(
    ns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    stamper = logs.IsoTimeStamper()
    stamper(None, "info", {})  # a second formatted before: the prefix must follow the clock
    monkeypatch.setattr(time, "time_ns", lambda: ns)
    expected = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)
    iso = expected.isoformat(timespec="microseconds").replace("+00:00", "Z")
    assert stamper(None, "info", {})["timestamp"] == iso


def test_fields_json_cannot_hold_are_written_as_their_repr(
    logging_to_bytes: Callable[[], tuple[io.BytesIO, Any]],
) -> None:
    raw, log = logging_to_bytes()
    log.info("odd", addr=("127.0.0.1", 80), obj=object, keys={(1, 2): "x"}, n=float("nan"))
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    odd, failed = lines(raw)
    assert odd["addr"] == ["127.0.0.1", 80]
    assert odd["obj"] == repr(object)
    assert odd["keys"] == {"(1, 2)": "x"}
    assert odd["n"] is None
    assert failed["level"] == "error" and "ValueError: boom" in failed["exception"]


def test_a_text_only_stderr_gets_the_same_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    text = io.StringIO()
    monkeypatch.setattr(sys, "stderr", text)
    try:
        logs.configure("warning")
        logs.get_logger("t").warning("slow_client", session_id="sess_2")
    finally:
        structlog.reset_defaults()
    [line] = [json.loads(x) for x in text.getvalue().splitlines()]
    assert line["event"] == "slow_client" and line["level"] == "warning"
