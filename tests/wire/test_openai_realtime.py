"""The OpenAI Realtime (GA) dialect, against the official SDK's own models.

Client events are built with the SDK's client-event models, parsed by the
dialect and fed to a real core Session; every server event the session emits
is encoded with `encode_all` and each frame is validated, strictly and with no
unexpected extra field, against the SDK's server-event models."""

from __future__ import annotations

import json
import typing
from typing import Any

import msgpack
import pytest
from openai.types.realtime import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemRetrieveEvent,
    ConversationItemTruncateEvent,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCommitEvent,
    OutputAudioBufferClearEvent,
    ResponseCancelEvent,
    ResponseCreateEvent,
    SessionUpdateEvent,
)
from pydantic import BaseModel

from tokenwire.core.errors import ErrorCode, ProtocolError, error_event
from tokenwire.core.schema import parse_client_event
from tokenwire.core.session import Session
from tokenwire.engines.base import ContextLengthExceeded, EngineDelta, ToolCallDelta
from tokenwire.wire.codec import encode_json
from tokenwire.wire.openai_errors import GACode, OpenAIProtocolError, ga_error, ga_param
from tokenwire.wire.openai_realtime import OpenAIRealtime, OpenAIRealtimeFamily

from ..helpers.openai_models import CLIENT_TYPES, validate
from ..helpers.openai_session import GAHarness as Harness
from ..helpers.openai_session import types

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def user_says(text: str) -> ConversationItemCreateEvent:
    return ConversationItemCreateEvent.model_validate(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            },
        }
    )


def session_update(**session: Any) -> SessionUpdateEvent:
    return SessionUpdateEvent.model_validate(
        {"type": "session.update", "session": {"type": "realtime", **session}}
    )


@pytest.fixture
def h() -> Harness:
    h = Harness()
    (created,) = h.take()
    assert created["type"] == "session.created"
    assert created["session"]["output_modalities"] == ["text"]
    return h


# -- server events ---------------------------------------------------------------


