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
from tokenwire.wire import dialect_for

from ..helpers.socket import open_socket
from ..helpers.template_engine import TemplateEngine
from ..helpers.wait import until


def queued(rt: SessionRuntime) -> list[dict[str, Any]]:
    """What waits for a socket (without Redis nothing is written meanwhile)."""
    return list(rt.delivery.outbox)


def frame(event: dict[str, Any]) -> str:
    return json.dumps(event)


async def test_a_forwarded_long_prompt_is_tokenized_off_the_loop_in_order() -> None:
    """The owner tokenizes a forwarded response.create's long prompt in a
    thread: the loop runs on, the session's next frame waits behind it, and a
    follower attaching meanwhile is told of every frame taken, so it resends
    none."""
    engine = TemplateEngine()
    rt = SessionRuntime(engine, ServerConfig(engine="scripted", max_events_per_s=0))
    rt.attach(open_socket(), dialect_for("tokenwire.v1.json"))  # type: ignore[arg-type]
    rt.go_live()
    await rt.detach("lost")
    receive_forwarded(rt, "attach", {"last_seq": 1}, "f1")
    assert rt.state is RuntimeState.REMOTE
    loop_thread = threading.get_ident()
    try:
        long = {"type": "message", "role": "user", "content": "tell me more " * 1000}
        item = {"type": "message", "role": "user", "content": "and then?"}
        receive_forwarded(
            rt, "frame", frame({"type": "conversation.item.create", "item": long}), "f1"
        )
        receive_forwarded(rt, "frame", frame({"type": "response.create", "event_id": "long"}), "f1")
        after = {"type": "conversation.item.create", "event_id": "after", "item": item}
        receive_forwarded(rt, "frame", frame(after), "f1")
        # The client moves to another follower while the prompt is tokenized.
        receive_forwarded(rt, "attach", {"last_seq": 2}, "f2")
        assert rt.session.client_events == 1  # neither taken yet
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await until(lambda: rt.forwarded is None, "the forwarded frames taken", every=0.01)
        ticker.cancel()
        chars, thread = engine.threads[-1]
        assert chars > 12_000 and thread != loop_thread  # tokenized once, in a thread
        assert ticks > 0  # the loop ran while it was
        assert rt.session.client_events == 3
        events = queued(rt)
        replies = [e.get("event_id") for e in events if e.get("event_id") in ("long", "after")]
        assert replies == ["long", "after"]  # in the order sent
        await until(lambda: rt.resuming is not None and rt.resuming.done(), "resumed", every=0.01)
        resumed = [e for e in queued(rt) if e["type"] == "session.resumed"]
        # Each goes ahead of what is queued: the second follower's comes first.
        assert [(e["last_seq"], e["client_events"]) for e in resumed] == [(2, 3), (1, 0)]
    finally:
        await rt.end()
