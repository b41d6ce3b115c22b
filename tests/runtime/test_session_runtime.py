"""A session runtime's own resources over its life, on a socket without a
network (helpers.socket): tool timers, and what an ended session still does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from tokenwire.config import ServerConfig
from tokenwire.core.outbox import estimate_size
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.runtime.session_runtime import SessionRuntime
from tokenwire.wire import dialect_for

from ..helpers.socket import open_socket, sent_events, types_sent
from ..helpers.template_engine import TemplateEngine
from ..helpers.tools import TIME
from ..helpers.wait import until


@pytest.fixture
async def runtime() -> AsyncIterator[SessionRuntime]:
    subprotocol = "tokenwire.v1.json"  # tool flow: requires_action, then outputs
    config = ServerConfig(engine="scripted", max_events_per_s=0)
    rt = SessionRuntime(ScriptedEngine(), config, subprotocol=subprotocol)
    rt.attach(open_socket(), dialect_for(subprotocol))  # type: ignore[arg-type]
    rt.go_live()
    yield rt
    await rt.end()


def send(rt: SessionRuntime, event: dict) -> None:
    rt.receive(json.dumps(event))


async def wait_tools(rt: SessionRuntime, n: int) -> str:
    """Ask for a forced call; returns its call id once `n` responses wait for outputs."""
    hi = [{"type": "message", "role": "user", "content": "hi"}]
    send(rt, {"type": "response.create", "response": {"conversation": "none", "input": hi}})
    await until(lambda: types_sent(rt.ws).count("response.requires_action") == n, "requires_action")
    return [e for e in sent_events(rt.ws) if e["type"] == "response.requires_action"][-1][
        "call_ids"
    ][0]


async def test_tool_timers_end_with_the_wait(runtime: SessionRuntime) -> None:
    rt = runtime
    send(rt, {"type": "session.update", "session": {"tools": [TIME], "tool_choice": "required"}})
    send(rt, {"type": "session.update", "session": {"tool_timeout_s": 3600}})
    for n in range(1, 4):  # cancelled while waiting: the timer goes with the response
        await wait_tools(rt, n)
        assert len(rt._timers) == 1
        send(rt, {"type": "response.cancel"})
        assert types_sent(rt.ws)[-1] == "response.done"
        assert rt._timers == {}
    # Outputs in: the wait is over and the response goes on, without its timer.
    call_id = await wait_tools(rt, 4)
    item = {"type": "function_call_output", "call_id": call_id, "output": "noon"}
    send(rt, {"type": "conversation.item.create", "item": item})
    assert rt._timers == {} and rt.session.active_responses
    await until(lambda: types_sent(rt.ws).count("response.done") == 4, "the answer")
    assert rt._timers == {}


async def test_an_ended_session_serves_its_socket_no_more(runtime: SessionRuntime) -> None:
    """A drain without Redis ends sessions whose sockets are still open."""
    rt, ws = runtime, runtime.ws
    await rt.end()
    await until(lambda: ws.close_code == 1001, "the socket closed: going away")
    written = len(ws.transport.written)
    send(rt, {"type": "response.create", "response": {"max_output_tokens": 50}})
    rt.receive("{")  # not even an error answers
    assert not rt.tasks and not rt.session.active_responses
    assert len(ws.transport.written) == written
    # Were anything still to come out, it would not reach the socket.
    rt.delivery.send([{"type": "error"}])
    assert len(ws.transport.written) == written


class SlowAbort(ScriptedEngine):
    """A scripted engine whose abort takes a while, as a remote replica's
    abort request does: `aborted` is set once it has run."""

    def __init__(self) -> None:
        super().__init__(tokens_per_s=100)
        self.aborted = False

    async def generate(self, request):  # type: ignore[no-untyped-def,override]
        try:
            async for delta in super().generate(request):
                yield delta
        except BaseException:
            await asyncio.sleep(0.2)  # the abort's round trip
            self.aborted = True
            raise


async def test_an_ended_session_waits_for_its_engine_aborts() -> None:
    """end() (a drain, a hand-over) goes on only once the generations it
    cancelled have run their engine aborts, not before."""
    subprotocol = "tokenwire.v1.json"
    engine = SlowAbort()
    rt = SessionRuntime(engine, ServerConfig(engine="scripted", max_events_per_s=0))
    rt.attach(open_socket(), dialect_for(subprotocol))  # type: ignore[arg-type]
    rt.go_live()
    send(rt, {"type": "response.create", "response": {"max_output_tokens": 1000}})
    await until(lambda: "response.output_text.delta" in types_sent(rt.ws), "a delta")
    await rt.end()
    assert engine.aborted
    assert not rt.tasks


async def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    """A response.create whose prompt is long has it tokenized in a thread while
    the loop goes on; the next frame waits for it, and the session counts the
    event once."""
    subprotocol = "tokenwire.v1.json"
    engine = TemplateEngine()
    rt = SessionRuntime(engine, ServerConfig(engine="scripted", max_events_per_s=0))
    rt.attach(open_socket(), dialect_for(subprotocol))  # type: ignore[arg-type]
    rt.go_live()
    try:
        short = {"type": "message", "role": "user", "content": "Hello"}
        send(
            rt, {"type": "response.create", "response": {"conversation": "none", "input": [short]}}
        )
        assert engine.encodes.on_loop(engine.encodes.calls[-1])  # a short prompt: on the loop
        long = {"type": "message", "role": "user", "content": "tell me more " * 1000}
        assert rt.receive(json.dumps({"type": "conversation.item.create", "item": long})) is None
        later = rt.receive(json.dumps({"type": "response.create", "event_id": "long"}))
        assert later is not None and not isinstance(later, dict)
        assert not [e for e in sent_events(rt.ws) if e.get("event_id") == "long"]  # not yet
        assert rt.session.client_events == 2  # not taken yet: a resume now must resend it
        await later
        created = [e for e in sent_events(rt.ws) if e["type"] == "response.created"]
        assert created[-1]["event_id"] == "long"
        (encode,) = engine.encodes.long(12_000)  # tokenized once,
        assert not engine.encodes.on_loop(encode)  # in a thread,
        assert encode.loop_ran  # while the loop went on
        assert rt.session.client_events == 3
    finally:
        await rt.end()


async def test_a_prompt_that_changed_meanwhile_is_tokenized_off_the_loop_again() -> None:
    """The conversation changes while the thread tokenizes (as a steer's prompt
    grows with each token): the next try asks for a thread again."""
    engine = TemplateEngine()
    rt = SessionRuntime(engine, ServerConfig(engine="scripted", max_events_per_s=0))
    rt.attach(open_socket(), dialect_for("tokenwire.v1.json"))  # type: ignore[arg-type]
    rt.go_live()
    try:
        long = {"type": "message", "role": "user", "content": "tell me more " * 500}
        rt.receive(json.dumps({"type": "conversation.item.create", "item": long}))
        later = rt.receive(json.dumps({"type": "response.create", "event_id": "long"}))
        assert later is not None and not isinstance(later, dict)
        # Meanwhile the prompt changes under it.
        more = {"type": "message", "role": "user", "content": "and more"}
        rt.session.receive_client_event({"type": "conversation.item.create", "item": more})
        await later
        created = [e for e in sent_events(rt.ws) if e["type"] == "response.created"]
        assert created[-1]["event_id"] == "long"
        long_encodes = engine.encodes.long()
        assert len(long_encodes) == 2
        assert not any(engine.encodes.on_loop(e) for e in long_encodes)
    finally:
        await rt.end()


async def test_only_events_that_change_the_session_snapshot_it(runtime: SessionRuntime) -> None:
    """A durable log rewrites the snapshot (the whole conversation) after an
    event that changed it; a retrieve, an error or a delta changes nothing."""
    item = {"type": "message", "role": "user", "content": "hello " * 1000}
    send(runtime, {"type": "conversation.item.create", "item": item})
    item_id = runtime.session.items[-1]["id"]
    send(runtime, {"type": "conversation.item.retrieve", "item_id": item_id})
    send(runtime, {"type": "conversation.item.retrieve", "item_id": "nope"})
    sent = sent_events(runtime.ws)
    by_type = {e["type"]: e for e in sent}
    retrieved, error = by_type["conversation.item.retrieved"], by_type["error"]
    assert runtime.log_state([retrieved]).snapshot is None
    assert runtime.log_state([error]).snapshot is None
    state = runtime.log_state([by_type["conversation.item.created"]])
    assert state.snapshot is not None and state.client_events == 3


async def test_a_session_resumed_its_socket_never_got_is_not_delivered_later(
    runtime: SessionRuntime,
) -> None:
    """The socket dies between its replay and the writer's turn: its
    session.resumed (that resume's last_seq and replayed) must not reach the
    next resume's socket beside that one's own."""
    rt = runtime
    rt.push_resumed(last_seq=0, replayed=0)  # queued first; the writer has not run
    await rt.detach("lost")
    queued = [e["type"] for e in rt.delivery.outbox]
    assert "session.resumed" not in queued
    assert rt.delivery.outbox.pending_bytes == sum(estimate_size(e) for e in rt.delivery.outbox)


async def test_each_paused_generation_is_counted(runtime: SessionRuntime) -> None:
    """tokenwire_generation_pauses_total counts generations, as documented:
    a client falling behind with two running counts two."""
    from prometheus_client import REGISTRY

    def pauses() -> float:
        return REGISTRY.get_sample_value("tokenwire_generation_pauses_total") or 0.0

    rt = runtime
    hi = [{"type": "message", "role": "user", "content": "hi"}]
    for _ in range(2):
        create = {
            "conversation": "none",
            "input": hi,
            "ignore_eos": True,
            "max_output_tokens": 5000,
        }
        send(rt, {"type": "response.create", "response": create})
    await until(lambda: len(rt.tasks) == 2, "two generations running")
    before = pauses()
    rt.fall_behind("hard_cap")
    assert pauses() == before + 2


async def test_a_long_prompts_tokenizing_counts_in_its_response_timings() -> None:
    """A prompt over the off-loop threshold is tokenized in a thread and the
    response.create taken again: its timings (TTFT, total) start when the
    client sent it, not when the tokens were ready."""
    import time

    from tokenwire.engines.base import TOKENIZE_OFF_LOOP, TokenizeOffLoop

    pause_s = 0.4

    memo: dict[str, list[int]] = {}

    class SlowTokenizer(ScriptedEngine):
        def preflight(self, request):  # type: ignore[no-untyped-def]
            text = "".join(m.get("content") or "" for m in request.messages)
            if len(text) > 4096 and text not in memo:
                if TOKENIZE_OFF_LOOP.get():
                    raise TokenizeOffLoop(
                        text,
                        lambda t: (time.sleep(pause_s), [1])[1],
                        lambda ids: memo.__setitem__(text, ids),
                    )
                time.sleep(pause_s)
                memo[text] = [1]
            return super().preflight(request)

    config = ServerConfig(engine="scripted", max_events_per_s=0)
    rt = SessionRuntime(SlowTokenizer(tokens_per_s=0), config, subprotocol="tokenwire.v1.json")
    rt.attach(open_socket(), dialect_for("tokenwire.v1.json"))  # type: ignore[arg-type]
    rt.go_live()
    try:
        long = {"type": "message", "role": "user", "content": "x" * 5000}
        send(rt, {"type": "conversation.item.create", "item": long})
        later = rt.receive(json.dumps({"type": "response.create"}))
        assert later is not None  # tokenized off the loop
        await later
        await until(lambda: "response.done" in types_sent(rt.ws), "the response ends")
        done = [e for e in sent_events(rt.ws) if e["type"] == "response.done"][-1]
        assert done["response"]["status"] == "completed"
        timings = done["response"]["timings"]
        assert timings["ttft_ms"] >= pause_s * 1000 and timings["total_ms"] >= pause_s * 1000
    finally:
        await rt.end()


async def test_a_fence_during_a_drain_hand_over_uncounts_its_responses_once(
    runtime: SessionRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-over took its running responses out of
    tokenwire_active_responses, and a fence that hit while it wrote the
    snapshot (another instance took the session) took them out again: -N."""
    from tokenwire import metrics
    from tokenwire.runtime.cluster import hand_over

    rt = runtime
    before = metrics.ACTIVE_RESPONSES.value
    send(
        rt, {"type": "response.create", "response": {"ignore_eos": True, "max_output_tokens": 500}}
    )
    await until(lambda: "response.output_text.delta" in types_sent(rt.ws), "streaming")
    assert metrics.ACTIVE_RESPONSES.value == before + 1

    async def fenced(snapshot: object) -> None:
        await rt.lost_ownership()

    monkeypatch.setattr(type(rt.delivery.log), "durable", True)
    monkeypatch.setattr(rt.delivery, "hand_over", fenced)
    await hand_over(rt)
    assert metrics.ACTIVE_RESPONSES.value == before
