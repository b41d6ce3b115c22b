"""A chat rendered to token ids through the tokenizer's chat template.

Shared by the in-process vLLM engine and the remote engine: both send token
ids, so both must render a conversation exactly the same way (the remote
engine checks its rendering against the server's `/tokenize` at startup).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import Any

from .base import (
    TOKENIZE_OFF_LOOP,
    ContextLengthExceeded,
    ConversationRefused,
    GenerationRequest,
    RequestError,
    TokenizeOffLoop,
    asking_off_loop,
)

# Prompts whose token ids are kept, by their text: a client that asks again
# for the same prompt (a refused one above all) costs no second tokenization.
MEMO_SIZE = 8
# Longer prompts are tokenized off the event loop where the caller can
# (TOKENIZE_OFF_LOOP): ~1.3 us a character, so about 5 ms on it at most.
CHARS_ON_LOOP = 4096


class ChatTemplate:
    """Renders chat messages (with tools) through one tokenizer's template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # Tokenizing costs ~1.3 s per MiB; a prompt longer than the context
        # times this cannot fit, and is refused without it.
        self.max_token_chars = _max_token_chars(tokenizer)
        self._memo: OrderedDict[str, list[int] | int] = OrderedDict()

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool turns in the shape the chat template understands."""
        if _takes_tool_calls(self.tokenizer.chat_template):
            # HF templates take a call's arguments as a mapping.
            return [
                {**m, "tool_calls": [_with_parsed_arguments(c) for c in m["tool_calls"]]}
                if m.get("tool_calls")
                else m
                for m in messages
            ]
        # No tool support in the template (SmolLM2's ChatML). Measured on
        # SmolLM2: written-out calls make it imitate JSON instead of answering,
        # while a plain "Result of NAME: ..." user turn gets a grounded answer.
        names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
        out = []
        for m in messages:
            if m.get("tool_calls"):
                if m["content"]:
                    out.append({"role": "assistant", "content": m["content"]})
            elif m["role"] == "tool":
                name = names.get(m["tool_call_id"], "the tool")
                out.append({"role": "user", "content": f"Result of {name}: {m['content']}"})
            else:
                out.append(m)
        return out

    def text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        from jinja2 import TemplateError

        try:
            return str(
                self.tokenizer.apply_chat_template(
                    self.template_messages(messages),
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
        except TemplateError as exc:
            # Templates refuse shapes the model was not trained on (roles that
            # do not alternate, a system turn): the conversation's, not ours.
            raise ConversationRefused(
                f"the model's chat template refused the conversation: {exc}"
            ) from None
        except Exception as exc:
            # No template at all, one that breaks on a value, or one whose
            # recursive macro meets a deeply nested tool schema (RecursionError):
            # this request fails, the session goes on.
            raise RequestError(
                f"the model's chat template could not render the conversation: {exc}"
            ) from None

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat, ready for generation (generation prompt added)."""
        return self._encode(self.text(messages, tools))

    def prompt_ids(self, request: GenerationRequest, max_len: int) -> list[int]:
        """The request's chat as token ids; ContextLengthExceeded when it leaves
        the model no room to generate."""
        return self._ids_of(self.text(request.messages, request.tools), max_len)

    async def prompt_ids_async(self, request: GenerationRequest, max_len: int) -> list[int]:
        """`prompt_ids` for a generation no client event started (a tool
        round's continuation, a takeover): a long prompt is tokenized in a
        thread, so the loop serves every other session meanwhile."""
        got = asking_off_loop(lambda: self.prompt_ids(request, max_len))
        if not isinstance(got, TokenizeOffLoop):
            return got
        got.remember(await asyncio.to_thread(got.tokenize, got.text))
        return self._ids_of(got.text, max_len)  # in the memo now

    def _ids_of(self, text: str, max_len: int) -> list[int]:
        memo = self._memo
        ids = memo.get(text)
        if ids is not None:
            memo.move_to_end(text)
        if isinstance(ids, int) and ids < max_len:
            ids = None  # refused under a smaller context: tokenize after all
        if ids is None:
            if self.max_token_chars and len(text) > max_len * self.max_token_chars:
                raise ContextLengthExceeded(
                    f"the prompt has more than {max_len} tokens ({len(text)} characters, "
                    f"and no token stands for more than {self.max_token_chars}); the model's "
                    f"context is {max_len} tokens. Shorten the conversation or its instructions.",
                )
            if len(text) > CHARS_ON_LOOP and TOKENIZE_OFF_LOOP.get():
                raise TokenizeOffLoop(
                    text, self._encode, lambda found: self._remember(text, found, max_len)
                )
            ids = self._encode(text)
            self._remember(text, ids, max_len)
        count = ids if isinstance(ids, int) else len(ids)
        if isinstance(ids, int) or count >= max_len:
            raise ContextLengthExceeded(
                f"the prompt has {count} tokens; the model's context is {max_len} "
                "tokens. Shorten the conversation or its instructions.",
            )
        return list(ids)  # the caller's own: the memo's copy stays as it is

    def _encode(self, text: str) -> list[int]:
        # transformers' fast encode releases the GIL: in a thread, the loop runs on.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _remember(self, text: str, ids: list[int], max_len: int) -> None:
        memo = self._memo
        memo[text] = ids if len(ids) < max_len else len(ids)  # a count is enough
        memo.move_to_end(text)
        if len(memo) > MEMO_SIZE:
            memo.popitem(last=False)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


def _max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, where that is
    sure: a byte-level BPE (a token spells each of its bytes as a character)
    with no normalizer and no added token that swallows the whitespace beside
    it. Other tokenizers can turn long text into one token (an unknown word,
    dropped whitespace), and get no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    pre = state.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") or [pre]
    byte_level = any(step.get("type") == "ByteLevel" for step in steps)
    stripping = any(t.get("lstrip") or t.get("rstrip") for t in state.get("added_tokens", ()))
    model = state.get("model") or {}
    if not byte_level or stripping or state.get("normalizer") or model.get("type") != "BPE":
        return None
    return max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=None)


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = call["function"]["arguments"]
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _takes_tool_calls(template: str | dict[str, str] | None) -> bool:
    """Whether the chat template renders assistant tool calls; a tokenizer may
    have several by name (Hermes: "default" and "tool_use", the one used with
    tools)."""
    if isinstance(template, dict):
        return any("tool_calls" in t for t in template.values())
    return "tool_calls" in (template or "")
