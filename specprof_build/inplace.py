"""Apply a series and the overlay to an SGLang that is already installed (a container's, say).

The installed release is read from its .dist-info; every file the series touches is first
checked against the sha256 the pinned upstream wheel gives it (`upstream.sha256` beside
the series), so a tree that is not exactly that release, or was edited, is refused before
anything changes. The patched files and the overlay are then staged and the originals
saved, and the site changes all or nothing (`apply_installed`); `--restore` puts the
published files back (`restore_installed`).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from . import apply, hookmap, release, repack
from .errors import BuildError, quote

MANIFEST = "upstream.sha256"


def touched_files(rel: release.Release) -> list[str]:
    return sorted({f for p in rel.patches for f in apply.hunks(p.read_text())})


def manifest_from_wheel(rel: release.Release, wheel: Path) -> str:
    """`sha256  path` for each file the series touches, as the upstream wheel has it."""
    lines = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in touched_files(rel):
            if f not in names:
                raise BuildError(f"{f}, which the series patches, is not in {wheel.name}.")
            lines.append(f"{hashlib.sha256(z.read(f)).hexdigest()}  {f}")
    return "\n".join(lines) + "\n"


def _relative(rel) -> bool:
    """`rel` is a relative path with no `..`, `.` or empty part (it cannot climb out)."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\0" not in rel
            and not any(part in ("", ".", "..") for part in rel.split("/")))


def inside(root: Path, rel) -> bool:
    """`rel` names a file or folder strictly inside `root` (a resolved folder), symlinks followed."""
    return _relative(rel) and (root / rel).resolve().is_relative_to(root)


