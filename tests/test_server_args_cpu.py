"""The patched server_args, imported with CPU torch and the release's pure-Python dependencies.

Every release that has a series is checked. The interpreter (not SGLang) is a virtual
environment made once under .cache/ from requirements-cpu-import.txt (or
SPECPROF_IMPORT_PYTHON); each release's own pins go into a folder of their own
(requirements-cpu-import-X.Y.Z.txt), and the built wheel, installed with --no-deps into a
fresh folder, comes first on the path.
"""
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, run_build
from specprof_build import release

RELEASES = release.available()
# every release's server_args.py under CPU torch (a 6 GB environment the first time): CI's run
pytestmark = pytest.mark.full


@functools.lru_cache(maxsize=None)
def base_python():
    """A virtual environment with torch and what every release imports (made once)."""
    if os.environ.get("SPECPROF_IMPORT_PYTHON"):
        return os.environ["SPECPROF_IMPORT_PYTHON"]
    requirements = ROOT / "tests" / "requirements-cpu-import.txt"
    env = ROOT / ".cache" / "cpu-import"
    py = env / "bin" / "python"
    stamp = env / "requirements.txt"
    if not (py.exists() and stamp.exists() and stamp.read_text() == requirements.read_text()):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
        stamp.write_text(requirements.read_text())
    return str(py)


@functools.lru_cache(maxsize=None)
def release_extras(version):
    """A folder with the release's own pins (and their dependencies), first on the path; the
    releases that pin the same versions share one (made once for the group)."""
    requirements = ROOT / "tests" / f"requirements-cpu-import-{version}.txt"
    pins = "".join(ln + "\n" for ln in requirements.read_text().splitlines() if ln and not ln.startswith("#"))
    folder = ROOT / ".cache" / f"cpu-import-extra-{hashlib.sha256(pins.encode()).hexdigest()[:12]}"
    stamp = folder / ".requirements.txt"
    if not (stamp.exists() and stamp.read_text() == pins):
        subprocess.run([base_python(), "-m", "pip", "install", "-q", "--upgrade", "--target", str(folder),
                        "-r", str(requirements)], check=True)
        stamp.write_text(pins)
    return str(folder)


# __post_init__ resolves the model and the GPU; on a CPU the check runs only the speculative
# part of it, which is where the patch hooks the profiler's validation.
SCRIPT = textwrap.dedent("""
    import json, sys
    from sglang.srt import server_args as s
    from sglang.specprof.server_args import SpecProfileArgError
    def post_init(self):
        # Past the profiler's check, upstream resolves the draft model, which needs a GPU
        # machine's packages and a real model; record where it stopped, if it did.
        self.stopped_after_check = None
        try:
            if hasattr(self, "_handle_speculative_decoding"):
                self._handle_speculative_decoding()
            else:  # 0.5.13 and later: the speculative checks live in arg_groups
                from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding
                handle_speculative_decoding(self)
        except SpecProfileArgError:
            raise
        except Exception as e:
            self.stopped_after_check = type(e).__name__
    s.ServerArgs.__post_init__ = post_init
    a = s.prepare_server_args(json.loads(sys.argv[1]))
    print(json.dumps({"algo": a.speculative_algorithm, "profile": a.speculative_profile,
                      "interval": a.speculative_profile_interval, "output": a.speculative_profile_output}))
""")


@pytest.fixture(scope="module", params=RELEASES)
def site(request, tmp_path_factory):
    """(interpreter, folder with the built wheel of one release installed)."""
    version = request.param
    out = tmp_path_factory.mktemp(f"wheel-{version}")
    proc = run_build("--sglang", version, "--out", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    target = tmp_path_factory.mktemp(f"site-{version}")
    py = base_python()
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), proc.stdout.strip()],
                   check=True)
    return py, os.pathsep.join([str(target), release_extras(version)])


def run(site, *argv, cwd=None):
    py, folder = site
    env = dict(os.environ, PYTHONPATH=folder)
    return subprocess.run([py, "-c", SCRIPT, json.dumps(list(argv))], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def test_help_lists_the_flags(site):
    py, folder = site
    env = dict(os.environ, PYTHONPATH=folder)
    code = "import argparse; from sglang.srt.server_args import ServerArgs as S; p = argparse.ArgumentParser(); S.add_cli_args(p); p.print_help()"
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    for flag in ("--speculative-profile", "--speculative-profile-interval", "--speculative-profile-output"):
        assert re.search(re.escape(flag) + r"(?![-\w])", out), flag


def test_parses_with_eagle3(site, tmp_path):
    out = tmp_path / "prof.jsonl"
    proc = run(site, "--model-path", "m", "--speculative-algorithm", "EAGLE3", "--speculative-profile",
               "--speculative-profile-interval", "7", "--speculative-profile-output", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"algo": "EAGLE3", "profile": True, "interval": 7, "output": str(out)}
    # the writability probe (the rejections below show it runs) leaves no empty file: with
    # tp > 1 each rank writes its own file beside this path
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--speculative-profile"], "--speculative-profile needs speculative decoding"),
    (["--speculative-profile", "--speculative-algorithm", "NGRAM"],
     "times the EAGLE and EAGLE3 workers only, not --speculative-algorithm NGRAM"),
    (["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-profile-interval", "0"],
     "--speculative-profile-interval must be 1 or more"),
    (["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-profile-output", "/nonexistent/p.jsonl"],
     "the folder /nonexistent does not exist"),
    (["--speculative-profile-output", "p.jsonl"], "only takes effect with --speculative-profile"),
])
def test_rejects_with_one_sentence(site, argv, says, tmp_path):
    proc = run(site, "--model-path", "m", *argv, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # "<prog>: error: <one sentence>": prog is "sglang serve" from 0.5.12 on, the script's name before
    assert re.match(r"^[^:]+: error: ", last) and says in last
    assert "usage:" not in proc.stderr  # one sentence, not the 500-line usage


def test_no_flag_leaves_upstream_behaviour(site):
    proc = run(site, "--model-path", "m")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"algo": None, "profile": False, "interval": 100, "output": None}


def test_the_server_side_profiler_imports_from_the_wheel(site):
    """What the patched workers import, with CPU torch: the hooks, the profiler, the CUDA backend,
    and the analysis they share with the offline tools. Without a GPU, install() must fall back
    to the null profiler with a warning instead of failing the worker."""
    code = textwrap.dedent("""
        import logging, types
        logging.basicConfig(level=logging.WARNING)
        from sglang.specprof import hooks, profiler, jsonl, metrics, cuda_backend
        from sglang_specprof import table, window, advisor, schema
        args = types.SimpleNamespace(speculative_profile=True, speculative_algorithm="EAGLE3",
                                     speculative_num_steps=3, speculative_eagle_topk=1,
                                     speculative_num_draft_tokens=4, speculative_profile_interval=100,
                                     speculative_profile_output=None, tp_size=1, enable_metrics=False)
        hooks.install(args, 0, "v2")
        assert not hooks.P.enabled
        hooks.P.begin("decode", 1); hooks.P.mark("verify"); hooks.P.end(); hooks.P.harvest([2])
        print("imports ok")
    """)
    py, folder = site
    env = dict(os.environ, PYTHONPATH=folder)
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "imports ok" in proc.stdout
    assert "speculative profile could not start" in proc.stderr
