"""Apply a series and the overlay to an SGLang that is already installed (a container's, say).

The installed release is read from its .dist-info; every file the series touches is first
checked against the sha256 the pinned upstream wheel gives it (`upstream.sha256` beside
the series), so a tree that is not exactly that release, or was edited, is refused before
anything changes. The series is then checked in a scratch copy of those files, and only
then applied in place; the overlay is copied without replacing any file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

from . import apply, release
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
                         f"--check once with network to write it.")
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


def apply_installed(site: Path, rel: release.Release, log) -> list[str]:
    site = site.resolve()
    if (site / "sglang" / "specprof").exists() or (site / "sglang_specprof").exists():
        raise BuildError(f"{site} already has sglang-specprof in it.")
    manifest = read_manifest(rel)
    bad = []
    for f, want in manifest.items():
        p = site / f
        got = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        if got != want:
            bad.append(f"{f} ({'missing' if got is None else 'differs'})")
    if bad:
        raise BuildError(f"The installed sglang {rel.version} is not the release as published: "
                         f"{', '.join(bad)}; nothing was changed.")
    log(f"check     {len(manifest)} installed files match sglang {rel.version} as published")
    with tempfile.TemporaryDirectory(prefix="specprof-inplace-") as tmp:
        scratch = Path(tmp)
        for f in manifest:
            (scratch / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / f, scratch / f)
        apply.apply_series(scratch, rel.patches, lambda m: None)  # every patch applies: now for real
    apply.apply_series(site, rel.patches, log)
    added = apply.copy_overlay(release.OVERLAY, site, release.overlay_files(), log)
    info = sorted(site.glob("sglang-*.dist-info"))[0]
    (info / "specprof.json").write_text(json.dumps({
        "upstream_version": rel.version, "series_revision": rel.pin.revision,
        "series_sha256": rel.series_sha256(), "patches": [p.name for p in rel.patches], "applied_in_place": True,
    }, indent=2, sort_keys=True) + "\n")
    return added
