"""Profiles written by real servers on the GPU machine (tests/data/, see docs/gpu-runs.md)."""
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import schema

DATA = Path(__file__).resolve().parent / "data"
FILES = sorted(DATA.glob("profile-*.jsonl"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_gpu_profile_reads_and_adds_up(path):
    windows, notes = schema.read(str(path))
    assert len(windows) >= 10 and notes == []
    cfg = windows[0]["config"]
    assert cfg["num_steps"] == 3 and cfg["num_draft_tokens"] == 4 and cfg["cuda_graph"]
    steady = [b for w in windows[1:] for b in w["buckets"].values() if b["cycles"] == 100]
    assert len(steady) >= 10
    for b in steady:
        phases = b["phases"]
        assert sum(p["gpu_ms"]["mean"] for p in phases.values()) == pytest.approx(b["cycle_gpu_ms"]["mean"], rel=1e-3)
        assert b["between_cycles_gpu_ms"]["mean"] < 0.05 * b["cycle_wall_ms"]["mean"]  # the phases hold the GPU
        assert b["accept"]["mean_length"] == 3.0 and b["accept"]["per_position"] == [1.0, 1.0, 0.0]
        assert len(b["draft_steps_gpu_ms"]) == 3
        assert b["graph"]["replays"] == {"draft": 100, "verify": 100, "draft_extend": 100}
        # verify dominates the cycle of an 8B-shaped target with a 1-layer draft
        assert max(phases, key=lambda n: phases[n]["gpu_ms"]["mean"]) == "verify"


def test_both_workers_are_covered():
    assert {schema.read(str(p))[0][0]["config"]["worker"] for p in FILES} == {"v1", "v2"}
