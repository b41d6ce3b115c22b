"""Tools: tool_choice checks, the engine's view of the tools, and the check
of the arguments a model produced."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import jsonschema
from referencing import Registry
from referencing.exceptions import NoSuchResource

from .errors import ErrorCode, ProtocolError
from .schema import NamedToolChoice


class ToolFlow(StrEnum):
    """What a response does once the model made its calls (a dialect's choice)."""

    # It waits in requires_action for their outputs, then continues by itself
    # (tokenwire v1).
    CONTINUE = "continue"
    # It ends `completed` with the calls in its output; the client sends their
    # outputs and a response.create for the next response (OpenAI Realtime; the
    # session's conversation then follows OpenAI's rules too, see Session).
    CLIENT = "client"


def check_tool_choice(
    choice: Any, tools: list[dict[str, Any]], event_id: str | None, param: str
) -> None:
    names = {t["name"] for t in tools}
    if isinstance(choice, dict | NamedToolChoice):
        name = choice["name"] if isinstance(choice, dict) else choice.name
        if name not in names:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"tool_choice names {name!r}, which is not among the tools "
                f"({sorted(names) or 'none defined'})",
                event_id=event_id,
                param=param,
            )
    elif choice == "required" and not names:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            'tool_choice "required" needs at least one tool',
            event_id=event_id,
            param=param,
        )


def engine_tools(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool
) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    """The tools in chat-completions shape (None when there are none to offer)
    and the tool_choice the engine gets."""
    offered = None
    if tools and tool_choice != "none":
        offered = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k)},
            }
            for t in tools
        ]
    if tool_choice == "required" and not parallel:
        tool_choice = "required_single"
    return offered, tool_choice


def _skip(validator: Any, value: Any, instance: Any, schema: Any) -> None:
    return None


_BASE = jsonschema.Draft202012Validator.VALIDATORS
# uniqueItems compares objects and arrays pair by pair, deeply (4,000 objects
# took 32 s; 256 larger ones 6.7 s): past this many such items it is not
# checked. Scalars are sorted, and always checked.
UNIQUE_ITEMS_CHECKED = 16


def _unique_items(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
    if (
        isinstance(instance, list)
        and len(instance) > UNIQUE_ITEMS_CHECKED
        and any(isinstance(item, dict | list) for item in instance)
    ):
        return None
    return _BASE["uniqueItems"](validator, value, instance, schema)


def _additional_properties(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
    if "patternProperties" in schema:
        return None  # telling them apart would run the patterns
    return _BASE["additionalProperties"](validator, value, instance, schema)


# Keyword checks one call's arguments may take (~12 us each), in proportion
# to their length as an honest check is: `$ref`s that fan out (each definition
# naming the next twice) make it exponential, in the schema's depth or,
# through recursion, in the arguments'.
CHECK_BUDGET = 1_000
CHECKS_PER_CHARACTER = 2


class _TooCostly(Exception):
    pass


_budget = [0]  # what the check running now has left (the loop runs one at a time)


# Keywords whose check walks their value (an enum of 100,000 entries took 7 s
# on a short argument), charged a check per this many of its entries (an
# enum's are compared deeply; the others' looked up in the instance).
_ENTRIES_PER_CHECK = {
    "enum": 8,
    "required": 64,
    "properties": 64,
    "dependentRequired": 64,
    "dependentSchemas": 64,
}


def _counted(name: str, keyword: Any) -> Any:
    per = _ENTRIES_PER_CHECK.get(name)

    def check(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _budget[0] -= 1 + len(value) // per if per and isinstance(value, list | dict) else 1
        if _budget[0] < 0:
            raise _TooCostly
        return keyword(validator, value, instance, schema)

    return check


# Client-supplied regexes would run against model output here, and Python's
# re has no time limit (`^(a+)+$` on 25 characters: 1.2 s), so no regex of the
# schema is run by us (structured outputs enforce them while generating
# forced calls).
_KEYWORDS = {
    **_BASE,
    "pattern": _skip,
    "patternProperties": _skip,
    "additionalProperties": _additional_properties,
    # It walks every subschema, running any patternProperties on the way.
    "unevaluatedProperties": _skip,
    "uniqueItems": _unique_items,
}
_ArgumentsValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {k: _counted(k, v) for k, v in _KEYWORDS.items()}
)


def _no_retrieval(uri: str) -> Any:
    raise NoSuchResource(ref=uri)


# A $ref beyond the schema itself (http:, file:, a relative one under an $id)
# is unresolvable: a client's schema must not make the server fetch a URL or
# read a file, on the event loop (jsonschema would, by default).
_LOCAL_ONLY: Registry[Any] = Registry(retrieve=_no_retrieval)


def check_arguments(item: dict[str, Any], tools: dict[str, dict[str, Any]]) -> str | None:
    """What is wrong with a call the model made, or None."""
    tool = tools.get(item["name"])
    if tool is None:
        return "the model called a tool that is not defined"
    try:
        arguments = json.loads(item["arguments"])
    except ValueError as exc:
        return f"the arguments are not valid JSON ({exc})"
    except RecursionError:
        return "the arguments nest too deeply to parse"
    budget = _budget[0] = CHECK_BUDGET + CHECKS_PER_CHARACTER * len(item["arguments"])
    try:
        error = jsonschema.exceptions.best_match(
            _ArgumentsValidator(tool["parameters"], registry=_LOCAL_ONLY).iter_errors(arguments)
        )
    except _TooCostly:
        return (
            f"the tool's parameters schema takes more than {budget} keyword checks "
            "for these arguments; simplify its $refs"
        )
    except Exception as exc:  # an unresolvable $ref, a broken schema: the client's tool
        return f"the tool's parameters schema cannot be used: {type(exc).__name__}: {exc}"
    if error is not None:
        return f"the arguments fail the tool's schema: {error.message}"
    return None
