"""What a chat template that refuses a conversation becomes for the client."""

from __future__ import annotations

from typing import Any

import pytest

from tokenwire.core.events import StartGeneration
from tokenwire.core.session import Session
from tokenwire.engines.base import ContextLengthExceeded, ConversationRefused
from tokenwire.engines.chat_template import ChatTemplate
from tokenwire.models import prepare_default_model

from ..helpers.session import codes, drive

# Strict templates (Mistral's, Gemma's) refuse roles that do not alternate
# this way, through the raise_exception HF gives every template.
STRICT = (
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def strict_template() -> tuple[Any, ChatTemplate]:
    """SmolLM2's real tokenizer, with the strict template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    tokenizer.chat_template = STRICT
    return tokenizer, ChatTemplate(tokenizer)


def preflighted_session(template: ChatTemplate) -> Session:
    """A session whose preflight renders through `template` (a 2048 context)."""
    s = Session(preflight=lambda request: tuple(template.prompt_ids(request, 2048)))
    s.events_to_send()
    return s


def test_a_template_that_refuses_the_conversation_is_an_error_event() -> None:
    """SmolLM2's real tokenizer, with a strict template: a refused conversation
    is answered with invalid_state and the session goes on."""
    tokenizer, template = strict_template()

    s = preflighted_session(template)
    for text in ("Hello", "Are you there?"):
        item = {"type": "message", "role": "user", "content": text}
        drive(s, {"type": "conversation.item.create", "item": item})
    events = drive(s, {"type": "response.create", "event_id": "r"})
    assert codes(events) == ["invalid_state"]
    assert events[0]["error"]["event_id"] == "r"
    assert "roles must alternate" in events[0]["error"]["message"]
    assert s.actions_to_perform() == []
    # Fixed by the client (the second question deleted), the same session answers.
    drive(s, {"type": "conversation.item.delete", "item_id": s.items[-1]["id"]})
    (created,) = drive(s, {"type": "response.create"})
    assert created["type"] == "response.created"
    (start,) = s.actions_to_perform()
    assert start.request.rendered == tuple(
        tokenizer.encode(
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
    )


def test_a_refusal_when_the_generation_starts_fails_the_response_with_invalid_state() -> None:
    """No preflight ran (vLLM still loading at create): the engine meets the
    template's refusal when the generation starts, and the response ends
    failed with the same code and message as a refused create."""
    _, template = strict_template()
    s = Session()  # no preflight, as while the engine loads
    s.events_to_send()
    for text in ("Hello", "Are you there?"):
        item = {"type": "message", "role": "user", "content": text}
        drive(s, {"type": "conversation.item.create", "item": item})
    drive(s, {"type": "response.create", "event_id": "r"})
    (start,) = s.actions_to_perform()
    assert isinstance(start, StartGeneration)
    with pytest.raises(ConversationRefused) as refused:
        template.prompt_ids(start.request, 2048)  # what the engine does first
    s.receive_engine_error(start.request.request_id, refused.value)
    events = s.events_to_send()
    assert codes(events) == ["invalid_state"]
    assert "roles must alternate" in events[0]["error"]["message"]
    assert events[-1]["type"] == "response.done"
    assert events[-1]["response"]["status"] == "failed"


def test_a_tokenizer_without_a_template_fails_the_request_not_the_session() -> None:
    """transformers raises a plain ValueError when the tokenizer has no chat
    template: the create is refused with an error event (it escaped the
    session, and the socket was closed with 1011)."""
    tokenizer, template = strict_template()
    tokenizer.chat_template = None

    s = preflighted_session(template)
    item = {"type": "message", "role": "user", "content": "Hello"}
    drive(s, {"type": "conversation.item.create", "item": item})
    events = drive(s, {"type": "response.create", "event_id": "r"})
    assert codes(events) == ["engine_error"]
    assert "chat template could not render" in events[0]["error"]["message"]
    assert s.actions_to_perform() == []
    update = {"type": "session.update", "session": {"instructions": "Be brief."}}
    assert [e["type"] for e in drive(s, update)] == ["session.updated"]  # it goes on


# A template that walks tool schemas with a recursive macro, as XML- and
# TypeScript-style tool templates do.
RECURSIVE = (
    "{% macro walk(node) %}{% if node is mapping %}{% for k, v in node.items() %}"
    "{{ k }}({{ step(v) }}){% endfor %}{% endif %}{% endmacro %}"
    "{% macro step(node) %}{{ walk(node) }}{% endmacro %}"
    "{% for t in tools or [] %}{{ walk(t) }}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_recurses_too_deep_fails_the_request_not_the_session() -> None:
    """A tool schema nested 100 deep (pydantic takes it) makes a recursive macro
    raise RecursionError: the create is refused with an error event; it escaped
    the session, and the socket was closed with 1011."""
    tokenizer, template = strict_template()
    tokenizer.chat_template = RECURSIVE

    s = preflighted_session(template)
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "name": "deep", "parameters": schema}
    assert codes(drive(s, {"type": "session.update", "session": {"tools": [tool]}})) == []
    drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": "Hi"},
        },
    )
    events = drive(s, {"type": "response.create", "event_id": "r"})
    assert codes(events) == ["engine_error"]
    assert "chat template could not render" in events[0]["error"]["message"]
    assert s.actions_to_perform() == []


class CountingTokenizer:
    """SmolLM2's tokenizer, counting what it is asked to encode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.encoded: list[int] = []

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def _request(text: str) -> Any:
    s = Session()
    s.events_to_send()
    drive(
        s,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": text},
        },
    )
    drive(s, {"type": "response.create"})
    (start,) = s.actions_to_perform()
    return start.request