def test_a_text_response_has_the_ga_lifecycle(h: Harness) -> None:
    h.send(
        session_update(
            instructions="Be brief.", output_modalities=["text"], max_output_tokens="inf"
        )
    )
    h.send(user_says("hi"))
    h.send(ResponseCreateEvent(type="response.create", event_id="c1"))
    h.engine(EngineDelta("Hel", 1, None, prompt_tokens=12, cached_tokens=8))
    h.engine(EngineDelta("lo", 1, "stop"))
    frames = h.take()
    assert types(frames) == [
        "session.updated",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert frames[0]["session"]["max_output_tokens"] == "inf"
    assert frames[1]["item"]["content"] == [{"type": "input_text", "text": "hi"}]
    # The answer follows the user's item: LiveKit's client places it by this.
    assert (
        frames[5]["previous_item_id"] == frames[-2]["previous_item_id"] == frames[1]["item"]["id"]
    )
    deltas = [f for f in frames if f["type"] == "response.output_text.delta"]
    assert [(d["output_index"], d["content_index"]) for d in deltas] == [(0, 0), (0, 0)]
    done = frames[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"] == [{"type": "output_text", "text": "Hello"}]
    assert done["usage"]["input_token_details"]["cached_tokens"] == 8
    assert done["usage"]["total_tokens"] == 14
    assert done["conversation_id"].startswith("conv_")
    assert frames[-3]["item"]["status"] == "completed"
    ids = [f["event_id"] for f in frames]
    assert len(set(ids)) == len(ids)


def test_a_tool_round_closes_the_call_items_and_goes_on(h: Harness) -> None:
    h.send(session_update(tools=[TOOL], tool_choice="auto"))
    h.send(user_says("Weather in Paris?"))
    h.send(ResponseCreateEvent(type="response.create"))
    h.engine(EngineDelta("Let me check. ", 3, None, 10, 0))
    call = ToolCallDelta(0, "get_weather", '{"city": "Paris"}')
    h.engine(EngineDelta("", 5, "stop", tool_calls=[call]))
    frames = h.take()
    call_done = next(f for f in frames if f["type"] == "response.function_call_arguments.done")
    assert call_done["output_index"] == 1 and call_done["name"] == "get_weather"
    items_done = [f["item"] for f in frames if f["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in items_done] == [
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    assert items_done[1]["arguments"] == '{"city": "Paris"}'
    assert "response.done" not in types(frames)  # tokenwire's policy: the response goes on
    h.send(
        ConversationItemCreateEvent.model_validate(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "function_call_output",
                    "call_id": call_done["call_id"],
                    "output": "sunny",
                },
            }
        )
    )
    h.engine(EngineDelta("Sunny.", 2, "stop", 20, 8))
    frames = h.take()
    assert types(frames)[:2] == ["conversation.item.added", "conversation.item.done"]
    assert frames[0]["item"]["output"] == "sunny"
    added = next(f for f in frames if f["type"] == "response.output_item.added")
    assert added["output_index"] == 2
    assert frames[-1]["response"]["status"] == "completed"
    assert len(frames[-1]["response"]["output"]) == 3


def test_cancel_closes_open_items_and_deletes_a_partial_call(h: Harness) -> None:
    h.send(session_update(tools=[TOOL]))
    h.send(user_says("Weather?"))
    h.send(ResponseCreateEvent(type="response.create"))
    h.engine(
        EngineDelta("Checking", 1, None, 5, 0, tool_calls=[ToolCallDelta(0, "get_weather", '{"ci')])
    )
    h.take()
    h.send(ResponseCancelEvent(type="response.cancel", event_id="stop"))
    frames = h.take()
    assert types(frames) == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.deleted",
        "response.done",
    ]
    assert frames[2]["item"]["status"] == "incomplete"
    assert frames[4]["arguments"] == '{"ci'
    assert frames[5]["item"]["status"] == "incomplete"
    assert frames[5]["item"]["arguments"] == '{"ci'
    done = frames[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    # GA lists every item it announced; the dropped call is incomplete there.
    assert [(i["type"], i["status"]) for i in done["output"]] == [
        ("message", "incomplete"),
        ("function_call", "incomplete"),
    ]

    h.send(ResponseCancelEvent(type="response.cancel", event_id="again"))
    (error,) = h.take()
    assert error["error"]["code"] == "response_cancel_not_active"
    assert error["error"]["event_id"] == "again"


def test_max_tokens_and_an_out_of_band_response(h: Harness) -> None:
    h.send(
        ResponseCreateEvent.model_validate(
            {
                "type": "response.create",
                "response": {
                    "conversation": "none",
                    "output_modalities": ["text"],
                    "max_output_tokens": 2,
                    "metadata": {"topic": "x"},
                    "input": [
                        {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}],
                        }
                    ],
                },
            }
        )
    )
    h.engine(EngineDelta("a b", 2, "length", 3, 0))
    frames = h.take()
    assert "conversation.item.added" not in types(frames)
    assert "conversation.item.done" not in types(frames)
    done = frames[-1]["response"]
    assert done["conversation_id"] is None
    assert done["metadata"] == {"topic": "x"}
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}


