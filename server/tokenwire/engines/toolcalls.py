"""Tool calls produced under structured outputs, extracted as they stream.

`required` makes the model emit a JSON array of {"name", "parameters"}
objects (vLLM's own schema for it); a named tool_choice makes the whole output
the arguments object. The scanner walks the raw text once, character by
character, and hands out each call's arguments exactly as generated, so the
deltas concatenate to valid JSON.
"""

from __future__ import annotations

import json
from typing import Any

from .base import EngineUnavailable, ToolCallDelta


def forced_call_text(calls: list[tuple[str, dict[str, Any]]], named: bool) -> str:
    """What a model emits for these calls under the structured-output schema."""
    if named:
        return json.dumps(calls[0][1])
    return json.dumps([{"name": n, "parameters": a} for n, a in calls])


class NamedCallScanner:
    """The whole output is the arguments of one call to a known tool."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
            return [ToolCallDelta(0, self.name, text)]
        return [ToolCallDelta(0, None, text)] if text else []


class ArrayCallScanner:
    """`[{"name": ..., "parameters": {...}}, ...]`, in either key order."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.index = -1
        self.expect_key = False
        self.key: str | None = None
        self._string: list[str] | None = None  # a key or the name being read
        self._string_is_key = False
        self.capturing = False
        self._capture_depth = 0
        self.names: dict[int, str] = {}
        self._unsent: dict[int, list[str]] = {}
        self._announced: set[int] = set()

    def feed(self, text: str) -> list[ToolCallDelta]:
        for ch in text:
            self._step(ch)
        return self._flush()

    def _step(self, ch: str) -> None:
        if self.capturing:
            self._unsent.setdefault(self.index, []).append(ch)
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                self._end_string()
                return
            if self._string is not None:
                self._string.append(ch)
            return
        if ch == '"':
            self.in_string = True
            if self.depth == 2 and not self.capturing:
                if self.expect_key:
                    self._string, self._string_is_key = [], True
                elif self.key == "name":
                    self._string, self._string_is_key = [], False
            self._maybe_start_capture(ch)
            return
        if ch in " \t\r\n":
            return
        if ch in "{[":
            self._maybe_start_capture(ch)
            self.depth += 1
            if self.depth == 2 and ch == "{":
                self.index += 1
                self.expect_key, self.key = True, None
        elif ch in "}]":
            self.depth -= 1
            if self.capturing and self.depth == self._capture_depth:
                self.capturing = False
            if self.capturing and self.depth < self._capture_depth:  # scalar value ended
                self._unsent[self.index].pop()
                self.capturing = False
        elif ch == ":" and self.depth == 2:
            self.expect_key = False
        elif ch == "," and self.depth == 2:
            if self.capturing:  # a scalar parameters value ended
                self._unsent[self.index].pop()
                self.capturing = False
            self.expect_key, self.key = True, None
        else:
            self._maybe_start_capture(ch)

    def _maybe_start_capture(self, ch: str) -> None:
        if (
            not self.capturing
            and self.depth == 2
            and self.key == "parameters"
            and not self.expect_key
        ):
            self.capturing = True
            self._capture_depth = self.depth
            self._unsent.setdefault(self.index, []).append(ch)

    def _end_string(self) -> None:
        if self._string is None:
            return
        value, self._string = "".join(self._string), None
        if self._string_is_key:
            self.key = value
        else:
            self.names[self.index] = json.loads(f'"{value}"')

    def _flush(self) -> list[ToolCallDelta]:
        out = []
        for index, chunks in self._unsent.items():
            name = self.names.get(index)
            if name is None or not chunks:
                continue  # wait until the call's name is known
            first = index not in self._announced
            self._announced.add(index)
            out.append(ToolCallDelta(index, name if first else None, "".join(chunks)))
            chunks.clear()
        return out


# ---------------------------------------------------------------------------
# vLLM side (imports vllm lazily; the scripted engine never calls these)


