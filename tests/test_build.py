"""build.py end to end, as a user runs it."""
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, refused_unbound, run_build
from specprof_build import fetch, release
from specprof_build.errors import BuildError


def test_list_marks_the_default():
    proc = run_build("--list")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert f"{release.default_release()}  (default)" in lines
    assert len(lines) == len(release.available())


def test_unknown_release_is_one_sentence_without_traceback(tmp_path):
    proc = run_build("--sglang", "0.4.0", "--out", str(tmp_path / "d"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("build.py: error: No patch series for sglang 0.4.0")
    for v in release.available():
        assert v in proc.stderr
    assert "python build.py rebase --onto 0.4.0" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_a_release_name_that_is_no_number_is_never_offered_as_a_command():
    proc = run_build("--sglang", "0.5.12; rm -rf /")
    assert proc.returncode == 1 and "is not an SGLang release number" in proc.stderr
    assert "rebase --onto" not in proc.stderr


def test_wheel_version_name_and_marker(built_wheel, default_release, upstream_wheel):
    v = default_release.full_version
    assert built_wheel.name.startswith(f"sglang-{v}-")
    tags = built_wheel.name.split("-", 2)[2]
    assert upstream_wheel.name.endswith(tags)
    with zipfile.ZipFile(built_wheel) as z:
        names = z.namelist()
        marker = json.loads(z.read(f"sglang-{v}.dist-info/specprof.json"))
        meta = z.read(f"sglang-{v}.dist-info/METADATA").decode()
        record = z.read(f"sglang-{v}.dist-info/RECORD").decode()
    assert not any(n.startswith("sglang-0.5.12.dist-info/") for n in names)
    assert f"\nVersion: {v}\n" in meta
    assert marker["upstream_version"] == default_release.version
    assert marker["series_sha256"] == default_release.series_sha256()
    assert marker["upstream_sha256"] == fetch.sha256_file(upstream_wheel)
    assert "sglang/specprof/server_args.py,sha256=" in record
    with zipfile.ZipFile(upstream_wheel) as z:
        upstream = {n for n in z.namelist() if not n.endswith("/") and ".dist-info/" not in n}
    assert upstream <= set(names)  # nothing upstream shipped is lost


def test_two_builds_are_byte_identical(tmp_path, built_wheel, upstream_wheel):
    proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    again = Path(proc.stdout.strip())
    assert again.read_bytes() == built_wheel.read_bytes()


def test_build_prints_progress_and_time(tmp_path, upstream_wheel):
    proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(tmp_path))
    for stage in ("upstream", "unpack", "apply", "overlay", "repack", "done"):
        assert any(line.startswith(stage) for line in proc.stderr.splitlines()), stage
    assert proc.stderr.rstrip().endswith(" s")


def _venv_python(path):
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return str(Path(path) / "bin" / "python")


def _installed_version(py, cwd):
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    return subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=cwd, check=True).stdout.strip()


def test_installs_with_pip_no_deps(tmp_path, built_wheel, default_release):
    py = _venv_python(tmp_path / "venv")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(built_wheel)], check=True)
    assert _installed_version(py, tmp_path) == default_release.full_version


def test_installs_with_installer(tmp_path, built_wheel, default_release):
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, clear=True).create(target)
    py = str(target / "bin" / "python")
    code = (
        "import sys, sysconfig\n"
        "from installer import install\n"
        "from installer.destinations import SchemeDictionaryDestination\n"
        "from installer.sources import WheelFile\n"
        "dest = SchemeDictionaryDestination(sysconfig.get_paths(vars={'base': sys.argv[2], 'platbase': sys.argv[2]}),"
        " interpreter=sys.argv[3], script_kind='posix')\n"
        "with WheelFile.open(sys.argv[1]) as w:\n"
        "    install(w, dest, {'INSTALLER': b'installer'})\n"
    )
    subprocess.run([sys.executable, "-c", code, str(built_wheel), str(target), py], check=True)
    assert _installed_version(py, tmp_path) == default_release.full_version


