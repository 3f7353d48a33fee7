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
from packaging.version import Version

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
# part of it, which is where the patch hooks the profiler's validation. Every case of a release
# runs in one interpreter (importing server_args with torch is most of a case's time): each
# parses its arguments as `launch_server` would, with its output and its exit caught.
SCRIPT = textwrap.dedent("""
    import argparse, contextlib, io, json, os, sys, traceback
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
    parser = argparse.ArgumentParser()
    s.ServerArgs.add_cli_args(parser)
    out = {"help": parser.format_help()}
    for case in json.loads(sys.argv[1]):
        os.chdir(case["cwd"])
        err, got, rc = io.StringIO(), None, 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                a = s.prepare_server_args(case["argv"])
                got = {"algo": a.speculative_algorithm, "profile": a.speculative_profile,
                       "interval": a.speculative_profile_interval, "output": a.speculative_profile_output}
                if hasattr(a, "speculative_adaptive_policy"):
                    got["policy"] = a.speculative_adaptive_policy
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:
                rc = 1
                traceback.print_exc()
        out[case["id"]] = {"rc": rc, "got": got, "stderr": err.getvalue()}
    # What the patched workers import, with CPU torch: the hooks, the profiler, the CUDA backend,
    # and the analysis they share with the offline tools; install() without a GPU.
    import logging, types
    log = io.StringIO()
    logging.getLogger().addHandler(logging.StreamHandler(log))
    logging.getLogger().setLevel(logging.WARNING)
    try:
        from sglang.specprof import hooks, profiler, jsonl, metrics, cuda_backend
        from sglang_specprof import table, window, advisor, schema
        args = types.SimpleNamespace(speculative_profile=True, speculative_algorithm="EAGLE3",
                                     speculative_num_steps=3, speculative_eagle_topk=1,
                                     speculative_num_draft_tokens=4, speculative_profile_interval=100,
                                     speculative_profile_output=None, tp_size=1, enable_metrics=False)
        hooks.install(args, 0, "v2")
        enabled = hooks.P.enabled
        hooks.P.begin("decode", 1); hooks.P.mark("verify"); hooks.P.end(); hooks.P.harvest([2])
        out["server-side"] = {"error": None, "enabled": enabled, "log": log.getvalue()}
    except BaseException:
        out["server-side"] = {"error": traceback.format_exc(), "enabled": None, "log": log.getvalue()}
    print(json.dumps(out))
""")

OUT = "prof.jsonl"  # in the parse case's folder
CASES = {
    "eagle3": ["--speculative-algorithm", "EAGLE3", "--speculative-profile", "--speculative-profile-interval", "7",
               "--speculative-profile-output", "<cwd>/" + OUT],
    "no-flag": [],
    "no-spec": ["--speculative-profile"],
    "ngram": ["--speculative-profile", "--speculative-algorithm", "NGRAM"],
    "standalone": ["--speculative-profile", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                   "d"],
    # 0.5.11 on; before, argparse's choices refuse it (the release has no such worker)
    "dflash": ["--speculative-profile", "--speculative-algorithm", "DFLASH"],
    # 0.5.16 on, taken wherever a release has it
    "dspark": ["--speculative-profile", "--speculative-algorithm", "DSPARK"],
    # 0.5.20 on: taken (a LoRA adapter path besides, which upstream checks after the profile's check)
    "uno": ["--speculative-profile", "--speculative-algorithm", "UNO"],
    # no release has it: argparse's choices refuse it where there are choices, the profile's check elsewhere
    "unknown": ["--speculative-profile", "--speculative-algorithm", "MEDUSA"],
    "multi-layer": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--enable-multi-layer-eagle"],
    # 0.5.12 on (a Gemma 4 assistant's draft), taken wherever a release has it. No draft path in
    # these three: from 0.5.12 upstream reads the draft's config before the profile's check runs
    "frozen-kv": ["--speculative-profile", "--speculative-algorithm", "FROZEN_KV_MTP", "--speculative-num-steps", "3",
                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "interval-0": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-profile-interval", "0"],
    "no-folder": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-profile-output",
                  "/nonexistent/p.jsonl"],
    "output-alone": ["--speculative-profile-output", "p.jsonl"],
    "output-empty": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-profile-output", ""],
    "interval-huge": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-profile-interval",
                      str(10**26)],
    "interval-alone": ["--speculative-profile-interval", "-5"],
    # 0.5.12 on; before, argparse refuses the unknown option (the test reads the help first)
    "adaptive": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-adaptive"],
    "adaptive-cost": ["--speculative-profile", "--speculative-algorithm", "EAGLE3", "--speculative-adaptive",
                      "--speculative-adaptive-policy", "cost"],
    "cost-unprofiled": ["--speculative-algorithm", "EAGLE3", "--speculative-adaptive",
                        "--speculative-adaptive-policy", "cost"],
}


