"""What checking a call against a tool's `parameters` schema may cost.

A model's arguments are checked on the event loop (`tools.check_arguments`).
A schema whose `$ref`s fan out (each definition referring twice to the next)
makes that check exponential: 15 levels in a 1.2 KB schema took 1.8 s. So a
tool's schema is refused when it defines more subschemas than MAX_NODES, its
local `$ref`s expanded. A `$ref` met again inside its own expansion is
recursion, which follows the instance rather than the schema, and counts once.
"""

from __future__ import annotations

from typing import Any

MAX_NODES = 5_000


def _resolve(root: Any, ref: str) -> Any:
    """A local reference ("#", "#/$defs/x"); None for any other."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def expands_past(schema: Any, limit: int = MAX_NODES) -> bool:
    """Whether `schema` holds more than `limit` maps and lists once its local
    `$ref`s are expanded (recursion counted once)."""
    stack: list[tuple[Any, frozenset[str]]] = [(schema, frozenset())]
    count = 0
    while stack:
        node, refs = stack.pop()
        if isinstance(node, list):
            count += 1
            stack.extend((item, refs) for item in node)
        elif isinstance(node, dict):
            count += 1
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in refs:
                target = _resolve(schema, ref)
                if target is not None:
                    stack.append((target, refs | {ref}))
            stack.extend((value, refs) for key, value in node.items() if key != "$ref")
        if count > limit:
            return True
    return False
