"""The GPU benchmark harnesses, driven on the CPU against a stand-in server.

`tests/fake_sglang_server.py` answers like `sglang.launch_server` and decodes on a cost
model through the real profiler, so these check the harnesses' own logic: the rotation,
the result files, and the advisor's verdict against measured runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script, tmp_path, *args):
    env = dict(os.environ, SPECPROF_BENCH_LAUNCH="fake_sglang_server",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "overlay")]))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--out", str(tmp_path),
                           "--logs", str(tmp_path / "logs"), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_advisor_check_judges_the_pick_and_each_prediction(tmp_path):
    out = run("advisor_check.py", tmp_path, "--acc", "2.5", "--steps", "1", "2", "3", "--profile-steps", "3",
              "--concurrency", "1", "4", "--rounds", "3", "--new-tokens", "160")
    result = json.loads((tmp_path / "advisor-0.5.12-acc2.5.json").read_text())
    assert result["profiled_steps"] == 3 and result["simulated_accept_length"] == 2.5
    assert "--out OUT --logs OUT/logs" in result["command"] and str(tmp_path) not in result["command"]
    for c in ("1", "4"):
        v = result["concurrency"][c]
        # acceptance 2.5: a third step adds cost and no tokens, a second adds half a token
        assert v["best_measured"] == 2 and v["advisor_pick"] == 2 and v["pick_within_noise"], out
        assert v["verify_growth"] == "measured"  # the stand-in's verify grows with tokens
        assert [s["steps"] for s in v["settings"]] == [1, 2, 3]
        assert all(len(s["measured_tok_s"]) == 3 for s in v["settings"])  # median of 3: one slow run cannot move it
        assert v["max_abs_error"] < 0.10, out
    # judged again from the file alone, the verdict is the same
    key = lambda r: [(s["steps"], s["predicted"]) for s in r["concurrency"]["1"]["settings"]]  # noqa: E731
    medians = lambda r: [s["measured_median"] for s in r["concurrency"]["1"]["settings"]]  # noqa: E731
    before = key(result)
    subprocess.run([sys.executable, str(ROOT / "bench" / "advisor_check.py"), "--acc", "2.5", "--rejudge",
                    str(tmp_path / "advisor-0.5.12-acc2.5.json"), str(tmp_path / "logs" / "acc2.5-steps3.jsonl")],
                   check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "overlay")))
    again = json.loads((tmp_path / "advisor-0.5.12-acc2.5.json").read_text())
    assert key(again) == before and again["judged_with"].startswith("python bench/advisor_check.py --rejudge")
    assert medians(again) == pytest.approx(medians(result), abs=0.02)  # from the runs as saved, 2 decimals


def test_overhead_pairs_runs_and_bounds_the_median(tmp_path):
    run("overhead.py", tmp_path, "--rounds", "3", "--concurrency", "2", "--new-tokens", "96")
    r = json.loads((tmp_path / "overhead-0.5.12-c2.json").read_text())
    assert len(r["tok_s_off"]) == len(r["tok_s_on"]) == len(r["ratios"]) == r["rounds"] == 3
    assert r["median_ratio_ci95"][0] <= r["median_ratio"] <= r["median_ratio_ci95"][1]
    assert r["command"].startswith("python bench/overhead.py ") and "OUT" in r["command"]
    assert 0.8 < r["median_ratio"] < 1.2  # the same stand-in both ways
