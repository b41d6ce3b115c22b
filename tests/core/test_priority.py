"""Priority lanes in the session: the field, its checks, the per-key floor,
and the queue wait in response.done."""

from __future__ import annotations

import pytest

from tokenwire.core.events import StartGeneration
from tokenwire.core.session import Session, SessionLimits
from tokenwire.engines.base import EngineDelta

from ..helpers.session import codes, drive


def create(s: Session, **response: object) -> tuple[list, list]:
    return drive(s, {"type": "response.create", "response": response}, actions=True)


def test_session_priority_reaches_every_generation() -> None:
    s = Session()
    drive(s)
    (ev,) = drive(s, {"type": "session.update", "session": {"priority": 5}})
    assert ev["session"]["priority"] == 5
    (start,), _ = create(s)
    assert isinstance(start, StartGeneration) and start.request.priority == 5
    assert start.request.session_id == s.id


def test_response_priority_overrides_the_session() -> None:
    s = Session()
    drive(s, {"type": "session.update", "session": {"priority": 5}})
    (start,), _ = create(s, priority=-3, conversation="none")
    assert start.request.priority == -3
    (start,), _ = create(s, conversation="none")
    assert start.request.priority == 5


@pytest.mark.parametrize("bad", ["high", 1.5, True, None, 1 << 31, -(1 << 31) - 1, [1]])
@pytest.mark.parametrize("where", ["session", "response"])
def test_bad_priority_is_invalid_field_and_the_session_goes_on(where: str, bad: object) -> None:
    s = Session()
    drive(s)
    if where == "session":
        events = drive(s, {"type": "session.update", "session": {"priority": bad}})
    else:
        events = drive(s, {"type": "response.create", "response": {"priority": bad}})
    if bad is None:  # null means "as is": not an error
        assert codes(events) == []
        return
    assert codes(events) == ["invalid_field"]
    assert events[0]["error"]["param"] == f"{where}.priority"
    (ev,) = drive(s, {"type": "session.update", "session": {"priority": 1}})
    assert ev["type"] == "session.updated"


def test_a_keys_floor_caps_the_priority_and_is_its_default() -> None:
    s = Session(limits=SessionLimits(min_priority=10))
    (created,) = drive(s)
    assert created["session"]["priority"] == 10  # a batch key's sessions start at its floor
    events = drive(s, {"type": "session.update", "event_id": "u", "session": {"priority": 0}})
    assert codes(events) == ["priority_not_allowed"]
    assert events[0]["error"]["event_id"] == "u"
    assert events[0]["error"]["param"] == "session.priority"
    events = drive(s, {"type": "response.create", "response": {"priority": 9}})
    assert codes(events) == ["priority_not_allowed"]
    assert not s.responses  # nothing started
    (start,), _ = create(s, priority=20)
    assert start.request.priority == 20
    (ev,) = drive(s, {"type": "session.update", "session": {"priority": 10}})
    assert ev["session"]["priority"] == 10


def test_queue_wait_is_in_the_timings() -> None:
    s = Session()
    drive(s)
    (start,), _ = create(s, conversation="none")
    rid = start.request.request_id
    s.receive_engine_output(rid, EngineDelta("hi", 1, None, 5, 0, queue_wait_s=0.25))
    s.receive_engine_output(rid, EngineDelta("!", 1, "stop"))
    done = drive(s)[-1]
    assert done["type"] == "response.done"
    assert done["response"]["timings"]["queue_wait_ms"] == 250.0
