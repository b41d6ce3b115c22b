"""A tool's parameters schema cannot make the check of a call expensive:
$ref fan-out is refused where the tool is given, and the check of the
arguments runs no regex of the client's and no quadratic uniqueItems."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tokenwire.core.session import Session
from tokenwire.core.tool_schema import MAX_NODES, expands_past
from tokenwire.core.tools import UNIQUE_ITEMS_CHECKED, check_arguments

from ..helpers.session import drive


def fan_out(levels: int) -> dict[str, Any]:
    """Each definition refers twice to the next: 2^levels subschemas expanded."""
    defs: dict[str, Any] = {f"d{levels}": {"type": "object"}}
    for i in range(levels):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def tree() -> dict[str, Any]:
    """A recursive schema (a node's children are nodes): legitimate."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
    }


def test_fan_out_counts_and_recursion_does_not() -> None:
    assert not expands_past(fan_out(8))
    assert expands_past(fan_out(15))
    assert not expands_past(tree())
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    assert not expands_past(wide)  # 1,002 maps: a big schema that is cheap to check


def test_a_fanning_out_schema_is_refused_where_the_tool_is_given() -> None:
    s = Session()
    s.events_to_send()
    tool = {"type": "function", "name": "f", "parameters": fan_out(15)}
    (error,) = drive(s, {"type": "session.update", "session": {"tools": [tool]}})
    assert error["error"]["code"] == "invalid_field"
    assert error["error"]["param"] == "session.tools.0.parameters"
    assert f"more than {MAX_NODES} subschemas" in error["error"]["message"]
    (error,) = drive(s, {"type": "response.create", "response": {"tools": [tool]}})
    assert error["error"]["param"] == "response.tools.0.parameters"
    tool = {"type": "function", "name": "f", "parameters": tree()}
    (updated,) = drive(s, {"type": "session.update", "session": {"tools": [tool]}})
    assert updated["type"] == "session.updated"


def test_the_arguments_check_runs_no_regex_of_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """`^(a+)+$` against 25 characters took 1.2 s in additionalProperties."""
    parameters = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
        "patternProperties": {"^(a+)+$": {"type": "integer"}},
        "additionalProperties": False,
        "propertyNames": {"pattern": "^(a+)+$"},
        "unevaluatedProperties": False,
    }
    tools = {"f": {"name": "f", "parameters": parameters}}

    def no_regex(*args: object, **kwargs: object) -> None:
        raise AssertionError("a regex of the schema ran")

    monkeypatch.setattr(re, "search", no_regex)
    monkeypatch.setattr(re, "match", no_regex)
    monkeypatch.setattr(re, "compile", no_regex)
    arguments = json.dumps({"s": "a" * 25 + "!", "a" * 25 + "!": "x"})
    assert check_arguments({"name": "f", "arguments": arguments}, tools) is None
    # What needs no regex is still checked.
    wrong = json.dumps({"s": 5})
    assert "is not of type 'string'" in str(
        check_arguments({"name": "f", "arguments": wrong}, tools)
    )


def test_unique_items_is_checked_on_short_arrays_only() -> None:
    parameters = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    tools = {"f": {"name": "f", "parameters": parameters}}
    short = json.dumps({"xs": [{"a": 1}, {"a": 1}]})
    assert "non-unique" in str(check_arguments({"name": "f", "arguments": short}, tools))
    long = json.dumps({"xs": [{"a": i % 5} for i in range(UNIQUE_ITEMS_CHECKED + 1)]})
    assert check_arguments({"name": "f", "arguments": long}, tools) is None
