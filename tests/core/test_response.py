"""Response output items: text and arguments grow in place, and what was
handed out before (an event's copy of an item) keeps what it had."""

from __future__ import annotations

from tokenwire.core.conversation import ITEM_BYTES, Conversation
from tokenwire.core.response import Response


def _response(conv: Conversation) -> Response:
    return Response(
        id="resp_1",
        event_id=None,
        in_conversation=True,
        params={"max_output_tokens": None},
        metadata=None,
        context=conv.items,
        created_at=0.0,
    )


def test_text_and_arguments_grow_and_earlier_copies_stay() -> None:
    conv = Conversation(1 << 20)
    resp = _response(conv)
    item = resp.append_text(conv, "Hel")
    early = resp.describe()["output"][0]  # shares the string "Hel"
    for part in ("lo", ", ", "world"):
        assert resp.append_text(conv, part) is item
    assert item["content"] == "Hello, world" and early["content"] == "Hel"
    assert list(item) == ["id", "object", "type", "role", "content", "status"]  # order kept
    call = resp.append_call_chunk(conv, 0, "f", '{"a"')
    held = call["arguments"]
    resp.append_call_chunk(conv, 0, None, ": 1}")
    assert call["arguments"] == '{"a": 1}' and held == '{"a"'
    assert conv.history_bytes == len("Hello, world") + len('{"a": 1}') + 2 * ITEM_BYTES
    assert conv.items == [item, call]
