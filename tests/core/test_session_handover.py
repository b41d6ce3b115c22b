"""Session snapshots for handover and takeover, driven without sockets or Redis.

What another instance gets is a snapshot (msgpack round trip, as in Redis)
plus the delta events and progress logged after it; from those it must
continue the same response exactly where the old owner stopped."""

from __future__ import annotations

from typing import Any

import pytest

from tokenwire.core import snapshot as snapshots
from tokenwire.core.events import AbortGeneration, CancelTimer, StartGeneration, StartTimer
from tokenwire.core.session import Session
from tokenwire.core.tools import ToolFlow
from tokenwire.engines.base import EngineDelta
from tokenwire.storage.redis import pack, unpack

from ..helpers.session import begin, call, codes, drive, output, start, types
from ..helpers.tools import WEATHER

USER = {"type": "message", "role": "user", "content": "private"}
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
    assert cont.request.resumed_text == "Hello wide world"  # what guardrails check on from
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
    assert "previous_item_id" not in events[0]  # placed by its first delta, long ago
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
    # A frame read meanwhile starts nothing here and is not counted as taken:
    # the client resends it to the instance that continues the session.
    taken = s.client_events
    drive(s, {"type": "response.create", "response": {"conversation": "none"}})
    assert s.actions_to_perform() == [] and s.events_to_send() == []
    assert s.client_events == taken
    assert Session.restore(over_the_wire(s)).client_events == taken
    # The slow client catches up while the hand-over waits for the aborts:
    # nothing starts again here (the other instance continues it).
    assert s.resume() == []
    assert s.actions_to_perform() == []


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

        def hold_response(self) -> None:
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


def test_a_restored_response_counts_against_its_key_even_past_the_limit() -> None:
    """The key is at its response limit on the instance that takes over (its
    other sessions run there): the restored response counts all the same, so
    its end gives back exactly what it took."""
    from tokenwire.server.admission import KeyUsage

    s = Session()
    start(s)
    usage = KeyUsage("k", 1, None)
    assert usage.acquire_response() is None  # another session's response: the key is full
    r = Session.restore(over_the_wire(s), quota=usage)
    assert usage.responses == 2
    assert r.resume()
    (again,) = r.actions_to_perform()
    r.receive_engine_output(again.request.request_id, EngineDelta("done", 1, "stop"))
    assert r.events_to_send()[-1]["response"]["status"] == "completed"
    assert usage.responses == 1  # only the other session's response


def test_the_client_event_count_survives_a_takeover() -> None:
    s = Session()
    start(s, "one")
    r = Session.restore(over_the_wire(s))
    assert r.client_events == s.client_events == 2


