"""build.py rebase: carry a series to another upstream release with git's 3-way merge.

The series is imported as commits (git am) on the old release's tree, replayed onto the
new release's tree (git rebase --onto), and exported again (git format-patch, the flags of
export.py) into patches/sglang-NEW/ with a new pin. A conflict stops with a work tree to
finish by hand; nothing is written into patches/ until the whole series is through.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from . import export, fetch, git, hookmap, inplace, release, repack, upstream
from .errors import BuildError

WORK = release.ROOT / ".rebase"


def published_pin(version: str, timeout: float = 30) -> release.Pin:
    """The pin of a release as PyPI lists it: every file name and its sha256."""
    try:
        data = upstream.simple_index(timeout)
    except BuildError as e:
        raise BuildError(f"{str(e).rstrip('.')}; rebase needs the network once.") from None
    return upstream.pin_of(data, version)


def _clear_tree(work: Path) -> None:
    for p in work.iterdir():
        if p.name != ".git":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _state(work: Path) -> dict:
    st = json.loads((work / ".git" / "specprof-rebase.json").read_text())
    if "patches" not in st:  # its commits carry no Patch-Filename trailer to name the patches by
        raise BuildError(f"The rebase in {work} was begun by an older build.py; drop it with --abort "
                         f"and start it again.")
    return st


def _in_progress(work: Path) -> bool:
    return (work / ".git" / "rebase-merge").is_dir() or (work / ".git" / "rebase-apply").is_dir()


def _conflict_message(work: Path, onto: str) -> str:
    name = "a patch"
    msg = work / ".git" / "rebase-merge" / "message"
    if msg.is_file():
        text = msg.read_text()
        name = git.patch_filename(text) or text.split("\n", 1)[0].strip() or name
    files = git.run(["diff", "--name-only", "--diff-filter=U"], work, check=False).stdout.split()
    return (f"{name} conflicts with sglang {onto} in {', '.join(files) or 'the tree'}. Resolve it in {work} "
            f"(git add the files; or drop the patch there with git rebase --skip), then run: "
            f"python build.py rebase --onto {onto} --continue; or give up with: "
            f"python build.py rebase --onto {onto} --abort. Nothing was written to patches/.")


def _finish(work: Path, onto: str, accept_moves: bool, log) -> Path:
    st = _state(work)
    again = f"then run python build.py rebase --onto {onto} --continue; nothing was written to patches/"
    dirty = git.run(["status", "--porcelain", "--untracked-files=no"], work, check=True).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip()]
    if dirty:  # the series is exported from the commits: an edit left outside them would be lost
        raise BuildError(f"{work} has changes that are in no commit ({', '.join(dirty)}); commit each into the "
                         f"patch it belongs to (git commit --amend, or git rebase -i upstream-{onto}) or drop it "
                         f"(git checkout -- .), {again}.")
    commits = git.run(["rev-list", "--reverse", f"upstream-{onto}..HEAD"], work, check=True).stdout.split()
    named = []
    for c in commits:
        message = git.run(["log", "-1", "--format=%B", c], work, check=True).stdout
        subject = message.split("\n", 1)[0].strip()  # a commit made during the rebase is named for its subject
        name = git.patch_filename(message) or (re.sub(r"[^A-Za-z0-9]+", "-", subject).strip("-").lower()[:60]
                                               + ".patch")
        named.append((name, export.export_commit(work, c)))
    dropped = sorted(set(st["patches"]) - {n for n, _ in named})
    touched = git.run(["diff", "--name-only", f"upstream-{onto}..HEAD"], work, check=True).stdout.split()
    files = sorted(set(st["files"]) | set(touched))
    # A hook that merged cleanly can still read a name the new release renamed.
    hookmap.refuse_unbound(work, files, patches=named, release=onto,
                           fix=f"correct the commit that added it in {work} (git commit --amend when it is the "
                               f"last, else git rebase -i upstream-{onto}), {again}")
    # A hook that still applies but now sits in another function changed meaning.
    after = hookmap.hook_map(work, files)
    notes = hookmap.moved({k: [tuple(x) for x in v] for k, v in st["hooks"].items()}, after)
    if notes and not accept_moves:
        raise BuildError(
            f"The series applies to sglang {onto}, but these hooks moved to other functions or vanished "
            f"(before -> after):\n" + "".join(f"  {n}\n" for n in notes)
            + f"Check each in {work}, amend if needed, then rerun with --continue --accept-hook-moves.")
    dest = release.PATCHES / f"sglang-{onto}"
    tmp = release.PATCHES / f".sglang-{onto}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export.write_series(tmp, named)
        pin = release.Pin(**st["pin"])
        (tmp / "pin.toml").write_text(release.format_pin(pin))
        if st.get("new_wheel") and Path(st["new_wheel"]).is_file():
            rel = release.Release(onto, tmp, pin, [tmp / n for n, _ in named])
            (tmp / inplace.MANIFEST).write_text(inplace.manifest_from_wheel(rel, Path(st["new_wheel"])))
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(work)
    log(f"export    {len(named)} patches into {dest}"
        + (f" (dropped, their code is gone upstream: {', '.join(dropped)})" if dropped else ""))
    for n in notes:
        log(f"moved     {n}")
    return dest


def start(onto: str, from_version: str | None, cache: Path, log, accept_moves=False) -> Path:
    t0 = time.monotonic()
    from_version = from_version or release.default_release()
    if (release.PATCHES / f"sglang-{onto}" / "series").is_file():
        raise BuildError(f"patches/sglang-{onto} already has a series; remove that folder first to rebase again.")
    work = WORK / f"sglang-{onto}"
    if work.exists():
        raise BuildError(f"A rebase onto {onto} is in progress in {work}; finish it with --continue "
                         f"or drop it with --abort.")
    old = release.load(from_version)
    new_pin = published_pin(onto)
    old_wheel = fetch.fetch(old.pin, fetch.choose(old.pin), cache, log=log)
    new_wheel = fetch.fetch(new_pin, fetch.choose(new_pin), cache, log=log)
    dest = rebase_trees(old, old_wheel, new_pin, new_wheel, log, accept_moves)
    log(f"done      in {time.monotonic() - t0:.1f} s")
    return dest


def rebase_trees(old: release.Release, old_wheel: Path, new_pin: release.Pin, new_wheel: Path, log,
                 accept_moves=False) -> Path:
    """The rebase proper, from the two upstream wheels (hash-checked by the caller)."""
    from_version, onto = old.version, new_pin.version
    work = WORK / f"sglang-{onto}"
    work.mkdir(parents=True)
    try:
        git.run(["init", "-q", "-b", "series"], work, check=True)
        # byte-compiling a file while resolving a conflict must not put .pyc files into a patch
        (work / ".git" / "info").mkdir(parents=True, exist_ok=True)
        (work / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")
        repack.unpack_sources(old_wheel, work)
        git.run(["add", "-A"], work, check=True)
        git.run(["commit", "-q", "-m", f"upstream {from_version}"], work, check=True)
        git.run(["tag", f"upstream-{from_version}"], work, check=True)
        files = set()
        for p in old.patches:
            if git.am(work, p).returncode != 0:
                raise BuildError(f"{p.name} does not apply to sglang {from_version} itself; run python build.py "
                                 f"--sglang {from_version} --check.")
            files.update(git.run(["show", "--name-only", "--format=", "HEAD"], work, check=True).stdout.split())
        hooks = hookmap.hook_map(work, sorted(files))
        git.run(["checkout", "-q", "--orphan", "upstream-new"], work, check=True)
        git.run(["rm", "-rq", "--cached", "."], work, check=True)
        _clear_tree(work)
        repack.unpack_sources(new_wheel, work)
        git.run(["add", "-A"], work, check=True)
        git.run(["commit", "-q", "-m", f"upstream {onto}"], work, check=True)
        git.run(["tag", f"upstream-{onto}"], work, check=True)
        git.run(["checkout", "-q", "series"], work, check=True)
        (work / ".git" / "specprof-rebase.json").write_text(json.dumps({
            "from": from_version, "onto": onto, "patches": [p.name for p in old.patches], "files": sorted(files),
            "new_wheel": str(new_wheel),
            "hooks": hooks, "pin": {"version": new_pin.version, "revision": new_pin.revision,
                                    "artifacts": new_pin.artifacts, "note": new_pin.note}}))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log(f"rebase    {len(old.patches)} patches from {from_version} onto {onto} (git rebase, 3-way merge)")
    proc = git.run(["rebase", "-q", "--onto", f"upstream-{onto}", f"upstream-{from_version}", "series"], work,
                check=False)
    if proc.returncode != 0:
        if _in_progress(work):
            raise BuildError(_conflict_message(work, onto))
        raise BuildError(f"git rebase failed: {(proc.stderr or proc.stdout).strip()}")
    return _finish(work, onto, accept_moves, log)


def resume(onto: str, log, accept_moves=False) -> Path:
    work = WORK / f"sglang-{onto}"
    if not (work / ".git" / "specprof-rebase.json").is_file():
        raise BuildError(f"No rebase onto {onto} is in progress.")
    if _in_progress(work):
        if git.run(["diff", "--name-only", "--diff-filter=U"], work, check=False).stdout.strip():
            raise BuildError(_conflict_message(work, onto))
        proc = git.run(["rebase", "--continue"], work, check=False)
    elif git.run(["merge-base", "--is-ancestor", f"upstream-{onto}", "HEAD"], work, check=False).returncode != 0:
        # interrupted before git rebase began: begin it now
        proc = git.run(["rebase", "-q", "--onto", f"upstream-{onto}", f"upstream-{_state(work)['from']}", "series"],
                    work, check=False)
    else:
        proc = None
    if proc is not None and proc.returncode != 0:
        if _in_progress(work):
            raise BuildError(_conflict_message(work, onto))
        raise BuildError(f"git rebase failed: {(proc.stderr or proc.stdout).strip()}")
    return _finish(work, onto, accept_moves, log)


def abort(onto: str, log) -> None:
    work = WORK / f"sglang-{onto}"
    if not work.exists():
        raise BuildError(f"No rebase onto {onto} is in progress.")
    if _in_progress(work):
        git.run(["rebase", "--abort"], work, check=False)
    shutil.rmtree(work)
    shutil.rmtree(release.PATCHES / f".sglang-{onto}.partial", ignore_errors=True)
    log(f"aborted   the rebase onto {onto}; patches/ is as it was")


def roundtrip(version: str, cache: Path) -> list[str]:
    """Import the series as commits on its pinned release and export it again: the patches
    whose bytes would change (empty: the series is up to date)."""
    rel = release.load(version)
    wheel = fetch.fetch(rel.pin, fetch.choose(rel.pin), cache, log=lambda m: None)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specprof-roundtrip-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        git.run(["init", "-q"], work, check=True)
        repack.unpack_sources(wheel, work)
        git.run(["add", "-A"], work, check=True)
        git.run(["commit", "-q", "-m", f"upstream {version}"], work, check=True)
        changed = []
        for p in rel.patches:
            if git.am(work, p).returncode != 0:
                return [f"{p.name} does not apply"]
            if export.export_commit(work, "HEAD") != p.read_text():
                changed.append(p.name)
        return changed