def import_vllm_side(tool_parser: str | None) -> None:
    """Import what the functions below import, off the event loop: vLLM's
    modules take seconds of CPU to import (8 s measured on the remote
    gateway, which imports no vLLM otherwise), and the first request with
    tools would hold every session on the loop that long. A remote gateway
    installed without vLLM (the `remote` extra) serves all but tools."""
    try:
        from vllm.entrypoints.openai.chat_completion import protocol  # noqa: F401
        from vllm.tool_parsers import utils  # noqa: F401
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
    except ImportError:
        if tool_parser:
            raise EngineUnavailable(
                "--tool-parser needs vLLM installed: pip install 'tokenwire[vllm]'"
            ) from None
        return
    if not tool_parser:
        return
    try:
        ToolParserManager.get_tool_parser(tool_parser)  # imports its module
    except KeyError:
        known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
        raise EngineUnavailable(
            f"--tool-parser {tool_parser!r} is not one of vLLM's tool parsers: " + ", ".join(known)
        ) from None


def _vllm_tools(tools: list[dict[str, Any]]) -> list[Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    return [ChatCompletionToolsParam.model_validate(t) for t in tools]


def structured_schema(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]
) -> dict[str, Any] | None:
    """vLLM's own structured-output schema for a forced tool choice, if any."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
    )
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    if tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        choice: Any = ChatCompletionNamedToolChoiceParam.model_validate(
            {"type": "function", "function": {"name": tool_choice["name"]}}
        )
        parallel = None
    else:
        choice, parallel = "required", (False if tool_choice == "required_single" else None)
    schema = get_json_schema_from_tools(choice, _vllm_tools(tools), parallel)
    return schema if isinstance(schema, dict) else None


def forced_scanner(tool_choice: str | dict[str, Any]) -> NamedCallScanner | ArrayCallScanner:
    if isinstance(tool_choice, dict):
        return NamedCallScanner(tool_choice["name"])
    return ArrayCallScanner()


def split_calls(
    text: str,
    token_ids: Any,
    scanner: NamedCallScanner | ArrayCallScanner | None,
    parser: ParserStream | None,
    finished: bool = False,
) -> tuple[str, list[ToolCallDelta] | None]:
    """A delta's text and the tool calls in it: a forced call's output is all
    call; "auto" goes through the vLLM tool parser (`finished`: the last delta,
    after which it gives up what it still holds); else it is all text."""
    if scanner is not None:
        return "", scanner.feed(text)
    if parser is not None:
        return parser.feed(text, list(token_ids), finished)
    return text, None


class ParserStream:
    """Runs a vLLM tool parser (tool_choice "auto") over a generation's deltas."""

    def __init__(self, parser_name: str, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        parser_cls = ToolParserManager.get_tool_parser(parser_name)
        self.request = ChatCompletionRequest(messages=[], tools=tools, tool_choice="auto")
        self.parser = parser_cls(tokenizer, self.request.tools)
        self.request = self.parser.adjust_request(self.request)
        self.text = ""
        self.ids: list[int] = []

    @property
    def skip_special_tokens(self) -> bool:
        # Some parsers need their special tokens (e.g. <tool_call>) in the text.
        return bool(self.request.skip_special_tokens)

    def feed(
        self, text: str, token_ids: list[int], finished: bool = False
    ) -> tuple[str, list[ToolCallDelta]]:
        """Split one delta into plain text and tool-call chunks."""
        prev_text, prev_ids = self.text, self.ids
        self.text, self.ids = prev_text + text, prev_ids + list(token_ids)
        msg = self.parser.extract_tool_calls_streaming(
            prev_text, self.text, text, prev_ids, self.ids, list(token_ids), self.request
        )
        if finished:
            msg = self._flush(msg)
        if msg is None:
            return "", []
        calls = [
            ToolCallDelta(
                tc.index,
                tc.function.name if tc.function else None,
                (tc.function.arguments or "") if tc.function else "",
            )
            for tc in msg.tool_calls
        ]
        return msg.content or "", calls

    def _flush(self, msg: Any) -> Any:
        """At the stream's end, as vLLM's own serving does: what a parser that
        streams through an engine still buffers (text held as a possible
        marker's start, a call's tail), and arguments parsed but not streamed."""
        parser = self.parser
        finish = getattr(parser, "finish_streaming", None)
        tail = finish() if finish is not None and parser.engine_based_streaming else None
        if tail is not None:
            if msg is None:
                msg = tail
            else:
                if tail.content:
                    msg.content = (msg.content or "") + tail.content
                if tail.tool_calls:
                    msg.tool_calls = [*(msg.tool_calls or []), *tail.tool_calls]
        if msg is not None and msg.tool_calls and (last := msg.tool_calls[-1]).function:
            rest = parser.get_remaining_unstreamed_args()
            last.function.arguments = (last.function.arguments or "") + rest
        return msg
