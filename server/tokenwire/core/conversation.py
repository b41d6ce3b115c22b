"""A session's conversation: its items, the room they take, and how they
render into chat messages for the engine."""

from __future__ import annotations

import os
import random
import secrets
from typing import Any

from .errors import ErrorCode, ProtocolError
from .schema import FunctionCallOutputItem, MessageItem

Item = dict[str, Any]
# What each item counts against the size cap besides its text: about the
# memory an empty item holds (measured: 370 bytes), so empty items cannot
# grow a session without bound.
ITEM_BYTES = 384
# OpenAI's previous_item_id for the conversation's start; only sessions that
# say so (ToolFlow.CLIENT) read it so: in tokenwire v1 it is an item id.
ROOT = "root"


# Response, item and call ids name things inside one session, which holds
# them by id; they need not be secret, only unique, so not a syscall each
# (secrets). Session ids are secrets: `new_secret_id`.
_ids = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _ids.seed(secrets.randbits(128)))


def new_id(prefix: str) -> str:
    return f"{prefix}_{_ids.getrandbits(64):016x}"


def new_secret_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def make_item(fields: dict[str, Any]) -> Item:
    item = {"id": fields.pop("id", None) or new_id("item"), "object": "realtime.item"}
    item.update(fields)
    item.setdefault("status", "completed")
    return item


# What an unknown-item error was doing, named in its message in OpenAI's
# wording; the OpenAI dialect reads it back as OpenAI's code for each
# (wire/openai_errors.UNKNOWN_ITEM_CODES).
RETRIEVING, DELETING, TRUNCATING, ADDING = "retrieving", "deleting", "truncating", "adding"


def unknown_item(
    action: str, item_id: str, event_id: str | None, param: str = "item_id"
) -> ProtocolError:
    which = "the previous item" if action == ADDING else "the item"
    return ProtocolError(
        ErrorCode.UNKNOWN_ITEM,
        f"Error {action} item: {which} with id {item_id!r} does not exist.",
        event_id=event_id,
        param=param,
    )


