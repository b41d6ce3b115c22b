"""End to end over real WebSockets, on the scripted engine."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tokenwire.client import Client, TokenwireError, connect

from ..conftest import RunningServer, http_json
from ..helpers.wait import until

PROTOCOLS = ["json", "msgpack"]


async def next_error(tw: Client) -> dict:
    while True:
        event = await asyncio.wait_for(tw.events.get(), 5)
        if event["type"] == "error":
            return event


async def assert_alive(tw: Client) -> None:
    assert await tw.ask("still here") == "You said: still here"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_answer_streams_in_both_subprotocols(scripted: RunningServer, protocol: str) -> None:
    async with await connect(scripted.url, protocol=protocol) as tw:
        assert tw.session["subprotocol"] == f"tokenwire.v1.{protocol}"
        assert tw.session["id"].startswith("sess_")
        await tw.update_session(instructions="Be brief.", temperature=0)
        await tw.add_message("hello wire")
        response = await tw.create_response()
        deltas = [d async for d in response.text_deltas()]
        assert "".join(deltas) == "You said: hello wire"
        assert len(deltas) == 4
        done = await response.done()
        assert done["status"] == "completed"
        assert done["usage"]["output_tokens"] == 4 and done["usage"]["input_tokens"] > 0
        assert done["timings"]["ttft_ms"] >= 0 and done["timings"]["total_ms"] > 0
        types = [e["type"] for e in response.events]
        assert types[-2:] == ["response.output_text.done", "response.done"]
        assert response.events[-2]["text"] == "You said: hello wire"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_frames_use_negotiated_encoding_and_seq(
    scripted: RunningServer, protocol: str
) -> None:
    sub = f"tokenwire.v1.{protocol}"
    async with ws_connect(scripted.url, subprotocols=[sub]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == sub
        request = {
            "type": "response.create",
            "response": {"ignore_eos": True, "max_output_tokens": 20},
        }
        await ws.send(
            msgpack.packb(request) if protocol == "msgpack" else __import__("json").dumps(request)
        )
        seqs = []
        while True:
            frame = await ws.recv()
            assert isinstance(frame, bytes if protocol == "msgpack" else str)
            event = (
                msgpack.unpackb(frame) if protocol == "msgpack" else __import__("json").loads(frame)
            )
            seqs.append(event["seq"])
            if event["type"] == "response.done":
                break
        assert seqs == list(range(1, len(seqs) + 1))


async def test_no_subprotocol_speaks_the_openai_dialect(scripted: RunningServer) -> None:
    """What the OpenAI SDKs do (they offer no subprotocol); tokenwire's own
    clients name theirs."""
    async with ws_connect(scripted.url) as ws:
        assert ws.subprotocol is None
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["event_id"] == "event_1"
        assert created["session"]["type"] == "realtime" and "seq" not in created
        await ws.send(json.dumps({"type": "response.steer", "input": "x"}))
        error = json.loads(await ws.recv())
        assert error["error"]["code"] == "invalid_value" and error["error"]["param"] == "type"


async def test_max_output_tokens_and_ignore_eos(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        r = await tw.create_response(ignore_eos=True, max_output_tokens=7)
        assert await r.text() == " t0 t1 t2 t3 t4 t5 t6"
        await tw.add_message("one two three four five")
        r = await tw.create_response(max_output_tokens=3)
        assert await r.text() == "You said: one"
        done = await r.done()
        assert done["status"] == "incomplete"
        assert done["status_details"]["reason"] == "max_output_tokens"


async def test_cancel_mid_stream(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        r = await tw.create_response(ignore_eos=True, max_output_tokens=100_000)
        got = 0
        async for _ in r.text_deltas():
            got += 1
            if got == 10:
                done = await r.cancel()
                break
        assert done["status"] == "cancelled"
        assert done["usage"]["output_tokens"] < 1000
        assert scripted.server.engine.load().running == 0
        await assert_alive(tw)


async def test_history_carries_across_responses(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        assert await tw.ask("first") == "You said: first"
        assert await tw.ask("second") == "You said: second"
        await tw.add_message("third")
        r = await tw.create_response()
        await r.done()
        assert r.created["response"]["conversation"] == "auto"


# -- bad input: each gets an error with a stable code; the connection stays open --


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{bad json", "malformed_frame"),
        (b"\xc1\xc1", "malformed_frame"),
        ("[1, 2, 3]", "invalid_event"),
        (msgpack.packb("just a string"), "invalid_event"),
    ],
)
async def test_undecodable_frames(
    scripted: RunningServer, protocol: str, frame: str | bytes, code: str
) -> None:
    async with await connect(scripted.url, protocol=protocol) as tw:
        await tw.send_raw(frame)
        error = await next_error(tw)
        assert error["error"]["code"] == code
        assert error["error"]["type"] == "invalid_request_error"
        assert isinstance(error["seq"], int)
        await assert_alive(tw)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("event", "code"),
    [
        ({"type": "response.teleport"}, "unknown_event_type"),
        ({"type": "conversation.item.create"}, "missing_field"),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": 42},
            },
            "invalid_field",
        ),
        ({"type": "session.update", "session": {"temperature": "warm"}}, "invalid_field"),
        ({"type": "response.create", "response": {"surprise": True}}, "unknown_field"),
        ({"type": "response.cancel", "response_id": "resp_unknown"}, "unknown_response"),
        ({"type": "response.cancel"}, "response_not_active"),
    ],
)
async def test_bad_events_echo_event_id(
    scripted: RunningServer, protocol: str, event: dict, code: str
) -> None:
    async with await connect(scripted.url, protocol=protocol) as tw:
        with pytest.raises(TokenwireError) as info:
            await tw.request(dict(event, event_id="evt-bad"))
        assert info.value.code == code
        assert info.value.error["event_id"] == "evt-bad"
        await assert_alive(tw)


async def test_second_response_in_same_conversation(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        first = await tw.create_response(ignore_eos=True, max_output_tokens=300)
        with pytest.raises(TokenwireError) as info:
            await tw.request({"type": "response.create", "event_id": "dup"})
        assert info.value.code == "conversation_already_has_active_response"
        assert info.value.error["event_id"] == "dup"
        # An out-of-band response may run beside it.
        side = await tw.create_response(
            conversation="none", input=[{"type": "message", "role": "user", "content": "aside"}]
        )
        assert await side.text() == "You said: aside"
        assert (await first.cancel())["status"] == "cancelled"


async def test_prompt_longer_than_context(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as tw:
        await tw.add_message("word " * 600)  # the fixture's context is 512 tokens
        with pytest.raises(TokenwireError) as info:
            await tw.request({"type": "response.create", "event_id": "long"})
        assert info.value.code == "context_length_exceeded"
        assert info.value.error["event_id"] == "long"
        # Refused before any engine work: no response was created.
        assert scripted.server.engine.load().running == 0
        assert tw._responses == {}
        side = await tw.create_response(
            conversation="none", input=[{"type": "message", "role": "user", "content": "short"}]
        )
        assert await side.text() == "You said: short"


async def test_oversized_frame_closes_1009_and_spares_others(scripted: RunningServer) -> None:
    async with await connect(scripted.url) as healthy, await connect(scripted.url) as bad:
        streaming = await healthy.create_response(ignore_eos=True, max_output_tokens=200)
        await bad.send_raw("x" * (64 * 1024 + 1))
        await asyncio.wait_for(bad.ws.wait_closed(), 5)
        assert bad.ws.close_code == 1009
        with pytest.raises(ConnectionClosed):
            await bad.add_message("after close")
        assert len(await streaming.text()) > 0
        assert (await streaming.done())["status"] == "completed"
        await assert_alive(healthy)


async def test_disconnect_aborts_generation(scripted: RunningServer) -> None:
    tw = await connect(scripted.url)
    await tw.create_response(ignore_eos=True, max_output_tokens=100_000)
    await asyncio.sleep(0.05)
    assert scripted.server.engine.load().running == 1
    await tw.ws.close()
    for _ in range(100):
        if scripted.server.engine.load().running == 0:
            break
        await asyncio.sleep(0.02)
    assert scripted.server.engine.load().running == 0


async def test_health_endpoints(scripted: RunningServer) -> None:
    status, body = await asyncio.to_thread(http_json, scripted.http + "/healthz")
    assert status == 200 and body["status"] == "ok" and body["engine"] == "scripted"
    status, body = await asyncio.to_thread(http_json, scripted.http + "/readyz")
    assert status == 200 and body["ready"] is True
    status, _ = await asyncio.to_thread(http_json, scripted.http + "/nope")
    assert status == 404


async def test_many_sessions_are_isolated(scripted: RunningServer) -> None:
    async def one(i: int) -> str:
        async with await connect(scripted.url, protocol=PROTOCOLS[i % 2]) as tw:
            return await tw.ask(f"client {i}")

    answers = await asyncio.gather(*(one(i) for i in range(20)))
    assert answers == [f"You said: client {i}" for i in range(20)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_stream_interval_sends_tokens_in_groups(
    scripted: RunningServer, protocol: str
) -> None:
    async with await connect(scripted.url, protocol=protocol) as tw:
        response = await tw.create_response(
            ignore_eos=True, max_output_tokens=10, stream_interval=4
        )
        deltas = [d async for d in response.text_deltas()]
        assert deltas == [" t0", " t1 t2 t3 t4", " t5 t6 t7 t8", " t9"]
        done = await response.done()
        assert done["usage"]["output_tokens"] == 10
        assert done["output"][0]["content"] == "".join(deltas)


@pytest.mark.parametrize("value", [0, -1, 1.5, "4", True, (1 << 16) + 1])
async def test_a_bad_stream_interval_is_an_invalid_field(
    scripted: RunningServer, value: object
) -> None:
    async with await connect(scripted.url) as tw:
        with pytest.raises(TokenwireError) as info:
            await tw.create_response(stream_interval=value)
        assert info.value.code == "invalid_field"
        assert info.value.error["param"] == "response.stream_interval"
        await assert_alive(tw)


async def test_drained_without_redis_a_socket_starts_nothing_more() -> None:
    """The drain ends the session with its socket still open: the client,
    idle, gets session.going_away first; a frame sent after that starts no
    response, and the socket is closed with 1001."""
    from tokenwire.config import ServerConfig
    from tokenwire.engines.scripted import ScriptedEngine
    from tokenwire.server import TokenwireServer

    config = ServerConfig(engine="scripted", port=0, drain_timeout_s=0.2)
    srv = TokenwireServer(config, ScriptedEngine(tokens_per_s=200))
    await srv.start()
    try:
        async with ws_connect(f"ws://127.0.0.1:{srv.port}/v1/realtime") as ws:
            sid = json.loads(await ws.recv())["session"]["id"]
            runtime = srv.sessions[sid]
            await srv.drain()
            request = {"type": "response.create", "response": {"max_output_tokens": 1000}}
            got = []
            with pytest.raises(ConnectionClosed):
                await ws.send(json.dumps(request))
                while True:  # going away, then nothing but the close
                    got.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
            # No subprotocol: the OpenAI dialect, whose going_away is this error.
            assert [e["error"]["code"] for e in got] == ["server_shutting_down"]
            assert ws.close_code == 1001
        assert not runtime.tasks and not runtime.session.active_responses
        assert srv.engine.load().running == 0
        # No response, session or socket holds the key any more: its record goes.
        await until(lambda: "anonymous" not in srv.admission.limiter.keys, "the key's record went")
    finally:
        await srv.close()
