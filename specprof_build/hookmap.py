"""Where the series' hooks sit: for each call into the overlay, the function around it.

A patch can apply cleanly and still land in code that changed meaning (upstream moved the
work the hook timed into another function). Comparing the hook map of a series before and
after a rebase shows each hook whose enclosing function changed.

A hook's arguments are upstream names, evaluated in upstream's code whether the profiler is
on or off: a patch that applies cleanly can still read a name the release renamed (0.5.17's
`can_cuda_graph`), a NameError at the worker's first cycle. `unbound_reads` finds each such
read in a patched tree; `refuse_unbound` makes it one sentence.
"""

from __future__ import annotations

import ast
import bisect
import builtins
from pathlib import Path
from typing import Iterator, NamedTuple

from .apply import hunks
from .errors import BuildError

HOOK_ROOTS = ("specprof", "specprof_args")


def _root(node) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _call_text(call: ast.Call) -> str:
    """A hook as the hook map names it: `specprof.P.graph('draft')`, its first argument where that is a string."""
    text = ast.unparse(call.func)
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text += f"({arg.value!r})"
    return text


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
                found.append((".".join(scope) or "<module>", _call_text(child)))
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


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPES = _FUNCTIONS + (ast.ClassDef,)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# what a module has bound before its first line runs, besides the builtins
_MODULE_NAMES = frozenset(dir(builtins)) | {"__file__", "__cached__", "__builtins__", "__path__"}
STAR = "*"  # bound by `from x import *`: any name may be


def _bound(scope) -> list[tuple[int, str]]:
    """(line, name) for each name `scope` (a module, function, lambda or class body) binds
    itself: its parameters (line 0), what it assigns, imports, defines, catches, matches or
    declares global. A nested function's, class's or comprehension's own names are not its
    (a comprehension's walrus is)."""
    out = []
    if isinstance(scope, _FUNCTIONS):
        a = scope.args
        out += [(0, x.arg) for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]

    def visit(node, in_comprehension):
        for child in ast.iter_child_nodes(node):
            line = getattr(child, "lineno", 0)
            if isinstance(child, _SCOPES):
                if not isinstance(child, ast.Lambda):
                    out.append((line, child.name))
                continue
            if isinstance(child, ast.NamedExpr) and isinstance(child.target, ast.Name):
                out.append((line, child.target.id))
            elif in_comprehension:
                pass
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                out.append((line, child.id))
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                out.extend((line, (x.asname or x.name).split(".")[0]) for x in child.names)
            elif isinstance(child, (ast.Global, ast.Nonlocal)):
                out.extend((line, x) for x in child.names)
            elif isinstance(child, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and child.name:
                out.append((line, child.name))
            elif isinstance(child, ast.MatchMapping) and child.rest:
                out.append((line, child.rest))
            visit(child, in_comprehension or isinstance(child, _COMPREHENSIONS))

    visit(scope, False)
    return out


def _own(expr) -> set[str]:
    """The names an argument binds for itself: a lambda's parameters, a comprehension's targets."""
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | {
        n.arg for n in ast.walk(expr) if isinstance(n, ast.arg)}


def hook_calls(module: ast.Module, root=None, lines=None) -> Iterator[tuple[ast.Call, list]]:
    """Each call into the overlay in a parsed module (a call whose attribute chain starts at
    one of `root`, a name or names, default HOOK_ROOTS), with its enclosing scopes, innermost first, the module
    last. With `lines` (sorted line numbers), only the statements that span one of them are
    searched: a large file is walked along the paths to its hooks only."""
    roots = _roots(root)

    def spans(node):
        if lines is None or not isinstance(node, ast.stmt):
            return True
        i = bisect.bisect_left(lines, min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())]))
        return i < len(lines) and lines[i] <= (node.end_lineno or node.lineno)

    def visit(node, scopes):
        for child in ast.iter_child_nodes(node):
            if not spans(child):
                continue
            if isinstance(child, ast.Call) and _root(child.func) in roots:
                yield child, scopes
            yield from visit(child, [child] + scopes if isinstance(child, _SCOPES) else scopes)

    yield from visit(module, [module])


