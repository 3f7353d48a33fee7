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


@pytest.fixture(scope="session")
def default_release():
    return release.load(release.default_release())


@pytest.fixture(scope="session")
def upstream_wheel(default_release):
    """The pinned upstream wheel for this interpreter, from the shared download cache."""
    name = fetch.choose(default_release.pin)
    return fetch.fetch(default_release.pin, name, fetch.default_cache(), log=lambda m: None)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory, upstream_wheel):
    out = tmp_path_factory.mktemp("dist")
    proc = run_build("--from-wheel", str(upstream_wheel), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.is_file()
    return path
