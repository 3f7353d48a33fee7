"""build.py upstream: is there an SGLang release the series do not cover, and does the newest
series apply to the newest release? For a maintainer, or a scheduled CI job.

Reads PyPI's file list for sglang once. For a release newer than the newest series it fetches
that release's wheel for this interpreter into a temporary folder (kept only in --cache-dir
when one is given) and checks, writing nothing, whether the newest series applies to it
exactly. Exit 0: every release up to the newest has a series, or the newest series applies
to the newest release as it is (`build.py rebase --onto` will carry it cleanly); 3: it does
not (the rebase needs a hand); 1: the check itself could not run.
"""

from __future__ import annotations

import json
import re
import tempfile
import urllib.request
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import apply, fetch, hookmap, release, repack
from .errors import BuildError

PYPI_SIMPLE = "https://pypi.org/simple/sglang/"  # the simple API, asked for its JSON form
FILE = re.compile(r"sglang-(\d[^-]*?)(?:-.+\.whl|\.tar\.gz)$")
BEHIND = 3


def simple_index(timeout: float = 30) -> dict:
    req = urllib.request.Request(PYPI_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except (OSError, ValueError) as e:
        raise BuildError(f"Cannot read PyPI's file list for sglang ({e}).") from None


def releases(data: dict) -> list[str]:
    """Final releases (.post ones included) with a file that is not yanked, oldest first."""
    out = set()
    for f in data.get("files", []):
        m = FILE.match(f.get("filename", ""))
        if not m or f.get("yanked"):
            continue
        try:
            v = Version(m.group(1))
        except InvalidVersion:
            continue
        if not (v.is_prerelease or v.is_devrelease):
            out.add(m.group(1))
    return sorted(out, key=Version)


def pin_of(data: dict, version: str) -> release.Pin:
    """The pin of a release as the list gives it: every file name and its sha256."""
    prefix = (f"sglang-{version}-", f"sglang-{version}.tar.gz")
    arts = {f["filename"]: f["hashes"]["sha256"] for f in data.get("files", [])
            if f["filename"].startswith(prefix) and not f.get("yanked")}
    if not arts:
        raise BuildError(f"PyPI has no files for sglang {version}.")
    return release.Pin(version=version, revision=1, artifacts=arts)


def survey(data: dict, patches: Path | None = None) -> dict:
    have = release.available(patches)
    published = releases(data)
    newest = have[-1] if have else None
    lo = Version(have[0]) if have else None
    return {
        "newest_series": newest,
        "newer": [v for v in published if newest is None or Version(v) > Version(newest)],
        "without_series": [v for v in published if lo is not None and lo <= Version(v) <= Version(newest)
                           and v not in have],
    }


def applies(rel: release.Release, wheel: Path, onto: str = "") -> str | None:
    """None where every patch of the series applies exactly to the wheel's files and every
    name its hooks read is bound there (hookmap), else why not."""
    with tempfile.TemporaryDirectory(prefix="specprof-upstream-") as work:
        tree = Path(work)
        repack.unpack_sources(wheel, tree)
        try:
            apply.apply_series(tree, rel.patches, log=lambda m: None)
            hookmap.refuse_unbound_in(tree, rel, release=onto, fix="rebase the series onto it")
        except BuildError as e:
            return str(e)
    return None


def main(args, log) -> int:
    if args.patches is not None and not args.patches.is_dir():
        raise BuildError(f"--patches {args.patches}: no such folder.")
    if args.from_wheel is not None:
        fetch.check_wheel_file(args.from_wheel)  # before the network, and whether or not it is needed
    data = simple_index()
    s = survey(data, args.patches)
    log(f"series    newest {s['newest_series']}; PyPI has {len(releases(data))} releases")
    if s["without_series"]:
        print(f"no series (within the supported range): {', '.join(s['without_series'])}")
    if not s["newer"]:
        print(f"up to date: no release after {s['newest_series']}")
        return 0
    onto = s["newer"][-1]
    print(f"newer than {s['newest_series']}: {', '.join(s['newer'])}")
    rel = release.load(s["newest_series"], args.patches)
    pin = pin_of(data, onto)
    if args.from_wheel is not None:
        fetch.from_wheel(pin, args.from_wheel)
        wheel = args.from_wheel
        why = applies(rel, wheel, onto)
    else:
        with tempfile.TemporaryDirectory(prefix="specprof-upstream-") as tmp:
            cache = args.cache_dir or Path(tmp)
            wheel = fetch.fetch(pin, fetch.choose(pin), cache, log=log)
            why = applies(rel, wheel, onto)
    if why is None:
        print(f"the {rel.version} series applies to {onto} exactly: build.py rebase --onto {onto} --from {rel.version}")
        return 0
    print(f"the {rel.version} series does not apply to {onto} as it is ({why}); "
          f"build.py rebase --onto {onto} --from {rel.version}, then resolve")
    return BEHIND
