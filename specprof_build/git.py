"""Every git call of the build tools, in one environment (as Electron's script/lib/git.py does).

`git apply` for the build, `git am` / `rebase` / `format-patch` for carrying a series: all
with the C locale (messages the tools read are git's English ones), no repository above the
work folder (GIT_CEILING_DIRECTORIES: a checkout around a temporary folder is never used),
no editor, and the tools' own identity and date, so an export changes no byte unless a
patch's content or message changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .errors import BuildError

IDENTITY = {
    "GIT_AUTHOR_NAME": "sglang-specprof",
    "GIT_AUTHOR_EMAIL": "sglang-specprof@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "sglang-specprof",
    "GIT_COMMITTER_EMAIL": "sglang-specprof@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z",
}


def run(args: list[str], cwd: Path, check: bool = False) -> subprocess.CompletedProcess:
    """git `args` in `cwd`; with `check`, a failure is one sentence (its last line)."""
    if shutil.which("git") is None:
        raise BuildError("git is not installed; build.py applies and rebases the patches with git.")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(cwd).resolve().parent), LC_ALL="C",
               GIT_EDITOR="true", **IDENTITY)
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise BuildError(f"git {args[0]} failed in {cwd}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}.")
    return proc
