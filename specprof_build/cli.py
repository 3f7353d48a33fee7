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


def _exclusive(parser: argparse.ArgumentParser, *actions: argparse.Action) -> None:
    """Make arguments already added mutually exclusive, so that argparse itself refuses them
    together (one sentence, exit 2). argparse's own groups take only new arguments, and an
    argument may conflict with several others that do not conflict with each other."""
    parser.add_mutually_exclusive_group()._group_actions.extend(actions)


def _source_options(p) -> list[argparse.Action]:
    """Which upstream wheel: the release, and a given wheel or the tags to fetch one for."""
    return [
        p.add_argument("--sglang", metavar="VERSION", help="the upstream release (default: patches/default)"),
        p.add_argument("--from-wheel", metavar="FILE", type=Path,
                       help="build from this upstream wheel instead of downloading (hash-checked against the "
                            "pin; it builds for its own tags: not with --python-tag or --platform)"),
        p.add_argument("--python-tag", metavar="TAG", help="build for another interpreter, e.g. cp312"),
        p.add_argument("--platform", metavar="PLAT", help="build for another platform, e.g. manylinux_2_34_aarch64"),
        p.add_argument("--cache-dir", metavar="DIR", type=Path, default=None,
                       help="download cache (default: $SGLANG_SPECPROF_CACHE or ~/.cache/sglang-specprof)"),
        p.add_argument("--offline", action="store_true", help="never download; use the cache or --from-wheel"),
    ]


def _patches_option(p) -> argparse.Action:
    return p.add_argument("--patches", metavar="DIR", type=Path, default=None,
                          help="the folder of series (default: this checkout's patches/)")


def _quiet_option(p, what="print only the wheel's path") -> argparse.Action:
    return p.add_argument("-q", "--quiet", action="store_true", help=what)


def _exclude_given_wheel_with_tags(p, actions) -> None:
    by_flag = {a.option_strings[0]: a for a in actions}
    for tag in ("--python-tag", "--platform"):
        _exclusive(p, by_flag["--from-wheel"], by_flag[tag])


