"""Imports inside the ``deltasync`` package point one way: no module imports, at module level or
inside a function, a module that imports it back (directly or through others). The checker is
also shown to find a cycle hidden in a function-level import of a small package written here."""

from __future__ import annotations

import ast
from pathlib import Path

import deltasync


def _imports(path: Path, package: str, modules: set[str]) -> set[str]:
    """The sibling modules ``path`` imports anywhere in its body (relative or absolute)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1 or node.module == package:
                found.update(a.name for a in node.names)
            elif node.level == 0 and node.module and node.module.startswith(package + "."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith(package + ".")
            )
    return (found & modules) - {path.stem}


def import_cycles(folder: Path) -> list[list[str]]:
    """Every import cycle between the modules of the package in ``folder``, each as the list of
    modules along it, first repeated at the end (e.g. ``["a", "b", "a"]``)."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph = {m: sorted(_imports(folder / f"{m}.py", folder.name, modules)) for m in modules}
    cycles, state, path = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for dep in graph[m]:
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_deltasync_has_no_import_cycle():
    folder = Path(deltasync.__file__).parent
    cycles = import_cycles(folder)
    assert cycles == [], (
        f"expected no import cycle in {folder}, found {[' -> '.join(c) for c in cycles]}; move "
        "what both modules need into a module that neither imports back"
    )


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n\nA = 1\n")
    (pkg / "b.py").write_text("class B:\n    def f(self):\n        from pkg.a import A\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert import_cycles(pkg) == [["a", "b", "a"]]
    (pkg / "b.py").write_text("class B:\n    pass\n")
    assert import_cycles(pkg) == []
