"""The Python client resumes its session by itself when the network drops.

A TCP proxy between client and server cuts connections (a reset on both
sides) or swallows one direction, as a network does; the server is the real
one, on the scripted engine, in this process so a test can look at what it
holds."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from tokenwire.client import Reconnect, TokenwireError, connect
from tokenwire.config import ServerConfig
from tokenwire.engines.scripted import ScriptedEngine
from tokenwire.server import TokenwireServer

from ..helpers.proxy import Proxy
from ..helpers.tools import WEATHER
from ..helpers.wait import until
from ..helpers.wire import expected

FAST = Reconnect(initial_delay_s=0.01, max_delay_s=0.05, attempt_timeout_s=5)


async def start(context: int = 4096, **overrides: Any) -> TokenwireServer:
    config = ServerConfig(
        **{
            "engine": "scripted",
            "port": 0,
            "scripted_tokens_per_s": 200.0,
            "resume_grace_s": 10.0,
            "max_events_per_s": 0,
            **overrides,
        }
    )
    engine = ScriptedEngine(tokens_per_s=config.scripted_tokens_per_s, max_context_tokens=context)
    server = TokenwireServer(config, engine)
    await server.start()
    return server


@pytest.fixture
def server_options() -> dict[str, Any]:
    return {}


@pytest.fixture
async def server(server_options: dict[str, Any]) -> AsyncIterator[TokenwireServer]:
    server = await start(**server_options)
    yield server
    await server.close()


@pytest.fixture
async def proxy(server: TokenwireServer) -> AsyncIterator[Proxy]:
    async with Proxy(server.port) as proxy:
        yield proxy


def items(server: TokenwireServer, session_id: str | None) -> list[dict[str, Any]]:
    assert session_id is not None
    return server.sessions[session_id].session.items


def drain(tw: Any) -> list[dict[str, Any]]:
    """The events that belonged to no call or response, so far."""
    return [tw.events.get_nowait() for _ in range(tw.events.qsize())]


async def in_background(call: Awaitable[Any]) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0)
    return task


async def test_a_cut_mid_response_loses_nothing(server: TokenwireServer, proxy: Proxy) -> None:
    async with await connect(proxy.url(), reconnect=FAST) as tw:
        session_id = tw.session_id
        runtime = server.sessions[session_id or ""]
        response = await tw.create_response(ignore_eos=True, max_output_tokens=80)
        deltas: list[str] = []
        async for delta in response.text_deltas():
            deltas.append(delta)
            if len(deltas) == 5:
                # What the server writes now is lost with the socket.
                proxy.drop_downstream = True
                # What the proxy passed on before may still reach the client meanwhile.
                await until(lambda: runtime.delivery.logged_seq > tw.last_seq + 5, "tokens lost")
                at_cut = runtime.delivery.logged_seq
                proxy.cut()
                proxy.drop_downstream = False
        done = await response.done()
        assert done["status"] == "completed"
        # Every token once, in order: the replay filled the gap, with no repeat.
        assert "".join(deltas) == expected(80)
        await until(lambda: tw.reconnects == 1, "the resume counted")
        (resumed,) = [e for e in drain(tw) if e["type"] == "session.resumed"]
        # The client lost events; the replay resent every one logged by the cut.
        assert resumed["last_seq"] < at_cut <= resumed["last_seq"] + resumed["replayed"]
        assert proxy.connections == 2
        assert tw.session_id == session_id and tw.state == "open"
        assert await tw.ask("still here?") == "You said: still here?"


async def test_an_event_the_server_never_got_is_sent_again_once(
    server: TokenwireServer, proxy: Proxy
) -> None:
    async with await connect(proxy.url(), reconnect=FAST) as tw:
        proxy.drop_upstream = True
        task = await in_background(tw.add_message("hello"))
        await until(lambda: proxy.dropped > 0, "the frame swallowed")
        proxy.cut()
        proxy.drop_upstream = False
        item = await asyncio.wait_for(task, 10)
        assert item["content"] == "hello"
        assert [i["content"] for i in items(server, tw.session_id)] == ["hello"]
        await until(lambda: tw.reconnects == 1, "the resume counted")


async def test_an_event_the_server_took_is_not_sent_again(
    server: TokenwireServer, proxy: Proxy
) -> None:
    async with await connect(proxy.url(), reconnect=FAST) as tw:
        proxy.drop_downstream = True
        task = await in_background(tw.add_message("once"))
        await until(lambda: len(items(server, tw.session_id)) == 1, "the item created")
        proxy.cut()
        proxy.drop_downstream = False
        # Its reply was lost with the socket; the replay brings it.
        item = await asyncio.wait_for(task, 10)
        stored = items(server, tw.session_id)
        assert [i["content"] for i in stored] == ["once"] and stored[0]["id"] == item["id"]
        await until(lambda: tw.reconnects == 1, "the resume counted")


async def test_an_event_with_no_reply_the_server_took_is_not_sent_again(
    server: TokenwireServer, proxy: Proxy
) -> None:
    """A cancel has no reply that echoes it; only session.resumed's
    client_events tells the client the server took it."""
    async with await connect(proxy.url(), reconnect=FAST) as tw:
        response = await tw.create_response(ignore_eos=True, max_output_tokens=1000)
        proxy.drop_downstream = True
        await tw.send({"type": "response.cancel", "response_id": response.id})
        runtime = server.sessions[tw.session_id or ""]
        await until(lambda: not runtime.session.active_responses, "the cancel taken")
        proxy.cut()
        proxy.drop_downstream = False
        done = await asyncio.wait_for(response.done(), 10)
        assert done["status"] == "cancelled"
        assert await tw.ask("next") == "You said: next"
        # response.create, response.cancel, then ask's item and response: four.
        assert runtime.session.client_events == 4
        unattached = [e["type"] for e in drain(tw)]
        assert unattached == ["session.created", "session.resumed"]  # no error about a cancel
        await until(lambda: tw.reconnects == 1, "the resume counted")


async def test_events_sent_while_reconnecting_wait_behind_the_resent_ones(
    server: TokenwireServer, proxy: Proxy
) -> None:
    patient = Reconnect(max_attempts=1000, initial_delay_s=0.01, max_delay_s=0.02)
    async with await connect(proxy.url(), reconnect=patient) as tw:
        proxy.drop_upstream = True
        lost = await in_background(tw.add_message("lost"))
        await until(lambda: proxy.dropped > 0, "the frame swallowed")
        proxy.refuse = True
        proxy.cut()
        proxy.drop_upstream = False
        await until(lambda: tw.state == "reconnecting", "the drop noticed")
        queued = [await in_background(tw.add_message(f"m{i}")) for i in range(5)]
        await until(lambda: proxy.connections == 1 and tw.state == "reconnecting", "refusals")
        assert not any(t.done() for t in [lost, *queued])  # held, not failed
        proxy.refuse = False
        await asyncio.wait_for(asyncio.gather(lost, *queued), 10)
        contents = [i["content"] for i in items(server, tw.session_id)]
        assert contents == ["lost", *(f"m{i}" for i in range(5))]


async def test_a_response_that_ended_during_the_drop_is_still_handed_out(
    server: TokenwireServer, proxy: Proxy
) -> None:
    async with await connect(proxy.url(), reconnect=FAST) as tw:
        runtime = server.sessions[tw.session_id or ""]
        proxy.drop_downstream = True  # response.created and all the rest are lost
        task = await in_background(tw.create_response(ignore_eos=True, max_output_tokens=3))
        await until(lambda: bool(runtime.session.lifecycle.finished), "the response done")
        proxy.cut()
        proxy.drop_downstream = False
        response = await asyncio.wait_for(task, 10)
        assert (await response.done())["status"] == "completed"
        assert await response.text() == expected(3)


async def test_close_while_reconnecting_fails_calls_at_once(
    server: TokenwireServer, proxy: Proxy
) -> None:
    patient = Reconnect(max_attempts=1000, initial_delay_s=0.01, max_delay_s=0.02)
    tw = await connect(proxy.url(), reconnect=patient)
    response = await tw.create_response(ignore_eos=True, max_output_tokens=1000)
    proxy.refuse = True
    proxy.cut()
    await until(lambda: tw.state == "reconnecting", "the drop noticed")
    waiting = await in_background(tw.add_message("never"))
    await asyncio.wait_for(tw.close(), 5)
    assert tw.state == "closed"
    for call in (response.done(), waiting):
        with pytest.raises(ConnectionError, match="the client closed"):
            await asyncio.wait_for(call, 5)


async def test_a_tool_output_crosses_a_drop(server: TokenwireServer, proxy: Proxy) -> None:
    running = asyncio.Event()
    release = asyncio.Event()

    async def get_weather(city: str) -> dict[str, str]:
        running.set()
        await release.wait()
        return {"city": city, "sky": "sunny"}

    async with await connect(proxy.url(), reconnect=FAST, tools={"get_weather": get_weather}) as tw:
        await tw.update_session(tools=[WEATHER], tool_choice="required")
        await tw.add_message("Weather in Paris?")
        response = await tw.create_response()
        await asyncio.wait_for(running.wait(), 10)
        proxy.drop_upstream = True
        release.set()  # the output is written, and lost with the socket
        await until(lambda: proxy.dropped > 0, "the output swallowed")
        proxy.cut()
        proxy.drop_upstream = False
        done = await asyncio.wait_for(response.done(), 10)
        assert done["status"] == "completed"
        assert "sunny" in await response.text()
        outputs = [i for i in items(server, tw.session_id) if i["type"] == "function_call_output"]
        assert len(outputs) == 1 and json.loads(outputs[0]["output"])["sky"] == "sunny"
        await until(lambda: tw.reconnects == 1, "the resume counted")


async def test_a_refused_resume_fails_what_was_in_flight_and_goes_on_fresh() -> None:
    server = await start(resume_grace_s=0)  # a dropped session ends at once
    try:
        async with Proxy(server.port) as proxy, await connect(proxy.url(), reconnect=FAST) as tw:
            first = tw.session_id
            response = await tw.create_response(ignore_eos=True, max_output_tokens=1000)
            async for _ in response.text_deltas():
                break
            proxy.refuse = True
            proxy.cut()
            await until(lambda: tw.state == "reconnecting", "the drop noticed")
            waiting = await in_background(tw.add_message("for the old session"))
            proxy.refuse = False
            with pytest.raises(TokenwireError) as info:
                await asyncio.wait_for(response.done(), 10)
            assert info.value.code == "resume_failed"
            with pytest.raises(TokenwireError, match="resume_failed"):
                await asyncio.wait_for(waiting, 10)
            assert "session_not_found" in str(info.value)
            assert tw.state == "open" and tw.session_id != first
            assert await tw.ask("fresh start") == "You said: fresh start"
    finally:
        await server.close()


async def test_a_final_close_is_not_resumed() -> None:
    server = await start(idle_timeout_s=0.2)
    try:
        async with Proxy(server.port) as proxy:
            tw = await connect(proxy.url(), reconnect=FAST)
            await until(lambda: tw.state == "closed", "the idle close")
            assert tw.ws.close_code == 4000
            assert proxy.connections == 1 and tw.reconnects == 0
            with pytest.raises(ConnectionClosed):
                await tw.add_message("too late")
            await tw.close()
    finally:
        await server.close()


async def test_it_gives_up_after_max_attempts(server: TokenwireServer, proxy: Proxy) -> None:
    policy = Reconnect(max_attempts=3, initial_delay_s=0.01, max_delay_s=0.02)
    tw = await connect(proxy.url(), reconnect=policy)
    response = await tw.create_response(ignore_eos=True, max_output_tokens=1000)
    proxy.refuse = True
    proxy.cut()
    with pytest.raises(TokenwireError) as info:
        await asyncio.wait_for(response.done(), 10)
    assert info.value.code == "reconnect_failed"
    assert tw.state == "closed" and tw.reconnects == 0
    await tw.close()


async def test_without_reconnect_a_drop_fails_calls(server: TokenwireServer, proxy: Proxy) -> None:
    tw = await connect(proxy.url(), reconnect=False)
    response = await tw.create_response(ignore_eos=True, max_output_tokens=1000)
    proxy.cut()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(response.done(), 10)
    assert tw.state == "closed" and proxy.connections == 1
    await tw.close()


async def test_an_event_too_big_is_refused_locally(server: TokenwireServer) -> None:
    async with await connect(f"ws://127.0.0.1:{server.port}/v1/realtime") as tw:
        limit = tw.session["max_message_bytes"]
        with pytest.raises(TokenwireError) as info:
            await tw.add_message("x" * limit)
        assert info.value.code == "message_too_big"
        assert tw.state == "open"
        assert await tw.ask("small") == "You said: small"


@pytest.mark.parametrize("server_options", [{"context": 1_000_000}])
async def test_a_hundred_random_cuts_lose_and_repeat_nothing(
    server: TokenwireServer, proxy: Proxy
) -> None:
    """Messages and responses go on while the network is cut a hundred times
    at random moments, often with one direction swallowed first: every
    message lands once, in order, and every response comes out whole."""
    rng = random.Random(20261122)
    patient = Reconnect(max_attempts=1000, initial_delay_s=0.005, max_delay_s=0.02)
    cuts = 0

    async def chaos() -> None:
        nonlocal cuts
        while cuts < 100:
            await asyncio.sleep(rng.uniform(0.005, 0.04))
            mode = rng.random()
            proxy.drop_upstream = mode < 0.3
            proxy.drop_downstream = 0.3 <= mode < 0.6
            await asyncio.sleep(rng.uniform(0, 0.01))
            resumed = tw.reconnects
            proxy.cut()
            proxy.drop_upstream = proxy.drop_downstream = False
            cuts += 1
            # The next cut waits for this one's resume: on a busy machine cuts
            # would otherwise pile onto one connection already dead.
            await until(lambda n=resumed: tw.reconnects > n, "resumed after a cut", timeout=30)

    async with await connect(proxy.url(), reconnect=patient) as tw:
        session_id = tw.session_id
        chaos_task = asyncio.create_task(chaos())
        sent: list[str] = []
        i = 0
        cancelled = 0
        while not chaos_task.done() or i < 20:
            # Three at once: pipelined frames, not one reply at a time.
            burst = [f"m{i}", f"m{i + 1}", f"m{i + 2}"]
            sent += burst
            await asyncio.wait_for(asyncio.gather(*(tw.add_message(m) for m in burst)), 30)
            if i % 5 == 0:
                response = await asyncio.wait_for(
                    tw.create_response(ignore_eos=True, max_output_tokens=20), 30
                )
                text, stopped = "", False
                async for delta in response.text_deltas():
                    text += delta
                    if rng.random() < 0.1:
                        await response.cancel()  # a frame nothing echoes
                        stopped = True
                        break
                done = await asyncio.wait_for(response.done(), 30)
                whole = await response.text()
                if done["status"] == "cancelled":
                    cancelled += 1
                    assert stopped and expected(20).startswith(whole)
                else:  # it may have ended before the cancel came
                    assert whole == expected(20) and (stopped or text == whole)
            i += 3
        await chaos_task
        assert tw.session_id == session_id and tw.reconnects >= 100 and cancelled > 0
        users = [it["content"] for it in items(server, session_id) if it.get("role") == "user"]
        assert users == sent  # each once, in order
        # Every frame the client sent was taken exactly once, echoed or not.
        assert server.sessions[session_id or ""].session.client_events == tw._sent_count


async def test_responses_are_not_kept_for_calls_that_never_take_them(
    server: TokenwireServer,
) -> None:
    async with await connect(f"ws://127.0.0.1:{server.port}/v1/realtime") as tw:
        await (await tw.create_response(max_output_tokens=3)).done()
        reply = await tw.request({"type": "response.create", "response": {"max_output_tokens": 3}})
        assert reply["type"] == "response.created"
        assert tw._created == {}
