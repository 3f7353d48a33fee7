"""build.py --into: patch an sglang that is already installed, after checking it is the release."""
import builtins
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT, refused_unbound, run_build
from specprof_build.inplace import touched_files


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, upstream_wheel):
    site = tmp_path_factory.mktemp("pristine")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(site), str(upstream_wheel)], check=True)
    return site


@pytest.fixture
def site(tmp_path, pristine):
    dest = tmp_path / "site"
    shutil.copytree(pristine, dest, symlinks=True)
    return dest


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_into_patches_the_installed_tree_like_the_wheel(site, built_wheel, default_release):
    proc = run_build("--into", str(site))
    assert proc.returncode == 0, proc.stderr
    v = default_release.version
    assert f"installed files match sglang {v} as published" in proc.stderr
    patched = set(touched_files(default_release))
    with zipfile.ZipFile(built_wheel) as z:
        for name in z.namelist():
            if name.startswith(("sglang/specprof/", "sglang_specprof/")) or name in patched:
                assert (site / name).read_bytes() == z.read(name), name
    assert (site / f"sglang-{v}.dist-info" / "specprof.json").is_file()
    again = run_build("--into", str(site))
    assert again.returncode == 1 and "already has sglang-specprof in it" in again.stderr


def test_edited_install_is_refused_and_left_alone(site):
    f = site / "sglang" / "srt" / "server_args.py"
    f.write_text(f.read_text() + "# a local edit\n")
    before = {p: digest(p) for p in (site / "sglang").rglob("*.py")}
    proc = run_build("--into", str(site))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "sglang/srt/server_args.py (differs); nothing was changed" in proc.stderr
    assert {p: digest(p) for p in (site / "sglang").rglob("*.py")} == before
    assert not (site / "sglang" / "specprof").exists()


@pytest.mark.parametrize("argv, says", [
    (["--sglang", "0.5.13"], "--sglang 0.5.13, but"),
    (["--check"], "argument --check: not allowed with argument --into"),
    (["--python-tag", "cp312"], "argument --python-tag: not allowed with argument --into"),
])
def test_into_with_contradicting_flags(site, argv, says):
    """A site that holds another release is one sentence (exit 1); a flag --into does not take, argparse's (exit 2)."""
    before = {p: p.read_bytes() for p in (site / "sglang").rglob("*.py")}
    proc = run_build("--into", str(site), *argv)
    assert proc.returncode == (1 if argv[0] == "--sglang" else 2) and says in proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in (site / "sglang").rglob("*.py")} == before


def test_into_refuses_a_hook_that_reads_a_name_unbound_there_and_changes_nothing(site, pristine, unbound_patches):
    """A series that applies exactly but whose hook reads a name the installed release does not
    bind there is refused in one sentence before anything in the site is written."""
    proc = run_build("--into", str(site), "--patches", str(unbound_patches))
    refused_unbound(proc, "nothing was changed")
    assert _tree(site) == _tree(pristine)


def test_into_a_folder_without_sglang(tmp_path):
    proc = run_build("--into", str(tmp_path))
    assert proc.returncode == 1 and "holds no sglang package" in proc.stderr


def test_manifest_matches_the_pinned_wheel(default_release, upstream_wheel):
    from specprof_build import inplace

    assert inplace.read_manifest(default_release) == {
        line.split()[1]: line.split()[0] for line in inplace.manifest_from_wheel(default_release, upstream_wheel).splitlines()}


