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
