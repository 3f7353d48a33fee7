"""Deterministic export of commits as a patch series (Electron's format-patch flags)."""

from __future__ import annotations

from pathlib import Path

from . import git
from .errors import BuildError

FORMAT_PATCH = ["format-patch", "--zero-commit", "--full-index", "--no-signature", "--no-stat",
                "--keep-subject", "--stdout"]
IDENTITY = git.IDENTITY  # the tools' commits: this identity and date (git.py)


def export_commit(repo: Path, commit: str) -> str:
    proc = git.run([*FORMAT_PATCH, "-1", commit], repo)
    if proc.returncode != 0:
        raise BuildError(f"git format-patch failed for {commit}: {proc.stderr.strip()}.")
    return git.drop_patch_filename(proc.stdout)


def write_series(directory: Path, named_patches: list[tuple[str, str]]) -> None:
    """Write patches and the series file; nothing else in `directory` is touched."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in named_patches:
        (directory / name).write_text(text)
    (directory / "series").write_text("".join(f"{name}\n" for name, _ in named_patches))