def _usage_after(
    takeover: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A response whose first delta (with the prompt's usage) is logged only
    as a delta batch, then continued: on the same instance (after a pause), or
    by another."""
    clock = [100.0]
    # The wall clock (what instances share) moves with this test's clock.
    monkeypatch.setattr(snapshots.time, "time", lambda: 1.7e9 + clock[0])
    s = Session(clock=lambda: clock[0])
    _, action = start(s, "tell me", max_output_tokens=10)
    snapshot = over_the_wire(s)
    s.events_to_send()
    clock[0] += 0.05
    s.receive_engine_output(
        action.request.request_id,
        EngineDelta(
            "Hello", 1, None, 12, 8, token_ids=[11], queue_wait_s=0.5, cached_response=True
        ),
    )
    events = s.events_to_send()
    assert {e["type"] for e in events} <= STRUCTURE_FREE
    progress = unpack(pack(s.progress()))
    if takeover:
        s = Session.restore(snapshot, clock=lambda: clock[0])
        for event in events:
            s.replay_delta(event)
        s.restore_progress(progress)
    else:
        s.pause()  # the client fell behind, then caught up
    s.resume()
    (cont,) = [a for a in s.actions_to_perform() if isinstance(a, StartGeneration)]
    clock[0] += 1.0
    s.receive_engine_output(
        cont.request.request_id, EngineDelta(" world", 1, "stop", 13, 12, token_ids=[12])
    )
    (done,) = [e["response"] for e in s.events_to_send() if e["type"] == "response.done"]
    return done["usage"], done["timings"]


def test_a_takeover_keeps_the_usage_and_timings_logged_after_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    same_usage, same_timings = _usage_after(False, monkeypatch)
    usage, timings = _usage_after(True, monkeypatch)
    assert usage == same_usage
    assert usage["input_tokens"] == 25 and usage["cached_tokens"] == 20
    assert usage.get("cached_response") is True
    assert timings["queue_wait_ms"] == same_timings["queue_wait_ms"] == 500.0
    assert timings["ttft_ms"] == same_timings["ttft_ms"] == 50.0


def test_out_of_band_responses_are_the_same_after_a_restore() -> None:
    """What conversation:"none" responses left (a finished one's call, which
    retrieve finds and whose late output is refused as response_not_active)
    and keep private (an active one's input) survive a snapshot unchanged."""
    s = Session()
    s.events_to_send()
    drive(s, {"type": "session.update", "session": {"tools": [WEATHER]}})
    question = {"type": "message", "role": "user", "content": "Paris"}
    drive(
        s,
        {
            "type": "response.create",
            "response": {"conversation": "none", "tool_choice": "required", "input": [question]},
        },
    )
    (gen,) = s.actions_to_perform()
    events = call(s, gen.request.request_id, 0, "get_weather", '{"city": "Paris"}', "stop")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    drive(s, {"type": "response.cancel"})
    private = {"type": "message", "role": "user", "content": "private", "id": "X"}
    drive(s, {"type": "response.create", "response": {"conversation": "none", "input": [private]}})
    public = {"type": "message", "role": "user", "content": "public", "id": "X"}
    drive(s, {"type": "conversation.item.create", "item": public})
    r = Session.restore(over_the_wire(s))

    def probe(session: Session) -> list[Any]:
        late = {"type": "function_call_output", "call_id": done["call_id"], "output": "sunny"}
        retrieve_call = {"type": "conversation.item.retrieve", "item_id": done["item_id"]}
        (got_x,) = drive(session, {"type": "conversation.item.retrieve", "item_id": "X"})
        return [
            codes(drive(session, {"type": "conversation.item.create", "item": late})),
            types(drive(session, retrieve_call)),
            got_x["item"]["content"],
            types(drive(session, {"type": "conversation.item.delete", "item_id": "X"})),
        ]

    expected = [
        ["response_not_active"],
        ["conversation.item.retrieved"],
        "public",
        ["conversation.item.deleted"],
    ]
    assert probe(s) == expected
    assert probe(r) == expected


def test_an_openai_input_response_keeps_its_context_and_writes_the_conversation() -> None:
    """conversation "auto" with OpenAI's `input`: the prompt is the input (its
    item "X" private, though the conversation has an "X" too), the output item
    is the conversation's and the context's, the same one after a restore."""
    s = Session(tool_flow=ToolFlow.CLIENT)
    s.events_to_send()
    drive(s, {"type": "conversation.item.create", "item": {**USER, "content": "history"}})
    drive(s, {"type": "response.create", "response": {"input": [{**USER, "id": "X"}]}})
    (gen,) = s.actions_to_perform()
    s.receive_engine_output(gen.request.request_id, EngineDelta("Hel", 1, None, 5, 0))
    drive(s, {"type": "conversation.item.create", "item": {**USER, "id": "X", "content": "pub"}})
    r = Session.restore(over_the_wire(s), tool_flow=ToolFlow.CLIENT)
    for session in (s, r):
        (resp,) = session.active_responses
        assert resp.context[-1] is resp.output[0] is session.items[1]
        assert [i["content"] for i in resp.context] == ["private", "Hel"]
        assert session.conversation.by_id["X"]["content"] == "pub"
    assert r.resume() == [resp.id]
    (cont,) = r.actions_to_perform()
    assert cont.request.messages == gen.request.messages == [{"role": "user", "content": "private"}]
    r.receive_engine_output(cont.request.request_id, EngineDelta("lo", 1, "stop"))
    assert r.events_to_send()[-1]["response"]["output"][0]["content"] == "Hello"
    assert [i["content"] for i in r.items] == ["history", "Hello", "pub"]


def test_an_openai_out_of_band_response_keeps_the_conversation_it_read() -> None:
    """conversation "none" without `input` (OpenAI): the prompt is the
    conversation as it was; after a restore it still is, the items shared
    with the conversation, and its output goes to neither."""
    s = Session(tool_flow=ToolFlow.CLIENT)
    s.events_to_send()
    drive(s, {"type": "conversation.item.create", "item": {**USER, "content": "history"}})
    drive(s, {"type": "response.create", "response": {"conversation": "none"}})
    (gen,) = s.actions_to_perform()
    s.receive_engine_output(gen.request.request_id, EngineDelta("Top", 1, None, 5, 0))
    drive(s, {"type": "conversation.item.create", "item": {**USER, "content": "later"}})
    r = Session.restore(over_the_wire(s), tool_flow=ToolFlow.CLIENT)
    for session in (s, r):
        (resp,) = session.active_responses
        assert [i["content"] for i in resp.context] == ["history", "Top"]
        assert resp.context[0] is session.items[0]
        assert [i["content"] for i in session.items] == ["history", "later"]
    assert r.resume() == [resp.id]
    (cont,) = r.actions_to_perform()
    assert gen.request.messages == [{"role": "user", "content": "history"}]
    assert cont.request.messages[0] == gen.request.messages[0]
    r.receive_engine_output(cont.request.request_id, EngineDelta("ic", 1, "stop"))
    assert r.events_to_send()[-1]["response"]["output"][0]["content"] == "Topic"
    assert [i["content"] for i in r.items] == ["history", "later"]


def test_a_restored_session_keeps_the_rules_of_the_dialect_it_began_with() -> None:
    """Resumed on a socket of any dialect, an OpenAI session reads "root" as
    the conversation's start, as it did."""
    s = Session(tool_flow=ToolFlow.CLIENT)
    s.events_to_send()
    drive(s, {"type": "conversation.item.create", "item": {**USER, "content": "second"}})
    r = Session.restore(over_the_wire(s))  # the socket's flow: tokenwire v1's default
    first = {"type": "conversation.item.create", "previous_item_id": "root", "item": USER}
    (created,) = drive(r, first)
    assert created["type"] == "conversation.item.created"
    assert [i["content"] for i in r.items] == [USER["content"], "second"]


def test_a_restore_that_fails_holds_none_of_the_keys_response_slots() -> None:
    """A corrupt snapshot, or a malformed entry logged after it (a newer
    version's shape, say): the restore fails, and the key's response count
    is what it was, not one more per response it had read."""
    from types import SimpleNamespace

    from tokenwire.runtime.session_runtime import _restore
    from tokenwire.server.admission import KeyUsage

    s = Session()
    rid, _ = start(s, "one")
    start(s, "two", conversation="none")
    usage = KeyUsage("k", 8, None)
    broken = over_the_wire(s)
    del broken["responses"][1]["status"]  # the second of two responses is corrupt
    with pytest.raises(KeyError):
        Session.restore(broken, quota=usage)
    assert usage.responses == 0
    state = {"session": over_the_wire(s), "seq": 3}
    entry = SimpleNamespace(
        decoded={"type": "response.output_text.delta", "response_id": rid},  # no delta
        progress=None,
        client_events=None,
        seq=4,
    )
    with pytest.raises(KeyError):
        _restore((state, [entry]), {"quota": usage})
    assert usage.responses == 0
    _restore((state, []), {"quota": usage})  # whole, it holds both
    assert usage.responses == 2


def test_a_taken_over_generation_never_reuses_the_old_owners_request_id() -> None:
    """A pause and resume after the last snapshot numbers the next request on
    the old owner; the new owner counted from the snapshot and sent the same
    id, which a fenced old owner could still abort (a shared remote replica)."""
    s = Session()
    rid, action = start(s, "tell me", max_output_tokens=50)
    s.receive_engine_output(
        action.request.request_id, EngineDelta("Hi", 1, None, 5, 0, token_ids=[1])
    )
    snapshot = over_the_wire(s)
    s.events_to_send()
    used = {action.request.request_id}
    for _ in range(2):  # backpressure: paused and resumed, no structural event
        assert s.pause() == [rid]
        s.actions_to_perform()
        assert s.resume() == [rid]
        (again,) = [a for a in s.actions_to_perform() if isinstance(a, StartGeneration)]
        used.add(again.request.request_id)
    r = Session.restore(snapshot)
    assert r.resume() == [rid]
    (cont,) = r.actions_to_perform()
    assert isinstance(cont, StartGeneration) and cont.request.request_id not in used
    assert cont.request.request_id.startswith(f"{rid}-2")
