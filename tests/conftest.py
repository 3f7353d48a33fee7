import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specprof_build import fetch, release  # noqa: E402


def run_build(*args, env=None, cwd=ROOT):
    """build.py as a user runs it: a separate process, its exit code and output."""
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def pinned_wheel(version):
    """The pinned upstream wheel of `version` for this interpreter, from the shared download cache."""
    rel = release.load(version)
    return fetch.fetch(rel.pin, fetch.choose(rel.pin), fetch.default_cache(), log=lambda m: None)


def patches_with_gaps(folder, versions, default):
    """A folder of series holding only `versions` (every release from 0.5.8 on has one in patches/)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for v in versions:
        shutil.copytree(release.PATCHES / f"sglang-{v}", folder / f"sglang-{v}")
    (folder / "default").write_text(default + "\n")
    return folder


@pytest.fixture(scope="session")
def default_release():
    return release.load(release.default_release())


@pytest.fixture(scope="session")
def upstream_wheel(default_release):
    """The default release's pinned upstream wheel for this interpreter."""
    return pinned_wheel(default_release.version)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory, upstream_wheel):
    out = tmp_path_factory.mktemp("dist")
    proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.is_file()
    return path
