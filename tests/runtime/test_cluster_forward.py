"""Frames a follower forwards to the session's owner (cluster): a long prompt
is tokenized off the event loop, and the session's frames stay in order."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from tokenwire.config import ServerConfig
from tokenwire.runtime.cluster import receive_forwarded
from tokenwire.runtime.session_runtime import RuntimeState, SessionRuntime
from tokenwire.server.app import _take as take_for_resume
from tokenwire.wire import dialect_for

from ..helpers.socket import open_socket
from ..helpers.template_engine import TemplateEngine
from ..helpers.wait import until


def queued(rt: SessionRuntime) -> list[dict[str, Any]]:
    """What waits for a socket (without Redis nothing is written meanwhile)."""
    return list(rt.delivery.outbox)


def frame(event: dict[str, Any]) -> str:
    return json.dumps(event)


LONG = {"type": "message", "role": "user", "content": "tell me more " * 1000}
ITEM = {"type": "message", "role": "user", "content": "and then?"}


def remote_runtime(engine: TemplateEngine) -> SessionRuntime:
    """A session with its client socket attached on this instance."""
    rt = SessionRuntime(engine, ServerConfig(engine="scripted", max_events_per_s=0))
    rt.attach(open_socket(), dialect_for("tokenwire.v1.json"))  # type: ignore[arg-type]
    rt.go_live()
    return rt


def forward_long_then_more(rt: SessionRuntime, follower: str = "f1") -> None:
    """A long item, the response.create that tokenizes it, then one more item."""
    for event in (
        {"type": "conversation.item.create", "item": LONG},
        {"type": "response.create", "event_id": "long"},
        {"type": "conversation.item.create", "event_id": "after", "item": ITEM},
    ):
        receive_forwarded(rt, "frame", frame(event), follower)


def resumed_counts(rt: SessionRuntime) -> list[tuple[int, int]]:
    """(last_seq, client_events) of each session.resumed queued, the latest
    first (each goes ahead of what is queued)."""
    return [
        (e["last_seq"], e["client_events"]) for e in queued(rt) if e["type"] == "session.resumed"
    ]


async def test_a_forwarded_long_prompt_is_tokenized_off_the_loop_in_order() -> None:
    """The owner tokenizes a forwarded response.create's long prompt in a
    thread; the session's next frame waits behind it, and a follower
    attaching meanwhile is told of every frame taken, so it resends none."""
    engine = TemplateEngine()
    rt = remote_runtime(engine)
    await rt.detach("lost")
    receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")
    assert rt.state is RuntimeState.REMOTE
    try:
        forward_long_then_more(rt)
        # The client moves to another follower while the prompt is tokenized.
        receive_forwarded(rt, "attach", {"last_seq": 2}, "f2")
        assert rt.session.client_events == 1  # neither taken yet
        await until(lambda: rt.forwarded is None, "the forwarded frames taken", every=0.01)
        (long,) = engine.encodes.long()  # once,
        assert not engine.encodes.on_loop(long) and long.loop_ran  # in a thread
        assert rt.session.client_events == 3
        replies = [e.get("event_id") for e in queued(rt) if e.get("event_id") in ("long", "after")]
        assert replies == ["long", "after"]  # in the order sent
        await until(lambda: rt.resuming is not None and rt.resuming.done(), "resumed", every=0.01)
        assert resumed_counts(rt) == [(2, 3), (1, 0)]
    finally:
        await rt.end()


async def test_a_resume_waits_for_the_old_socket_and_the_forwarded_frames() -> None:
    """A follower attaches while the local socket is still to detach (its
    frames still to take), and forwards a long prompt: the resume is told of
    it only once both are done, whichever finishes first."""
    engine = TemplateEngine()
    rt = remote_runtime(engine)
    try:
        receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")  # the old socket is aborted
        forward_long_then_more(rt)
        await until(lambda: rt.forwarded is None, "the forwarded frames taken", every=0.01)
        assert rt.session.client_events == 3
        await asyncio.sleep(0.05)
        assert not rt.detached.is_set() and resumed_counts(rt) == []  # the socket is not done
        await rt.detach("resume")
        await until(lambda: rt.resuming is not None and rt.resuming.done(), "resumed", every=0.01)
        assert resumed_counts(rt) == [(1, 3)]
    finally:
        await rt.end()


async def test_the_old_socket_detaching_first_still_waits_for_the_forwarded_frames() -> None:
    engine = TemplateEngine()
    rt = remote_runtime(engine)
    gate, encode = threading.Event(), engine.template.tokenizer.encode

    def held(text: str, **kwargs: Any) -> list[int]:
        if len(text) > 4096:
            gate.wait(5)
        return encode(text, **kwargs)

    engine.template.tokenizer.encode = held
    try:
        receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")
        forward_long_then_more(rt)
        assert rt.forwarded is not None
        await rt.detach("resume")  # the old socket is done first
        assert not rt.detached.is_set() and resumed_counts(rt) == []
        gate.set()
        await until(lambda: rt.forwarded is None, "the forwarded frames taken", every=0.01)
        await until(lambda: rt.resuming is not None and rt.resuming.done(), "resumed", every=0.01)
        assert resumed_counts(rt) == [(1, 3)]
    finally:
        gate.set()
        engine.template.tokenizer.encode = encode
        await rt.end()


async def test_a_forwarded_frame_whose_tokenizer_fails_is_taken_as_a_short_one() -> None:
    """The thread's tokenization fails: the event is taken on the loop, where
    it fails as one with a short prompt would (counted, so never resent), and
    the session's next frames are still taken."""
    engine = TemplateEngine()
    rt = remote_runtime(engine)
    await rt.detach("lost")
    receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")
    encode = engine.template.tokenizer.encode

    def failing(text: str, **kwargs: Any) -> list[int]:
        raise RuntimeError("the tokenizer broke")

    engine.template.tokenizer.encode = failing
    try:
        forward_long_then_more(rt)
        await until(lambda: rt.forwarded is None, "the forwarded frames taken", every=0.01)
        replies = [e.get("event_id") for e in queued(rt) if e.get("event_id") in ("long", "after")]
        assert replies == ["after"] and rt.session.client_events == 3
        assert rt.detached.is_set()
    finally:
        engine.template.tokenizer.encode = encode
        await rt.end()


