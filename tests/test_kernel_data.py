"""Kernel samples recorded on the GPU (docs/gpu-runs.md), replayed: what they must show.

tests/data/kernels/<run>/ holds what the runs wrote: for `*-exact`, tests/gpu/exact_check.py
with `--kernels 2` (check.json and each server's profile); for `0.5.16-cost`, the profile of
the `on` server of bench/overhead.py with `--speculative-profile-kernels 1`, and its ratios in
bench/results/overhead-0.5.16-c*-kernels1-2026-12-01.json.
"""
import json
import lzma
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang.specprof.server_args import KERNELS_EVERY
from sglang_specprof import kernels as K
from sglang_specprof import report, schema
from sglang_specprof.trace import trace

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "kernels"
EXACT = sorted(p for p in DATA.iterdir() if (p / "check.json").is_file())


def _windows(path, tmp_path):
    out = tmp_path / (path.name[:-3])
    out.write_bytes(lzma.decompress(path.read_bytes()))
    windows, notes = schema.read(str(out))
    assert notes == []
    return windows


def _samples(run, tmp_path):
    for prof in sorted(run.glob("profile-*.jsonl.xz")):
        windows = _windows(prof, tmp_path)
        for w in windows:
            if w.get("kernels"):
                yield prof.name, w, windows


@pytest.mark.parametrize("run", EXACT, ids=lambda p: p.name)
def test_counts_stay_exact_with_kernel_samples_on(run):
    check = json.loads((run / "check.json").read_text())
    assert "--kernels" in check["argv"]
    loads = [(n, ld) for n, e in check["servers"].items() for ld in e["loads"]]
    assert len(loads) >= 14
    for server, ld in loads:
        assert not ld["errors"], (server, ld["load"])
        assert ld["committed_tokens"] == ld["client_decode_tokens"], (server, ld["load"])


@pytest.mark.parametrize("run", sorted(DATA.iterdir()), ids=lambda p: p.name)
def test_every_sample_holds_its_cycles_kernels_inside_the_phases(run, tmp_path):
    """Coverage: at least 99% of the sampled decode cycles' kernel time was launched inside a
    named phase; the rest is the scheduler's own work between cycles, named."""
    n = 0
    for prof, w, _ in _samples(run, tmp_path):
        k = w["kernels"]
        assert "error" not in k, (prof, w["window"])
        assert k["cycles"] >= 4 and k["unmatched_kernels"] == 0 or k["unmatched_kernels"] < 50
        assert k["coverage"] >= 0.99, (prof, k["window"], k["coverage"])
        if k["between_cycles"]["kernel_ms"]:
            assert k["between_cycles"]["top"], (prof, k["window"])  # named
        n += 1
    assert n >= 6


@pytest.mark.parametrize("run", sorted(DATA.iterdir()), ids=lambda p: p.name)
def test_forward_phase_event_spans_agree_with_the_kernels(run, tmp_path):
    """Per sample, for draft, verify and draft extend: the CUDA events' span is no more than
    2% over the kernels' span from the previous phase's last kernel, and (samples that keep
    the bracket's lower side: `events_agree`, and the cycles kept one by one) no more than 2%
    under the span from the phase's own first kernel."""
    checked = 0
    for prof, w, _ in _samples(run, tmp_path):
        k = w["kernels"]
        for name in K.FORWARD_PHASES:
            p = k["phases"].get(name)
            if not p or not p.get("kernels"):
                continue
            assert p["event_ms"] <= p["span_ms"] * 1.02, (prof, k["window"], name)
            for t in k["tracks"]:  # cycle by cycle, where the sample kept the cycle's event times
                if "events" not in t:
                    continue
                first, ev = {}, dict(t["events"])
                for off, dur, pi, ci, ni in t["kernels"]:
                    first[pi] = min(first.get(pi, off), off)
                for i, (ph, lo, d) in enumerate(t["phases"]):
                    if ph == name and i in first and ph in ev:
                        assert (lo + d - first[i]) / 1000.0 <= ev[ph] * 1.02, (prof, k["window"], name)
                        assert ev[ph] <= d / 1000.0 * 1.02, (prof, k["window"], name)
            if p.get("events_agree") is not None:
                assert p["events_agree"], (prof, k["window"], name)
            checked += 1
    assert checked >= 18


def test_verify_splits_into_gemm_and_attention_and_eager_forwards_are_sampled_too(tmp_path):
    seen = set()
    for run in EXACT:
        for prof, w, _ in _samples(run, tmp_path):
            k = w["kernels"]
            v = k["phases"]["verify"]
            share = {c: v["busy_ms"].get(c, 0) / v["kernel_ms"] for c in K.CLASSES}
            assert share["gemm"] + share["attention"] > 0.9, (prof, k["window"], share)
            assert share["communication"] == 0  # one GPU: no all-reduce
            seen.add(("eager" if w["config"]["cuda_graph"] is False else "graph", w["config"]["worker"],
                      w["config"]["topk"]))
    assert {("graph", "v2", 1), ("graph", "v2", 4), ("graph", "v1", 2), ("eager", "v2", 1)} <= seen


def test_report_merges_the_samples_and_compares_them_with_their_windows(tmp_path):
    prof = DATA / "0.5.12-exact" / "profile-s3k1e.jsonl.xz"
    windows = _windows(prof, tmp_path)
    s = report.summarize(windows)
    k = s["kernels"]
    assert k["samples"] == sum(1 for w in windows if w.get("kernels"))
    # eager forwards under the torch profiler: the host-bound cycles ran slower than the
    # window's own (the recorded run: +23% to +34% in verify), and the report says so
    assert k["slowed"] > 1.1
    text = report.render(s, {})
    assert "the sampled cycles ran +" in text and "kernel samples merged" in text
    tr = trace(windows)
    assert any(e.get("tid") == 4 for e in tr["traceEvents"])


def test_the_default_interval_keeps_the_sampler_under_a_thousandth():
    """bench/overhead.py with a sample every window (interval 100): the median on/off ratio
    prices one sample in windows; at the default of one every KERNELS_EVERY windows it is
    that cost over KERNELS_EVERY."""
    for c in (1, 16):
        res = json.loads((ROOT / "bench" / "results" / f"overhead-0.5.16-c{c}-kernels1-2026-12-01.json").read_text())
        assert res["on_extra"] == "--speculative-profile-kernels 1" and res["off_profile"] is True
        assert res["rounds"] >= 15
        per_sample_windows = 1 / res["median_ratio"] - 1  # extra time per sample, in windows
        assert per_sample_windows / KERNELS_EVERY <= 0.001, (c, per_sample_windows)
