"""A tool's parameters schema cannot make the check of a call expensive:
the check has a budget of keyword checks ($ref fan-out is exponential), and
runs no regex of the client's and no quadratic uniqueItems."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tokenwire.core.tools import CHECK_BUDGET, UNIQUE_ITEMS_CHECKED, check_arguments


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


def call(parameters: dict[str, Any], arguments: Any) -> str | None:
    tools = {"f": {"name": "f", "parameters": parameters}}
    return check_arguments({"name": "f", "arguments": json.dumps(arguments)}, tools)


def test_a_schema_that_fans_out_is_checked_within_a_budget() -> None:
    """15 levels of two $refs each took 1.8 s; 40 would never end."""
    problem = call(fan_out(40), {})
    assert problem is not None and f"more than {CHECK_BUDGET + 4} keyword checks" in problem
    assert call(fan_out(6), {}) is None  # 64 subschemas: checked
    assert "is not of type 'object'" in str(call(fan_out(6), 5))


def test_recursion_that_fans_out_is_stopped_by_the_arguments_depth() -> None:
    """Recursion follows the arguments: fan-out through it is exponential in
    their depth, and stopped by the same budget; plain recursion is fine."""
    fanning = {"type": "array", "items": {"allOf": [{"$ref": "#"}, {"$ref": "#"}]}}
    nested: Any = []
    for _ in range(30):
        nested = [nested]
    assert "keyword checks" in str(call(fanning, nested))
    assert call(tree(), {"name": "a", "children": [{"name": "b", "children": []}]}) is None
    assert "is not of type 'string'" in str(call(tree(), {"name": "a", "children": [{"name": 1}]}))


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


def test_long_honest_arguments_stay_within_the_budget() -> None:
    """The budget grows with the arguments: 2,000 objects of three typed fields."""
    item = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}}
    parameters = {"type": "object", "properties": {"rows": {"type": "array", "items": item}}}
    rows = [{"a": i, "b": i, "c": i} for i in range(2000)]
    assert call(parameters, {"rows": rows}) is None
    rows[-1]["c"] = "x"
    assert "is not of type 'integer'" in str(call(parameters, {"rows": rows}))


def test_unique_items_is_checked_on_short_arrays_only() -> None:
    parameters = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    tools = {"f": {"name": "f", "parameters": parameters}}
    short = json.dumps({"xs": [{"a": 1}, {"a": 1}]})
    assert "non-unique" in str(check_arguments({"name": "f", "arguments": short}, tools))
    long = json.dumps({"xs": [{"a": i % 5} for i in range(UNIQUE_ITEMS_CHECKED + 1)]})
    scalars = json.dumps({"xs": [i % 300 for i in range(1000)]})  # sorted: always checked
    assert "non-unique" in str(check_arguments({"name": "f", "arguments": scalars}, tools))
    assert check_arguments({"name": "f", "arguments": long}, tools) is None


def test_a_huge_enum_is_charged_by_its_size() -> None:
    """Each value is compared with every entry: 100,000 entries cost 12,500
    checks a value, past the budget of a short argument."""
    parameters = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"enum": list(range(100_000))}}},
    }
    assert "keyword checks" in str(call(parameters, {"xs": [1, 2, 3]}))
    parameters["properties"]["xs"]["items"]["enum"] = list(range(100))
    assert call(parameters, {"xs": [1, 2, 3]}) is None
    assert "is not one of" in str(call(parameters, {"xs": [1, 2, 300]}))
