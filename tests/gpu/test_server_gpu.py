"""A --speculative-profile server on dummy EAGLE3 models (needs CUDA and an installed wheel).

Runs tests/gpu/serve_check.py and asserts what the profile must show. Skipped without a GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

HERE = Path(__file__).resolve().parent


def has_v1_worker():
    import importlib.util

    return importlib.util.find_spec("sglang.srt.speculative.eagle_worker") is not None


@pytest.mark.parametrize("topk", [1, 2])  # 1: the v2 worker; 2: the v1 worker (up to 0.5.12)
def test_profile_accounts_for_the_cycle(tmp_path, topk):
    if topk == 2 and not has_v1_worker():
        pytest.skip("this SGLang has no v1 worker (0.5.16 and later run topk > 1 on v2)")
    subprocess.run([sys.executable, str(HERE / "serve_check.py"), "--out", str(tmp_path), "--topk", str(topk),
                    "--concurrency", "1", "4", "--new-tokens", "3072"], check=True,
                   env=dict(os.environ, SGLANG_SIMULATE_ACC_LEN="3.0"))
    check = json.loads((tmp_path / "check.json").read_text())
    assert check["ngram_rejected"]["returncode"] == 2
    steady = [b for w in check["windows"][1:] for b in w["buckets"].values() if b["cycles"] == 100]
    assert steady
    for b in steady:
        assert b["accounted"] >= 0.97
        assert b["accept"] == 3.0 and b["per_position"] == [1.0, 1.0, 0.0]
        assert len(b["steps"]) == 3 and all(s > 0 for s in b["steps"])  # per-step times under CUDA graphs
        assert b["graph"]["replays"]["draft"] == 100
        total = sum(b["phases_gpu_ms"].values())
        assert total == pytest.approx(b["cycle_gpu_ms"], rel=1e-3)
    for run in check["runs"]:
        assert abs(run["ratio"] - 1) <= 0.03, run
