"""Unpack an upstream wheel, and pack the patched tree as X.Y.Z+specprof.N, byte-reproducibly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .errors import BuildError

# Zip entries carry this time (2020-01-01) unless SOURCE_DATE_EPOCH says otherwise,
# so two builds of the same inputs are the same bytes.
DEFAULT_EPOCH = "1577836800"
MARKER = "specprof.json"


def _wheel(args: list[str], env=None) -> None:
    proc = subprocess.run([sys.executable, "-m", "wheel", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise BuildError(f"wheel {args[0]} failed: {msg}.")


def unpack(wheel_file: Path, dest: Path) -> Path:
    _wheel(["unpack", "-d", str(dest), str(wheel_file)])
    trees = [p for p in dest.iterdir() if p.is_dir()]
    if len(trees) != 1:
        raise BuildError(f"{wheel_file.name} did not unpack into one folder.")
    return trees[0]


def unpack_sources(wheel_file: Path, dest: Path) -> None:
    """The release's sglang/*.py files only, which are all a series may touch."""
    with zipfile.ZipFile(wheel_file) as z:
        for info in z.infolist():
            if info.filename.startswith("sglang/") and info.filename.endswith(".py"):
                z.extract(info, dest)


def dist_info(tree: Path) -> Path:
    found = [p for p in tree.iterdir() if p.name.endswith(".dist-info") and p.is_dir()]
    if len(found) != 1:
        raise BuildError(f"{tree.name} has {len(found)} .dist-info folders, not one.")
    return found[0]


def normalize_modes(tree: Path) -> None:
    """0644 for files, 0755 for those upstream marked executable, whatever the umask."""
    for root, dirs, files in os.walk(tree):
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):  # never follow one out of the tree
                raise BuildError(f"{os.path.relpath(os.path.join(root, name), tree)} is a symlink; "
                                 f"the wheel holds plain files only.")
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            p = os.path.join(root, f)
            os.chmod(p, 0o755 if os.stat(p).st_mode & 0o111 else 0o644)


def check_compiles(tree: Path, rel_paths: list[str]) -> None:
    for rel in rel_paths:
        if not rel.endswith(".py"):
            continue
        src = (tree / rel).read_text()
        try:
            compile(src, rel, "exec", dont_inherit=True)
        except SyntaxError as e:
            raise BuildError(f"{rel} does not compile after patching (line {e.lineno}: {e.msg}).") from None


CONSOLE_SCRIPT = "sglang-specprof = sglang_specprof.cli:main"


def add_entry_points(tree: Path, added: list[str]) -> None:
    """The sglang-specprof command, and the overlay's new top-level packages in top_level.txt."""
    info = dist_info(tree)
    ep = info / "entry_points.txt"
    text = ep.read_text() if ep.is_file() else ""
    if "[console_scripts]" not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "[console_scripts]\n"
    lines = text.splitlines()
    at = lines.index("[console_scripts]") + 1
    lines.insert(at, CONSOLE_SCRIPT)
    ep.write_text("\n".join(lines) + "\n")
    tops = {rel.split("/", 1)[0] for rel in added if "/" in rel}
    tl = info / "top_level.txt"
    have = tl.read_text().split() if tl.is_file() else []
    tl.write_text("\n".join(sorted(set(have) | tops)) + "\n")


def write_marker(tree: Path, info: dict) -> None:
    (dist_info(tree) / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def pack(tree: Path, dest: Path, local_version: str | None) -> Path:
    before = set(dest.iterdir())
    env = dict(os.environ)
    env.setdefault("SOURCE_DATE_EPOCH", DEFAULT_EPOCH)
    local = ["--local-version", local_version] if local_version else []
    _wheel(["pack", "-d", str(dest), *local, str(tree)], env=env)
    made = [p for p in dest.iterdir() if p not in before and p.suffix == ".whl"]
    if len(made) != 1:
        raise BuildError("wheel pack did not write exactly one wheel.")
    return made[0]
