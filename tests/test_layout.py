"""The packages' shape: no import cycle among a package's modules, each module imports on its
own, no file above 350 lines and no class above 250. Both packages, the analysis one and the
server one, are held to it whole."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

OVERLAY = Path(__file__).resolve().parent.parent / "overlay"
PACKAGE = OVERLAY / "sglang_specprof"
SERVER = OVERLAY / "sglang" / "specprof"
MAX_FILE_LINES = 350
MAX_CLASS_LINES = 250
# each package and the modules of it held to the rules (None: every one)
CHECKED = {PACKAGE: None, SERVER: None}
# modules that import a package the tests may lack at their top (the GPU's): imported on their
# own only where it is installed
NEEDS = {"cuda_backend": "torch"}


def dotted(package: Path) -> str:
    """The name the package is imported by: sglang_specprof, sglang.specprof."""
    return ".".join(package.relative_to(OVERLAY).parts)


def modules(package: Path = PACKAGE) -> list[str]:
    return sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")


def checked(package: Path) -> list[str]:
    """The modules of `package` the rules hold for."""
    names = CHECKED[package]
    return modules(package) if names is None else names


def imports(module: str, package: Path = PACKAGE) -> set[str]:
    """The package's modules that `module` imports, at any depth of its code."""
    name = dotted(package)
    tree = ast.parse((package / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None or node.level == 0 and node.module == name:  # from . import a
                found.update(a.name for a in node.names)
            elif node.level == 1:  # from .a import x
                found.add(node.module.split(".")[0])
            elif node.module and node.module.startswith(name + "."):  # from sglang_specprof.a import x
                found.add(node.module[len(name) + 1:].split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name[len(name) + 1:].split(".")[0] for a in node.names if a.name.startswith(name + "."))
    return found & set(modules(package))


def cycle(package: Path = PACKAGE, through: list[str] | None = None) -> list[str] | None:
    """One import cycle among the package's modules (its path), or None; with `through`, only
    one that passes through one of those modules."""
    graph = {m: imports(m, package) for m in modules(package)}
    for start in through or sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:  # a path from `start` back to it
            m, path = stack.pop()
            for n in sorted(graph[m]):
                if n == start:
                    return path + [n]
                if n not in seen:
                    seen.add(n)
                    stack.append((n, path + [n]))
    return None


@pytest.mark.parametrize("package", CHECKED, ids=dotted)
def test_no_import_cycle(package):
    found = cycle(package, CHECKED[package])
    assert found is None, f"an import cycle: {' -> '.join(found)}"


def test_the_cycle_finder_finds_one(monkeypatch):
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda package=None: sorted(fake))
    monkeypatch.setattr(sys.modules[__name__], "imports", lambda m, package=None: fake[m])
    assert cycle() == ["a", "b", "c", "a"]
    assert cycle(through=["c"]) == ["c", "a", "b", "c"]
    assert cycle(through=["d"]) == ["d", "d"]
    del fake["d"]
    fake["c"] = set()
    assert cycle() is None


@pytest.mark.parametrize("package, module", [(p, m) for p in CHECKED for m in checked(p) if m != "__main__"],
                         ids=lambda x: dotted(x) if isinstance(x, Path) else x)  # __main__ runs the command
def test_each_module_imports_first_in_a_fresh_interpreter(package, module):
    """A module imported before any other of the package: a cycle that the order of imports
    elsewhere hides would fail here."""
    need = NEEDS.get(module)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{module} imports {need}, not installed here")
    r = subprocess.run([sys.executable, "-c", f"import {dotted(package)}.{module}"], cwd=OVERLAY,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("package", CHECKED, ids=dotted)
def test_files_and_classes_stay_small(package):
    names = CHECKED[package]
    files = sorted(package.glob("*.py")) if names is None else [package / f"{m}.py" for m in names]
    big = []
    for p in files:
        text = p.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            big.append(f"{p.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{p.name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not big, f"above {MAX_FILE_LINES} lines a file or {MAX_CLASS_LINES} a class: {big}"


def test_the_checks_find_both_packages_modules():
    """The modules are found where the checks look (a move would drop them silently)."""
    assert {"profiler", "recorder", "slots", "policy", "hooks"} <= set(checked(SERVER))
    assert {"advisor", "window", "schema"} <= set(checked(PACKAGE))
    assert set(NEEDS) <= set(checked(SERVER))
