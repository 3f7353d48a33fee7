import os
import re
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


# A hook line of the 0.5.16 series, and the same hook reading 0.5.17's name for its argument,
# which 0.5.16 does not bind there: a series a rebase that merged cleanly could leave.
UNBOUND_HOOK = ('+        specprof.P.graph("draft", can_cuda_graph, self.cuda_graph_runner)\n',
                '+        specprof.P.graph("draft", can_run_decode_cuda_graph, self.cuda_graph_runner)\n')
UNBOUND_SAYS = re.compile(
    re.escape("specprof.P.graph('draft') in sglang/srt/speculative/eagle_worker_v2.py line ") + r"\d+ "
    + re.escape("(eagle-v2-profile-hooks.patch) reads 'can_run_decode_cuda_graph', which is not bound there in "
                "sglang 0.5.16: the worker would stop with a NameError at its first cycle; correct the patch in "))


def refused_unbound(proc, after):
    """build.py's refusal of the unbound_patches series: exit 1 and one sentence, ending `after`."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and UNBOUND_SAYS.search(errors[0]), proc.stderr
    assert errors[0].endswith(f"sglang-0.5.16; {after}."), errors[0]


@pytest.fixture
def unbound_patches(tmp_path, default_release):
    """A folder of series holding the default release's (0.5.16), with one hook changed to read
    a name that release does not bind where the hook runs; it still applies exactly."""
    assert default_release.version == "0.5.16"
    folder = patches_with_gaps(tmp_path / "unbound-patches", ["0.5.16"], "0.5.16")
    patch = folder / "sglang-0.5.16" / "eagle-v2-profile-hooks.patch"
    text = patch.read_text()
    assert text.count(UNBOUND_HOOK[0]) == 1
    patch.write_text(text.replace(*UNBOUND_HOOK))
    return folder