def test_no_token_of_the_model_stands_for_more_characters_than_the_bound() -> None:
    """The bound that refuses prompts untokenized holds for every token of
    SmolLM2's vocabulary, special ones included."""
    tokenizer, template = strict_template()
    assert template.max_token_chars is not None
    longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    assert 1 < longest <= template.max_token_chars


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized() -> None:
    tokenizer, _ = strict_template()
    counting = CountingTokenizer(tokenizer)
    template = ChatTemplate(counting)
    bound = template.max_token_chars
    assert bound is not None
    request = _request("word " * (100 * bound // 5 + 1))  # past 100 tokens for sure
    with pytest.raises(ContextLengthExceeded) as info:
        template.prompt_ids(request, 100)
    assert "more than 100 tokens" in info.value.message
    assert counting.encoded == []
    # Below the bound it is tokenized, and refused with its count.
    request = _request("word " * 200)
    with pytest.raises(ContextLengthExceeded) as info:
        template.prompt_ids(request, 100)
    assert "the prompt has 2" in info.value.message and len(counting.encoded) == 1


def test_a_prompt_asked_for_again_is_not_tokenized_again() -> None:
    tokenizer, _ = strict_template()
    counting = CountingTokenizer(tokenizer)
    template = ChatTemplate(counting)
    refused = _request("word " * 200)
    for _ in range(3):
        with pytest.raises(ContextLengthExceeded):
            template.prompt_ids(refused, 100)
    fits = _request("Hello")
    ids = template.prompt_ids(fits, 100)
    ids.append(-1)  # the caller's copy: the kept one does not change
    assert template.prompt_ids(fits, 100) == ids[:-1]
    assert ids[:-1] == tokenizer.encode(
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert len(counting.encoded) == 2  # once each
    # A larger context tokenizes a prompt refused under a smaller one.
    assert len(template.prompt_ids(refused, 4096)) > 100
    assert len(counting.encoded) == 3


def test_a_tokenizer_that_can_swallow_text_gets_no_bound() -> None:
    """An added token that strips the whitespace beside it covers more text than
    its spelling: no prompt is refused untokenized with such a tokenizer."""
    from tokenizers import AddedToken

    tokenizer, template = strict_template()
    assert template.max_token_chars == max(map(len, tokenizer.get_vocab()))
    tokenizer.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    assert ChatTemplate(tokenizer).max_token_chars is None


TOOL_USE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}CALL {{ c['function']['name'] }}"
    "{{ c['function']['arguments']['city'] }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_tokenizer_with_named_templates_keeps_the_tool_turns() -> None:
    """Hermes-style tokenizers carry {"default", "tool_use"}: the one used
    with tools renders calls, so they stay calls (not "Result of" turns)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    tokenizer.chat_template = {"default": STRICT, "tool_use": TOOL_USE}
    template = ChatTemplate(tokenizer)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    shaped = template.template_messages(messages)
    assert shaped[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert shaped[2]["role"] == "tool"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert "CALL get_weatherParis" in template.text(messages, tools)