def test_a_failed_response_carries_a_ga_error(h: Harness) -> None:
    h.send(session_update(tools=[{**TOOL, "parameters": {"type": "object", "required": ["city"]}}]))
    h.send(ResponseCreateEvent(type="response.create"))
    h.engine(EngineDelta("", 1, "stop", 4, 0, tool_calls=[ToolCallDelta(0, "get_weather", "{}")]))
    frames = h.take()
    assert "error" in types(frames)
    done = frames[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["type"] == "server_error"
    item_done = next(f for f in frames if f["type"] == "response.output_item.done")
    assert item_done["item"]["status"] == "incomplete"


def test_a_response_failed_by_the_client_input_says_so_as_its_error_does(h: Harness) -> None:
    """response.done's error has the type of the `error` event before it."""
    h.send(ResponseCreateEvent(type="response.create"))
    h.session.receive_engine_error(h.request_id, ContextLengthExceeded("the prompt is too long"))
    frames = h.take()
    error = next(f for f in frames if f["type"] == "error")["error"]
    done = frames[-1]["response"]
    assert done["status"] == "failed"
    assert error["type"] == done["status_details"]["error"]["type"] == "invalid_request_error"


def test_core_errors_get_ga_codes_and_param_paths(h: Harness) -> None:
    h.send(ConversationItemRetrieveEvent(type="conversation.item.retrieve", item_id="nope"))
    h.send(
        {
            "type": "session.update",
            "session": {"type": "realtime", "tools": [{"type": "function", "name": "bad name"}]},
        }
    )
    h.send({"type": "session.update", "session": {"type": "realtime", "voice_speed": 2}})
    h.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user"}})
    h.send(user_says("one"))
    h.send(ResponseCreateEvent(type="response.create"))
    h.send(ResponseCreateEvent(type="response.create", event_id="twice"))
    errors = [f["error"] for f in h.take() if f["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("item_retrieve_invalid_item_id", "item_id"),
        ("invalid_value", "session.tools[0].name"),
        ("unknown_parameter", "session.voice_speed"),
        ("missing_required_parameter", "item.content"),
        ("conversation_already_has_active_response", None),
    ]
    assert errors[2]["message"] == "Unknown parameter: 'session.voice_speed'."
    assert errors[-1]["event_id"] == "twice"


def test_an_unknown_item_gets_openais_code_for_what_the_event_was_doing(h: Harness) -> None:
    """Clients switch on these (Pipecat fails a pending retrieve on
    item_retrieve_invalid_item_id; many ignore item_delete_invalid_item_id as a
    lost race); invalid_value would read as a fatal error."""
    h.send({"type": "conversation.item.retrieve", "item_id": "gone", "event_id": "r"})
    h.send({"type": "conversation.item.delete", "item_id": "gone", "event_id": "d"})
    h.send(
        {
            "type": "conversation.item.create",
            "event_id": "c",
            "previous_item_id": "gone",
            "item": {"type": "message", "role": "user", "content": "hi"},
        }
    )
    errors = [f["error"] for f in h.take() if f["type"] == "error"]
    assert [(e["code"], e["event_id"], e["message"]) for e in errors] == [
        (
            "item_retrieve_invalid_item_id",
            "r",
            "Error retrieving item: the item with id 'gone' does not exist.",
        ),
        (
            "item_delete_invalid_item_id",
            "d",
            "Error deleting item: the item with id 'gone' does not exist.",
        ),
        (
            "item_create_invalid_previous_item_id",
            "c",
            "Error adding item: the previous item with id 'gone' does not exist.",
        ),
    ]
    assert all(e["type"] == "invalid_request_error" for e in errors)


def test_an_unknown_parameter_is_quoted_short(h: Harness) -> None:
    """The client's key is echoed in param and message: at most 64 characters of it."""
    h.send({"type": "session.update", "session": {"type": "realtime", "k" * 100_000: 1}})
    (error,) = [f["error"] for f in h.take() if f["type"] == "error"]
    assert error["code"] == "unknown_parameter"
    assert error["param"] == "session." + "k" * 64


def test_a_type_that_is_not_a_string_is_named_by_its_kind(h: Harness) -> None:
    """A MiB-long value in `type` is not echoed (its repr took 20-40 ms a MiB)."""
    h.send({"type": [0] * 100_000, "event_id": "t1"})
    item = {"type": {"k": "v" * 100_000}, "role": "user", "content": "x"}
    h.send({"type": "conversation.item.create", "event_id": "t2", "item": item})
    errors = [f["error"] for f in h.take() if f["type"] == "error"]
    assert [(e["code"], e["param"], e["event_id"]) for e in errors] == [
        ("invalid_value", "type", "t1"),
        ("invalid_value", "item.type", "t2"),
    ]
    assert "type must be a string, not list" in errors[0]["message"]
    assert "type must be a string, not dict" in errors[1]["message"]
    assert all(len(e["message"]) < 200 for e in errors)


def test_retrieve_gives_content_parts(h: Harness) -> None:
    h.send(
        ConversationItemCreateEvent.model_validate(
            {
                "type": "conversation.item.create",
                "item": {
                    "id": "sys1",
                    "type": "message",
                    "role": "system",
                    "content": [{"type": "input_text", "text": "Be kind."}],
                },
            }
        )
    )
    h.send(ConversationItemRetrieveEvent(type="conversation.item.retrieve", item_id="sys1"))
    frames = h.take()
    assert frames[-1]["type"] == "conversation.item.retrieved"
    assert frames[-1]["item"]["content"] == [{"type": "input_text", "text": "Be kind."}]


def test_events_without_a_ga_counterpart_map_to_the_closest() -> None:
    d = OpenAIRealtime()
    item = {
        "id": "i1",
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "content": "x",
        "status": "completed",
    }
    events = [
        {
            "type": "session.resumed",
            "session": Session().describe(),
            "last_seq": 3,
            "replayed": 1,
            "seq": 1,
        },
        {"type": "session.going_away", "reason": "shutdown", "retry_after_ms": 0, "seq": 2},
        {"type": "conversation.item.truncated", "item_id": "i1", "text_end": 2, "seq": 3},
        {
            "type": "response.created",
            "response": {"id": "r1", "conversation": "auto", "output": []},
            "seq": 4,
        },
        {
            "type": "response.steered",
            "response_id": "r1",
            "previous_item_id": None,
            "item": item,
            "seq": 5,
        },
        {"type": "error", "error": error_event(ErrorCode.ENGINE_ERROR, "boom")["error"], "seq": 6},
    ]
    got = [[validate(f)["type"] for f in d.encode_all(e)] for e in events]
    assert got == [
        ["session.updated"],
        ["error"],
        ["conversation.item.truncated"],
        ["response.created"],
        ["conversation.item.added", "conversation.item.done"],
        ["error"],
    ]
    assert json.loads(d.main_frame(events[1]))["error"]["code"] == "server_shutting_down"


def test_the_main_frame_is_among_the_frames_and_replay_gives_the_same_frames() -> None:
    from .test_dialect_conformance import server_events

    events = server_events()
    live, main_of, from_json, from_msgpack = (OpenAIRealtime() for _ in range(4))
    for event in events:
        frames = live.frames(event)
        main = main_of.main_frame(event)
        if event["type"] == "response.requires_action":  # its calls closed already
            assert main == "" and frames == []
        else:
            assert main in frames
            assert json.loads(main)["event_id"] == f"event_{event['seq']}"
        assert from_json.from_logged(encode_json(event)) == frames
        assert from_msgpack.from_logged(msgpack.packb(event, use_bin_type=True)) == frames
        for frame in frames:
            validate(frame)


def test_one_instance_gives_an_event_the_same_frames_live_and_replayed() -> None:
    """The runtime passes an event live, then maybe again from the log."""
    from .test_dialect_conformance import server_events

    d = OpenAIRealtime()
    for event in server_events():
        live = d.frames(event)
        assert d.from_logged(encode_json(event)) == live
        assert d.from_logged(msgpack.packb(event, use_bin_type=True)) == live
        assert d.encode(event) == encode_json(event)  # the log keeps the internal event


def test_family() -> None:
    d = OpenAIRealtimeFamily().for_subprotocol("realtime")
    assert (d.name, d.subprotocol, d.binary) == ("openai.realtime", "realtime", False)
    assert OpenAIRealtimeFamily.subprotocols == ("realtime",)
    assert OpenAIRealtimeFamily.for_subprotocol(None).subprotocol == "realtime"


# -- client events -----------------------------------------------------------------

SUPPORTED = [
    session_update(
        instructions="Be brief.",
        model="gpt-realtime",
        output_modalities=["text"],
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens="inf",
        tracing="auto",
        truncation="auto",
    ),
    # What openai-agents' RealtimeRunner sends first: audio settings included.
    session_update(
        model="gpt-realtime",
        output_modalities=["text"],
        audio={
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "gpt-4o-mini-transcribe"},
                "turn_detection": {"type": "semantic_vad", "interrupt_response": True},
            },
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "ash"},
        },
        tools=[TOOL],
        instructions="",
    ),
    user_says("hi"),
    ConversationItemCreateEvent.model_validate(
        {
            "type": "conversation.item.create",
            "event_id": "e1",
            "previous_item_id": "sys1",
            "item": {
                "id": "a1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "ok"}],
            },
        }
    ),
    ConversationItemCreateEvent.model_validate(
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "call_1", "output": "{}"},
        }
    ),
    ConversationItemRetrieveEvent(type="conversation.item.retrieve", item_id="a1"),
    ResponseCreateEvent(type="response.create"),
    ResponseCreateEvent.model_validate(
        {
            "type": "response.create",
            "response": {
                "conversation": "none",
                "instructions": "Say yes.",
                "max_output_tokens": "inf",
                "output_modalities": ["text"],
                "tool_choice": "none",
                "tools": [TOOL],
                "metadata": {"k": "v"},
                "input": [
                    {
                        "type": "message",
                        "role": "system",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_text", "text": "b"},
                        ],
                    }
                ],
            },
        }
    ),
    ResponseCancelEvent(type="response.cancel"),
    ResponseCancelEvent(type="response.cancel", response_id="resp_1"),
    ConversationItemDeleteEvent(type="conversation.item.delete", item_id="i1", event_id="d1"),
]


