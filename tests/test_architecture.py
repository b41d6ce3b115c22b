"""The package's shape, checked from its source: who may import whom, no
import cycles, and the size limits (docs/architecture.md states the rules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "server" / "tokenwire"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level_imports(path: Path) -> set[str]:
    """Modules imported when `path` is imported (lazy imports inside
    functions excluded; `if TYPE_CHECKING:` blocks included)."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    found: set[str] = set()
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If | ast.Try):
            nodes.extend(node.body)
            nodes.extend(getattr(node, "orelse", []))
            nodes.extend(h for handler in getattr(node, "handlers", []) for h in handler.body)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            # `from . import events` imports a module, not a name.
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
IMPORTS = {
    name: {m for m in top_level_imports(path) if m in MODULES or not m.startswith("tokenwire")}
    for name, path in MODULES.items()
}


def imports_of(package: str) -> dict[str, set[str]]:
    return {m: IMPORTS[m] for m in MODULES if m == package or m.startswith(package + ".")}


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in imports_of(package).items()
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    )


def test_core_is_sans_io() -> None:
    forbidden = (
        "asyncio",
        "websockets",
        "redis",
        "tokenwire.wire",
        "tokenwire.runtime",
        "tokenwire.storage",
        "tokenwire.server",
    )
    assert offenders("tokenwire.core", forbidden) == []


def test_wire_holds_no_session_state() -> None:
    forbidden = ("asyncio", "tokenwire.runtime", "tokenwire.storage", "tokenwire.server")
    assert offenders("tokenwire.wire", forbidden) == []


def test_engines_know_nothing_of_sessions_or_the_wire() -> None:
    forbidden = (
        "tokenwire.core",
        "tokenwire.wire",
        "tokenwire.runtime",
        "tokenwire.storage",
        "tokenwire.server",
    )
    assert offenders("tokenwire.engines", forbidden) == []


def test_storage_knows_nothing_of_sockets() -> None:
    forbidden = ("websockets", "tokenwire.runtime", "tokenwire.server", "tokenwire.wire")
    assert offenders("tokenwire.storage", forbidden) == []


def reachable(module: str) -> set[str]:
    """Every tokenwire module importing `module` loads."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in IMPORTS[todo.pop()]:
            if target in MODULES and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_session_runtime_and_socket_do_not_import_each_other() -> None:
    """Not even through another module: they meet only in server.app."""
    assert "tokenwire.runtime.socket" not in reachable("tokenwire.runtime.session_runtime")
    assert "tokenwire.runtime.session_runtime" not in reachable("tokenwire.runtime.socket")


def test_no_import_cycles() -> None:
    graph = {m: {t for t in targets if t in MODULES} for m, targets in IMPORTS.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is not a cycle.
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_class_sizes(name: str) -> None:
    source = MODULES[name].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= MAX_CLASS_LINES, node.name


def test_the_rules_see_the_imports() -> None:
    """The checks above would pass on an empty graph; this one makes sure they
    read real imports."""
    assert "tokenwire.runtime.delivery" in IMPORTS["tokenwire.runtime.session_runtime"]
    assert "tokenwire.core.events" in IMPORTS["tokenwire.core.session"]
    assert "asyncio" in IMPORTS["tokenwire.runtime.socket"]
    assert len(MODULES) > 30
