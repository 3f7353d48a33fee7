"""python build.py: a patched, hash-pinned SGLang wheel that accepts --speculative-profile."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import analysis, apply, fetch, hookmap, inplace, rebase, release, repack, upstream
from .errors import BuildError

# The one copy into the output folder (a name of its own so that the tests can fill the disk).
copy_out = shutil.copyfile
BUILD_PARTIAL = "partial-"  # dist/.partial-<pid>-<wheel>: a wheel being written


# build.py's other commands (main() hands them their own parsers): one line each in --help
SUBCOMMANDS = """\
other commands (each with its own --help):
  build.py rebase --onto X.Y.Z [--from A.B.C]   carry the series to another release (--continue, --abort)
  build.py upstream                             a release the series miss? does the newest series apply to it?"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build.py",
        description="Build sglang-X.Y.Z+specprof.N: a pinned SGLang release with the patch series\n"
        "and the timing overlay applied, as a drop-in wheel.",
        epilog=SUBCOMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sglang", metavar="VERSION", help="the upstream release (default: patches/default)")
    p.add_argument("--list", action="store_true", help="list the releases that have a series, and exit")
    p.add_argument("--check", action="store_true", help="check that the series applies exactly; write nothing")
    p.add_argument("--from-wheel", metavar="FILE", type=Path,
                   help="build from this upstream wheel instead of downloading (hash-checked against the pin)")
    p.add_argument("--python-tag", metavar="TAG", help="build for another interpreter, e.g. cp312")
    p.add_argument("--platform", metavar="PLAT", help="build for another platform, e.g. manylinux_2_34_aarch64")
    p.add_argument("--out", metavar="DIR", type=Path, default=Path("dist"), help="where the wheel goes (default: dist)")
    p.add_argument("--cache-dir", metavar="DIR", type=Path, default=None,
                   help="download cache (default: $SGLANG_SPECPROF_CACHE or ~/.cache/sglang-specprof)")
    p.add_argument("--offline", action="store_true", help="never download; use the cache or --from-wheel")
    p.add_argument("--into", metavar="SITE", type=Path, default=None,
                   help="instead of a wheel, patch the sglang already installed in SITE (the folder holding "
                        "sglang/), after checking it is the release as published")
    p.add_argument("--restore", metavar="SITE", type=Path, default=None,
                   help="take an --into back out of SITE: the published files, byte for byte")
    p.add_argument("--patches", metavar="DIR", type=Path, default=None,
                   help="the folder of series (default: this checkout's patches/)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the wheel's path")
    return p


def check_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as e:
        raise BuildError(f"Cannot write the wheel into {out}: {e.strerror}.") from None


def _deliver(wheel: Path, out: Path) -> Path:
    """Into `out` under a partial name first, then renamed: never a torn wheel there."""
    final = out / wheel.name
    partial = out / f".{BUILD_PARTIAL}{os.getpid()}-{wheel.name}"  # one per build: two may share --out
    try:
        copy_out(wheel, partial)
        os.replace(partial, final)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise BuildError(f"Cannot write {final}: {e.strerror}.") from None
    return final


def into(args, log) -> Path:
    t0 = time.monotonic()
    if args.from_wheel or args.python_tag or args.platform or args.check:
        raise BuildError("--into patches an installed sglang; leave out --from-wheel, --python-tag, --platform and --check.")
    patches = args.patches or release.PATCHES
    installed = inplace.installed_version(args.into)
    if "+specprof" in installed:
        raise BuildError(f"{args.into} already holds the sglang-specprof wheel ({installed}); nothing to patch.")
    if args.sglang and args.sglang != installed:
        raise BuildError(f"--sglang {args.sglang}, but {args.into} holds sglang {installed}.")
    rel = release.load(installed, patches)
    added = inplace.apply_installed(args.into, rel, log)
    log(f"done      {len(rel.patches)} patches and {len(added)} files into {args.into} in {time.monotonic() - t0:.1f} s")
    return args.into