@pytest.mark.parametrize("event", SUPPORTED, ids=lambda e: e.type)
def test_sdk_client_events_parse_into_the_internal_schema(event: BaseModel) -> None:
    obj = event.model_dump(exclude_none=True)
    parsed = OpenAIRealtime().parse(json.dumps(obj))
    assert parse_client_event(parsed).type == obj["type"]


def test_parts_and_inf_are_translated() -> None:
    parsed = OpenAIRealtime().parse(json.dumps(SUPPORTED[7].model_dump(exclude_none=True)))
    assert parsed["response"]["input"][0]["content"] == "a\nb"
    assert parsed["response"]["max_output_tokens"] == "inf"
    assert parse_client_event(parsed).response.max_output_tokens == "inf"
    assert "output_modalities" not in parsed["response"]
    assert OpenAIRealtime().parse(json.dumps(SUPPORTED[0].model_dump()))["session"] == {
        "instructions": "Be brief.",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": "inf",
    }


REFUSED = [
    (InputAudioBufferAppendEvent(type="input_audio_buffer.append", audio="AAAA"), "type"),
    (InputAudioBufferCommitEvent(type="input_audio_buffer.commit"), "type"),
    (InputAudioBufferClearEvent(type="input_audio_buffer.clear"), "type"),
    (OutputAudioBufferClearEvent(type="output_audio_buffer.clear"), "type"),
    (
        ConversationItemTruncateEvent(
            type="conversation.item.truncate", item_id="i1", content_index=0, audio_end_ms=10
        ),
        "type",
    ),
    (session_update(output_modalities=["audio"]), "session.output_modalities"),
    ({"type": "session.update", "session": {"type": "transcription"}}, "session.type"),
    (session_update(prompt={"id": "pmpt_1"}), "session.prompt"),
    (session_update(include=["item.input_audio_transcription.logprobs"]), "session.include"),
    (
        session_update(tools=[{"type": "mcp", "server_label": "x", "server_url": "https://x"}]),
        "session.tools[0].type",
    ),
    (
        session_update(tool_choice={"type": "mcp", "server_label": "x"}),
        "session.tool_choice.type",
    ),
    (
        ConversationItemCreateEvent.model_validate(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_audio", "audio": "AAAA"}],
                },
            }
        ),
        "item.content[0].type",
    ),
    (
        ConversationItemCreateEvent.model_validate(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"},
            }
        ),
        "item.type",
    ),
    (  # the SDK's ResponseCreateEventWithReferencesParam (a TypedDict) allows it
        {
            "type": "response.create",
            "response": {"input": [{"type": "item_reference", "id": "i1"}]},
        },
        "response.input[0].type",
    ),
    (
        ResponseCreateEvent.model_validate(
            {"type": "response.create", "response": {"output_modalities": ["audio"]}}
        ),
        "response.output_modalities",
    ),
    ({"type": "response.create", "response": {"conversation": "conv_1"}}, "response.conversation"),
    ({"type": "response.steer", "input": "shorter"}, "type"),
    ({"type": "session.resume", "session_id": "sess_1", "last_seq": 0}, "type"),
    ({"type": "transcription_session.update", "session": {}}, "type"),
    ({"type": 7}, "type"),
    ({"type": "response.cancel", "response_idd": "r"}, "response_idd"),
    (
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text"}]},
        },
        "item.content[0].text",
    ),
    ({"type": "session.update"}, "session"),
    ({"event_id": "x"}, "type"),
]


