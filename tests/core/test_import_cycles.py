"""Imports inside each of the project's packages point one way: no module imports, at module level
or inside a function, a module that imports it back (directly or through others). Packages with
sub-packages (``trainer``) are walked whole. The checker is also shown to find a cycle hidden in a
function-level import of a small package written here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = ["deltasync", "trainer", "rollout", "dashboard", "wordle_env"]


def _module_names(folder: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package in ``folder`` (a package's
    ``__init__.py`` is named for the package)."""
    names = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
            found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    # importing a.b.c runs a/__init__ and a/b/__init__ too, but those are the packages'
    # docstrings here: count the module named, not its parents
    return {m for m in found if m in modules} - {name}


def import_cycles(folder: Path) -> list[list[str]]:
    """Every import cycle between the modules of the package in ``folder``, each as the list of
    modules along it, first repeated at the end (e.g. ``["pkg.a", "pkg.b", "pkg.a"]``)."""
    modules = _module_names(folder)
    graph = {m: sorted(_imports(m, p, modules)) for m, p in modules.items()}
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


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_no_import_cycle(package):
    folder = Path(importlib.util.find_spec(package).origin).parent
    cycles = import_cycles(folder)
    assert cycles == [], (
        f"expected no import cycle in {folder}, found {[' -> '.join(c) for c in cycles]}; move "
        "what both modules need into a module that neither imports back"
    )


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import B\n\nA = 1\n")
    (pkg / "sub" / "b.py").write_text("class B:\n    def f(self):\n        from pkg.a import A\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert import_cycles(pkg) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    (pkg / "sub" / "b.py").write_text("class B:\n    pass\n")
    assert import_cycles(pkg) == []


# trainer/'s layers, lowest first: a module imports its own layer or lower ones, never higher
# (docs/LAYOUT.md says what each holds). The task knows nothing of the run; the config composes the
# parts' settings; the fleet and the local children know nothing of TRL; the loop is TRL and what
# the run adds to it; the stack, the starting point and the summary assemble; run() tells the
# story; the entry points (make train, make e2e, make eval) and their signal handling drive it.
TRAINER_LAYERS = [
    ["trainer", "trainer.task"],
    ["trainer.settings", "trainer.config"],
    ["trainer.fleet"],
    ["trainer.local"],
    ["trainer.loop"],
    ["trainer.starting_point", "trainer.stack", "trainer.summary"],
    ["trainer.run"],
    ["trainer.e2e", "trainer.eval_run", "trainer.__main__", "trainer.shutdown"],
]


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """The index of the layer that holds ``module`` (a listed name or a package above it)."""
    best = None
    for i, names in enumerate(layers):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (
                best is None or len(n) > len(best[1])
            ):
                best = (i, n)
    if best is None:
        raise AssertionError(f"{module} is in no layer; add it to TRAINER_LAYERS")
    return best[0]


def upward_imports(folder: Path, layers: list[list[str]]) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as ``"a -> b"``."""
    modules = _module_names(folder)
    found = []
    for m, p in sorted(modules.items()):
        for dep in sorted(_imports(m, p, modules)):
            if _layer_of(dep, layers) > _layer_of(m, layers):
                found.append(f"{m} -> {dep}")
    return found


def test_trainer_imports_point_down_its_layers():
    folder = Path(importlib.util.find_spec("trainer").origin).parent
    up = upward_imports(folder, TRAINER_LAYERS)
    assert up == [], (
        f"expected trainer's imports to point down its layers {TRAINER_LAYERS}, found {up}; "
        "move what the lower module needs down, or the caller up"
    )


def test_an_upward_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg.high import H\n")
    (pkg / "high.py").write_text("from pkg import low\n\nH = 1\n")
    layers = [["pkg", "pkg.low"], ["pkg.high"]]
    assert upward_imports(pkg, layers) == ["pkg.low -> pkg.high"]
    (pkg / "low.py").write_text("X = 1\n")
    assert upward_imports(pkg, layers) == []