async def test_a_resume_waits_again_if_a_forwarded_frame_queued_before_it_ran() -> None:
    """`detached` is set, then cleared again by a forwarded frame before the
    waiting resume runs: the resume waits for that frame too."""
    rt = remote_runtime(TemplateEngine())
    await rt.detach("lost")
    receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")
    rt.detached.clear()  # a forwarded frame's prompt is being tokenized
    try:
        waiter = asyncio.create_task(take_for_resume(open_socket(), rt))
        await asyncio.sleep(0)
        rt.detached.set()  # taken...
        rt.detached.clear()  # ...and the next one queued, before the resume ran
        await asyncio.sleep(0.02)
        assert not waiter.done()
        rt.detached.set()
        assert await asyncio.wait_for(waiter, 1) is True
    finally:
        await rt.end()


async def test_a_follower_resume_waits_again_if_a_frame_queued_before_it_ran() -> None:
    rt = remote_runtime(TemplateEngine())
    await rt.detach("lost")
    receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")
    rt.detached.clear()  # a forwarded frame's prompt is being tokenized
    try:
        receive_forwarded(rt, "attach", {"last_seq": 1}, "f2")
        await asyncio.sleep(0)
        rt.detached.set()  # taken...
        rt.detached.clear()  # ...and the next one queued, before the resume ran
        await asyncio.sleep(0.02)
        assert resumed_counts(rt) == [(1, 0)]  # f1's only
        rt.detached.set()
        await until(lambda: rt.resuming is not None and rt.resuming.done(), "resumed", every=0.01)
        assert resumed_counts(rt) == [(1, 0), (1, 0)]
    finally:
        await rt.end()
