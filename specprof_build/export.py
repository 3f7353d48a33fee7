"""Deterministic export of commits as a patch series (Electron's format-patch flags)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .errors import BuildError

FORMAT_PATCH = ["format-patch", "--zero-commit", "--full-index", "--no-signature", "--no-stat",
                "--keep-subject", "--stdout"]
# Commits made by the tools carry this identity and date, so an export changes no byte
# unless a patch's content or message changed.
IDENTITY = {
    "GIT_AUTHOR_NAME": "sglang-specprof",
    "GIT_AUTHOR_EMAIL": "sglang-specprof@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "sglang-specprof",
    "GIT_COMMITTER_EMAIL": "sglang-specprof@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z",
}


def export_commit(repo: Path, commit: str) -> str:
    proc = subprocess.run(["git", *FORMAT_PATCH, "-1", commit], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"git format-patch failed for {commit}: {proc.stderr.strip()}.")
    return proc.stdout


def write_series(directory: Path, named_patches: list[tuple[str, str]]) -> None:
    """Write patches and the series file; nothing else in `directory` is touched."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in named_patches:
        (directory / name).write_text(text)
    (directory / "series").write_text("".join(f"{name}\n" for name, _ in named_patches))