def test_check_writes_nothing(tmp_path, upstream_wheel):
    out = tmp_path / "out"
    proc = run_build("--check", "--from-wheel", str(upstream_wheel), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "zero fuzz and zero offset, and every name their hooks read is bound there" in proc.stderr
    assert proc.stdout == ""
    assert not out.exists()


def test_check_writes_nothing_even_into_a_series_without_its_hashes(tmp_path, upstream_wheel, default_release):
    """--check on a series folder that lacks upstream.sha256 says so and leaves it as it was;
    a build writes it (what --into checks an installed tree against)."""
    import shutil

    patches = tmp_path / "patches"
    shutil.copytree(release.PATCHES, patches)
    manifest = patches / default_release.directory.name / "upstream.sha256"
    want = manifest.read_text()
    manifest.unlink()
    before = sorted(p.relative_to(patches) for p in patches.rglob("*"))
    proc = run_build("--check", "--from-wheel", str(upstream_wheel), "--patches", str(patches))
    assert proc.returncode == 0, proc.stderr
    assert "has no upstream.sha256 (a build writes it" in proc.stderr
    assert sorted(p.relative_to(patches) for p in patches.rglob("*")) == before
    proc = run_build("--from-wheel", str(upstream_wheel), "--patches", str(patches), "--out", str(tmp_path / "d"))
    assert proc.returncode == 0, proc.stderr
    assert manifest.read_text() == want


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_check_and_build_refuse_a_hook_that_reads_a_name_unbound_there(tmp_path, upstream_wheel, unbound_patches):
    """The series applies exactly, but a hook reads a name the release does not bind where it
    runs (a NameError at the worker's first cycle): --check and the build say which, in one
    sentence, and write nothing: no --out folder, no upstream.sha256 in the series folder."""
    (unbound_patches / "sglang-0.5.16" / "upstream.sha256").unlink()  # a build would write it
    before = _files(unbound_patches)
    proc = run_build("--check", "--from-wheel", str(upstream_wheel), "--patches", str(unbound_patches))
    refused_unbound(proc, "nothing was written")
    out = tmp_path / "d"
    proc = run_build("--from-wheel", str(upstream_wheel), "--patches", str(unbound_patches), "--out", str(out))
    refused_unbound(proc, "nothing was written")
    assert "repack" not in proc.stderr and not out.exists()
    assert _files(unbound_patches) == before


def test_hash_mismatch_is_refused_and_leaves_the_cache_clean(tmp_path, default_release):
    name = fetch.choose(default_release.pin)
    wrong = release.Pin(default_release.version, 1, {name: "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(BuildError, match="refusing to build"):
        fetch.fetch(wrong, name, cache, log=lambda m: None)
    assert list(cache.iterdir()) == []


def test_altered_cached_file_is_checked_again(tmp_path, upstream_wheel, default_release):
    name = upstream_wheel.name
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_bytes(upstream_wheel.read_bytes()[:-10])
    with pytest.raises(BuildError, match="--offline forbids"):
        fetch.fetch(default_release.pin, name, cache, offline=True, log=lambda m: None)
    assert not (cache / name).exists()


def test_foreign_from_wheel_is_refused(tmp_path, default_release):
    bogus = tmp_path / "sglang-0.5.12-cp311-cp311-manylinux_2_34_x86_64.whl"
    bogus.write_bytes(b"not a wheel")
    proc = run_build("--from-wheel", str(bogus), "--out", str(tmp_path / "d"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"is none of the 8 files pinned for sglang {default_release.version}" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_contradicting_flags(upstream_wheel, tmp_path):
    proc = run_build("--from-wheel", str(upstream_wheel), "--python-tag", "cp312", "--out", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    said = proc.stderr.splitlines()[-1]
    assert said == "build.py: error: argument --python-tag: not allowed with argument --from-wheel"
    assert not tmp_path.joinpath("d").exists()


def _parsed(argv):
    """What build.py would run for argv: the command and the arguments it reads."""
    from specprof_build import cli

    args = cli.parser().parse_args(argv)
    return args.command or "build", {k: v for k, v in vars(args).items() if k != "command"}


# Every invocation README.md, docs/, .ci/run and bench/ show, and the command it runs
DOCUMENTED = [
    ([], "build", {}),
    (["--list"], "list", {}),
    (["--sglang", "0.5.12", "--check"], "check", {"sglang": "0.5.12"}),
    (["--from-wheel", "FILE"], "build", {"from_wheel": Path("FILE")}),
    (["--python-tag", "cp312", "--platform", "manylinux_2_34_aarch64"], "build",
     {"python_tag": "cp312", "platform": "manylinux_2_34_aarch64"}),
    (["--out", "DIR", "--cache-dir", "C", "--offline", "--patches", "P"], "build",
     {"out": Path("DIR"), "cache_dir": Path("C"), "offline": True, "patches": Path("P")}),
    (["-q", "--out", "DIR"], "build", {"quiet": True, "out": Path("DIR")}),
    (["--sglang", "0.5.12", "--python-tag", "cp312"], "build", {"sglang": "0.5.12", "python_tag": "cp312"}),
    (["--into", "SITE"], "into", {"site": Path("SITE")}),
    (["-q", "--sglang", "0.5.16", "--into", "SITE"], "into", {"quiet": True, "sglang": "0.5.16", "site": Path("SITE")}),
    (["--restore", "SITE"], "restore", {"site": Path("SITE")}),
    (["rebase", "--onto", "0.5.30"], "rebase", {"onto": "0.5.30", "from_version": None, "cont": False, "abort": False}),
    (["rebase", "--onto", "0.5.30", "--from", "0.5.16"], "rebase", {"onto": "0.5.30", "from_version": "0.5.16"}),
    (["rebase", "--onto", "0.5.30", "--continue"], "rebase", {"cont": True, "abort": False}),
    (["rebase", "--onto", "0.5.30", "--continue", "--accept-hook-moves"], "rebase",
     {"cont": True, "accept_hook_moves": True}),
    (["rebase", "--onto", "0.5.30", "--abort"], "rebase", {"cont": False, "abort": True}),
    (["upstream"], "upstream", {"from_wheel": None}),
    (["upstream", "--from-wheel", "FILE", "--cache-dir", "DIR"], "upstream",
     {"from_wheel": Path("FILE"), "cache_dir": Path("DIR")}),
]


@pytest.mark.parametrize("argv, command, reads", DOCUMENTED)
def test_each_documented_invocation_runs_its_command(argv, command, reads):
    got, args = _parsed(argv)
    assert got == command
    assert {k: args[k] for k in reads} == reads


@pytest.mark.parametrize("flags, command", [
    (["--check", "--sglang", "0.5.12"], ["check", "--sglang", "0.5.12"]),
    (["--list", "--patches", "P"], ["list", "--patches", "P"]),
    (["-q", "--sglang", "0.5.16", "--into", "SITE"], ["into", "SITE", "-q", "--sglang", "0.5.16"]),
    (["--restore", "SITE"], ["restore", "SITE"]),
])
def test_a_flag_and_its_command_run_the_same_with_the_same_arguments(flags, command):
    """The flags are the commands' older spelling: the same command, reading the same values."""
    kind, by_flag = _parsed(flags)
    same_kind, by_command = _parsed(command)
    assert kind == same_kind == command[0]
    assert {k: by_flag[k] for k in by_command} == by_command


@pytest.mark.parametrize("argv, says", [
    (["--check", "--into", "SITE"], "argument --into: not allowed with argument --check"),
    (["--list", "--restore", "SITE"], "argument --restore: not allowed with argument --list"),
    (["--into", "SITE", "--restore", "SITE"], "argument --restore: not allowed with argument --into"),
    (["--into", "SITE", "--from-wheel", "W"], "argument --from-wheel: not allowed with argument --into"),
    (["--into", "SITE", "--python-tag", "cp312"], "argument --python-tag: not allowed with argument --into"),
    (["--platform", "P", "--into", "SITE"], "argument --into: not allowed with argument --platform"),
    (["--restore", "SITE", "--sglang", "0.5.16"], "argument --sglang: not allowed with argument --restore"),
    (["--restore", "SITE", "--from-wheel", "W"], "argument --from-wheel: not allowed with argument --restore"),
    (["--from-wheel", "W", "--platform", "P"], "argument --platform: not allowed with argument --from-wheel"),
    (["--check", "--from-wheel", "W", "--python-tag", "cp312"],
     "argument --python-tag: not allowed with argument --from-wheel"),
    (["check", "--from-wheel", "W", "--platform", "P"], "argument --platform: not allowed with argument --from-wheel"),
    (["into", "SITE", "--from-wheel", "W"], "unrecognized arguments: --from-wheel W"),
    (["restore", "SITE", "--sglang", "0.5.16"], "unrecognized arguments: --sglang 0.5.16"),
    (["--sglang", "0.5.16", "into", "SITE"], "argument COMMAND: not allowed with argument --sglang"),
    (["--check", "check"], "argument COMMAND: not allowed with argument --check"),
    (["rebase", "--onto", "0.5.30", "--continue", "--abort"], "argument --abort: not allowed with argument --continue"),
])
def test_argparse_refuses_contradicting_modes_and_options(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        _parsed(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {says}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_out_dir(tmp_path, upstream_wheel):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(out))
    finally:
        out.chmod(0o700)
    assert proc.returncode == 1 and "Cannot write the wheel into" in proc.stderr
    assert list(out.iterdir()) == []


def test_out_path_that_is_a_file(tmp_path, upstream_wheel):
    out = tmp_path / "file"
    out.write_text("x")
    proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(out))
    assert proc.returncode == 1 and "Cannot write the wheel into" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_choose_other_interpreter_and_platform(default_release):
    name = fetch.choose(default_release.pin, "cp312", "manylinux_2_34_aarch64")
    assert name == f"sglang-{default_release.version}-cp312-cp312-manylinux_2_34_aarch64.whl"
    with pytest.raises(BuildError, match="publishes no wheel for cp39"):
        fetch.choose(default_release.pin, "cp39", None)


def test_pip_arguments_for_a_pure_python_wheel():
    assert fetch._pip_args("sglang-0.5.8-py3-none-any.whl", "0.5.8") == ["--only-binary=:all:", "sglang==0.5.8"]


def test_pip_arguments_select_exactly_one_artifact():
    args = fetch._pip_args("sglang-0.5.12-cp312-cp312-manylinux_2_34_aarch64.whl", "0.5.12")
    assert args == ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12",
                    "--abi", "cp312", "--platform", "manylinux_2_34_aarch64", "sglang==0.5.12"]


def test_builds_for_another_interpreter_and_architecture(tmp_path, default_release):
    proc = run_build("--python-tag", "cp312", "--platform", "manylinux_2_34_aarch64", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).name == (f"sglang-{default_release.full_version}-cp312-cp312-"
                                              "manylinux_2_34_aarch64.whl")


def test_leftovers_of_killed_builds_go_and_a_running_builds_stay(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    dead = tmp_path / f"{fetch.PARTIAL}{gone}-abc"
    dead.mkdir()
    (dead / "half.whl").write_bytes(b"x")
    mine = tmp_path / f"{fetch.PARTIAL}{os.getpid()}-def"
    mine.mkdir()
    legacy = tmp_path / f"{fetch.PARTIAL}abc123"  # named without a pid, by an earlier build.py
    legacy.mkdir()
    fetch.clean_partials(tmp_path)
    assert not dead.exists() and mine.exists() and not legacy.exists()


def test_a_folder_in_the_cache_entrys_place_is_one_sentence(tmp_path, default_release):
    name = fetch.choose(default_release.pin)
    (tmp_path / name).mkdir()
    with pytest.raises(BuildError, match="is in the download cache's way"):
        fetch.fetch(default_release.pin, name, tmp_path, offline=True, log=lambda m: None)


def test_the_wheel_is_the_same_bytes_whatever_the_umask(tmp_path, upstream_wheel, built_wheel):
    old = os.umask(0o077)
    try:
        proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(tmp_path / "d"))
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    assert fetch.sha256_file(Path(proc.stdout.strip())) == fetch.sha256_file(built_wheel)


def test_a_folder_of_series_named_for_no_release_is_one_sentence(tmp_path):
    patches = tmp_path / "patches"
    (patches / "sglang-garbage").mkdir(parents=True)
    (patches / "sglang-garbage" / "series").write_text("")
    (patches / "default").write_text("0.5.16\n")
    for argv in (["--list"], ["--sglang", "0.5.99"]):
        proc = run_build(*argv, "--patches", str(patches), "--out", str(tmp_path / "d"))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{patches / 'sglang-garbage'} is not named for a release (sglang-X.Y.Z" in proc.stderr


def test_the_cache_folder_from_the_environment_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SGLANG_SPECPROF_CACHE", "~/x")
    assert fetch.default_cache() == tmp_path / "x"


def test_rebase_onto_a_name_that_is_no_release_asks_no_one(tmp_path):
    for argv in (["--onto", "../../etc"], ["--onto", "0.5.99", "--from", "../x"], ["--onto", "../../etc", "--abort"]):
        proc = run_build("rebase", *argv)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "is not an SGLang release number (like 0.5.16)." in proc.stderr
        assert "PyPI" not in proc.stderr


def test_help_lists_every_command_and_flag():
    proc = run_build("--help")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    for command in ("check", "into", "restore", "list", "rebase", "upstream"):
        mine = [x for x in lines if x.strip().split(None, 1)[:1] == [command]]
        assert len(mine) == 1, (command, proc.stdout)  # one line each, saying what it does
        assert len(mine[0].split(None, 1)) == 2
        assert run_build(command, "--help").returncode == 0
    for flag in ("--sglang", "--from-wheel", "--python-tag", "--platform", "--cache-dir", "--offline", "--out",
                 "--patches", "--quiet", "--check", "--list", "--into", "--restore"):
        assert flag in proc.stdout, flag


# build.py as Python 3.10 runs it: a sys.version_info of 3.10, and tomllib (new in 3.11, which
# release.py imports) not there, so that reaching any module that needs 3.11 fails loudly
AS_PYTHON_3_10 = """
import runpy, sys
sys.version_info = (3, 10, 13, "final", 0)
sys.modules["tomllib"] = None
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_an_interpreter_below_3_11_is_refused_in_one_sentence_before_any_import_that_needs_it(tmp_path):
    for argv in (["--help"], [], ["rebase", "--onto", "0.5.17"]):
        proc = subprocess.run([sys.executable, "-c", AS_PYTHON_3_10, str(ROOT / "build.py"), *argv], cwd=tmp_path,
                              capture_output=True, text=True)
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr
        assert proc.stderr == ("build.py: error: sglang-specprof needs Python 3.11 or newer and this is Python "
                               "3.10.13: make the venv with a newer one (python3.11 -m venv .venv, or python3.12, "
                               "...)\n")
    assert not list(tmp_path.iterdir())
    # the build backend pip runs for `pip install -e .` refuses it too, before pip resolves anything
    code = AS_PYTHON_3_10.replace("runpy.run_path(sys.argv[0], run_name=\"__main__\")",
                                  "import specprof_build.backend")
    proc = subprocess.run([sys.executable, "-c", code, "x"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("sglang-specprof needs Python 3.11 or newer and this "
                                                           "is Python 3.10.13:"), proc.stderr
    assert proc.stderr.count("\n") == 1
    from specprof_build import pyversion

    assert pyversion.too_old((3, 11, 0)) is None and pyversion.too_old((4, 0, 0)) is None
    assert "this is Python 2.7.18:" in pyversion.too_old((2, 7, 18, "final", 0))


def _python_3_10():
    """A Python 3.10 on this machine (PATH, or pyenv's), or None."""
    import glob
    import shutil

    found = [shutil.which("python3.10")] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for py in filter(None, found):
        try:
            out = subprocess.run([py, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 10)":
            return py
    return None


def test_readme_set_up_on_python_3_10_fails_fast_in_one_sentence(tmp_path):
    """README's set-up command on a real Python 3.10: pip stops within 30 s at the build
    backend with the sentence (its own Requires-Python check came only after resolving the
    test extras, and on 3.10's pip 23.0 that backtracked for more than 10 minutes), and
    build.py says the same."""
    import shutil
    import time

    py = _python_3_10()
    if py is None:
        pytest.skip("no Python 3.10 on this machine")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "build.py", src)
    shutil.copytree(ROOT / "specprof_build", src / "specprof_build", ignore=shutil.ignore_patterns("__pycache__"))
    t0 = time.monotonic()
    subprocess.run([py, "-m", "venv", str(tmp_path / "venv")], check=True)
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "pip"), "install", "-q", "-e", ".[test]"], cwd=src,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30, proc.stderr[-2000:]
    assert "sglang-specprof needs Python 3.11 or newer and this is Python 3.10" in proc.stderr, proc.stderr[-2000:]
    assert "looking at multiple versions" not in proc.stdout + proc.stderr
    proc = subprocess.run([py, "build.py"], cwd=src, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("build.py: error: sglang-specprof needs Python 3.11")
    assert proc.stderr.count("\n") == 1
