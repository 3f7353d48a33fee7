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


def run(args: list[str], cwd: Path, check: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
    """git `args` in `cwd` (`input` on its stdin); with `check`, a failure is one sentence (its last line)."""
    if shutil.which("git") is None:
        raise BuildError("git is not installed; build.py applies and rebases the patches with git.")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(cwd).resolve().parent), LC_ALL="C",
               GIT_EDITOR="true", **IDENTITY)
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise BuildError(f"git {args[0]} failed in {cwd}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}.")
    return proc


# A commit imported from a patch file carries the file's name in its message, as Electron's
# script/lib/git.py does: the rebase names each exported patch from it, and an export drops it.
PATCH_FILENAME = "Patch-Filename: "


def am(repo: Path, patch: Path) -> subprocess.CompletedProcess:
    """Import `patch` as a commit (git am, its subject kept), with a Patch-Filename trailer naming it."""
    text = patch.read_text()
    at = text.find("\ndiff --git a/")  # the end of the message
    if at >= 0:
        text = f"{text[:at + 1]}{PATCH_FILENAME}{patch.name}\n\n{text[at + 1:]}"
    return run(["am", "-q", "-k", "--committer-date-is-author-date"], repo, input=text)


def patch_filename(message: str) -> str | None:
    """The Patch-Filename trailer of a commit message, if it has one."""
    for line in message.splitlines():
        if line.startswith(PATCH_FILENAME):
            return line[len(PATCH_FILENAME):].strip()
    return None


def drop_patch_filename(mail: str) -> str:
    """A format-patch mail without the Patch-Filename trailer and the blank line before it."""
    out = []
    in_message = True
    for line in mail.splitlines(keepends=True):
        in_message = in_message and not line.startswith("diff --git ")
        if in_message and line.startswith(PATCH_FILENAME):
            if out and out[-1] == "\n" and not (len(out) >= 2 and out[-2].startswith("Subject: ")):
                out.pop()
            continue
        out.append(line)
    return "".join(out)