def _tree(root):
    """Every file under root (bytecode caches aside) and its sha256."""
    return {str(p.relative_to(root)): digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_restore_puts_the_published_files_back_byte_for_byte(site, pristine):
    assert run_build("--into", str(site)).returncode == 0
    info = next(site.glob("sglang-*.dist-info"))
    record = (info / "RECORD").read_text()
    assert "sglang/specprof/profiler.py,sha256=" in record  # pip uninstall takes the overlay out too
    proc = run_build("--restore", str(site))
    assert proc.returncode == 0, proc.stderr
    assert "back as published" in proc.stderr
    assert _tree(site) == _tree(pristine)
    again = run_build("--restore", str(site))
    assert again.returncode == 1 and "nothing to restore" in again.stderr
    assert run_build("--into", str(site)).returncode == 0  # and it patches again


def test_a_read_only_folder_changes_nothing(site, pristine):
    managers = site / "sglang" / "srt" / "managers"
    managers.chmod(0o555)
    try:
        proc = run_build("--into", str(site))
    finally:
        managers.chmod(0o755)
    if proc.returncode == 0:
        pytest.skip("running as a user that writes into read-only folders (root)")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "nothing was changed" in proc.stderr
    assert _tree(site) == _tree(pristine)


KILLER = r"""
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from specprof_build import inplace, release
n = [int(sys.argv[3])]
real_replace, real_copy2 = os.replace, inplace.shutil.copy2
def count():
    n[0] -= 1
    if n[0] < 0:
        os._exit(9)  # as SIGKILL: no cleanup, no finally
def replace(*a, **k):
    count(); return real_replace(*a, **k)
def copy2(*a, **k):
    count(); return real_copy2(*a, **k)
inplace.os.replace = replace
inplace.shutil.copy2 = copy2
site = Path(sys.argv[2])
rel = release.load(inplace.installed_version(site))
inplace.apply_installed(site, rel, lambda m: None)
print("finished")
"""


@pytest.mark.full  # 1.5 minutes: a process killed at each of its steps
def test_killed_at_any_point_the_site_is_published_patched_or_taken_back_next_time(tmp_path, pristine, built_wheel):
    """--into killed after each of its file operations in turn: the site is as published, or
    fully patched, or (journal left) the next --restore gives back the published files and
    the next --into patches it whole."""
    from conftest import ROOT

    ref = tmp_path / "ref"
    shutil.copytree(pristine, ref, symlinks=True)
    assert run_build("--into", str(ref)).returncode == 0
    patched = {f: h for f, h in _tree(ref).items() if "/specprof-state/" not in f}
    published = _tree(pristine)
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    outcomes = set()
    for k in range(0, 200, 3):
        site = tmp_path / f"s{k}"
        shutil.copytree(pristine, site, symlinks=True)
        proc = subprocess.run([sys.executable, str(script), str(ROOT), str(site), str(k)],
                              capture_output=True, text=True)
        now = _tree(site)
        state = [f for f in now if "/specprof-state/" in f]
        if proc.returncode == 0:
            assert "finished" in proc.stdout, proc.stderr
            outcomes.add("finished")
            assert {f: h for f, h in now.items() if f not in state} == patched
            shutil.rmtree(site)
            break
        assert proc.returncode == 9, proc.stderr
        if now == published:
            outcomes.add("untouched")
        elif any(f.endswith("journal.json") for f in state):
            outcomes.add("journaled")
        else:  # staged or saved only: the published files are all still there
            assert {f: h for f, h in now.items() if f not in state} == published, k
            outcomes.add("staged")
        if k % 2:
            restored = run_build("--restore", str(site))
            assert _tree(site) == published, (k, restored.stderr)
        else:
            assert run_build("--into", str(site)).returncode == 0
            assert {f: h for f, h in _tree(site).items() if "/specprof-state/" not in f} == patched, k
        shutil.rmtree(site)
    assert {"journaled", "finished"} <= outcomes, outcomes


def test_into_a_site_holding_the_built_wheel_says_so(tmp_path, built_wheel):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(site), str(built_wheel)], check=True)
    proc = run_build("--into", str(site))
    assert proc.returncode == 1 and "already holds the sglang-specprof wheel" in proc.stderr
    back = run_build("--restore", str(site))
    assert back.returncode == 1 and "not an --into" in back.stderr


