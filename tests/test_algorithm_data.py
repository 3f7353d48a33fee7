"""The other speculative algorithms on a GPU (tests/gpu/exact_check.py --servers sa3 ng8 ml3),
replayed from the recorded runs.

tests/data/algorithms/<run>/ holds what the check wrote (docs/gpu-runs.md): check.json, with
the clients' tokens and the profiler's totals around each load, the cost on / off of each
server at one request, and each server's profile. sa3: STANDALONE, a 1B-shaped Llama drafting
3 steps for the 8B-shaped target; ng8: NGRAM, 8 draft tokens matched on the host; ml3:
multi-layer EAGLE, a 4-layer dense MiMoV2 target whose 3 MTP layers draft (H200).
"""
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import report
from sglang_specprof.table import format_summary
from test_exact_data import V2_EAGER, V2_GRAPH, _check, _windows  # the recorded runs read alike

DATA = Path(__file__).resolve().parent / "data" / "algorithms"
RUNS = sorted(p for p in DATA.iterdir() if (p / "check.json").is_file())
NGRAM = {"ngram_match", "verify_prep", "verify", "accept", "ngram_update"}
MULTI_LAYER = {"draft", "tree", "verify_prep", "verify", "accept", "draft_extend"}
LOADS = {"c1-long", "c16-256", "c24-eager", "c16x24x4", "c8-stagger", "c16-stagger", "c8-abort", "c4-stop"}


def _multi_layer(e) -> bool:
    return "--enable-multi-layer-eagle" in e.get("extra", [])


