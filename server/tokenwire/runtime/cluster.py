"""A session among several instances (with Redis): operations a follower
forwards to the owner, the hand-over when an instance drains, and the
continuation of a session taken over from a dead owner."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from typing import Any

from .. import metrics
from ..core.schema import SessionResume
from ..logs import get_logger
from ..wire.close_codes import CLOSE_SERVICE_RESTART
from .session_runtime import GONE, RuntimeState, SessionRuntime, until_detached

log = get_logger("tokenwire.cluster")
_FORWARDING: set[asyncio.Task[None]] = set()  # held until done


def receive_forwarded(rt: SessionRuntime, op: str, data: Any, follower: str) -> None:
    """An op from the instance whose client follows this session."""
    if op == "attach":
        ws = rt.ws if rt.state is RuntimeState.ATTACHED else None
        rt.follower = follower
        rt.state = RuntimeState.REMOTE
        if ws is not None and ws.transport is not None:
            ws.transport.abort()  # the client has moved on from that socket
        if rt.detached.is_set():
            _resumed_remotely(rt, data["last_seq"])
        else:
            # Frames the last socket or follower sent are still taken; count
            # them in session.resumed's client_events, so none is resent.
            if rt.resuming is not None:
                rt.resuming.cancel()
            rt.resuming = asyncio.get_running_loop().create_task(
                _resumed_after_detach(rt, data["last_seq"])
            )
    elif op == "frame" and rt.state is RuntimeState.REMOTE:
        _take_forwarded(rt, data)
    elif op == "detach" and rt.state is RuntimeState.REMOTE:
        rt.state = RuntimeState.DETACHED


def _take_forwarded(rt: SessionRuntime, frame: Any) -> None:
    """A forwarded frame, in order. One whose prompt is tokenized in a thread
    holds the session's later frames (and any resume) until it is taken; the
    inbox goes on serving every other session meanwhile."""
    if rt.forwarded is not None:
        rt.forwarded.append(frame)
        return
    later = rt.receive(frame)
    if later is not None:
        assert not isinstance(later, SessionResume)  # only a socket's first frame is one
        rt.forwarded = deque()
        rt.detached.clear()
        task = asyncio.get_running_loop().create_task(_forwarded_after(rt, later))
        _FORWARDING.add(task)
        task.add_done_callback(_FORWARDING.discard)


async def _forwarded_after(rt: SessionRuntime, later: Awaitable[None] | None) -> None:
    try:
        while later is not None:
            try:
                await later
            except Exception:
                # It failed as on the loop (a failing tokenizer is retried
                # there); as the inbox does, the session's next frames go on.
                rt.log.exception("forwarded_frame_failed")
            later, frames = None, rt.forwarded
            while later is None and frames and rt.state not in GONE:
                try:
                    later = rt.receive(frames.popleft())
                except Exception:
                    rt.log.exception("forwarded_frame_failed")
            assert not isinstance(later, SessionResume)
    finally:
        rt.forwarded = None
        if rt.delivery.ws is None:  # else that socket's detach sets it
            rt.detached.set()


async def _resumed_after_detach(rt: SessionRuntime, last_seq: int) -> None:
    await until_detached(rt)
    if rt.state is RuntimeState.REMOTE:
        _resumed_remotely(rt, last_seq)


def _resumed_remotely(rt: SessionRuntime, last_seq: int) -> None:
    """The follower replays the log itself: all after last_seq counts."""
    rt.push_resumed(last_seq, max(rt.delivery.logged_seq - last_seq, 0))


def continue_restored(rt: SessionRuntime) -> None:
    """A taken-over session: continue its generations (logged while no
    socket is attached) and re-arm its tool timeouts."""
    # Counted here from now: their response.done comes here, their
    # response.created came on the old owner.
    metrics.ACTIVE_RESPONSES.inc(len(rt.session.active_responses))
    rt.session.resume()
    rt.pump()
    rt.delivery.start_writer()


async def hand_over(rt: SessionRuntime) -> None:
    """Drain: stop the generations here and leave the session, snapshot and
    log complete in the durable log, for another instance to continue."""
    assert rt.delivery.log.durable
    if rt.state in GONE:
        return
    rt.cancel_timers()
    rt.session.suspend()
    rt.pump()
    await rt.wait_generations()
    await rt.delivery.hand_over(rt.session.snapshot)
    # They end elsewhere. Counted out now, not before the waits: a fence
    # meanwhile (lost_ownership) has counted them out and let them go.
    metrics.ACTIVE_RESPONSES.dec(len(rt.session.active_responses))
    rt.state = RuntimeState.HANDED_OVER
    await rt.delivery.close_socket(CLOSE_SERVICE_RESTART, "draining; resume the session")
    rt.detached.set()
    rt.log.info("session_handed_over", last_seq=rt.delivery.logged_seq)


async def hand_over_all(runtimes: list[SessionRuntime], timeout_s: float) -> list[str]:
    """Drain: hand every session over, within `timeout_s` (a Redis that does
    not answer must not hold the shutdown). Returns the ids of those that were
    not: they stop here, their log left in Redis as it is."""
    tasks = {asyncio.create_task(hand_over(rt)): rt for rt in runtimes}
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=1)  # bounded: a cancel may land late
    failed = [tasks[t] for t in pending]
    failed += [tasks[t] for t in done if t.exception() is not None]
    for rt in failed:
        await abandon(rt)
    ids = [rt.session.id for rt in failed]
    if ids:
        log.warning("hand_over_failed", session_ids=ids, timeout_s=timeout_s)
    return ids


async def abandon(rt: SessionRuntime) -> None:
    """A hand-over that did not finish: stop here without ending the session.
    What Redis already holds of it (everything its client was sent) stays
    for another instance to take over, as after a crash of this one."""
    if rt.state is RuntimeState.ENDED:
        return
    rt.state = RuntimeState.HANDED_OVER
    rt.cancel_timers()
    rt.session.abandon()
    rt.pump()
    await rt.delivery.stop()  # a flush still retrying gives up
    await rt.delivery.close_socket(CLOSE_SERVICE_RESTART, "draining; resume the session")
    rt.detached.set()
