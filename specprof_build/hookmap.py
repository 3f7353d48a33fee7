"""Where the series' hooks sit: for each call into the overlay, the function around it.

A patch can apply cleanly and still land in code that changed meaning (upstream moved the
work the hook timed into another function). Comparing the hook map of a series before and
after a rebase shows each hook whose enclosing function changed.
"""

from __future__ import annotations

import ast
from pathlib import Path

HOOK_ROOTS = ("specprof", "specprof_args")


def _root(node) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def hooks_in(source: str, filename: str) -> list[tuple[str, str]]:
    """(enclosing class.function, call text) of every call into the overlay in `source`."""
    tree = ast.parse(source, filename)
    found: list[tuple[str, str]] = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            if isinstance(child, ast.Call) and _root(child.func) in HOOK_ROOTS:
                text = ast.unparse(child.func)
                arg = child.args[0] if child.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    text += f"({arg.value!r})"
                found.append((".".join(scope) or "<module>", text))
            visit(child, scope)

    visit(tree, [])
    return found


def hook_map(tree: Path, files: list[str]) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for rel in files:
        path = tree / rel
        if path.is_file() and rel.endswith(".py"):
            out[rel] = hooks_in(path.read_text(), rel)
    return out


def moved(before: dict, after: dict) -> list[str]:
    """One sentence per hook that is gone, new, or now in another function."""
    def where(m):
        pos = {}
        for rel, items in m.items():
            for scope, call in items:
                pos.setdefault(call, []).append(f"{rel}:{scope}")
        return {k: sorted(v) for k, v in pos.items()}

    a, b = where(before), where(after)
    notes = []
    for call in sorted(set(a) | set(b)):
        if a.get(call) != b.get(call):
            notes.append(f"{call}: {', '.join(a.get(call, [])) or 'absent'} -> {', '.join(b.get(call, [])) or 'absent'}")
    return notes
