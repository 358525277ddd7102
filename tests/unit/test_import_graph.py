"""The package's import graph: no circle, and dependencies only run down the layers
api -> builders -> inventory -> status -> controller -> admin -> cli (docs/design.md). A circle hidden
in a function-level import (the admin <-> inventory.cleanup and buildcheck <-> status.conditions
ones this replaced) is an import-order bug waiting for the first caller that imports the other
side first, so imports inside functions count as much as those at the top. And what one module
imports of another is public: no `from kvpersist.x import _name`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "kvpersist"

# Leaves first. Modules of one layer may import each other, never one above (status reads the
# inventory's figures; the inventory reads nothing of status).
LAYERS = {
    "kvpersist": 0, "kvpersist.identity": 0, "kvpersist.httpclient": 0, "kvpersist.httpserver": 0, "kvpersist.inserver": 0,
    "kvpersist.api": 1, "kvpersist.builders": 2, "kvpersist.l2backends": 2, "kvpersist.inventory": 3, "kvpersist.status": 4,
    "kvpersist.controller": 5, "kvpersist.admin": 6, "kvpersist.cli": 7,
    "kvpersist.pinscmd": 6, "kvpersist.plancmd": 6, "kvpersist.vllmclient": 0,
}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_of(node: ast.ImportFrom, path: Path, root: Path = PACKAGE) -> str:
    """The module a `from ... import` reads, relative ones resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """Every kvpersist module this file imports, anywhere in it (top level or inside a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = source_of(node, path, root)
            found.update(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names)
    return {m for m in found if m in modules and m != module_name(path, root)}


def private_imports(root: Path = PACKAGE) -> list[str]:
    """Every `from kvpersist.x import _name` in another module than x, anywhere in a file."""
    return sorted(f"{module_name(f, root)}: {source}.{a.name}" for f in root.rglob("*.py")
                  for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.ImportFrom)
                  and (source := source_of(node, f, root)).partition(".")[0] == root.name
                  and source != module_name(f, root)
                  for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    return {module_name(f, root): imports_of(f, modules, root) for f in files}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"{module}: in no layer of LAYERS; add its package there")


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in edges.items() for b in deps if layer(b) > layer(a))


def test_the_package_has_no_import_circle() -> None:
    assert circles(graph()) == []


def test_imports_only_run_down_the_layers() -> None:
    assert upward(graph()) == []
    assert layer("kvpersist.inventory") < layer("kvpersist.status")  # cleanup once read status.users


def test_no_module_imports_another_ones_private_names() -> None:
    assert private_imports() == []


def test_the_checks_see_a_circle_hidden_in_a_function(tmp_path: Path) -> None:
    """What the two tests above would say of the circles this replaced (a function-level import)."""
    root = tmp_path / "kvpersist"
    (root / "status").mkdir(parents=True)
    (root / "controller").mkdir()
    for init in (root, root / "status", root / "controller"):
        (init / "__init__.py").write_text("")
    (root / "status" / "conditions.py").write_text("from kvpersist.controller import buildcheck\n")
    (root / "controller" / "buildcheck.py").write_text(
        "def condition():\n    from kvpersist.status.conditions import condition as make\n")
    (root / "status" / "ok.py").write_text("from . import conditions\n")  # a relative import, downward: fine
    (root / "status" / "peek.py").write_text("from .conditions import _made, made\n")
    edges = graph(root)
    assert circles(edges) == [["kvpersist.controller.buildcheck", "kvpersist.status.conditions"]]
    assert upward(edges) == ["kvpersist.status.conditions -> kvpersist.controller.buildcheck"]
    assert edges["kvpersist.status.ok"] == {"kvpersist.status.conditions"}
    assert private_imports(root) == ["kvpersist.status.peek: kvpersist.status.conditions._made"]


def test_a_module_outside_every_layer_is_named() -> None:
    with pytest.raises(AssertionError, match="kvpersist_other"):
        layer("kvpersist_other.x")