def build(args, log) -> Path | None:
    t0 = time.monotonic()
    patches = args.patches or release.PATCHES
    if not patches.is_dir():
        raise BuildError(f"--patches {patches}: no such folder.")
    if args.sglang is not None:
        release.check_release(args.sglang, patches)
    if args.restore is not None:
        if args.into is not None or args.sglang or args.check or args.from_wheel:
            raise BuildError("--restore takes only the site; leave out --into, --sglang, --check and --from-wheel.")
        with inplace.locked(args.restore):
            inplace.restore_installed(args.restore, log)
        return None
    if args.into is not None:
        with inplace.locked(args.into):  # one --into or --restore at a time on a site
            return into(args, log)
    rel = release.load(args.sglang or release.default_release(patches), patches)
    name, source = _upstream(args, rel, log)
    if args.check:
        check(rel, name, source, log)
        return None
    final = build_wheel(args, rel, name, source, log)
    log(f"done      in {time.monotonic() - t0:.1f} s")
    return final


def _upstream(args, rel, log) -> tuple[str, Path]:
    """The pinned upstream wheel: the given one (hash-checked), or from the cache or PyPI."""
    if args.from_wheel is not None:
        if args.python_tag or args.platform:
            raise BuildError("--from-wheel builds for the wheel's own tags; leave out --python-tag and --platform.")
        name = fetch.from_wheel(rel.pin, args.from_wheel)
        log(f"upstream  {name} from {args.from_wheel} (sha256 ok)")
        return name, args.from_wheel
    name = fetch.choose(rel.pin, args.python_tag, args.platform)
    return name, fetch.fetch(rel.pin, name, args.cache_dir or fetch.default_cache(), args.offline, log)


def _manifest_agrees(rel, name, source) -> bool:
    """The series folder's hashes of the upstream files it patches against the wheel's;
    False where the folder has none yet."""
    mpath = rel.directory / inplace.MANIFEST
    if not mpath.is_file():
        return False
    if release.read_text(mpath, f"{rel.directory.name}/{inplace.MANIFEST}") != inplace.manifest_from_wheel(rel, source):
        raise BuildError(f"{rel.directory.name}/{inplace.MANIFEST} does not match {name}; "
                         f"the series folder and the pin disagree.")
    return True


def check(rel, name, source, log) -> None:
    """--check: the series applies exactly to the pinned wheel, and its hashes agree. Writes nothing."""
    with tempfile.TemporaryDirectory(prefix=f"specprof-build-{os.getpid()}-") as work:
        tree = repack.unpack(source, Path(work) / "tree")
        log(f"unpack    {tree.name}")
        apply.apply_series(tree, rel.patches, log)  # into this check's own temporary tree
        hookmap.refuse_unbound_in(tree, rel, "nothing was written")
        if not _manifest_agrees(rel, name, source):
            log(f"manifest  {rel.directory.name} has no {inplace.MANIFEST} (a build writes it; --into needs it)")
    log(f"check     sglang {rel.version}: {len(rel.patches)} patches apply with zero fuzz and zero offset, "
        f"and every name their hooks read is bound there")


def build_wheel(args, rel, name, source, log) -> Path:
    """The sglang wheel and the analysis wheel into --out (each under a partial name first)."""
    fetch.sweep(Path(tempfile.gettempdir()), "specprof-build-")  # left by builds that were killed
    with tempfile.TemporaryDirectory(prefix=f"specprof-build-{os.getpid()}-") as work:
        work = Path(work)
        tree = repack.unpack(source, work / "tree")
        log(f"unpack    {tree.name}")
        apply.apply_series(tree, rel.patches, log, write=True)
        hookmap.refuse_unbound_in(tree, rel, "nothing was written")  # before --out or the series folder is written
        check_out_dir(args.out)
        fetch.sweep(args.out, f".{BUILD_PARTIAL}")
        if not _manifest_agrees(rel, name, source):  # the upstream hashes of the patched files, for --into
            manifest = inplace.manifest_from_wheel(rel, source)
            (rel.directory / inplace.MANIFEST).write_text(manifest)
            log(f"manifest  wrote {inplace.MANIFEST} ({len(manifest.splitlines())} files)")
        files = release.overlay_files()
        added = apply.copy_overlay(release.OVERLAY, tree, files, log)
        repack.check_compiles(tree, inplace.touched_files(rel) + added)
        repack.add_entry_points(tree, added)
        repack.write_marker(tree, {
            "upstream_version": rel.version,
            "upstream_artifact": name,
            "upstream_sha256": rel.pin.artifacts[name],
            "series_revision": rel.pin.revision,
            "series_sha256": rel.series_sha256(),
            "patches": [p.name for p in rel.patches],
        })
        repack.normalize_modes(tree)  # after every file is written: the marker too, whatever the umask
        staged = work / "out"
        staged.mkdir()
        wheel = repack.pack(tree, staged, rel.local_version)
        log(f"repack    {wheel.name}")
        lite = analysis.build_wheel(work)
        final = _deliver(wheel, args.out)
        lite = _deliver(lite, args.out)
    tags = "-".join(final.name[:-4].split("-")[-3:])
    if args.python_tag or args.platform or args.from_wheel:
        log(f"tags      {tags}")
    else:
        log(f"tags      {tags}, this interpreter's; for another, where SGLang runs: --python-tag cp312 "
            f"(and --platform ...), or build there")
    log(f"analysis  {lite} (profiles on a machine without SGLang: pip install it, [plot] for --plot)")
    return final


