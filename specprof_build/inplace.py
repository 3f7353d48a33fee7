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
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

from . import apply, release, repack
from .errors import BuildError

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


def read_manifest(rel: release.Release) -> dict[str, str]:
    path = rel.directory / MANIFEST
    if not path.is_file():
        raise BuildError(f"{rel.directory.name} has no {MANIFEST}; run python build.py --sglang {rel.version} "
                         f"once with network to write it.")
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise BuildError(f"{rel.directory.name}/{MANIFEST} line {n} is not 'sha256  path'.")
        out[parts[1]] = parts[0]
    return out


def installed_version(site: Path) -> str:
    infos = sorted(site.glob("sglang-*.dist-info"))
    if not (site / "sglang").is_dir():
        raise BuildError(f"{site} holds no sglang package; give the folder that contains sglang/ "
                         f"(site-packages, or a pip --target folder).")
    if len(infos) != 1:
        raise BuildError(f"{site} has {len(infos)} sglang .dist-info folders; expected one.")
    for line in (infos[0] / "METADATA").read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise BuildError(f"{infos[0].name}/METADATA has no Version.")


STATE = "specprof-state"  # inside the .dist-info: the originals, the staged files, the journal
JOURNAL = "journal.json"
MARKER = repack.MARKER
OVERLAY_TOPS = ("sglang/specprof", "sglang_specprof")


def _dist_info(site: Path) -> Path:
    return sorted(site.glob("sglang-*.dist-info"))[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write beside, flush to disk, rename over: the file is the old one or the new one."""
    tmp = path.with_name(path.name + ".specprof-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def _undo(site: Path, plan: dict) -> None:
    """Put the published files back from the saved originals and take out everything added.
    Each step can run again: the journal goes last, so a kill here is finished next time."""
    info = _dist_info(site)
    backup = info / STATE / "backup"
    for f in plan["touched"] + [plan["record"]]:
        saved = backup / f
        if saved.is_file() and (not (site / f).is_file() or _sha(site / f) != _sha(saved)):
            _copy_atomic(saved, site / f)
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


def recover(site: Path, log) -> bool:
    """An --into or --restore that was killed: finish taking it back. True if there was one."""
    infos = sorted(site.glob("sglang-*.dist-info"))
    if len(infos) != 1:
        return False
    state = infos[0] / STATE
    journal = state / JOURNAL
    if not journal.is_file():
        if state.is_dir() and not (infos[0] / MARKER).is_file():
            shutil.rmtree(state, ignore_errors=True)  # staged, never begun
        return False
    try:
        plan = json.loads(journal.read_text())
    except (OSError, ValueError):
        raise BuildError(f"{journal} is unreadable; the site may be half patched: reinstall sglang.") from None
    _undo(site, plan)
    log(f"recover   an interrupted {plan.get('op', '--into')} was taken back: {site} holds the published files")
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
    if (info / MARKER).exists() or any((site / t).exists() for t in OVERLAY_TOPS):
        raise BuildError(f"{site} already has sglang-specprof in it; python build.py --restore {site} "
                         f"puts the published files back.")
    manifest = read_manifest(rel)
    _check_published(site, manifest, rel)
    log(f"check     {len(manifest)} installed files match sglang {rel.version} as published")
    touched = sorted(manifest)
    record = str((info / "RECORD").relative_to(site))
    state = info / STATE
    stage, backup = state / "stage", state / "backup"
    try:
        for f in touched + [record]:
            for root in (stage, backup):
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(site / f, root / f)
        apply.apply_series(stage, rel.patches, log)
        added = apply.copy_overlay(release.OVERLAY, stage, release.overlay_files(), log)
        clashes = [f for f in added if (site / f).exists()]
        if clashes:
            raise BuildError(f"The overlay would overwrite the installed {', '.join(clashes)}; nothing was changed.")
        with open(stage / record, "a") as f:
            f.write(_record_lines(stage, added))
        for d in sorted({(site / f).parent for f in touched}):
            if not os.access(d, os.W_OK):
                raise BuildError(f"Cannot write into {d} (permission denied); nothing was changed.")
    except OSError as e:
        shutil.rmtree(state, ignore_errors=True)
        raise BuildError(f"Cannot stage the patched files in {state}: {e.strerror}; nothing was changed.") from None
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    plan = {"op": "--into", "touched": touched, "record": record, "added": added,
            "created": [t for t in OVERLAY_TOPS if any(f.startswith(t + "/") for f in added)]}
    _write_atomic(state / JOURNAL, json.dumps(plan, indent=1).encode())
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
        _undo(site, plan)
        if isinstance(e, OSError):
            raise BuildError(f"Cannot write {e.filename or site}: {e.strerror}; the site is back as it was.") from None
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
    if not marker.is_file():
        if any((site / t).exists() for t in OVERLAY_TOPS):
            raise BuildError(f"{site} has sglang-specprof files but no record of how they came; reinstall sglang.")
        raise BuildError(f"{site} holds sglang as published; there is nothing to restore.")
    plan = json.loads(marker.read_text())
    if not plan.get("applied_in_place") or not (info / STATE / "backup").is_dir():
        raise BuildError(f"{site} holds the sglang-specprof wheel, not an --into: pip install the upstream "
                         f"sglang to go back.")
    plan["op"] = "--restore"
    _write_atomic(info / STATE / JOURNAL, json.dumps(plan, indent=1).encode())
    _undo(site, plan)
    log(f"restore   {len(plan['touched'])} files back as published, {len(plan['added'])} taken out of {site}")
