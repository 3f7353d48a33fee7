"""The GPU check of exact figures (tests/gpu/exact_check.py), replayed from its recorded runs.

tests/data/exact/<run>/ holds what the check wrote on the GPU machine (docs/gpu-runs.md):
check.json, with the clients' tokens and the profiler's totals around each load, and each
server's profile. These tests assert what those runs must show, and read the profiles with
the report as a user would.
"""
import json
import lzma
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import report, schema
from sglang_specprof.table import format_summary

DATA = Path(__file__).resolve().parent / "data" / "exact"
RUNS = sorted(p for p in DATA.iterdir() if (p / "check.json").is_file())
V2_GRAPH = {"draft_prep", "draft_inputs", "draft", "draft_outputs", "tree", "verify_prep", "verify", "accept",
            "draft_extend_prep", "draft_extend", "draft_extend_post"}
V2_EAGER = V2_GRAPH - {"draft_inputs", "draft_outputs"}  # those two exist only around a draft graph replay


def _check(run):
    return json.loads((run / "check.json").read_text())


def _windows(run, name, tmp_path):
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(lzma.decompress((run / f"profile-{name}.jsonl.xz").read_bytes()))
    windows, notes = schema.read(str(path))
    assert notes == []
    return windows


def test_the_runs_cover_both_releases_both_workers_and_the_step_counts():
    seen = {(_check(r)["servers"][n]["steps"], _check(r)["servers"][n]["topk"], r.name.split("-")[0])
            for r in RUNS for n in _check(r)["servers"]}
    assert {s for s, _, rel in seen if rel == "0.5.16"} >= {1, 3, 6, 8}
    assert {s for s, _, rel in seen if rel == "0.5.12"} >= {1, 3, 8}
    assert {k for _, k, _ in seen} >= {1, 4}


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_committed_tokens_are_what_the_clients_received(run):
    loads = [(n, ld) for n, e in _check(run)["servers"].items() for ld in e["loads"]]
    for server, e in _check(run)["servers"].items():  # every server had every kind of load
        names = {ld["load"] for ld in e["loads"]}
        assert names >= {
            "c1-long", "c16-256", "c24-eager", "c16x24x4", "c8-stagger", "c8-abort", "c4-stop"}, server
    for server, ld in loads:
        assert not ld["errors"], (server, ld["load"])
        assert ld["committed_tokens"] == ld["client_decode_tokens"], (server, ld["load"])
    # the cases the counting is for were there: finished requests still in flight, cut tails, aborts
    assert sum(ld["skipped_requests"] for _, ld in loads) > 0 or all(
        _check(run)["servers"][s]["topk"] > 1 for s, _ in loads)
    assert any("abort" in r for _, ld in loads for r in ld["finish_reasons"])
    assert any("stop" in r for _, ld in loads for r in ld["finish_reasons"])


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_one_request_decodes_at_the_clients_rate(run):
    for name, e in _check(run)["servers"].items():
        (ld,) = [x for x in e["loads"] if x["load"] == "c1-long"]
        # every forward eager (0.5.16-e): 1.2% apart, not explained yet (two first-use stalls
        # of 136 and 224 ms sit in the clients' stream; see docs/gpu-runs.md)
        rel = 0.015 if "--disable-cuda-graph" in e.get("extra", []) else 0.01
        if "rate_ratio" in ld:  # recorded from the second run on
            assert abs(ld["rate_ratio"] - 1) <= rel, name
        assert ld["profile_decode_gpu_s"] == pytest.approx(ld["client_span_s"], rel=rel), name


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_no_phase_or_step_is_lost_on_graph_and_eager_paths(run, tmp_path):
    check = _check(run)
    for name, e in check["servers"].items():
        windows = _windows(run, name, tmp_path)
        assert all(w["marks_lost"] == 0 and w["uncut_cycles"] == 0 and w["dropped_cycles"] == 0 for w in windows)
        worker = windows[0]["config"]["worker"]
        # the buckets with a cycle timed by phase (with --speculative-profile-phases-every K, a
        # bucket of a few cycles in a run from before each window timed its first may have none)
        timed = [(k, b) for w in windows for k, b in w["buckets"].items()
                 if b["cycles"] and (b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"])["n"]]
        graph = [b for k, b in timed if int(k.split("-")[0]) <= 16]
        eager = [b for k, b in timed if k == "17-32"]
        assert graph and eager, name
        if worker == "v2":
            assert all(set(b["phases"]) == V2_EAGER for b in eager), name
            # one step, or every forward eager: SGLang drafts without the draft graph
            graphs = e["steps"] > 1 and "--disable-cuda-graph" not in e["extra"]
            assert any(set(b["phases"]) == (V2_GRAPH if graphs else V2_EAGER) for b in graph), name
        # every draft step of the eager path is timed, whatever the step count
        assert all(len(b["draft_steps_gpu_ms"]) == e["steps"] for b in eager if worker == "v2"), name
        assert all(b["graph"]["eager"]["draft"] == b["cycles"] for b in eager), name


@pytest.mark.parametrize("name", ["0.5.16-c", "0.5.16-d"])
def test_decode_rate_matches_the_clients_once_each_load_is_warm(name):
    """With each load sent once first (no first-use stalls in the measured one), the
    profiler's decode tokens/s is the clients' decode-only rate for requests that start
    together, for aborts, and on the eager path above the captured batch sizes."""
    check = _check(DATA / name)
    assert "--warm-each" in check["argv"]
    for server, e in check["servers"].items():
        rates = {ld["load"]: ld["rate_ratio"] for ld in e["loads"]}
        for load in ("c1-long", "c16-256", "c8-abort"):
            assert abs(rates[load] - 1) <= 0.02, (name, server, load)
        assert abs(rates["c24-eager"] - 1) <= 0.035, (name, server)


def test_stalls_are_where_the_device_waited_on_the_host(tmp_path):
    """0.5.16, second run: every stalled phase's host time is within 2% of its GPU time (the
    device followed the host), and the steady windows have none."""
    run = DATA / "0.5.16-b"
    found = 0
    for name in _check(run)["servers"]:
        for w in _windows(run, name, tmp_path):
            for b in w["buckets"].values():
                for p in b["stalled"]["phases"].values():
                    found += 1
                    assert p["host_ms"] >= 0.98 * p["gpu_ms"]
                for ph in b["phases"].values():  # what is left holds no mean far above the median
                    g = ph["gpu_ms"]
                    if g["n"] >= 20:
                        assert g["mean"] <= g["p99"] + 1e-6 or g["max"] < 4 * g["p50"] + 0.5
    assert found >= 10


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_report_reads_the_profiles(run, tmp_path):
    for name in _check(run)["servers"]:
        windows = _windows(run, name, tmp_path)
        summary = report.summarize(windows)
        text = format_summary(summary)
        assert "accounted" not in text and "between cycles" in text
        for key, b in summary["buckets"].items():
            acc = b["accept"]
            assert acc["committed_tokens"] == sum(n * c for n, c in enumerate(acc["histogram"]))
            assert sum(acc["drafts_histogram"]) == acc["verified_requests"]


def test_phases_one_cycle_in_four_with_every_cycle_timed(tmp_path):
    """0.5.16 with the default --speculative-profile-phases-every 4 (graph path and every
    forward eager): every decode cycle is in the cycle figures, about one in four in the
    phase figures, the counts stay exact, and the kernel samples' cycles were timed by phase
    (their events agree with the kernels)."""
    run = DATA / "0.5.16-e"
    check = _check(run)
    for name in check["servers"]:
        windows = _windows(run, name, tmp_path)
        assert {w["config"]["phases_every"] for w in windows} == {4}
        cycles = timed = 0
        for w in windows:
            for b in w["buckets"].values():
                cycles += b["cycles"]
                timed += b["phase_cycle_gpu_ms"]["n"] + sum(e["n"] for e in b["stalled"]["phases"].values()
                                                         if e["n"] and b["stalled"]["cycles"])
                assert b["cycle_gpu_ms"]["n"] + b["stalled"]["cycles"] == b["cycles"]
        assert 0.2 <= timed / cycles <= 0.4, (name, timed, cycles)
        samples = [w["kernels"] for w in windows if w.get("kernels")]
        assert samples and all(k["phases"]["verify"]["events_agree"] for k in samples), name
        assert all(k["coverage"] >= 0.99 for k in samples), name


def _client_rate():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    from client_rate import client_decode_seconds

    return client_decode_seconds


def test_the_clients_decode_time_takes_each_prefill_out_once():
    """The clients' side of the rate, judged again from the recorded chunk times: two arrivals
    close together (15 requests 1.8 ms apart, after one that started 500 ms before) fall in
    one interval of the running requests; it is taken out once, not once per arrival (which
    left no decode time at all)."""
    client = _client_rate()
    ld = next(x for x in _check(DATA / "0.5.16-e")["servers"]["s3k1"]["loads"] if x["load"] == "c16-256")
    assert ld["client_decode_s"] == 0.0  # as recorded, by the estimator before
    again = client([[t / 1000.0 for t in c] for c in ld["chunks_ms"]])
    assert 0.3 < again < ld["client_span_s"] - 0.45  # the 500 ms wait for the arrivals' prefill is out, once


def test_decode_rate_matches_the_clients_for_rounds_too_once_warm():
    """0.5.16, with each load sent once first and the clients' decode time recomputed: 1
    request, 16 together, 24 above the captured sizes and 16 x 24-token rounds agree with the
    profiler's decode time within 2% on both servers (staggered arrivals do not: 12-28%)."""
    client = _client_rate()
    check = _check(DATA.parent / "kernels" / "0.5.16-exact")
    assert "--warm-each" in check["argv"]
    for server, e in check["servers"].items():
        for ld in e["loads"]:
            if ld["load"] in ("c16-256", "c24-eager", "c16x24x4", "c8-abort"):
                mine = client([[t / 1000.0 for t in c] for c in ld["chunks_ms"]])
                assert mine / ld["profile_decode_gpu_s"] == pytest.approx(1.0, abs=0.02), (server, ld["load"])


PARTITIONED = [r for r in RUNS if any("accounted_ratio" in ld for e in _check(r)["servers"].values() for ld in e["loads"])]


@pytest.mark.parametrize("run", PARTITIONED, ids=lambda p: p.name)
def test_the_profilers_gpu_time_is_the_servers_busy_time(run):
    """Decode, drain, prefill and the time beside prefills add up to the time the server was
    busy as its clients saw it (each request from its send to its last token): nothing is
    lost between the categories, nothing counted twice. Rounds of short requests leave the
    server idle between them (their sends and first scheduling), so their clients' figure is
    a few percent larger."""
    assert len(PARTITIONED) >= 3
    for server, e in _check(run)["servers"].items():
        for ld in e["loads"]:
            if ld["client_busy_s"] < 0.3:  # the 4 stops: 80 ms, sends and HTTP of the same order
                continue
            # c16x24x4: rounds of short requests; c24-eager: 24 sends and one batch of 19 cycles above
            # the captured graphs, 0.968 in the run without a warm-up of 2026-12-07 (25 ms of 0.79 s)
            lo = {"c16x24x4": 0.92, "c24-eager": 0.96}.get(ld["load"], 0.97)
            assert lo <= ld["accounted_ratio"] <= 1.01, (run.name, server, ld["load"], ld["accounted_ratio"])
            part = ld["profile_partition_s"]
            assert part["decode_gpu"] == ld["profile_decode_gpu_s"]
            assert ld["admissions"] >= 1 and part["prefill_gpu"] > 0


def test_staggered_arrivals_decode_at_the_clients_rate_once_warm():
    """0.5.16, each load sent once first; the clients' decode time recomputed from the chunk
    times (client_rate.py: a prefill taken out of the three intervals it shows in). One
    request, 8 staggered (twice), 8 with aborts and 16 together agree within 2.5% on the graph
    path, every forward eager and topk 4, and little waits beside the prefills once their
    shapes have run."""
    client = _client_rate()
    check = _check(DATA / "0.5.16-g")
    assert "--warm-each" in check["argv"]
    for server, e in check["servers"].items():
        loads = {ld["load"]: ld for ld in e["loads"]}
        for name in ("c1-long", "c8-stagger", "c8-stagger-again", "c8-abort", "c16-256"):
            ld = loads[name]
            mine = client([[t / 1000.0 for t in c] for c in ld["chunks_ms"]])
            assert mine / ld["profile_decode_gpu_s"] == pytest.approx(1.0, abs=0.025), (server, name)
        again = loads["c8-stagger-again"]
        assert again["profile_partition_s"]["beside_prefill_gpu"] / again["admissions"] < 0.005, server


def test_first_use_of_prefill_shapes_is_time_beside_the_prefills():
    """0.5.16 without a warm-up: the first staggered load waited 0.26 s beside its prefills
    (the host compiling for new shapes, the device idle) on the graph path, the same load
    again 0.02 s; that time is neither decode nor prefill time, and the decode rate of the
    second agrees with the clients' within 1%."""
    client = _client_rate()
    loads = {ld["load"]: ld for ld in _check(DATA / "0.5.16-f")["servers"]["s3k1"]["loads"]}
    first, again = loads["c8-stagger"], loads["c8-stagger-again"]
    assert first["profile_partition_s"]["beside_prefill_gpu"] > 5 * again["profile_partition_s"]["beside_prefill_gpu"]
    mine = client([[t / 1000.0 for t in c] for c in again["chunks_ms"]])
    assert mine / again["profile_decode_gpu_s"] == pytest.approx(1.0, abs=0.01)


def test_prefill_first_scheduling_is_one_admission():
    """0.5.12 v2, 16 requests 40 ms apart: SGLang prefilled each as it came and decoded none
    until the last had arrived (every request's second token after the last first token).
    The profiler saw one admission (16 prefills, then the decode cycles); the clients' stream
    holds no decode interval beside an arrival, so their estimate has nothing to go on."""
    ld = next(x for x in _check(DATA / "0.5.12-b")["servers"]["s3k1"]["loads"] if x["load"] == "c16-stagger")
    firsts = [c[0] for c in ld["chunks_ms"]]
    assert min(c[1] for c in ld["chunks_ms"]) > max(firsts)
    assert ld["admissions"] == 1 and ld["difference"] == 0
    assert ld["accounted_ratio"] == pytest.approx(1.0, abs=0.015)