def times_adaptive(version):
    """The series passes each cycle's step count (it adds the policy field to ServerArgs)."""
    series = ROOT / "patches" / f"sglang-{version}"
    return any("+    speculative_adaptive_policy" in p.read_text() for p in series.glob("*.patch"))


@pytest.fixture(scope="module", params=RELEASES)
def site(request, tmp_path_factory):
    """(interpreter, folder with the built wheel of one release installed)."""
    version = request.param
    out = tmp_path_factory.mktemp(f"wheel-{version}")
    proc = run_build("--sglang", version, "--out", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    target = tmp_path_factory.mktemp(f"site-{version}")
    py = base_python()
    # --no-compile: byte-compiling all of sglang took most of the install; the check imports a part
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target),
                    proc.stdout.strip()], check=True)
    return py, os.pathsep.join([str(target), release_extras(version)]), version


@pytest.fixture(scope="module")
def parsed(site, tmp_path_factory):
    """{case: {rc, got, stderr}} and the help text, every case of CASES in one interpreter, each
    in a folder of its own."""
    py, folder, version = site
    cases = []
    for name, argv in CASES.items():
        cwd = tmp_path_factory.mktemp(f"case-{name}")
        cases.append({"id": name, "cwd": str(cwd),
                      "argv": ["--model-path", "m"] + [a.replace("<cwd>", str(cwd)) for a in argv]})
    proc = subprocess.run([py, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_SPEC_V2"},
                               "PYTHONPATH": folder}, timeout=900)  # upstream's default spec v2 setting
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["cwd"] = {c["id"]: c["cwd"] for c in cases}
    got["version"] = version
    return got


def test_help_lists_the_flags(parsed):
    for flag in ("--speculative-profile", "--speculative-profile-interval", "--speculative-profile-output"):
        assert re.search(re.escape(flag) + r"(?![-\w])", parsed["help"]), flag


def test_parses_with_eagle3(parsed):
    case = parsed["eagle3"]
    out = os.path.join(parsed["cwd"]["eagle3"], OUT)
    assert case["rc"] == 0, case["stderr"]
    assert case["got"].pop("policy", None) is None  # the field (0.5.16): upstream's rule unless asked
    assert case["got"] == {"algo": "EAGLE3", "profile": True, "interval": 7, "output": out}
    # the writability probe (the rejections below show it runs) leaves no empty file: with
    # tp > 1 each rank writes its own file beside this path
    assert not os.path.exists(out)


@pytest.mark.parametrize("name, algo", [("ngram", "NGRAM"), ("standalone", "STANDALONE")])
def test_parses_with_each_profiled_algorithm(parsed, name, algo):
    """STANDALONE runs the EAGLE worker with a draft model of its own; NGRAM's cycle is wrapped
    from the overlay (ngram.py): both taken with the flag in every release."""
    case = parsed[name]
    assert case["rc"] == 0, case["stderr"]
    assert case["got"]["algo"] == algo and case["got"]["profile"] is True