@pytest.mark.parametrize(
    ("event", "param"), REFUSED, ids=lambda v: getattr(v, "type", None) or str(v)[:40]
)
def test_what_tokenwire_does_not_do_is_refused_with_a_ga_code(event: Any, param: str) -> None:
    obj = event.model_dump(exclude_none=True) if isinstance(event, BaseModel) else event
    with pytest.raises(OpenAIProtocolError) as caught:
        OpenAIRealtime(ignore_audio_settings=True).parse(json.dumps(obj))
    err = caught.value
    assert err.param == param
    assert err.ga_code in set(GACode)
    # What the session emits from it encodes into the same GA code.
    assert ga_error(err.to_event()["error"])["code"] == err.ga_code


def test_audio_settings_are_refused_when_told_to() -> None:
    with pytest.raises(OpenAIProtocolError) as caught:
        OpenAIRealtime(ignore_audio_settings=False).parse(
            json.dumps(SUPPORTED[1].model_dump(exclude_none=True))
        )
    assert (caught.value.ga_code, caught.value.param) == ("invalid_value", "session.audio")


def test_every_ga_client_event_type_is_parsed_or_refused() -> None:
    for kind in sorted(CLIENT_TYPES):
        try:
            parse_client_event(OpenAIRealtime().parse(json.dumps({"type": kind})))
        except OpenAIProtocolError as err:
            assert err.ga_code in set(GACode), kind
        except ProtocolError as err:  # the core's own check of a supported event
            assert ga_error(err.to_event()["error"])["code"] in set(GACode), kind


