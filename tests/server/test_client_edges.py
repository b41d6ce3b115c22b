"""The Python client (tokenwire.client) where a caller meets an edge: a
response read twice, a value the server would refuse, a cancel awaited as a
request, a clean close, a large server frame, a caller that gives up, a
failed response. On the scripted engine, or on a stand-in server that plays
one exchange."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosedOK

from tokenwire.client import Reconnect, TokenwireError, connect

from ..conftest import RunningServer

SESSION = {"id": "sess_a", "object": "realtime.session", "max_message_bytes": 1 << 20}


@asynccontextmanager
async def stand_in(
    play: Callable[[ServerConnection], Awaitable[None]],
) -> AsyncIterator[str]:
    """A server that sends session.created, then plays `play`."""

    async def handler(ws: ServerConnection) -> None:
        await ws.send(json.dumps({"type": "session.created", "session": SESSION, "seq": 1}))
        await play(ws)

    async with serve(handler, "127.0.0.1", 0, subprotocols=["tokenwire.v1.json"]) as server:  # type: ignore[list-item]
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/v1/realtime"


async def test_a_response_can_be_read_again(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        await tw.add_message("twice")
        r = await tw.create_response()

        async def deltas() -> list[str]:
            return [d async for d in r.text_deltas()]

        first = await asyncio.wait_for(deltas(), 5)
        second = await asyncio.wait_for(deltas(), 5)  # it waited forever before
        assert "".join(first) == "You said: twice"
        assert second == first
        assert [e["type"] async for e in r][-1] == "response.done"


async def test_a_value_the_server_refuses_raises_at_the_call(scripted: RunningServer) -> None:
    """NaN (or a lone surrogate) would be refused as a malformed frame, with no
    event_id to name the call: the client refuses it itself."""
    async with await connect(scripted.url) as tw:
        with pytest.raises(TokenwireError) as err:
            await asyncio.wait_for(tw.create_response(temperature=float("nan")), 5)
        assert err.value.code == "invalid_value"
        with pytest.raises(TokenwireError):
            await asyncio.wait_for(tw.add_message("cut \ud83d"), 5)
        assert await tw.ask("still here") == "You said: still here"


async def test_a_cancel_sent_as_a_request_returns_the_response_done(
    scripted: RunningServer,
) -> None:
    async with await connect(scripted.url) as tw:
        r = await tw.create_response(ignore_eos=True, max_output_tokens=100_000)
        async for _ in r.text_deltas():
            break
        done = await asyncio.wait_for(tw.request({"type": "response.cancel"}), 5)
        assert done["type"] == "response.done"
        assert done["response"]["status"] == "cancelled"
        assert r.status == "cancelled"
        with pytest.raises(TokenwireError) as err:  # nothing left to cancel
            await asyncio.wait_for(tw.request({"type": "response.cancel"}), 5)
        assert err.value.code == "response_not_active"


async def test_a_cancel_without_an_id_beside_an_out_of_band_response_returns(
    scripted: RunningServer,
) -> None:
    """The server cancels the conversation response (protocol.md §5): the
    request returns its response.done rather than wait forever."""
    async with await connect(scripted.url) as tw:
        long = {"ignore_eos": True, "max_output_tokens": 100_000}
        auto = await tw.create_response(**long)
        apart = await tw.create_response(conversation="none", **long)
        done = await asyncio.wait_for(tw.request({"type": "response.cancel"}), 5)
        assert done["response"]["id"] == auto.id
        assert done["response"]["status"] == "cancelled"
        assert apart.status is None  # still running
        assert (await asyncio.wait_for(apart.cancel(), 5))["status"] == "cancelled"


async def test_a_cancel_sent_before_its_response_is_known_returns(
    scripted: RunningServer,
) -> None:
    """Barge-in: response.create is still on the wire when the cancel goes."""
    async with await connect(scripted.url) as tw:
        create = {"ignore_eos": True, "max_output_tokens": 100_000}
        await tw.send({"type": "response.create", "response": create})
        done = await asyncio.wait_for(tw.request({"type": "response.cancel"}), 5)
        assert done["type"] == "response.done"
        assert done["response"]["status"] == "cancelled"


async def test_a_caller_that_gives_up_on_create_response_leaves_nothing_running(
    scripted: RunningServer,
) -> None:
    async with await connect(scripted.url) as tw:
        task = asyncio.create_task(tw.create_response(ignore_eos=True, max_output_tokens=100_000))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Its response is cancelled once it exists: a new one may start.
        for _ in range(100):
            try:
                assert await tw.ask("next") == "You said: next"
                break
            except TokenwireError as exc:
                assert exc.code == "conversation_already_has_active_response"
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the abandoned response kept running")


async def test_a_clean_close_fails_calls_with_its_close_code() -> None:
    async def play(ws: ServerConnection) -> None:
        await ws.recv()  # the update, never answered
        await ws.close(1001, "going away")

    async with stand_in(play) as url:
        tw = await connect(url, protocol="json")
        with pytest.raises(ConnectionClosedOK) as err:
            await asyncio.wait_for(tw.update_session(temperature=0), 5)
        assert err.value.rcvd is not None and err.value.rcvd.code == 1001
        await tw.close()


async def test_a_server_frame_over_1_mib_is_read() -> None:
    big = "x" * (2 << 20)

    async def play(ws: ServerConnection) -> None:
        event = json.loads(await ws.recv())
        item = {"id": "item_1", "type": "message", "role": "user", "content": big}
        reply = {"type": "conversation.item.created", "item": item, "seq": 2}
        await ws.send(json.dumps({**reply, "event_id": event["event_id"]}))
        await ws.wait_closed()

    async with stand_in(play) as url:
        async with await connect(url, protocol="json") as tw:
            item = await asyncio.wait_for(tw.add_message("hi"), 10)
            assert item["content"] == big


async def test_a_failed_response_raises_from_text() -> None:
    error = {"type": "server_error", "code": "invalid_tool_arguments", "message": "bad call"}

    async def play(ws: ServerConnection) -> None:
        event = json.loads(await ws.recv())
        resp = {"id": "resp_1", "status": "in_progress", "output": []}
        await ws.send(
            json.dumps(
                {"type": "response.created", "response": resp, "event_id": event["event_id"]}
            )
        )
        details = {"type": "failed", "error": error}
        done = {**resp, "status": "failed", "status_details": details}
        await ws.send(json.dumps({"type": "response.done", "response": done, "seq": 3}))
        await ws.wait_closed()

    async with stand_in(play) as url:
        async with await connect(url, protocol="json") as tw:
            r = await tw.create_response()
            with pytest.raises(TokenwireError) as err:
                await asyncio.wait_for(r.text(), 5)
            assert err.value.code == "invalid_tool_arguments"
            assert (await r.done())["status"] == "failed"


async def test_a_bad_frame_while_resuming_is_a_failed_attempt() -> None:
    """A resume that meets a frame it cannot read counts as a failed attempt;
    when they run out, calls fail with reconnect_failed, not a raw error."""

    connections = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        connections += 1
        await ws.send(json.dumps({"type": "session.created", "session": SESSION, "seq": 1}))
        if connections == 1:
            ws.transport.abort()  # the first connection drops
            return
        await ws.recv()  # session.resume
        await ws.send("{not json")
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, subprotocols=["tokenwire.v1.json"]) as server:  # type: ignore[list-item]
        port = server.sockets[0].getsockname()[1]
        policy = Reconnect(max_attempts=2, initial_delay_s=0.01, max_delay_s=0.02)
        tw = await connect(f"ws://127.0.0.1:{port}/v1/realtime", protocol="json", reconnect=policy)
        with pytest.raises(TokenwireError) as err:
            await asyncio.wait_for(tw.request({"type": "session.update", "session": {}}), 10)
        assert err.value.code == "reconnect_failed"
        assert connections == 3
        await tw.close()


async def test_a_connect_given_up_before_session_created_closes_its_socket() -> None:
    closed = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        await ws.wait_closed()  # never says session.created
        closed.set()

    async with serve(handler, "127.0.0.1", 0, subprotocols=["tokenwire.v1.json"]) as server:  # type: ignore[list-item]
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                connect(f"ws://127.0.0.1:{port}/v1/realtime", protocol="json"), 0.5
            )
        await asyncio.wait_for(closed.wait(), 5)


async def test_close_stops_tool_handlers_still_running(scripted: RunningServer) -> None:
    started, stopped = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()
        return "never"

    tool = {"type": "function", "name": "slow", "parameters": {"type": "object"}}
    tw = await connect(scripted.url, tools={"slow": slow})
    await tw.update_session(tools=[tool], tool_choice="required")
    await tw.add_message("go")
    await tw.create_response()
    await asyncio.wait_for(started.wait(), 10)
    await tw.close()
    await asyncio.wait_for(stopped.wait(), 5)


async def test_a_large_resend_goes_out_while_the_replay_is_read() -> None:
    """After a resume, the frames the server never took are sent again while
    the client goes on reading: a server busy writing reads nothing until its
    client reads (tokenwire's upstream backpressure, with few frames queued),
    so a resend written before reading again stalled both sides."""

    frames, size = 96, 256 << 10  # 24 MiB, in more frames than the server queues
    got_resends = asyncio.Event()
    connections = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        connections += 1
        created = {"type": "session.created", "session": SESSION, "seq": 1}
        if connections == 1:
            await ws.send(json.dumps(created))
            for _ in range(frames):  # taken off the wire, never answered
                await ws.recv()
            ws.transport.abort()
            return
        await ws.send(json.dumps({**created, "session": {**SESSION, "id": "sess_b"}}))
        await ws.recv()  # session.resume
        resumed = {"type": "session.resumed", "session": SESSION, "last_seq": 1}
        await ws.send(json.dumps({**resumed, "replayed": 0, "client_events": 0, "seq": 2}))
        pad = "x" * (64 << 10)
        for seq in range(3, 3 + 768):  # 48 MiB the client must read first
            await ws.send(json.dumps({"type": "rate_limits.updated", "pad": pad, "seq": seq}))
        for _ in range(frames):
            await ws.recv()
        got_resends.set()
        await ws.wait_closed()

    async with serve(
        handler, "127.0.0.1", 0, subprotocols=["tokenwire.v1.json"], max_queue=4
    ) as server:  # type: ignore[list-item]
        port = server.sockets[0].getsockname()[1]
        policy = Reconnect(initial_delay_s=0.01, max_delay_s=0.02)
        tw = await connect(f"ws://127.0.0.1:{port}/v1/realtime", protocol="json", reconnect=policy)
        item = {"type": "message", "role": "user", "content": "y" * (size - 200)}
        for _ in range(frames):
            await tw.send({"type": "conversation.item.create", "item": item})
        await asyncio.wait_for(got_resends.wait(), 60)
        await tw.close()


def test_a_reconnect_policy_that_retries_for_ever_keeps_its_delay_capped() -> None:
    policy = Reconnect(max_attempts=100_000, initial_delay_s=0.25, max_delay_s=2.0)
    delays = [policy.delay(attempt) for attempt in (0, 5, 1023, 1024, 99_999)]
    assert all(0.0 <= d <= 2.0 for d in delays)
