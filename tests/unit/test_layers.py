"""The package's layers, read from the source: imports go only downwards and
there are no import cycles (docs/ARCHITECTURE.md).

cli -> node -> {gateway, dns, admin} -> egress -> mesh -> ground. Imports
under `if TYPE_CHECKING:` are left out: they exist for mypy only.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "meshgate"

# Rank per top-level part: a module may import its own part or a lower rank.
RANK = {"top": 6, "node": 5, "gateway": 4, "dns": 4, "admin": 4,
        "egress": 3, "mesh": 2}
GROUND = 1


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typing_only.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshgate"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("meshgate"))
    return {m for m in found if m in modules}


_TOP = {"cli", "demo", "__main__"}  # the command and what it runs besides a node


def _part(module: str) -> str:
    parts = module.split(".")
    part = parts[1] if len(parts) > 1 else ""
    return "top" if part in _TOP else part


def _rank(module: str) -> int:
    return RANK.get(_part(module), GROUND)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_the_layers_are_recognised() -> None:
    parts = {_part(m) for m in _modules()}
    assert {"node", "gateway", "dns", "egress", "mesh", "config"} <= parts


def test_imports_only_go_downwards() -> None:
    upward = []
    for mod, deps in _graph().items():
        for dep in deps:
            same_part = _part(dep) == _part(mod)
            if _rank(mod) == GROUND and _rank(dep) == GROUND:
                continue  # ground modules build on each other; cycles are checked below
            if not same_part and _rank(dep) >= _rank(mod):
                upward.append(f"{mod} -> {dep}")
    assert sorted(upward) == []


def test_there_are_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append([*path[path.index(d):], d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []
