"""Apply a series to an unpacked tree with git: zero fuzz, zero offset, first failure named."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from . import git
from .errors import BuildError

_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", re.M)
_CHECKING = re.compile(r"^Checking patch (.+?)\.\.\.$")
_OFFSET = re.compile(r"^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)\.$")
_FAILED = re.compile(r"^error: patch failed: (.+):(\d+)$")
_MISSING = re.compile(r"^error: (.+): (No such file or directory|does not exist in index)$")


def hunks(patch_text: str) -> dict[str, list[int]]:
    """For each file a patch touches, the old start line of each hunk, in order."""
    out: dict[str, list[int]] = {}
    sections = list(_FILE.finditer(patch_text))
    for i, m in enumerate(sections):
        end = sections[i + 1].start() if i + 1 < len(sections) else len(patch_text)
        out[m.group(1)] = [int(h.group(1)) for h in _HUNK.finditer(patch_text, m.end(), end)]
    return out


_UNSAFE_MODE = re.compile(r"^(?:new file mode|new mode|old mode|deleted file mode) 120000$", re.M)
_MOVES = re.compile(r"^(?:rename|copy) (?:from|to) ", re.M)


def check_safe(text: str, name: str) -> None:
    """A patch may change and add plain files inside the tree, nothing else: every file header
    parses (no path with spaces slips past the checks), no path is absolute or climbs out
    with `..`, no symlink, no rename or copy, no CRLF line endings."""
    if "\r\n" in text:
        raise BuildError(f"{name} has Windows line endings (CRLF); convert it to LF (git config core.autocrlf false).")
    headers = [line for line in text.splitlines() if line.startswith("diff --git ")]
    for line in headers:
        m = _FILE.match(line)
        if m is None:
            raise BuildError(f"{name}: the file header {line!r} names a path build.py does not take "
                             f"(spaces or quotes in it); rename the file.")
        for path in m.groups():
            if path.startswith("/") or ".." in path.split("/"):
                raise BuildError(f"{name}: {path} is outside the tree; a patch changes files inside it only.")
    if _UNSAFE_MODE.search(text):
        raise BuildError(f"{name} adds or changes a symlink; a patch changes plain files only.")
    if _MOVES.search(text):
        raise BuildError(f"{name} renames or copies a file; a patch changes files in place only.")


def check_one(tree: Path, patch: Path) -> None:
    """Raise BuildError naming patch, file and hunk unless the patch applies exactly."""
    text = patch.read_bytes().decode("utf-8", errors="replace")
    check_safe(text, patch.name)
    proc = git.run(["apply", "--check", "--verbose", str(patch.resolve())], tree)
    lines = (proc.stderr + proc.stdout).splitlines()
    current = None
    table = hunks(text)
    for line in lines:
        if m := _CHECKING.match(line):
            current = m.group(1)
        elif m := _OFFSET.match(line):
            n, at, off = m.groups()
            raise BuildError(
                f"{patch.name}: hunk #{n} of {current} only applies {off} lines away from where it says "
                f"(line {int(at) - int(off)}); the series must apply with zero offset, so refresh it "
                f"with python build.py rebase."
            )
    if proc.returncode == 0:
        return
    for line in lines:
        if m := _FAILED.match(line):
            path, start = m.group(1), int(m.group(2))
            starts = table.get(path, [])
            n = starts.index(start) + 1 if start in starts else "?"
            raise BuildError(
                f"{patch.name}: hunk #{n} of {path} (at line {start}) does not apply: "
                f"upstream changed the lines it expects; refresh the series with python build.py rebase."
            )
        if m := _MISSING.match(line):
            raise BuildError(f"{patch.name}: {m.group(1)} does not exist in this upstream tree.")
    detail = next((l for l in lines if l.startswith("error:")), "git apply failed")
    raise BuildError(f"{patch.name} does not apply: {detail[len('error: '):] if detail.startswith('error: ') else detail}.")


def apply_series(tree: Path, patches: list[Path], log=print, write: bool = True) -> None:
    """Each patch checked to apply exactly, then applied; with `write` False, `tree` is left
    alone: the patches apply to a scratch copy of the files they touch, so that a patch is
    checked against the file as the patches before it leave it (two patches may touch one file)."""
    if not write:
        with tempfile.TemporaryDirectory(prefix="specprof-check-") as scratch:
            apply_to_copy(tree, patches, Path(scratch), log)
        return
    for patch in patches:
        check_one(tree, patch)
        proc = git.run(["apply", str(patch.resolve())], tree)
        if proc.returncode != 0:
            raise BuildError(f"{patch.name} does not apply: {proc.stderr.strip().splitlines()[-1]}.")
        log(f"apply     {patch.name} ({sum(len(v) for v in hunks(patch.read_text()).values())} hunks, exact)")


def apply_to_copy(tree: Path, patches: list[Path], dest: Path, log=print) -> list[str]:
    """The files the series touches, copied from `tree` into `dest` and patched there; `tree`
    is left alone. Returns those files (relative paths)."""
    touched = sorted({f for patch in patches for f in hunks(patch.read_text())})
    for rel in touched:
        if (tree / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree / rel, dest / rel)
    apply_series(dest, patches, log, write=True)
    return touched


def copy_overlay(overlay: Path, tree: Path, files: list[Path], log=print) -> list[str]:
    """Copy the overlay into the tree; refuse to replace anything upstream has."""
    clashes = [str(f.relative_to(overlay)) for f in files if (tree / f.relative_to(overlay)).exists()]
    if clashes:
        raise BuildError(
            f"The overlay would overwrite upstream's {', '.join(clashes)}; "
            f"change upstream files with a patch, not the overlay."
        )
    added = []
    for f in files:
        rel = f.relative_to(overlay)
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
        added.append(str(rel))
    log(f"overlay   {len(added)} files")
    return added