def _algorithms(parsed):
    """The --speculative-algorithm choices the release's parser lists, or None (free text)."""
    choices = re.search(r"--speculative-algorithm \{([A-Z0-9_,]+)\}", parsed["help"])
    return choices.group(1).split(",") if choices else None


def test_an_algorithm_the_profile_does_not_know_is_refused_in_one_sentence(parsed):
    """Every algorithm the releases ship is profiled (UNO from its first release, 0.5.20); a name
    none of them has is argparse's to refuse where it lists the choices, else the profile's."""
    if _algorithms(parsed) is not None:
        assert parsed["unknown"]["rc"] == 2 and "invalid choice" in parsed["unknown"]["stderr"]
        return
    _one_sentence(parsed["unknown"], "times the EAGLE, EAGLE3, STANDALONE, NGRAM, FROZEN_KV_MTP, DFLASH, DSPARK and "
                                     "UNO workers only, not --speculative-algorithm MEDUSA")
    if Version(parsed["version"]) >= Version("0.5.20"):
        case = parsed["uno"]
        assert case["rc"] == 0, case["stderr"]
        assert case["got"]["algo"] == "UNO" and case["got"]["profile"] is True


@pytest.mark.parametrize("name, algo, first", [("dflash", "DFLASH", "0.5.11"), ("dspark", "DSPARK", "0.5.16")])
def test_the_block_drafters_are_taken_wherever_a_release_has_them(parsed, name, algo, first):
    """DFLASH's v1 worker (0.5.11 to 0.5.13) and v2 worker, and DSPARK's: each cycle wrapped
    (block_draft.py)."""
    case = parsed[name]
    choices = _algorithms(parsed)
    assert choices is None or (algo in choices) == (Version(parsed["version"]) >= Version(first))
    if Version(parsed["version"]) < Version(first):  # upstream's own answer to a name it lacks
        pytest.skip(f"this release has no {algo}")
    assert case["rc"] == 0, case["stderr"]
    assert case["got"]["algo"] == algo and case["got"]["profile"] is True


def test_multi_layer_eagle_is_taken_where_sglang_runs_its_v2_worker(parsed):
    """Its v2 worker's cycle is wrapped in every release (multilayer.py); up to 0.5.10 SGLang runs
    the v1 worker (no hook) unless SGLANG_ENABLE_SPEC_V2 is set (this case does not set it, as
    SGLang does for MiMoV2 and Step3p5 models): refused there in one sentence that says so; from
    0.5.11 the v2 worker is the default, taken."""
    if not re.search(r"^\s+--enable-multi-layer-eagle(?![-\w])", parsed["help"], re.M):
        assert parsed["multi-layer"]["rc"] == 2  # upstream's parser: no such option
        pytest.skip("this release has no --enable-multi-layer-eagle")
    if Version(parsed["version"]) >= Version("0.5.11"):
        case = parsed["multi-layer"]
        assert case["rc"] == 0, case["stderr"]
        assert case["got"]["algo"] == "EAGLE3" and case["got"]["profile"] is True
    else:
        _one_sentence(parsed["multi-layer"], "--speculative-profile times multi-layer EAGLE's v2 worker, which SGLang "
                                             f"{parsed['version']} runs here only with SGLANG_ENABLE_SPEC_V2=1")


def test_frozen_kv_mtp_is_taken_wherever_a_release_has_it(parsed):
    """Its v1 worker (0.5.12, 0.5.13) and its v2 worker (0.5.14 on): each cycle wrapped (frozen_kv.py)."""
    case = parsed["frozen-kv"]
    if case["rc"] == 2 and "invalid choice" in case["stderr"]:  # argparse's choices: no such algorithm
        assert Version(parsed["version"]) < Version("0.5.12")
        pytest.skip("this release has no FROZEN_KV_MTP")
    assert case["rc"] == 0, case["stderr"]
    assert case["got"]["algo"] == "FROZEN_KV_MTP" and case["got"]["profile"] is True