class Unbound(NamedTuple):
    file: str
    line: int
    hook: str
    name: str


def _roots(root) -> tuple[str, ...]:
    return (root,) if isinstance(root, str) else tuple(root or HOOK_ROOTS)


def parse(tree: Path, rel: str, text: str | None = None) -> ast.Module:
    """A patched file's syntax tree (from `text` where given); one that does not parse is one sentence."""
    try:
        return ast.parse((tree / rel).read_text() if text is None else text, rel)
    except SyntaxError as e:
        raise BuildError(f"{rel} is not valid Python with the series applied (line {e.lineno}: {e.msg}).") from None


def unbound_reads(tree: Path, files: list[str], root=None) -> list[Unbound]:
    """Each name a hook call's arguments read that is not bound where the call runs, in the
    `files` (paths relative to `tree`; those that are not Python are passed over). Bound is:
    the innermost scope's parameters and what it binds up to the call's line; whatever the
    enclosing functions and the module bind; a builtin; what the argument binds itself (a
    lambda's parameters). An attribute chain is read through its root name
    (`batch.seq_lens` reads `batch`). A module with `from x import *` binds any name."""
    found = []
    for rel in files:
        if not rel.endswith(".py") or not (tree / rel).is_file():
            continue
        text = (tree / rel).read_text()
        roots = _roots(root)
        lines = [n for n, row in enumerate(text.splitlines(), 1) if any(r in row for r in roots)]
        cache: dict = {}
        for call, scopes in hook_calls(parse(tree, rel, text), roots, lines):
            known = set(_MODULE_NAMES)
            for i, scope in enumerate(scopes):
                if i and isinstance(scope, ast.ClassDef):
                    continue  # a class body's names are not seen from its methods
                if scope not in cache:
                    cache[scope] = _bound(scope)
                known |= {name for line, name in cache[scope] if i or line <= call.lineno}
            if STAR in known:
                continue
            for arg in list(call.args) + [k.value for k in call.keywords]:
                mine = known | _own(arg)
                found += [Unbound(rel, n.lineno, _call_text(call), n.id) for n in ast.walk(arg)
                          if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in mine]
    return found


def added_by(patches: list[tuple[str, str]], rel: str, line: str) -> str | None:
    """The last of `patches` ((name, text) in series order) whose added lines in `rel` hold `line`."""
    want = "+" + line.rstrip("\n")
    hit = None
    for name, text in patches:
        inside = False
        for row in text.splitlines():
            if row.startswith("diff --git "):
                inside = row.endswith(f" b/{rel}")
            elif inside and row == want:
                hit = name
    return hit


def refuse_unbound(tree: Path, files: list[str], root=None, *, patches=(), release: str = "", fix: str = "") -> None:
    """BuildError, one sentence naming the hook, the name, the file and line (and the patch
    that added it, from `patches`), unless every name a hook reads is bound there."""
    found = unbound_reads(tree, files, root)
    if not found:
        return
    u = found[0]
    source = (tree / u.file).read_text().splitlines()
    patch = added_by(list(patches), u.file, source[u.line - 1]) if 0 < u.line <= len(source) else None
    more = f" (and {len(found) - 1} more such read{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
    raise BuildError(
        f"{u.hook} in {u.file} line {u.line}{f' ({patch})' if patch else ''} reads {u.name!r}, which is not bound "
        f"there{f' in sglang {release}' if release else ''}{more}: the worker would stop with a NameError at its "
        f"first cycle; {fix or 'use the name upstream has there'}.")


def refuse_unbound_in(tree: Path, rel, after: str = "", *, release: str | None = None, fix: str | None = None) -> None:
    """refuse_unbound over every file the series of `rel` (a release.Release) patches, in
    `tree` with the series applied; the sentence names the patch and ends with `after` (or
    `fix` in place of the whole advice). `release`: the release `tree` is, if not the series' own."""
    fix = fix or f"correct the patch in {rel.directory}; {after}"
    texts = [(p.name, p.read_text()) for p in rel.patches]
    files = sorted({f for _, text in texts for f in hunks(text)})
    refuse_unbound(tree, files, patches=texts, release=rel.version if release is None else release, fix=fix)
