"""Session snapshots for handover and takeover, driven without sockets or Redis.

What another instance gets is a snapshot (msgpack round trip, as in Redis)
plus the delta events and progress logged after it; from those it must
continue the same response exactly where the old owner stopped."""

from __future__ import annotations

from typing import Any

from tokenwire.core.events import AbortGeneration, CancelTimer, StartGeneration, StartTimer
from tokenwire.core.session import Session
from tokenwire.engines.base import EngineDelta
from tokenwire.storage.redis import pack, unpack

from ..helpers.session import begin, call, drive, output, start, types

STRUCTURE_FREE = {"response.output_text.delta", "response.function_call_arguments.delta"}


def over_the_wire(s: Session) -> dict[str, Any]:
    return unpack(pack(s.snapshot()))


def test_text_generation_continues_after_the_logged_tokens() -> None:
    s = Session()
    rid, action = start(s, "tell me", max_output_tokens=10)
    rq = action.request.request_id
    s.receive_engine_output(rq, EngineDelta("Hello", 1, None, 5, 0, token_ids=[11]))
    snapshot = over_the_wire(s)  # the batch had structural events
    s.events_to_send()
    # Two more batches of deltas only: logged with their progress.
    logged: list[tuple[list[dict[str, Any]], Any]] = []
    for text, tid in ((" wide", 12), (" world", 13)):
        s.receive_engine_output(rq, EngineDelta(text, 1, token_ids=[tid]))
        events = s.events_to_send()
        assert {e["type"] for e in events} <= STRUCTURE_FREE
        logged.append((events, unpack(pack(s.progress()))))
    # The owner dies here. Another instance restores and folds the log in.
    r = Session.restore(snapshot)
    assert r.events_to_send() == []  # no second session.created
    for events, progress in logged:
        for event in events:
            r.replay_delta(event)
        r.restore_progress(progress)
    assert r.resume() == [rid]
    (cont,) = r.actions_to_perform()
    assert isinstance(cont, StartGeneration) and cont.response_id == rid
    assert cont.request.resume_token_ids == (11, 12, 13)
    assert cont.request.max_output_tokens == 7  # 10 minus the 3 already made
    assert cont.request.messages == action.request.messages  # the original prompt
    r.receive_engine_output(cont.request.request_id, EngineDelta("!", 1, "stop", token_ids=[14]))
    events = r.events_to_send()
    assert types(events) == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.done",
    ]
    assert events[0]["item_id"] == logged[0][0][0]["item_id"]  # the same item goes on
    assert events[1]["text"] == "Hello wide world!"
    done = events[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed"
    assert done["usage"]["output_tokens"] == 4
    # The history has the one assistant item, complete.
    assert [i["content"] for i in r.items] == ["tell me", "Hello wide world!"]


def test_a_response_waiting_for_tools_waits_on_the_new_instance() -> None:
    s = Session()
    action = begin(s, tool_choice={"type": "function", "name": "get_weather"})
    call(s, action.request.request_id, 0, "get_weather", '{"city": "Paris"}', finish="stop")
    (call_id,) = [c for c in s.responses[action.response_id].pending_calls]
    r = Session.restore(over_the_wire(s))
    (timer,) = r.actions_to_perform()  # the tool timeout runs again
    assert isinstance(timer, StartTimer) and timer.response_id == action.response_id
    assert r.resume() == []  # nothing was generating
    created = output(r, call_id, '{"sky": "sunny"}')
    assert types(created) == ["conversation.item.created"]
    cancel, cont = r.actions_to_perform()
    assert cancel == CancelTimer(action.response_id)
    assert isinstance(cont, StartGeneration) and cont.response_id == action.response_id
    assert [m["role"] for m in cont.request.messages] == ["user", "assistant", "tool"]
    # A late timer from before the handover does nothing.
    r.receive_timeout(action.response_id, timer.token - 1)
    assert r.events_to_send() == []


def test_a_tool_call_cut_off_mid_arguments_is_made_again() -> None:
    s = Session()
    action = begin(s, tool_choice="required")
    call(s, action.request.request_id, 0, "get_weather", '{"ci')
    r = Session.restore(over_the_wire(s))
    assert r.resume() == [action.response_id]
    (again,) = r.actions_to_perform()
    # Parser state did not survive: a fresh generation, not a token resume.
    assert isinstance(again, StartGeneration) and again.request.resume_token_ids == ()
    assert again.request.tool_choice == "required"
    assert r.responses[action.response_id].output == []  # the partial call is gone


def test_suspend_stops_generation_without_ending_the_response() -> None:
    s = Session()
    rid, action = start(s)
    s.actions_to_perform()
    s.suspend()
    (abort,) = s.actions_to_perform()
    assert isinstance(abort, AbortGeneration) and abort.request_id == action.request.request_id
    assert s.events_to_send() == []  # no response.done: the client will see it finish elsewhere
    assert s.responses[rid].active


def test_snapshot_keeps_the_conversation_and_settings() -> None:
    s = Session()
    drive(s, {"type": "session.update", "session": {"instructions": "Be brief.", "temperature": 0}})
    rid, action = start(s, "one")
    s.receive_engine_output(action.request.request_id, EngineDelta("uno", 1, "stop"))
    s.events_to_send()
    r = Session.restore(over_the_wire(s))
    assert r.id == s.id and r.config == s.config
    assert r.items == s.items and r.history_bytes == s.history_bytes
    # A finished response is still known as finished.
    events = drive(r, {"type": "response.cancel", "response_id": rid, "event_id": "x"})
    assert events[0]["error"]["code"] == "response_not_active"
    _, action2 = start(r, "two")
    assert [m["content"] for m in action2.request.messages] == ["Be brief.", "one", "uno", "two"]


def test_abandon_frees_the_key_quota_and_says_nothing() -> None:
    class Quota:
        held = 0

        def acquire_response(self) -> None:
            self.held += 1

        def release_response(self) -> None:
            self.held -= 1

        def spend_tokens(self, n: int) -> None:
            pass

    quota = Quota()
    s = Session(quota=quota)
    start(s)
    assert quota.held == 1
    s.abandon()
    assert quota.held == 0 and not s.active_responses
    assert s.events_to_send() == []
    assert isinstance(s.actions_to_perform()[-1], AbortGeneration)


def test_the_client_event_count_survives_a_takeover() -> None:
    s = Session()
    start(s, "one")
    r = Session.restore(over_the_wire(s))
    assert r.client_events == s.client_events == 2