class _Spelled(argparse.Action):
    """--check, --list, --into SITE, --restore SITE: the commands' spelling as flags, which
    build.py had first; each names its command (and the site) as the command itself does."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.command = self.const
        if self.nargs != 0:
            namespace.site = values


USAGE = """build.py [options]          build the wheel (the options below)
       build.py COMMAND [options]  check, into, restore, list, rebase, upstream: build.py COMMAND --help"""


def parser() -> argparse.ArgumentParser:
    """The whole command line: the build's options at the top (no command builds the wheel),
    the other modes as commands with options of their own, and the older flag spelling of
    four of them. argparse refuses every combination that contradicts itself."""
    p = argparse.ArgumentParser(
        prog="build.py", usage=USAGE,
        description="Build sglang-X.Y.Z+specprof.N: a pinned SGLang release with the patch series\n"
        "and the timing overlay applied, as a drop-in wheel.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = _source_options(p)
    _exclude_given_wheel_with_tags(p, source)
    top = [*source,
           p.add_argument("--out", metavar="DIR", type=Path, default=Path("dist"),
                          help="where the wheel goes (default: dist)"),
           _patches_option(p), _quiet_option(p)]

    flags = p.add_argument_group("the commands check, list, into and restore as flags (one at a time)")
    one = flags.add_mutually_exclusive_group()
    check = one.add_argument("--check", action=_Spelled, nargs=0, const="check", dest="command",
                             help="= build.py check: check that the series applies exactly; write nothing")
    listed = one.add_argument("--list", action=_Spelled, nargs=0, const="list", dest="command",
                              help="= build.py list: the releases that have a series")
    into = one.add_argument("--into", action=_Spelled, const="into", dest="command", metavar="SITE", type=Path,
                            help="= build.py into SITE: patch the sglang installed in SITE instead of building")
    restore = one.add_argument("--restore", action=_Spelled, const="restore", dest="command", metavar="SITE",
                               type=Path, help="= build.py restore SITE: take an --into back out of SITE")
    by_flag = {a.option_strings[0]: a for a in source}
    for tag in ("--from-wheel", "--python-tag", "--platform"):  # into and restore fetch no upstream wheel
        _exclusive(p, into, restore, by_flag[tag])
    _exclusive(p, restore, by_flag["--sglang"])  # restore puts back the release the site holds
    top += [check, listed, into, restore]

    commands = p.add_subparsers(dest="command", metavar="COMMAND", title="commands (each with its own --help)")
    for action in top:  # an option before the command would be silently the build's: refused
        _exclusive(p, commands, action)

    c = commands.add_parser(
        "check", prog="build.py check", help="does the series apply exactly to the pinned wheel? writes nothing",
        description="Apply the series to the pinned upstream wheel in a temporary folder, with zero fuzz and zero "
        "offset, and check that every name a hook reads is bound there. Writes nothing.")
    _exclude_given_wheel_with_tags(c, _source_options(c))
    _patches_option(c)
    _quiet_option(c, "print nothing but errors")

    i = commands.add_parser(
        "into", prog="build.py into", help="patch the sglang installed in SITE in place (containers)",
        description="Patch the sglang installed in SITE (the folder holding sglang/) in place, after checking it "
        "is the release as published; all or nothing.")
    i.add_argument("site", metavar="SITE", type=Path, help="the site-packages folder that holds sglang/")
    i.add_argument("--sglang", metavar="VERSION", help="the release SITE must hold (default: the one it holds)")
    _patches_option(i)
    _quiet_option(i, "print only the site")

    r = commands.add_parser(
        "restore", prog="build.py restore", help="take an into back out of SITE: the published files",
        description="Take a build.py into back out of SITE: the published files, byte for byte.")
    r.add_argument("site", metavar="SITE", type=Path, help="the site-packages folder that holds sglang/")
    _quiet_option(r, "print nothing but errors")

    lst = commands.add_parser("list", prog="build.py list", help="the releases that have a series; the default marked",
                              description="List the releases that have a series; the default is marked.")
    _patches_option(lst)

    rebase_parser(commands)
    upstream_parser(commands)
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


def _patches(args) -> Path:
    patches = args.patches or release.PATCHES
    if not patches.is_dir():
        raise BuildError(f"--patches {patches}: no such folder.")
    return patches


def _release(args, patches) -> release.Release:
    if args.sglang is not None:
        release.check_release(args.sglang, patches)
    return release.load(args.sglang or release.default_release(patches), patches)


def into(args, log) -> Path:
    """build.py into SITE (--into SITE): the series and the overlay into an installed sglang."""
    t0 = time.monotonic()
    patches = _patches(args)
    if args.sglang is not None:
        release.check_release(args.sglang, patches)
    with inplace.locked(args.site):  # one into or restore at a time on a site
        installed = inplace.installed_version(args.site)
        if "+specprof" in installed:
            raise BuildError(f"{args.site} already holds the sglang-specprof wheel ({installed}); nothing to patch.")
        if args.sglang and args.sglang != installed:
            raise BuildError(f"--sglang {args.sglang}, but {args.site} holds sglang {installed}.")
        rel = release.load(installed, patches)
        added = inplace.apply_installed(args.site, rel, log)
    log(f"done      {len(rel.patches)} patches and {len(added)} files into {args.site} in {time.monotonic() - t0:.1f} s")
    return args.site


def restore(args, log) -> None:
    """build.py restore SITE (--restore SITE)."""
    with inplace.locked(args.site):
        inplace.restore_installed(args.site, log)


def list_releases(args, log) -> None:
    """build.py list (--list)."""
    patches = args.patches or release.PATCHES
    default = release.default_release(patches)
    for v in release.available(patches):
        print(f"{v}{'  (default)' if v == default else ''}")


def check_series(args, log) -> None:
    """build.py check (--check)."""
    rel = _release(args, _patches(args))
    check(rel, *_upstream(args, rel, log), log)


def build(args, log) -> Path:
    """build.py with no command: the wheel into --out."""
    t0 = time.monotonic()
    rel = _release(args, _patches(args))
    name, source = _upstream(args, rel, log)
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


def rebase_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "rebase", prog="build.py rebase", help="carry the series to another release (--onto X.Y.Z [--from A.B.C])",
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


def run_rebase(args, log) -> None:
    """build.py rebase."""
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


def upstream_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "upstream", prog="build.py upstream",
        help="a release the series miss? does the newest series apply to it? (exit 3: it does not)",
        description="Is there an SGLang release the series do not cover, and does the newest series apply to the "
        "newest release? Writes nothing (the release's wheel goes to a temporary folder unless --cache-dir). "
        "Exit 0: up to date, or the newest series applies as it is; 3: it does not; 1: the check could not run.")
    p.add_argument("--from-wheel", metavar="FILE", type=Path, default=None,
                   help="the newest release's wheel, instead of downloading it (hash-checked against PyPI's list)")
    p.add_argument("--cache-dir", metavar="DIR", type=Path, default=None, help="keep the download there")
    p.add_argument("--patches", metavar="DIR", type=Path, default=None, help="the folder of series")
    return p


def _print_path(run):
    """A command whose result is a path prints it on stdout (the wheel, the site)."""
    def printed(args, log):
        result = run(args, log)
        if result is not None:
            print(result)
    return printed


# Each command: what runs it, its name in its error messages, and what an interrupt leaves.
COMMANDS = {
    "build": (_print_path(build), "build.py", lambda args: "nothing was written."),
    "check": (check_series, "build.py", lambda args: "nothing was written."),
    "list": (list_releases, "build.py", lambda args: "nothing was written."),
    "into": (_print_path(into), "build.py", lambda args: f"{args.site} is as it was."),
    "restore": (restore, "build.py", lambda args: f"{args.site} is as it was."),
    "rebase": (run_rebase, "build.py rebase", lambda args: "run it again with --continue or --abort."),
    "upstream": (upstream.main, "build.py upstream", lambda args: "nothing was written."),
}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    run, prog, on_interrupt = COMMANDS[args.command or "build"]
    quiet = getattr(args, "quiet", False)
    log = (lambda *a, **k: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    return _guarded(prog, on_interrupt(args), lambda: run(args, log))