def test_the_runs_hold_every_algorithm_run_on_the_gpu():
    servers = [e for r in RUNS for e in _check(r)["servers"].values()]
    assert {e["algorithm"] for e in servers} >= {"STANDALONE", "NGRAM"}
    assert any(_multi_layer(e) for e in servers)


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_committed_tokens_are_what_the_clients_received(run):
    for name, e in _check(run)["servers"].items():
        assert {ld["load"] for ld in e["loads"]} >= LOADS, name
        for ld in e["loads"]:
            assert not ld["errors"], (name, ld["load"])
            assert ld["committed_tokens"] == ld["client_decode_tokens"], (name, ld["load"])
        reasons = {r for ld in e["loads"] for r in ld["finish_reasons"]}
        assert any("abort" in r for r in reasons) and any("stop" in r for r in reasons), name
        assert sum(ld["skipped_requests"] for ld in e["loads"]) > 0, name  # finished requests in flight were there


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_one_request_decodes_at_the_clients_rate_and_the_time_is_all_accounted(run):
    for name, e in _check(run)["servers"].items():
        (ld,) = [x for x in e["loads"] if x["load"] == "c1-long"]
        # the 4-layer multi-layer target (a cycle of 3-4 ms, the GPU idle half of it): 1.2% and,
        # with many admissions, up to 11% of the clients' busy time outside the profile's
        # partition (docs/gpu-runs.md); the 8B-shaped targets within 1% and 2.5%
        rate, whole = (0.015, 0.12) if _multi_layer(e) else (0.01, 0.025)
        assert abs(ld["rate_ratio"] - 1) <= rate, name
        for ld in e["loads"]:
            if ld["load"] != "c4-stop":  # 15 ms of decode: one prefill's rounding is a percent
                assert abs(ld["accounted_ratio"] - 1) <= whole, (name, ld["load"])


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_every_phase_of_each_worker_is_timed_on_graph_and_eager_paths(run, tmp_path):
    for name, e in _check(run)["servers"].items():
        windows = _windows(run, name, tmp_path)
        assert all(w["marks_lost"] == 0 and w["uncut_cycles"] == 0 and w["dropped_cycles"] == 0 for w in windows)
        config = windows[0]["config"]
        assert config["algorithm"] == e["algorithm"] and config["worker"] == "v2"
        timed = [(k, b) for w in windows for k, b in w["buckets"].items()
                 if b["cycles"] and (b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"])["n"]]
        graph = [b for k, b in timed if int(k.split("-")[0]) <= 16]
        eager = [b for k, b in timed if k == "17-32"]
        assert graph and eager, name
        if _multi_layer(e):
            # no EAGLE draft graph and no draft step (each step an MTP layer inside the draft
            # extend): the same six phases on graph and eager cycles alike
            assert config["multi_layer"] and config["num_steps"] == e["steps"]
            assert all(set(b["phases"]) == MULTI_LAYER for _, b in timed), name
            assert all(not b["draft_steps_gpu_ms"] for _, b in timed), name
            assert all(b["graph"]["replays"].get("verify", 0) == b["cycles"] for b in graph), name
            assert all(b["graph"]["eager"]["verify"] == b["cycles"] for b in eager), name
        elif e["algorithm"] == "NGRAM":
            # a host-side match and a verify, no draft forward: no step is timed
            assert config["num_steps"] is None and config["num_draft_tokens"] == e["draft_tokens"]
            assert all(set(b["phases"]) == NGRAM for _, b in timed), name
            assert all(not b["draft_steps_gpu_ms"] for _, b in timed), name
        else:
            assert config["num_steps"] == e["steps"]
            assert all(set(b["phases"]) == V2_EAGER for b in eager), name
            assert any(set(b["phases"]) == V2_GRAPH for b in graph), name
            assert all(len(b["draft_steps_gpu_ms"]) == e["steps"] for b in eager), name
            assert all(b["graph"]["eager"]["draft"] == b["cycles"] for b in eager), name


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_the_kernel_samples_explain_each_phase(run, tmp_path):
    for name, e in _check(run)["servers"].items():
        samples = [w["kernels"] for w in _windows(run, name, tmp_path) if w.get("kernels")]
        assert len(samples) >= 3 and not any("error" in k for k in samples), name
        for k in samples:
            # every kernel of a cycle falls inside one of its phases: what is left out ran between
            # the cycles (the scheduler's copies of the results), 0.8-1.6% of the small multi-layer
            # target's kernel time, 0.1-0.2% of the 8B-shaped one's
            inside = sum(p["kernel_ms"] for p in k["phases"].values())
            assert k["unmatched_kernels"] == 0, name
            assert inside + k["between_cycles"]["kernel_ms"] == pytest.approx(k["kernel_ms"], abs=2e-3), name
            assert k["coverage"] >= (0.98 if _multi_layer(e) else 0.99), name
        expected = NGRAM if e["algorithm"] == "NGRAM" else MULTI_LAYER if _multi_layer(e) else V2_GRAPH
        assert {p for k in samples for p in k["phases"]} == expected, name
        # the check's own summary, read as the loads ended: the last window had not closed yet
        assert e["kernels"]["coverage"] >= (0.98 if _multi_layer(e) else 0.99)
        assert len(samples) - 1 <= e["kernels"]["samples"] <= len(samples)


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_the_cost_on_and_off_was_measured_in_ten_rounds_at_least(run):
    cost = _check(run)["cost"]
    assert set(cost) == set(_check(run)["servers"])
    for name, c in cost.items():
        assert c["rounds"] >= 10 and len(c["tok_s_on"]) == len(c["tok_s_off"]) == c["rounds"]
        ratios = sorted(on / off for on, off in zip(c["tok_s_on"], c["tok_s_off"]))
        assert c["median_ratio"] == pytest.approx((ratios[4] + ratios[5]) / 2 if len(ratios) == 10 else
                                                  c["median_ratio"], abs=1e-3)
        lo, hi = c["median_ratio_ci95"]
        assert lo <= c["median_ratio"] <= hi, name
        if not _multi_layer(_check(run)["servers"][name]):
            assert lo < 1.0 < hi, name  # on the 8B-shaped target no cost told apart from noise
        # the 4-layer multi-layer target, whose cycle waits on the host: 0.952 [0.875, 0.977]
        # (docs/benchmarks.md: the hot path's host time on the critical path)


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_report_reads_the_profiles_and_says_what_the_advisor_cannot_do(run, tmp_path):
    for name, e in _check(run)["servers"].items():
        summary = report.summarize(_windows(run, name, tmp_path))
        text = format_summary(summary)
        for b in summary["buckets"].values():
            acc = b["accept"]
            assert acc["committed_tokens"] == sum(n * c for n, c in enumerate(acc["histogram"]))
        if e["algorithm"] == "NGRAM":
            assert "the step-count advisor does not apply to NGRAM" in text
            assert "ngram_match" in text and "draft_extend" not in text
        elif _multi_layer(e):
            # the header says what ran (not "no draft model"), the advisor why it has nothing
            # to say, and the graph line counts the verify alone (the draft extend's graphs are
            # the multi-layer worker's own runners, which the profile does not see)
            assert text.startswith("window ") and "[EAGLE multi-layer v2 steps=3 topk=1 draft_tokens=4]" in text
            assert "no draft model" not in text
            assert "the step-count advisor does not apply to multi-layer EAGLE" in text
            assert all(ln.strip().startswith("graph replays: verify") and "draft_extend" not in ln
                       for ln in text.splitlines() if "graph replays" in ln)
        else:
            assert "[STANDALONE v2" in text and "draft_extend" in text
