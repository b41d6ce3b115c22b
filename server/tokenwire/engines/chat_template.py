"""A chat rendered to token ids through the tokenizer's chat template.

Shared by the in-process vLLM engine and the remote engine: both send token
ids, so both must render a conversation exactly the same way (the remote
engine checks its rendering against the server's `/tokenize` at startup).
"""

from __future__ import annotations

import json
from typing import Any

from .base import ContextLengthExceeded, ConversationRefused, GenerationRequest, RequestError


class ChatTemplate:
    """Renders chat messages (with tools) through one tokenizer's template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool turns in the shape the chat template understands."""
        if "tool_calls" in (self.tokenizer.chat_template or ""):
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
        except (ValueError, TypeError, KeyError) as exc:
            # No template at all, or one that breaks on a value: this request
            # fails, the session goes on.
            raise RequestError(
                f"the model's chat template could not render the conversation: {exc}"
            ) from None

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat, ready for generation (generation prompt added)."""
        return list(self.tokenizer.encode(self.text(messages, tools), add_special_tokens=False))

    def prompt_ids(self, request: GenerationRequest, max_len: int) -> list[int]:
        """The request's chat as token ids; ContextLengthExceeded when it leaves
        the model no room to generate."""
        ids = self.render(request.messages, request.tools)
        if len(ids) >= max_len:
            raise ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens; the model's context is {max_len} "
                "tokens. Shorten the conversation or its instructions.",
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = call["function"]["arguments"]
    return {**call, "function": {**call["function"], "arguments": arguments}}