@pytest.mark.parametrize("name, says", [
    ("interval-0", "--speculative-profile-interval must be 1 or more"),
    ("no-folder", "the folder /nonexistent does not exist"),
    ("output-alone", "only takes effect with --speculative-profile"),
    ("output-empty", "--speculative-profile-output needs a file path; an empty one writes nothing."),
    ("interval-huge", "--speculative-profile-interval must be 1 or more (at most 1000000 decode cycles a window)"),
    ("interval-alone", "--speculative-profile-interval must be 1 or more"),
])
def test_rejects_with_one_sentence(parsed, name, says):
    case = parsed[name]
    assert case["rc"] == 2, case["stderr"]
    assert "Traceback" not in case["stderr"]
    last = case["stderr"].strip().splitlines()[-1]
    # "<prog>: error: <one sentence>": prog is "sglang serve" from 0.5.12 on, the script's name before
    assert re.match(r"^[^:]+: error: ", last) and says in last
    assert "usage:" not in case["stderr"]  # one sentence, not the 500-line usage


def _one_sentence(case, says):
    assert case["rc"] == 2, case["stderr"]
    last = case["stderr"].strip().splitlines()[-1]
    assert re.match(r"^[^:]+: error: ", last) and says in last, last
    assert "Traceback" not in case["stderr"] and "usage:" not in case["stderr"]


def test_adaptive_speculation_is_profiled_where_the_series_times_it_and_refused_elsewhere(parsed):
    if not re.search(r"^\s+--speculative-adaptive(?![-\w])", parsed["help"], re.M):  # upstream's own option
        assert "--speculative-adaptive-policy" not in parsed["help"]  # nor the policy (nor a prefix of it)
        pytest.skip("this release has no --speculative-adaptive")
    if times_adaptive(parsed["version"]):  # 0.5.15 to 0.5.18: profiled, and the cost policy taken
        for name, policy in (("adaptive", None), ("adaptive-cost", "cost")):
            case = parsed[name]
            assert case["rc"] == 0, case["stderr"]
            assert case["got"]["profile"] is True and case["got"]["policy"] == policy
        _one_sentence(parsed["cost-unprofiled"], "takes its figures from the profile: add --speculative-profile")
    else:
        _one_sentence(parsed["adaptive"], "times --speculative-adaptive on SGLang 0.5.15 to 0.5.18 only")
        _one_sentence(parsed["adaptive-cost"], "--speculative-adaptive-policy needs the adaptive speculation hooks of SGLang 0.5.15 to 0.5.18")
        _one_sentence(parsed["cost-unprofiled"], "--speculative-adaptive-policy needs the adaptive speculation hooks of SGLang 0.5.15 to 0.5.18")


def test_the_flag_without_speculation_is_taken_each_forward_timed_whole(parsed):
    """A server without --speculative-algorithm is profiled too (plain.py): the baseline a
    step-0 speculative cycle is compared with."""
    case = parsed["no-spec"]
    assert case["rc"] == 0, case["stderr"]
    assert case["got"].pop("policy", None) is None
    assert case["got"] == {"algo": None, "profile": True, "interval": 100, "output": None}


def test_no_flag_leaves_upstream_behaviour(parsed):
    case = parsed["no-flag"]
    assert case["rc"] == 0, case["stderr"]
    assert case["got"].pop("policy", None) is None
    assert case["got"] == {"algo": None, "profile": False, "interval": 100, "output": None}


def test_the_server_side_profiler_imports_from_the_wheel(parsed):
    """What the patched workers import, with CPU torch: the hooks, the profiler, the CUDA backend,
    and the analysis they share with the offline tools. Without a GPU, install() must fall back
    to the null profiler with a warning instead of failing the worker."""
    got = parsed["server-side"]
    assert got["error"] is None, got["error"]
    assert got["enabled"] is False
    assert "speculative profile could not start" in got["log"]
