"""Tool-call extraction: the structured-output scanner and vLLM's tool parsers."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tokenwire.engines.toolcalls import (
    ArrayCallScanner,
    NamedCallScanner,
    ParserStream,
    forced_call_text,
    structured_schema,
)
from tokenwire.models import prepare_default_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
calls_strategy = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=10),
        st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


def collect(deltas: list) -> tuple[dict[int, str], dict[int, str]]:
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index not in names, "a name is announced once"
            names[d.index] = d.name
        assert d.index in names, "arguments never come before the name"
        args[d.index] = args.get(d.index, "") + d.arguments
    return names, args


@given(calls_strategy, st.lists(st.integers(1, 7), min_size=1), st.booleans())
def test_array_scanner_any_chunking(calls: list, cuts: list[int], indent: bool) -> None:
    text = json.dumps(
        [{"name": n, "parameters": a} for n, a in calls], indent=2 if indent else None
    )
    scanner, out, i, k = ArrayCallScanner(), [], 0, 0
    while i < len(text):
        step = cuts[k % len(cuts)]
        out += scanner.feed(text[i : i + step])
        i, k = i + step, k + 1
    names, args = collect(out)
    assert [names[i] for i in sorted(names)] == [n for n, _ in calls]
    assert [json.loads(args[i]) for i in sorted(args)] == [a for _, a in calls]


def test_array_scanner_name_after_parameters() -> None:
    text = '[{"parameters": {"x": [1, "]"]}, "name": "f"}]'
    names, args = collect(ArrayCallScanner().feed(text))
    assert names == {0: "f"} and json.loads(args[0]) == {"x": [1, "]"]}


def test_named_scanner_streams_everything_as_arguments() -> None:
    scanner = NamedCallScanner("get_weather")
    text = forced_call_text([("get_weather", {"city": "Paris"})], named=True)
    out = [d for ch in ["  ", text[:3], text[3:]] for d in scanner.feed(ch)]
    names, args = collect(out)
    assert names == {0: "get_weather"} and json.loads(args[0]) == {"city": "Paris"}


def test_structured_schema_comes_from_vllm() -> None:
    required = structured_schema([WEATHER], "required")
    assert required is not None and required["type"] == "array"
    single = structured_schema([WEATHER], "required_single")
    assert single is not None and single["maxItems"] == 1
    named = structured_schema([WEATHER], {"type": "function", "name": "get_weather"})
    assert named == WEATHER["function"]["parameters"]
    assert structured_schema([WEATHER], "auto") is None


def test_hermes_parser_splits_text_and_calls() -> None:
    """vLLM's real hermes parser, with SmolLM2's real tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    stream = ParserStream("hermes", tokenizer, [WEATHER])
    text = (
        'Let me check. <tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}</tool_call>'
    )
    said, deltas = "", []
    for i in range(0, len(text), 3):
        chunk = text[i : i + 3]
        content, calls = stream.feed(chunk, tokenizer.encode(chunk, add_special_tokens=False))
        said += content
        deltas += calls
    names, args = collect(deltas)
    assert said.strip() == "Let me check."
    assert names == {0: "get_weather"} and json.loads(args[0]) == {"city": "Paris"}


def test_a_parser_gives_up_what_it_holds_at_the_last_delta() -> None:
    """qwen3_coder (an engine-streaming parser) holds a "<" that may begin a
    marker; at the stream's end it is text, as in vLLM's own server."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    text = "It costs 5 <"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for finish in (False, True):
        stream = ParserStream("qwen3_coder", tokenizer, [WEATHER])
        said = ""
        for n, piece in enumerate(pieces):
            ids = tokenizer.encode(piece, add_special_tokens=False)
            content, _ = stream.feed(piece, ids, finish and n == len(pieces) - 1)
            said += content
        assert said == (text if finish else "It costs 5 ")
    # A call still streams whole.
    call = (
        "Sure.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>"
    )
    stream = ParserStream("qwen3_coder", tokenizer, [WEATHER])
    said, deltas = "", []
    pieces = [call[i : i + 3] for i in range(0, len(call), 3)]
    for n, piece in enumerate(pieces):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        content, calls = stream.feed(piece, ids, n == len(pieces) - 1)
        said += content
        deltas += calls
    names, args = collect(deltas)
    assert said == "Sure.\n"
    assert names == {0: "get_weather"} and json.loads(args[0]) == {"city": "Paris"}