def read_manifest(rel: release.Release) -> dict[str, str]:
    path = rel.directory / MANIFEST
    if not path.is_file():
        raise BuildError(f"{rel.directory.name} has no {MANIFEST}; run python build.py --sglang {rel.version} "
                         f"once with network to write it.")
    out = {}
    for n, line in enumerate(release.read_text(path, f"{rel.directory.name}/{MANIFEST}").splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise BuildError(f"{rel.directory.name}/{MANIFEST} line {n} is not 'sha256  path'.")
        if not _relative(parts[1]) or not parts[1].startswith("sglang/"):
            raise BuildError(f"{rel.directory.name}/{MANIFEST} line {n} names {parts[1]!r}, which is not a file "
                             f"of the sglang package; nothing was changed.")
        out[parts[1]] = parts[0]
    if set(out) != set(touched_files(rel)):
        raise BuildError(f"{rel.directory.name}/{MANIFEST} does not list exactly the files the series patches; "
                         f"remove it and run python build.py --sglang {rel.version} once with network to write it.")
    return out


STATE = "specprof-state"  # inside the .dist-info: the originals, the staged files, the journal
JOURNAL = "journal.json"
MARKER = repack.MARKER
OVERLAY_TOPS = ("sglang/specprof", "sglang_specprof")
ANALYSIS = "sglang_specprof"  # the analysis wheel's package (analysis.py), one of the overlay's tops


def _dist_infos(site: Path) -> list[Path]:
    """The site's sglang .dist-info folders, those that only hold sglang-specprof's records
    (left by pip uninstall, which removes the files its RECORD lists) aside."""
    found = sorted(p for p in site.glob("sglang-*.dist-info") if p.is_dir())
    left = [p for p in found if not (p / "METADATA").exists() and not (p / "RECORD").exists()
            and {c.name for c in p.iterdir()} <= {MARKER, STATE}]
    if left and len(found) > len(left):
        raise BuildError(f"{left[0]} is left from an sglang that pip uninstalled (it holds only sglang-specprof's "
                         f"record of an --into); remove it (rm -r {quote(left[0])}) and run build.py again.")
    return found


def installed_version(site: Path) -> str:
    if not (site / "sglang").is_dir():
        raise BuildError(f"{site} holds no sglang package; give the folder that contains sglang/ "
                         f"(site-packages, or a pip --target folder).")
    infos = _dist_infos(site)
    if len(infos) != 1:
        raise BuildError(f"{site} has {len(infos)} sglang .dist-info folders; expected one.")
    try:
        text = (infos[0] / "METADATA").read_text(errors="replace")
    except OSError:
        raise BuildError(f"{infos[0]} has no readable METADATA file, so sglang in {site} is not installed whole; "
                         f"reinstall sglang there.") from None
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise BuildError(f"{infos[0].name}/METADATA has no Version.")


def _dist_info(site: Path) -> Path:
    return _dist_infos(site)[0]


def _analysis_info(site: Path) -> Path | None:
    """The .dist-info of the analysis wheel (sglang-specprof without SGLang), where it is installed."""
    found = sorted(site.glob(f"{ANALYSIS}-*.dist-info"))
    return found[0] if found else None


def _overlay_present(site: Path) -> list[str]:
    """The overlay's top folders in the site, the analysis wheel's own package aside."""
    tops = [t for t in OVERLAY_TOPS if (site / t).exists()]
    if _analysis_info(site) is not None:
        tops = [t for t in tops if t != ANALYSIS]
    return tops


def _lock_holder(fd: int) -> str | None:
    """The pid holding the flock on the folder open as fd, as /proc/locks tells (Linux)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "->" not in parts and len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
                    return parts[4]
    except OSError:
        pass
    return None


@contextlib.contextmanager
def locked(site: Path):
    """One --into or --restore at a time on a site: an flock on the site folder itself (no file
    to leave behind), which the kernel drops when the process ends, however it ends."""
    try:
        fd = os.open(site, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield  # no such folder: the command names what is wrong
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BuildError(f"Cannot lock {site} ({e.strerror}); nothing was changed.") from None
            pid = _lock_holder(fd)
            raise BuildError(f"Another build.py is patching or restoring {site}"
                             f"{f' (pid {pid})' if pid else ''}; wait for it to finish, then run this again.") from None
        yield
    finally:
        os.close(fd)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write beside, flush to disk, rename over: the file is the old one or the new one, and
    a write that fails (a full disk) leaves no temporary file."""
    tmp = path.with_name(path.name + ".specprof-tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _copy_atomic(src: Path, dest: Path) -> None:
    _write_atomic(dest, src.read_bytes())
    shutil.copymode(src, dest)


def _record_lines(site: Path, files: list[str]) -> str:
    """RECORD lines for files added to the installation, so that pip uninstall removes them."""
    out = []
    for f in files:
        data = (site / f).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        out.append(f"{f},sha256={digest},{len(data)}\n")
    return "".join(out)


def _plan(site: Path, info: Path, path: Path) -> dict:
    """The journal's or the marker's record of an --into, checked before anything is touched:
    the fields build.py writes, and every path in it inside the site (one that is not would
    have --restore delete or overwrite files elsewhere)."""
    def damaged(why: str) -> BuildError:
        return BuildError(f"{path} is damaged ({why}); nothing was changed, and {site} may be half patched: "
                          f"remove {quote(info / STATE)} and {quote(info / MARKER)}, then reinstall sglang there.")

    try:
        plan = json.loads(path.read_bytes())
    except OSError as e:
        raise damaged(e.strerror) from None
    except ValueError:
        raise damaged("not JSON") from None
    if not isinstance(plan, dict):
        raise damaged("not a JSON object")
    for key in ("touched", "added", "created"):
        if not isinstance(plan.get(key), list) or not all(isinstance(f, str) for f in plan[key]):
            raise damaged(f"no list of paths under {key!r}")
    if plan.get("record") != str((info / "RECORD").relative_to(site)):
        raise damaged(f"its 'record' is not {info.name}/RECORD")
    for f in plan["touched"] + plan["added"]:
        if not inside(site, f):
            raise damaged(f"it names {f!r}, which is not inside the site")
    for top in plan["created"]:
        if top not in OVERLAY_TOPS:
            raise damaged(f"it names {top!r} as a folder it created, which is none of {', '.join(OVERLAY_TOPS)}")
    return plan


def _put_back(saved: Path, dest: Path) -> None:
    """The saved original over `dest` by a rename (no new bytes to write: a full disk cannot
    stop it); a copy where the two are on different file systems."""
    try:
        os.replace(saved, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        _copy_atomic(saved, dest)
        saved.unlink()


def _undo(site: Path, plan: dict) -> None:
    """Put the published files back from the saved originals and take out everything added.
    Each step can run again (a saved original is renamed back, so it is there until it is
    in place): the journal goes last, so a kill here is finished next time."""
    info = _dist_info(site)
    backup = info / STATE / "backup"
    for f in plan["touched"] + [plan["record"]]:
        saved = backup / f
        if saved.is_file():
            _put_back(saved, site / f)
    for f in plan["touched"] + [plan["record"], str((info / MARKER).relative_to(site))]:
        (site / (f + ".specprof-tmp")).unlink(missing_ok=True)  # written, not yet renamed
    for top in plan["created"]:
        if (site / top).exists():
            shutil.rmtree(site / top)
    marker = info / MARKER
    if marker.exists():
        marker.unlink()
    journal = info / STATE / JOURNAL
    if journal.exists():
        journal.unlink()
    shutil.rmtree(info / STATE, ignore_errors=True)


def _undo_or_say(site: Path, plan: dict, what: str) -> None:
    """_undo; an OSError in it (a folder made read-only meanwhile, say) is one sentence, and
    the journal stays for the next run to finish."""
    try:
        _undo(site, plan)
    except OSError as e:
        raise BuildError(f"{what}, but putting {e.filename or site} back failed ({e.strerror}); fix that and run "
                         f"python build.py --restore {quote(site)} to finish.") from None


def recover(site: Path, log) -> bool:
    """An --into or --restore that was killed: finish taking it back. True if there was one."""
    info = _dist_info(site)
    state = info / STATE
    journal = state / JOURNAL
    if not journal.is_file():
        if state.is_dir() and not (info / MARKER).is_file():
            shutil.rmtree(state, ignore_errors=True)  # staged, never begun
        return False
    plan = _plan(site, info, journal)
    op = plan.get("op") or ("--restore" if plan.get("applied_in_place") else "--into")
    _undo_or_say(site, plan, f"An interrupted {op} is being taken back")
    log(f"recover   an interrupted {op} was taken back: {site} holds the published files")
    return True


def _stale(site: Path, info: Path) -> bool:
    """A marker left by an --into from before sglang was reinstalled (pip keeps the files its
    RECORD does not list): no overlay in the site, and the RECORD lists none of it."""
    if not (info / MARKER).is_file() or _overlay_present(site):
        return False
    try:
        record = (info / "RECORD").read_text(errors="replace")
    except OSError:
        return False
    return not any(line.startswith(tuple(t + "/" for t in OVERLAY_TOPS)) for line in record.splitlines())


def _clear_stale(site: Path, info: Path, log) -> bool:
    if not _stale(site, info):
        return False
    (info / MARKER).unlink()
    shutil.rmtree(info / STATE, ignore_errors=True)
    log(f"stale     removed {info.name}/{MARKER}, left by an --into from before sglang was reinstalled")
    return True


def _check_published(site: Path, manifest: dict, rel) -> None:
    bad = []
    for f, want in manifest.items():
        p = site / f
        got = _sha(p) if p.is_file() else None
        if got != want:
            bad.append(f"{f} ({'missing' if got is None else 'differs'})")
    if bad:
        raise BuildError(f"The installed sglang {rel.version} is not the release as published: "
                         f"{', '.join(bad)}; nothing was changed.")


def apply_installed(site: Path, rel: release.Release, log) -> list[str]:
    """All or nothing: the patched files and the overlay are staged and the originals saved
    (in the .dist-info) before anything in the site changes; a journal lists what will
    change; each file is then renamed into place. An error or an interrupt puts the site
    back at once; a kill leaves the journal, and the next --into or --restore finishes
    taking it back."""
    site = site.resolve()
    recover(site, log)
    info = _dist_info(site)
    analysis = _analysis_info(site)
    if analysis is not None:
        raise BuildError(f"{site} has the analysis package sglang-specprof installed ({analysis.name}), whose "
                         f"{ANALYSIS}/ the patched sglang brings too; pip uninstall sglang-specprof (in a --target "
                         f"folder: rm -r {quote(site / ANALYSIS)} {quote(analysis)}), then run --into again.")
    _clear_stale(site, info, log)
    if (info / MARKER).exists() or _overlay_present(site):
        raise BuildError(f"{site} already has sglang-specprof in it; python build.py --restore {quote(site)} "
                         f"puts the published files back.")
    manifest = read_manifest(rel)
    _check_published(site, manifest, rel)
    log(f"check     {len(manifest)} installed files match sglang {rel.version} as published")
    touched = sorted(manifest)
    record = str((info / "RECORD").relative_to(site))
    state = info / STATE
    stage, backup = state / "stage", state / "backup"
    try:
        # patched and checked outside the site first: a series that does not fit is refused before anything is written
        with tempfile.TemporaryDirectory(prefix=f"specprof-build-{os.getpid()}-") as scratch:
            patched = Path(scratch)
            apply.apply_to_copy(site, rel.patches, patched, log)
            hookmap.refuse_unbound_in(patched, rel, "nothing was changed")
            for f in touched + [record]:
                for root in (stage, backup):
                    (root / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(site / f, backup / f)
                shutil.copy2(patched / f if f in manifest else site / f, stage / f)
        added = apply.copy_overlay(release.OVERLAY, stage, release.overlay_files(), log)
        clashes = [f for f in added if (site / f).exists()]
        if clashes:
            raise BuildError(f"The overlay would overwrite the installed {', '.join(clashes)}; nothing was changed.")
        with open(stage / record, "a") as f:
            f.write(_record_lines(stage, added))
        for d in sorted({(site / f).parent for f in touched}):
            if not os.access(d, os.W_OK):
                raise BuildError(f"Cannot write into {d} (permission denied); nothing was changed.")
        plan = {"op": "--into", "touched": touched, "record": record, "added": added,
                "created": [t for t in OVERLAY_TOPS if any(f.startswith(t + "/") for f in added)]}
        _write_atomic(state / JOURNAL, json.dumps(plan, indent=1).encode())
    except OSError as e:
        shutil.rmtree(state, ignore_errors=True)
        raise BuildError(f"Cannot stage the patched files in {state}: {e.strerror}; nothing was changed.") from None
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    try:
        for f in touched + [record]:
            _copy_atomic(stage / f, site / f)
        for f in added:
            (site / f).parent.mkdir(parents=True, exist_ok=True)
            _copy_atomic(stage / f, site / f)
        _write_atomic(info / MARKER, (json.dumps({
            "upstream_version": rel.version, "series_revision": rel.pin.revision,
            "series_sha256": rel.series_sha256(), "patches": [p.name for p in rel.patches], "applied_in_place": True,
            "touched": touched, "record": record, "added": added, "created": plan["created"],
        }, indent=2, sort_keys=True) + "\n").encode())
        (state / JOURNAL).unlink()  # the site is patched: from here on only --restore takes it out
    except BaseException as e:
        why = f"Cannot write {e.filename or site}: {e.strerror}" if isinstance(e, OSError) else "Interrupted"
        _undo_or_say(site, plan, why)
        if isinstance(e, OSError):
            raise BuildError(f"{why}; the site is back as it was.") from None
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return added


def restore_installed(site: Path, log) -> None:
    """--restore: the published files back, byte for byte, and everything added taken out."""
    site = site.resolve()
    installed_version(site)
    if recover(site, log):
        return
    info = _dist_info(site)
    marker = info / MARKER
    if _clear_stale(site, info, log):
        log(f"restore   {site} holds sglang as published; nothing else to restore")
        return
    if not marker.is_file():
        analysis = _analysis_info(site)
        also = (f" and the analysis package sglang-specprof ({analysis.name}), which pip uninstall "
                f"sglang-specprof removes" if analysis is not None else "")
        if _overlay_present(site):
            raise BuildError(f"{site} has sglang-specprof files but no record of how they came; reinstall sglang.")
        raise BuildError(f"{site} holds sglang as published{also}; there is nothing to restore.")
    try:
        head = json.loads(marker.read_bytes())
    except (OSError, ValueError):
        head = None
    if isinstance(head, dict) and not head.get("applied_in_place") and "+specprof" in installed_version(site):
        raise BuildError(f"{site} holds the sglang-specprof wheel, not an --into: pip install the upstream "
                         f"sglang to go back.")
    plan = _plan(site, info, marker)
    if not (info / STATE / "backup").is_dir():
        raise BuildError(f"{info / STATE / 'backup'}, where --into saved the published files, is missing; "
                         f"nothing was changed: reinstall sglang there.")
    # the marker becomes the journal by a rename (no bytes to write: a full disk cannot stop it)
    os.replace(marker, info / STATE / JOURNAL)
    _undo_or_say(site, plan, "The restore began")
    log(f"restore   {len(plan['touched'])} files back as published, {len(plan['added'])} taken out of {site}")