@pytest.mark.parametrize("frame", ["{", "[1,", "NaN", b"\xc1", b"\x92\x01", '"\\ud800"'])
def test_malformed_frames_are_a_protocol_error(frame: str | bytes) -> None:
    with pytest.raises(OpenAIProtocolError) as caught:
        OpenAIRealtime().parse(frame)
    assert (caught.value.code, caught.value.ga_code) == (ErrorCode.MALFORMED_FRAME, "invalid_json")


@pytest.mark.parametrize("frame", ["[]", "1", '"session.update"', b'{"type": "response.cancel"}'])
def test_frames_that_are_not_event_objects(frame: str | bytes) -> None:
    if isinstance(frame, bytes):  # JSON in a binary frame is read as text
        assert OpenAIRealtime().parse(frame) == {"type": "response.cancel"}
        return
    with pytest.raises(OpenAIProtocolError) as caught:
        OpenAIRealtime().parse(frame)
    assert caught.value.ga_code == "invalid_value"


JUNK: list[Any] = [
    None,
    0,
    -1,
    1.5,
    "",
    "x",
    True,
    [],
    [1],
    {},
    {"type": "x"},
    [{"type": "input_text"}],
]


def _mutations(obj: Any) -> typing.Iterator[Any]:
    """`obj` with one value replaced by junk, or one unknown key added, anywhere."""
    if isinstance(obj, dict):
        yield {**obj, "zz_unknown": 1}
        for key, value in obj.items():
            for junk in JUNK:
                yield {**obj, key: junk}
            for sub in _mutations(value):
                yield {**obj, key: sub}
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            for sub in _mutations(value):
                yield [*obj[:i], sub, *obj[i + 1 :]]


def test_bad_input_is_only_ever_a_protocol_error() -> None:
    count = 0
    for event in SUPPORTED + [e for e, _ in REFUSED]:
        base = event.model_dump(exclude_none=True) if isinstance(event, BaseModel) else event
        for obj in _mutations(base):
            count += 1
            try:
                parsed = OpenAIRealtime().parse(json.dumps(obj))
                parse_client_event(parsed)
            except ProtocolError as err:
                assert ga_error(err.to_event()["error"])["code"]
    assert count > 1000


# -- error mapping ----------------------------------------------------------------


def test_every_internal_code_maps_to_a_ga_error() -> None:
    for code in ErrorCode:
        error = ga_error(
            error_event(code, "m", event_id="e", param="session.tools.0.name")["error"]
        )
        assert set(error) == {"type", "code", "message", "param", "event_id"}
        assert error["param"] == "session.tools[0].name"
        assert error["type"] in ("invalid_request_error", "server_error")
    not_active = error_event(ErrorCode.RESPONSE_NOT_ACTIVE, "m", param="item.call_id")["error"]
    assert ga_error(not_active)["code"] == "invalid_value"
    assert ga_param("response.input.10.content.2.text") == "response.input[10].content[2].text"


# -- a random walk: many interleaved responses, every frame checked ----------------