def rebase_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build.py rebase",
        description="Carry the patch series to another SGLang release: import it as commits on the old "
        "release, replay them onto the new one with git's 3-way merge, and export patches/sglang-NEW/.",
    )
    p.add_argument("--onto", metavar="VERSION", required=True, help="the release to carry the series to")
    p.add_argument("--from", dest="from_version", metavar="VERSION", help="the series to start from (default: the default release)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--continue", dest="cont", action="store_true", help="after resolving a conflict, go on")
    g.add_argument("--abort", action="store_true", help="drop the rebase in progress; patches/ stays as it was")
    p.add_argument("--accept-hook-moves", action="store_true",
                   help="export even though some hooks now sit in other functions (after checking each)")
    p.add_argument("--cache-dir", metavar="DIR", type=Path, default=None, help="download cache")
    return p


def _guarded(prog: str, on_interrupt: str, fn) -> int:
    """Run fn (its result, when it returns one, is the exit code; else 0); a BuildError is
    one sentence and exit 1, an interrupt exit 130."""
    try:
        return fn() or 0
    except BuildError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {on_interrupt}", file=sys.stderr)
        return 130


def main_rebase(argv) -> int:
    args = rebase_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    def run():
        for flag, version in (("--onto", args.onto), ("--from", args.from_version)):
            if version is not None and not release.is_release(version):  # before it names a folder or asks PyPI
                raise BuildError(f"{flag} {release.shown(version)} is not an SGLang release number (like 0.5.16).")
        if args.abort:
            rebase.abort(args.onto, log)
        elif args.cont:
            print(rebase.resume(args.onto, log, args.accept_hook_moves))
        else:
            if args.from_version and args.from_version == args.onto:
                raise BuildError("--from and --onto name the same release; nothing to rebase.")
            print(rebase.start(args.onto, args.from_version, args.cache_dir or fetch.default_cache(), log,
                               args.accept_hook_moves))

    return _guarded("build.py rebase", "run it again with --continue or --abort.", run)


def upstream_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build.py upstream",
        description="Is there an SGLang release the series do not cover, and does the newest series apply to the "
        "newest release? Writes nothing (the release's wheel goes to a temporary folder unless --cache-dir). "
        "Exit 0: up to date, or the newest series applies as it is; 3: it does not; 1: the check could not run.")
    p.add_argument("--from-wheel", metavar="FILE", type=Path, default=None,
                   help="the newest release's wheel, instead of downloading it (hash-checked against PyPI's list)")
    p.add_argument("--cache-dir", metavar="DIR", type=Path, default=None, help="keep the download there")
    p.add_argument("--patches", metavar="DIR", type=Path, default=None, help="the folder of series")
    return p


def main_upstream(argv) -> int:
    args = upstream_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    return _guarded("build.py upstream", "nothing was written.", lambda: upstream.main(args, log))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rebase"]:
        return main_rebase(argv[1:])
    if argv[:1] == ["upstream"]:
        return main_upstream(argv[1:])
    args = parser().parse_args(argv)
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    def run():
        if args.list:
            patches = args.patches or release.PATCHES
            default = release.default_release(patches)
            for v in release.available(patches):
                print(f"{v}{'  (default)' if v == default else ''}")
            return
        wheel = build(args, log)
        if wheel is not None:
            print(wheel)

    where = args.into or args.restore
    return _guarded("build.py", f"{where} is as it was." if where is not None else "nothing was written.", run)
