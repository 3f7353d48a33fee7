"""build.py --into: patch an sglang that is already installed, after checking it is the release."""
import hashlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import run_build
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
    (["--check"], "leave out --from-wheel"),
])
def test_into_with_contradicting_flags(site, argv, says):
    proc = run_build("--into", str(site), *argv)
    assert proc.returncode == 1 and says in proc.stderr


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