class Conversation:
    """The session's items in order, every item it knows by id (a
    conversation:"none" response's private items too), and the bytes of text
    they hold, which bound the session's memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: list[Item] = []
        self.by_id: dict[str, Item] = {}
        self.history_bytes = 0

    def check_room(self, text_bytes: int, event_id: str | None, items: int = 1) -> None:
        """Refuse new client items past the cap; callers count their text
        (`add_bytes`) once every other check has passed, and adding an item
        counts the item."""
        if self.history_bytes + text_bytes + items * ITEM_BYTES > self.max_bytes:
            raise ProtocolError(
                ErrorCode.CONVERSATION_TOO_LARGE,
                f"the conversation would exceed {self.max_bytes} bytes of text; start a new "
                "session",
                event_id=event_id,
            )

    def add_bytes(self, text: str) -> None:
        self.history_bytes += len(text.encode())

    def response_inputs(
        self,
        raw_inputs: list[MessageItem | FunctionCallOutputItem],
        event_id: str | None,
        calls: dict[str, tuple[Item, str, bool]] | None = None,
    ) -> list[Item]:
        """A response's own `input` items, new and not yet inserted. `calls`
        (OpenAI's sessions: the session's calls by call_id) lets outputs in:
        they are only the prompt's, answer no call, and one for a call of the
        session follows a copy of that call (the model sees what it answers);
        without it, tokenwire v1's rule refuses them."""
        # Every item's id first, as protocol.md orders the checks.
        inputs = [
            self.new_item(raw, event_id, f"response.input.{i}.id")
            for i, raw in enumerate(raw_inputs)
        ]
        if len({i["id"] for i in inputs}) < len(inputs):
            raise ProtocolError(
                ErrorCode.DUPLICATE_ITEM_ID,
                "two input items share an id",
                event_id=event_id,
                param="response.input",
            )
        if calls is None and any(i["type"] == "function_call_output" for i in inputs):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                "send function_call_output items with conversation.item.create",
                event_id=event_id,
                param="response.input",
            )
        context: list[Item] = []
        for item in inputs:
            output = calls is not None and item["type"] == "function_call_output"
            known = calls.get(item["call_id"]) if output else None  # type: ignore[union-attr]
            if known is not None and known[0] not in context:
                context.append(known[0])
            context.append(item)
        # Copies: the conversation's items go on changing (truncate, delete).
        return [dict(item) for item in context]

    def new_item(
        self,
        raw: MessageItem | FunctionCallOutputItem,
        event_id: str | None,
        param: str = "item.id",
    ) -> Item:
        fields = raw.model_dump(exclude_none=True)
        if fields.get("id") in self.by_id:
            raise ProtocolError(
                ErrorCode.DUPLICATE_ITEM_ID,
                f"an item {fields['id']!r} already exists",
                event_id=event_id,
                param=param,
            )
        return make_item(fields)

    def get(
        self, item_id: str, event_id: str | None, action: str = RETRIEVING, listed: bool = False
    ) -> Item:
        """`listed`: an item of the conversation only, not of a private context."""
        item = self.by_id.get(item_id)
        if item is None or (listed and item not in self.items):
            raise unknown_item(action, item_id, event_id)
        return item

    def check_previous(
        self, previous_item_id: str | None, event_id: str | None, root: bool = False
    ) -> None:
        """`root`: OpenAI's "root", the conversation's start, is a valid place too."""
        if root and previous_item_id == ROOT:
            return
        if previous_item_id is not None and not any(
            it["id"] == previous_item_id for it in self.items
        ):
            raise unknown_item(ADDING, previous_item_id, event_id, "previous_item_id")

    def insert(
        self, item: Item, previous_item_id: str | None = None, root: bool = False
    ) -> str | None:
        """After `previous_item_id`, at the end if None; with `root`, "root" is
        the start. Returns the id of the item it now follows (None: the first)."""
        if previous_item_id is None:
            index = len(self.items)
        elif root and previous_item_id == ROOT:
            index = 0
        else:
            index = 1 + next(i for i, it in enumerate(self.items) if it["id"] == previous_item_id)
        self.items.insert(index, item)
        self.by_id[item["id"]] = item
        self.history_bytes += ITEM_BYTES
        return self.items[index - 1]["id"] if index else None

    def append_to(self, context: list[Item], item: Item, after: str | None = None) -> str | None:
        """Add an item to a response's context: the conversation (after `after`,
        "root" read as the start), or its own list. Returns the id it follows."""
        if context is self.items:
            return self.insert(item, after, root=True)
        previous = context[-1]["id"] if context else None
        context.append(item)
        self.by_id[item["id"]] = item
        self.history_bytes += ITEM_BYTES
        return previous

    def add_output(self, context: list[Item], item: Item, in_conversation: bool) -> str | None:
        """A response's output item, at its context's end; a conversation:"auto"
        response with a context of its own (OpenAI's `input`) writes it at
        the conversation's end too, the same item (counted once). Returns the
        id of the item it follows in the conversation (None: the first)."""
        last = self.items[-1]["id"] if self.items else None
        previous = self.append_to(context, item)
        if in_conversation and context is not self.items:
            self.items.append(item)
            return last
        return previous

    def remove_from(self, context: list[Item], item: Item) -> None:
        """Take a response's item out of its context (and the conversation),
        and its bytes out of the count."""
        for items in (context, self.items):
            if item in items:
                items.remove(item)
        self._forget(item)

    def _forget(self, item: Item) -> None:
        """An item out of the lists: off the index, its bytes out of the count."""
        if self.by_id.pop(item["id"], None) is not None:
            size = len(item_text(item).encode())
            self.history_bytes = max(self.history_bytes - size - ITEM_BYTES, 0)

    def delete(self, item_id: str, busy: set[str], event_id: str | None) -> Item:
        """Take an item out of the conversation; `busy`: ids an active
        response still writes or waits on, which stay."""
        item = self.get(item_id, event_id, DELETING, listed=True)
        if item_id in busy:
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                "the item belongs to a response that is still active; cancel it first",
                event_id=event_id,
                param="item_id",
            )
        self.items.remove(item)
        self._forget(item)
        return item

    def truncate(self, item_id: str, text_end: int, event_id: str | None) -> Item:
        """Keep the first `text_end` characters of an assistant message (what
        the user heard)."""
        item = self.get(item_id, event_id, TRUNCATING)
        if item["type"] != "message" or item["role"] != "assistant":
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                "only assistant messages can be truncated",
                event_id=event_id,
                param="item_id",
            )
        if item["status"] == "in_progress":
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                "the item is still being generated; send response.cancel first, then truncate",
                event_id=event_id,
                param="item_id",
            )
        if text_end > len(item["content"]):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"text_end {text_end} is past the item's {len(item['content'])} characters",
                event_id=event_id,
                param="text_end",
            )
        item["content"] = item["content"][:text_end]
        item["status"] = "incomplete"
        return item


def item_text(item: Item) -> str:
    """The text an item holds (what counts against the size cap)."""
    return item.get("content") or item.get("arguments") or item.get("output") or ""


def render_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat-completions messages, for the engine's chat template."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    turn_of: dict[str, dict[str, Any]] = {}  # call id -> the assistant turn that made it
    for item in items:
        kind = item["type"]
        if kind == "message":
            if item["content"] or item["role"] != "assistant":
                messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call" and item["status"] == "completed":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            # Parallel calls (and text before them) make one assistant turn.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(last := {"role": "assistant", "content": "", "tool_calls": [call]})
            turn_of[item["call_id"]] = last
        elif kind == "function_call_output":
            tool = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            _after_its_call(messages, tool, turn_of.get(item["call_id"]))
    return messages


def _after_its_call(
    messages: list[dict[str, Any]], tool: dict[str, Any], turn: dict[str, Any] | None
) -> None:
    """Append a tool message, or put it with its call's turn if it is not the
    turn just before: chat templates want a call's output right after it, and
    an output may come late (a cancelled response's, after the next one's
    call) or after a user message sent while the response waited."""
    i = len(messages)
    while i and messages[i - 1]["role"] == "tool":
        i -= 1
    if turn is None or (i and messages[i - 1] is turn):
        messages.append(tool)
        return
    i = next(i for i, m in enumerate(messages) if m is turn) + 1
    while i < len(messages) and messages[i]["role"] == "tool":
        i += 1
    messages.insert(i, tool)