def _patched_ref(tmp_path, pristine):
    """A copy of the pristine site with --into applied, and its files (the saved state aside)."""
    ref = tmp_path / "ref"
    shutil.copytree(pristine, ref, symlinks=True)
    assert run_build("--into", str(ref)).returncode == 0
    return {f: h for f, h in _tree(ref).items() if "/specprof-state/" not in f}


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_a_second_run_on_a_locked_site_is_one_sentence_and_changes_nothing(site, pristine):
    """--into and --restore hold an flock on the site folder while they run; another run
    meanwhile is refused, naming the holder, and touches nothing."""
    fd = os.open(site, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for cmd in ("--into", "--restore"):
            proc = run_build(cmd, str(site))
            assert proc.returncode == 1
            assert (f"Another build.py is patching or restoring {site} (pid {os.getpid()}); wait for it"
                    in _no_traceback(proc))
            assert _tree(site) == _tree(pristine)
    finally:
        os.close(fd)  # the lock goes with it
    assert run_build("--into", str(site)).returncode == 0


def test_two_runs_at_once_on_one_site_never_tangle(tmp_path, site, pristine):
    """Two --into at once, then two --restore at once: one of each does the work, the other
    is one sentence; the site ends patched whole, then published byte for byte."""
    patched = _patched_ref(tmp_path, pristine)

    def both(cmd):
        procs = [subprocess.Popen([sys.executable, str(ROOT / "build.py"), cmd, str(site)], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        errs = [(p.wait(), p.stderr.read()) for p in procs]
        for p in procs:
            p.stderr.close()
        for code, err in errs:
            assert "Traceback" not in err, err
            assert code == 0 or ("Another build.py is" in err or "already has" in err
                                 or "nothing to restore" in err), err
        assert sum(code == 0 for code, _ in errs) >= 1, errs

    for _ in range(3):
        both("--into")
        assert {f: h for f, h in _tree(site).items() if "/specprof-state/" not in f} == patched
        both("--restore")
        assert _tree(site) == _tree(pristine)


class _NoRoom:
    """A file opened on a full disk: made, but every write fails."""

    def __init__(self, f, err):
        self._f, self._err = f, err

    def write(self, data):
        raise self._err

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class _FullDisk:
    """A disk that fills up: the first `room` files written (inplace's writes, and the copies
    that stage the files) go in whole; each later one is made but takes no byte (ENOSPC)."""

    def __init__(self, room):
        self.room = room

    def _full(self, path):
        self.room -= 1
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) if self.room < 0 else None

    def open(self, file, mode="r", *a, **k):
        f = builtins.open(file, mode, *a, **k)
        err = self._full(file) if any(c in mode for c in "wax+") else None
        return f if err is None else _NoRoom(f, err)

    def copy2(self, src, dst, *a, **k):
        err = self._full(dst)
        if err is not None:
            builtins.open(dst, "wb").close()
            raise err
        return real_copy2(src, dst, *a, **k)


real_copy2 = shutil.copy2


def _fill_disk(monkeypatch, room):
    from specprof_build import inplace

    disk = _FullDisk(room)
    monkeypatch.setattr(inplace, "open", disk.open, raising=False)
    monkeypatch.setattr(inplace.shutil, "copy2", disk.copy2)
    return disk


# the site's writes, in order: 16 copies that stage and save, RECORD's lines, the journal, the
# 8 files the series touches and RECORD, the 29 overlay files, the marker
@pytest.mark.parametrize("room", [0, 10, 16, 17, 18, 20, 25, 40, 55])
def test_a_disk_that_fills_up_during_into_leaves_the_site_as_published(tmp_path, site, pristine, monkeypatch,
                                                                       capsys, room):
    """--into on a disk that fills at any of its writes: one sentence, and the site as
    published (no file patched, no temporary file, no saved state): taking it back renames
    the saved originals, it writes nothing. With room again, --into patches it whole, and
    --restore on a full disk still puts every published file back."""
    from specprof_build import cli

    patched = _patched_ref(tmp_path, pristine)
    disk = _fill_disk(monkeypatch, room)
    code = cli.main(["--into", str(site)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and err.count("error:") == 1, err
    assert "No space left on device" in err and ("nothing was changed" in err or "back as it was" in err), err
    assert _tree(site) == _tree(pristine)
    disk.room = 10_000
    assert cli.main(["--into", str(site)]) == 0
    assert {f: h for f, h in _tree(site).items() if "/specprof-state/" not in f} == patched
    disk.room = 0
    code = cli.main(["--restore", str(site)])
    assert code == 0, capsys.readouterr().err
    assert _tree(site) == _tree(pristine)


def test_restore_on_a_full_disk_of_an_interrupted_into(site, pristine, monkeypatch, capsys):
    """A journal left by a killed --into, and a full disk: --restore still finishes it."""
    from specprof_build import cli

    assert run_build("--into", str(site)).returncode == 0
    info = next(site.glob("sglang-*.dist-info"))
    plan = json.loads((info / "specprof.json").read_text())
    (info / "specprof-state" / "journal.json").write_text(json.dumps(dict(plan, op="--into")))
    (info / "specprof.json").unlink()  # killed after the files, before the marker
    _fill_disk(monkeypatch, 0)
    assert cli.main(["--restore", str(site)]) == 0
    assert "an interrupted --into was taken back" in capsys.readouterr().err
    assert _tree(site) == _tree(pristine)


@pytest.mark.parametrize("where, field", [("journal", "created"), ("journal", "touched"), ("marker", "touched"),
                                          ("marker", "created"), ("marker", "record")])
def test_a_tampered_journal_or_marker_touches_nothing_outside_or_inside(tmp_path, site, where, field):
    """A path in the journal or the marker that leads out of the site: one sentence, and not a
    file changed, outside the site or in it."""
    assert run_build("--into", str(site)).returncode == 0
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    info = next(site.glob("sglang-*.dist-info"))
    marker = info / "specprof.json"
    plan = json.loads(marker.read_text())
    plan[field] = "../victim" if field == "record" else ["../victim"]
    if where == "journal":
        marker.unlink()
        (info / "specprof-state" / "journal.json").write_text(json.dumps(plan))
    else:
        marker.write_text(json.dumps(plan))
    before = _tree(site)
    for cmd in ("--restore", "--into"):
        proc = run_build(cmd, str(site))
        assert proc.returncode == 1
        line = _no_traceback(proc)
        if cmd == "--into" and where == "marker":  # a marker: --into leaves the site to --restore
            assert "already has sglang-specprof in it" in line
        else:
            assert "is damaged" in line and "nothing was changed" in line
        assert victim.read_text() == "keep me\n"
        assert _tree(site) == before


def _series_copy(tmp_path, default_release):
    patches = tmp_path / "patches"
    shutil.copytree(default_release.directory.parent, patches)
    return patches, patches / default_release.directory.name


def test_a_path_out_of_the_site_in_upstream_sha256_is_refused(tmp_path, site, pristine, default_release):
    """upstream.sha256 naming a file outside the site (with its right hash): refused by line
    before anything is read or copied."""
    victim = tmp_path / "victim"
    victim.write_text("elsewhere\n")
    patches, d = _series_copy(tmp_path, default_release)
    manifest = d / "upstream.sha256"
    manifest.write_text(manifest.read_text() + f"{digest(victim)}  ../../victim\n")
    outside = sorted(p for p in tmp_path.rglob("*") if site not in p.parents and patches not in p.parents)
    proc = run_build("--into", str(site), "--patches", str(patches))
    assert proc.returncode == 1
    assert "names '../../victim', which is not a file of the sglang package" in _no_traceback(proc)
    assert _tree(site) == _tree(pristine)
    assert sorted(p for p in tmp_path.rglob("*") if site not in p.parents and patches not in p.parents) == outside


def _damage(site, what):
    info = next(site.glob("sglang-*.dist-info"))
    if what == "no METADATA":
        (info / "METADATA").unlink()
    elif what == "METADATA a folder":
        (info / "METADATA").unlink()
        (info / "METADATA").mkdir()
    elif what in ("journal {}", "journal []"):
        assert run_build("--into", str(site)).returncode == 0
        (info / "specprof.json").unlink()
        (info / "specprof-state" / "journal.json").write_text(what.split()[1])
    else:
        assert run_build("--into", str(site)).returncode == 0
        (info / "specprof.json").write_text("{}" if what == "marker {}" else "not json {")


@pytest.mark.parametrize("what, says", [
    ("no METADATA", "has no readable METADATA file"),
    ("METADATA a folder", "has no readable METADATA file"),
    ("journal {}", "journal.json is damaged (no list of paths under 'touched')"),
    ("journal []", "journal.json is damaged (not a JSON object)"),
    ("marker {}", "specprof.json is damaged (no list of paths under 'touched')"),
    ("marker not JSON", "specprof.json is damaged (not JSON)"),
])
def test_a_damaged_site_is_one_sentence(site, what, says):
    _damage(site, what)
    before = _tree(site)
    for cmd in ("--restore", "--into"):
        proc = run_build(cmd, str(site))
        assert proc.returncode == 1
        line = _no_traceback(proc)
        assert says in line or (cmd == "--into" and "already has sglang-specprof" in line), line
        assert _tree(site) == before


def test_a_site_with_the_analysis_wheel_says_what_to_do(tmp_path, site, pristine, built_wheel):
    """The analysis wheel (sglang_specprof, no SGLang) beside a published sglang: --restore has
    nothing to restore and says so; --into says to uninstall the analysis package first,
    which done, --into works."""
    lite = next(built_wheel.parent.glob("sglang_specprof-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(site), str(lite)], check=True)
    proc = run_build("--restore", str(site))
    assert proc.returncode == 1
    assert "holds sglang as published and the analysis package sglang-specprof" in _no_traceback(proc)
    proc = run_build("--into", str(site))
    assert proc.returncode == 1
    assert "pip uninstall sglang-specprof" in _no_traceback(proc)
    for p in [site / "sglang_specprof", *site.glob("sglang_specprof-*.dist-info")]:
        shutil.rmtree(p)
    assert run_build("--into", str(site)).returncode == 0


def test_a_marker_left_by_pip_uninstall_is_no_obstacle(tmp_path, site, pristine, upstream_wheel):
    """pip uninstall after --into keeps the files RECORD does not list (the marker, the saved
    state) in the .dist-info folder; a reinstall of the same release lands beside them: --into
    sees the marker is stale (no overlay, RECORD lists none) and patches the site, --restore
    says there is nothing to restore. Another release reinstalled: the old folder is named."""
    assert run_build("--into", str(site)).returncode == 0
    info = next(site.glob("sglang-*.dist-info"))
    kept = {info / "specprof.json", info / "specprof-state"}
    for p in list(site.iterdir()):  # what pip uninstall leaves
        if p != info:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in list(info.iterdir()):
        if p not in kept:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    moved = tmp_path / "left"
    shutil.copytree(info, moved)
    for p in pristine.iterdir():  # pip install again
        if p.is_dir():
            shutil.copytree(p, site / p.name, dirs_exist_ok=True)
        else:
            shutil.copy2(p, site / p.name)
    proc = run_build("--restore", str(site))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "nothing else to restore" in proc.stderr
    assert _tree(site) == _tree(pristine)
    shutil.copytree(moved, info, dirs_exist_ok=True)
    proc = run_build("--into", str(site))
    assert proc.returncode == 0, proc.stderr
    assert run_build("--restore", str(site)).returncode == 0
    assert _tree(site) == _tree(pristine)
    old = site / "sglang-0.0.1.dist-info"
    shutil.copytree(moved, old)
    proc = run_build("--into", str(site))
    assert proc.returncode == 1
    assert f"{old} is left from an sglang that pip uninstalled" in _no_traceback(proc)
    assert f"rm -r {old}" in proc.stderr


def test_hints_quote_the_site(tmp_path, pristine):
    """A site path with a space: the command a message suggests can be pasted as it is."""
    site = tmp_path / "my site"
    shutil.copytree(pristine, site, symlinks=True)
    assert run_build("--into", str(site)).returncode == 0
    proc = run_build("--into", str(site))
    assert f"python build.py --restore '{site}' puts" in _no_traceback(proc)
