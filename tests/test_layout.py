"""The analysis package's shape: no import cycle among its modules, each module imports on its
own, no file above 350 lines and no class above 250."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "overlay" / "sglang_specprof"
NAME = PACKAGE.name
MAX_FILE_LINES = 350
MAX_CLASS_LINES = 250


def modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports, at any depth of its code."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if (node.level == 1 and node.module is None) or (node.level == 0 and node.module == NAME):  # from . import a
                found.update(a.name for a in node.names)
            elif node.level == 1:  # from .a import x
                found.add(node.module.split(".")[0])
            elif node.module and node.module.startswith(NAME + "."):  # from sglang_specprof.a import x
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith(NAME + "."))
    return found & set(modules())


def cycle() -> list[str] | None:
    """One import cycle among the modules (its path), or None."""
    graph = {m: imports(m) for m in modules()}
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n] if n in path else [m, n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in modules():
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycle():
    assert cycle() is None, f"an import cycle: {' -> '.join(cycle())}"


def test_the_cycle_finder_finds_one(monkeypatch):
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: sorted(fake))
    monkeypatch.setattr(sys.modules[__name__], "imports", lambda m: fake[m])
    assert cycle() == ["a", "b", "c", "a"]


@pytest.mark.parametrize("module", [m for m in modules() if m != "__main__"])  # __main__ runs the command
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    """A module imported before any other of the package: a cycle that the order of imports
    elsewhere hides would fail here."""
    r = subprocess.run([sys.executable, "-c", f"import {NAME}.{module}"], cwd=PACKAGE.parent,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_files_and_classes_stay_small():
    big = []
    for p in sorted(PACKAGE.glob("*.py")):
        text = p.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            big.append(f"{p.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{p.name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not big, f"above {MAX_FILE_LINES} lines a file or {MAX_CLASS_LINES} a class: {big}"