def _check_lifecycle(frames: list[dict[str, Any]]) -> None:
    """GA's ordering rules over a whole stream."""
    open_items: dict[str, tuple[str, int]] = {}  # item id -> (response id, output_index)
    next_index: dict[str, int] = {}
    ids = [f["event_id"] for f in frames]
    assert len(set(ids)) == len(ids)
    for f in frames:
        kind = f["type"]
        if kind == "response.created":
            next_index[f["response"]["id"]] = 0
        elif kind == "response.output_item.added":
            rid = f["response_id"]
            assert f["output_index"] == next_index[rid]
            next_index[rid] += 1
            assert f["item"]["id"] not in open_items
            open_items[f["item"]["id"]] = (rid, f["output_index"])
        elif kind == "response.output_item.done":
            assert open_items.pop(f["item"]["id"]) == (f["response_id"], f["output_index"])
            assert f["item"]["status"] in ("completed", "incomplete")
        elif "delta" in kind or kind.endswith(("text.done", "arguments.done", "part.added")):
            assert open_items[f["item_id"]] == (f["response_id"], f["output_index"])
        elif kind == "response.done":
            rid = f["response"]["id"]
            assert not [i for i, (r, _) in open_items.items() if r == rid], f
            del next_index[rid]
    assert open_items == {}


@pytest.mark.parametrize("seed", range(12))
def test_a_random_walk_gives_only_valid_ga_frames(seed: int) -> None:
    import random

    rng = random.Random(seed)
    h = Harness()
    h.session.limits.tool_timeout_s = 1.0
    h.take()
    h.send(session_update(tools=[TOOL], tool_choice="auto"))
    running: dict[str, str] = {}  # request id -> response id
    call_ids: list[str] = []
    timers: list[tuple[str, int]] = []

    def actions() -> None:
        for action in h.session.actions_to_perform():
            if hasattr(action, "request"):
                running[action.request.request_id] = action.response_id
            elif hasattr(action, "request_id"):
                running.pop(action.request_id, None)
            elif hasattr(action, "token"):  # a StartTimer; a CancelTimer's is stale anyway
                timers.append((action.response_id, action.token))

    h._actions = actions  # type: ignore[method-assign]
    for _ in range(120):
        roll = rng.random()
        if roll < 0.12 or not running:
            conversation = rng.choice(["auto", "auto", "none"])
            params: dict[str, Any] = {"conversation": conversation}
            if conversation == "none":
                params["input"] = [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "x"}],
                    }
                ]
            h.send({"type": "response.create", "response": params})
        elif roll < 0.17:
            h.send(user_says(rng.choice(["hi", "more", ""])))
        elif roll < 0.22:
            h.send(
                {
                    "type": "response.cancel",
                    **({"response_id": rng.choice(list(running.values()))} if running else {}),
                }
            )
        elif roll < 0.27 and call_ids:
            item = {"type": "function_call_output", "call_id": call_ids.pop(0), "output": "ok"}
            h.send({"type": "conversation.item.create", "item": item})
        elif roll < 0.29:
            h.send({"type": "input_audio_buffer.append", "audio": "AAAA"})
        elif roll < 0.31 and timers:
            h.session.receive_timeout(*timers.pop(0))
        else:
            request_id = rng.choice(list(running))
            text = rng.choice(["", "a", "bc ", "😀"])
            calls = []
            if rng.random() < 0.3:
                calls = [
                    ToolCallDelta(
                        rng.choice([0, 1]),
                        "get_weather",
                        rng.choice(['{"city": "P"}', '{"city":', ' "P"}', ""]),
                    )
                ]
            finish = rng.choice([None, None, "stop", "stop", "length", "abort"])
            delta = EngineDelta(text, 1, finish, rng.choice([None, 5]), 2, tool_calls=calls or None)
            h.session.receive_engine_output(request_id, delta)
            if finish is not None:
                running.pop(request_id, None)
            actions()
        for f in h.take():
            if f["type"] == "response.function_call_arguments.done":
                call_ids.append(f["call_id"])
    # End every response still running, as a closing client would.
    h.session.close()
    h.take()
    _check_lifecycle(h.frames)
    kinds = set(types(h.frames))
    assert {"response.done", "response.output_text.delta", "response.output_item.done"} <= kinds


def test_tokenwire_response_extensions_pass() -> None:
    frame = {
        "type": "response.create",
        "response": {"seed": 7, "cache": False, "temperature": 1, "stream_interval": 8},
    }
    parsed = OpenAIRealtime().parse(json.dumps(frame))
    response = parse_client_event(parsed).response
    assert (response.seed, response.cache, response.temperature) == (7, False, 1)
    assert response.stream_interval == 8
