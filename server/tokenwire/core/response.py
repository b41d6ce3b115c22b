"""One response: its lifecycle state, its output items, its accounting."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..engines.base import GenerationRequest
from .conversation import Conversation, Item, make_item, new_id


class ResponseStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    REQUIRES_ACTION = "requires_action"  # waiting for tool outputs
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    INCOMPLETE = "incomplete"
    FAILED = "failed"


ACTIVE = frozenset({ResponseStatus.IN_PROGRESS, ResponseStatus.REQUIRES_ACTION})


@dataclass(slots=True)
class Response:
    id: str
    event_id: str | None
    in_conversation: bool
    params: dict[str, Any]
    metadata: dict[str, str] | None
    # Items the prompt is rendered from: the session's list for conversation
    # "auto", a private one for "none" and for an OpenAI session's `input`.
    # Output items are appended to it, and to the conversation when
    # `in_conversation` (see Conversation.add_output).
    context: list[Item]
    created_at: float
    tool_choice: str | dict[str, Any] = "auto"
    status: ResponseStatus = ResponseStatus.IN_PROGRESS
    status_details: dict[str, Any] | None = None
    output: list[Item] = field(default_factory=list)
    current_item: Item | None = None  # the assistant text being written
    calls: dict[int, Item] = field(default_factory=dict)  # this generation's, by index
    pending_calls: dict[str, Item] = field(default_factory=dict)  # call_id -> item
    request_id: str | None = None
    # The current generation's request and the token ids it has produced:
    # what a paused response resubmits.
    gen_request: GenerationRequest | None = None
    gen_token_ids: list[int] = field(default_factory=list)
    paused: bool = False
    logged_ids: int = 0  # gen_token_ids already in the event log (progress())
    logged_usage: tuple[Any, ...] | None = None  # usage() as last logged
    generation: int = 0
    wait_token: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    queue_wait_s: float = 0.0  # waiting for the engine's scheduler, all generations
    # A conversation response's newest output item and the id of the item it
    # follows there, until its first delta event takes it (`placed`).
    new_item: tuple[str, str | None] | None = None
    cached_response: bool = False  # a response cache served a generation of it
    first_token_at: float | None = None
    done_at: float | None = None
    # Set by a takeover: the old owner may have used the next numbers after
    # its last snapshot (a pause and resume), and may still abort them.
    request_tag: str = ""

    def next_request_id(self) -> str:
        """The engine request id of its next generation."""
        return f"{self.id}-{self.generation + 1}{self.request_tag}"

    def usage(self) -> tuple[Any, ...]:
        """What a takeover needs for usage and timings besides output tokens."""
        return (
            self.input_tokens,
            self.cached_tokens,
            self.queue_wait_s,
            self.cached_response,
            self.first_token_at,
        )

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def remaining_tokens(self) -> int | None:
        limit = self.params["max_output_tokens"]
        return None if limit is None else max(limit - self.output_tokens, 0)

    # -- output items ----------------------------------------------------------

    def _add_output(self, conv: Conversation, item: Item) -> None:
        previous = conv.add_output(self.context, item, self.in_conversation)
        self.output.append(item)
        if self.in_conversation:
            self.new_item = (item["id"], previous)

    def placed(self, event: dict[str, Any]) -> dict[str, Any]:
        """An item's first delta event says where the item went in the
        conversation (`previous_item_id`), as conversation.item.created does."""
        if self.new_item is not None and self.new_item[0] == event["item_id"]:
            event["previous_item_id"] = self.new_item[1]
            self.new_item = None
        return event

    def append_text(self, conv: Conversation, text: str, item_id: str | None = None) -> Item:
        """Add text to the current assistant message (made on first text)."""
        item = self.current_item
        if item is None:
            item = make_item(
                {
                    "id": item_id,
                    "type": "message",
                    "role": "assistant",
                    "content": "",
                    "status": "in_progress",
                }
            )
            self._add_output(conv, item)
            self.current_item = item
        # Taken out of the item while it grows: a string nothing else holds is
        # extended in place, where `item["content"] += text` copies it all
        # (per token: about 4 µs at 100 KB of text).
        content, item["content"] = item["content"], ""
        content += text
        item["content"] = content
        conv.add_bytes(text)
        return item

    def append_call_chunk(
        self,
        conv: Conversation,
        index: int,
        name: str | None,
        arguments: str,
        item_id: str | None = None,
        call_id: str | None = None,
    ) -> Item:
        """Add arguments to this generation's index-th call (made on its first chunk)."""
        item = self.calls.get(index)
        if item is None:
            item = make_item(
                {
                    "id": item_id,
                    "type": "function_call",
                    "call_id": call_id or new_id("call"),
                    "name": name or "",
                    "arguments": "",
                    "status": "in_progress",
                }
            )
            self._add_output(conv, item)
            self.calls[index] = item
        args, item["arguments"] = item["arguments"], ""  # in place, as in append_text
        args += arguments
        item["arguments"] = args
        conv.add_bytes(arguments)
        return item

    def close_text_item(self, status: str) -> Item | None:
        item, self.current_item = self.current_item, None
        if item is not None:
            item["status"] = status
        return item

    def drop_partial_calls(self, conv: Conversation) -> None:
        # Calls cut off mid-arguments cannot be run; they leave the history
        # (the context, and the conversation).
        for item in self.calls.values():
            conv.remove_from(self.context, item)
            self.output.remove(item)
        self.calls = {}

    # -- the response object ---------------------------------------------------

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status.value,
            "status_details": self.status_details,
            "conversation": "auto" if self.in_conversation else "none",
            "metadata": self.metadata,
            # Copies: the event is encoded later, after the items have moved on.
            "output": [dict(item) for item in self.output],
        }
        if self.done_at is not None:
            out["usage"] = {
                "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
            }
            if self.cached_response:
                out["usage"]["cached_response"] = True
            total = self.done_at - self.created_at
            ttft = None if self.first_token_at is None else self.first_token_at - self.created_at
            decode = total - ttft if ttft is not None else 0.0
            out["timings"] = {
                "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
                "queue_wait_ms": round(self.queue_wait_s * 1000, 2),
                "total_ms": round(total * 1000, 2),
                "output_tokens_per_s": (
                    round((self.output_tokens - 1) / decode, 2)
                    if decode > 0 and self.output_tokens > 1
                    else None
                ),
            }
        return out
