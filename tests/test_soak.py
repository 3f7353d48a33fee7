"""bench/soak.py's analysis on synthetic data (no GPU), and the soak itself against the stand-in server."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import fakes  # noqa: F401  (puts overlay/ on the path)
from sglang.specprof.jsonl import JsonlSink  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import soak  # noqa: E402


def _series(slope_mb_min, seconds=600, every=10, noise=0.5, seed=0, start=2300.0):
    rng = random.Random(seed)
    return [(t, start + slope_mb_min * t / 60.0 + rng.gauss(0, noise)) for t in range(0, seconds + 1, every)]


def test_fit_slope_recovers_a_known_slope_and_leaves_the_warmup_out():
    pts = _series(0.5)
    # the first minute climbs fast (graphs, allocator pools): 300 MB that --warmup-s leaves out
    pts = [(t, y + (300.0 * t / 60.0 if t < 60 else 300.0)) for t, y in pts]
    f = soak.fit_slope(pts, warmup_s=60)
    assert f["n"] == 55 and f["slope"] == pytest.approx(0.5, abs=0.08)
    assert f["ci95"][0] < 0.5 < f["ci95"][1] and f["ci95"][1] - f["ci95"][0] < 0.2
    with_warmup = soak.fit_slope(pts, warmup_s=0)
    assert with_warmup["slope"] > 1.0  # the climb, had it been kept


def test_fit_slope_widens_its_interval_for_memory_that_moves_in_steps():
    rng = random.Random(3)
    level, pts = 2000.0, []
    for t in range(0, 601, 10):  # a flat trend, and steps that stay: correlated residuals
        if rng.random() < 0.1:
            level += rng.choice((-20.0, 20.0))
        pts.append((t, level + rng.gauss(0, 0.5)))
    f = soak.fit_slope(pts)
    assert f["lag1_autocorr"] > 0.5
    plain, adj = f["ci95_plain"], f["ci95"]
    assert adj[1] - adj[0] > 1.5 * (plain[1] - plain[0])
    assert soak.fit_slope(pts[:2])["ci95"] is None and soak.fit_slope([])["slope"] is None


def test_the_verdict_tells_a_faster_growing_on_server_from_an_equal_one():
    off = soak.fit_slope(_series(0.5, seed=1))
    same = soak.fit_slope(_series(0.5, seed=2))
    faster = soak.fit_slope(_series(2.5, seed=2))
    v_same = soak.rss_verdict(same, off, soak.slope_difference(same, off))
    assert v_same["on_within_off"] and v_same["difference_interval_holds_zero"]
    d = soak.slope_difference(faster, off)
    assert d["diff"] == pytest.approx(2.0, abs=0.1) and d["ci95"][0] > 0
    v = soak.rss_verdict(faster, off, d)
    assert not v["on_within_off"] and v["excess_mb_per_hour"] == pytest.approx(120, abs=6)
    assert v["bounded_mb_per_hour"] > v["excess_mb_per_hour"]


def _window(i, committed=None, **over):
    w = {"schema": "sglang-specprof/2", "window": i, "rank": 0, "time": 1000.0 + i, "dropped_cycles": 0,
         "steps_lost": 0, "marks_lost": 0, "backlog_dropped": 0, "uncut_cycles": 0,
         "totals": {"committed_tokens": 100 * (i + 1) if committed is None else committed},
         "kernel_samples": {"taken": i // 3, "skipped": 0}, "pad": "x" * 400}
    w.update(over)
    return w


def test_every_rotation_is_kept_and_counted_and_without_the_copies_the_loss_shows(tmp_path):
    path = str(tmp_path / "on.jsonl")
    sink = JsonlSink(path, max_bytes=20_000)  # about 40 windows a file: several rotations
    archive = soak.RotationArchive(path, str(tmp_path / "rotated"))
    for i in range(300):
        sink(_window(i))
        archive.poll()
    assert sink.rotations >= 5 and archive.copies == sink.rotations
    assert not archive.poll()  # the same PATH.1: no second copy
    read = soak.read_windows(soak.profile_files(path, str(tmp_path / "rotated")))
    acc = soak.window_accounting(read, published_last=299)
    assert acc["windows"] == 300 and acc["repeated"] == 0 and acc["missing"] == 0
    assert acc["missing_at_end"] == 0 and acc["lost_total"] == 0 and len(acc["files"]) == sink.rotations + 1
    assert acc["kernel_samples"] == {"taken": 99, "skipped": 0}
    # what the writer alone keeps (PATH.1 and PATH): the windows of the earlier rotations are gone
    kept = soak.window_accounting(soak.read_windows(soak.profile_files(path)), published_last=299)
    assert kept["windows"] < 100 and kept["missing_before_first"] > 200 and kept["lost_total"] > 200
    samples = [{"t": 0, "jsonl": {"bytes": 5000, "rotated_bytes": 19_900, "rotations": 6}},
               {"t": 10, "jsonl": {"bytes": 19_990, "rotated_bytes": 19_900, "rotations": 7}}]
    j = soak.analyse(samples, 0, cap_bytes=20_000)["jsonl"]
    assert j["rotations"] == 7 and j["max_bytes_on_disk"] == 39_890 and j["within_twice_the_cap"]


def test_a_cut_last_line_is_counted_not_fatal_and_gaps_and_losses_are_found(tmp_path):
    a, b = tmp_path / "p.jsonl.1", tmp_path / "p.jsonl"
    a.write_text("".join(json.dumps(_window(i)) + "\n" for i in (0, 1, 2)) + "not json\n"
                 + json.dumps(_window(3)) + "\n")
    cut = json.dumps(_window(7))
    b.write_text("".join(json.dumps(_window(i)) + "\n" for i in (4, 6))
                 + json.dumps(_window(6)) + "\n" + cut[: len(cut) // 2])
    read = soak.read_windows([str(a), str(b)])
    assert read["torn"] == ["p.jsonl:4"] and read["bad"] == ["p.jsonl.1:4"]
    acc = soak.window_accounting(read, published_last=8)
    assert acc["windows"] == 6 and acc["repeated"] == 1 and acc["missing_first"] == [5]
    assert acc["missing_at_end"] == 2  # 7 (cut) and 8 are in no file
    assert acc["lost_total"] == 1 + 2 + 1 + 1  # the gap, the end, the cut line, the bad one
    # the counters as the last window has them count as lost too
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps(_window(0)) + "\n" + json.dumps(_window(1, dropped_cycles=3, backlog_dropped=1)) + "\n")
    acc = soak.window_accounting(soak.read_windows([str(c)]))
    assert acc["counters"]["dropped_cycles"] == 3 and acc["lost_total"] == 4


def test_the_logs_warnings_are_counted_and_kept_once_each(tmp_path):
    log = tmp_path / "server-on.log"
    lines = []
    for i in range(30):
        lines.append(f"[2026-12-05 10:00:{i:02d} TP0] speculative profile\n")  # the window table: no warning
        lines.append(f"[2026-12-05 10:00:{i:02d} TP0] Decode batch, #running-req: {i}, token usage: 0.{i}\n")
    lines.append("[2026-12-05 10:01:00 TP0] speculative profile: cannot append to /x/on.jsonl (No space); "
                 "profiling goes on\n")
    for i in range(3):  # the same warning, its numbers aside
        lines.append(f"[2026-12-05 10:02:0{i}] WARNING:  Invalid HTTP request received after {i + 1} s.\n")
    lines.append("/site/torch/x.py:12: UserWarning: The given NumPy array is not writable\n")
    for i in range(25):
        lines.append(f"[2026-12-05 10:03:00] WARNING: distinct case {chr(65 + i)}\n")
    lines += ["Traceback (most recent call last):\n", "RuntimeError: CUDA error\n"]
    log.write_text("".join(lines))
    got = soak.scan_log(str(log))
    assert got["warnings"] == 1 + 3 + 1 + 25 and got["profiler_warnings"] == 1
    assert got["distinct_warnings"] == 1 + 1 + 1 + 25 and len(got["warnings_first"]) == 20
    first = got["warnings_first"]
    assert first[0]["line"].startswith("speculative profile: cannot append") and first[1]["count"] == 3
    assert got["errors"] == 2 and got["distinct_errors"] == 2
    assert soak.scan_log(str(tmp_path / "none.log")) == {"log": None}


def test_tokens_are_exact_only_when_the_profile_counts_what_the_clients_got():
    t = soak.token_check(900, {"committed_tokens": 100}, {"committed_tokens": 1000}, 1000)
    assert t["exact"] and t["difference"] == 0 and t["jsonl_total_matches_server_info"]
    t = soak.token_check(900, {"committed_tokens": 100}, {"committed_tokens": 1003}, 990)
    assert not t["exact"] and t["difference"] == 3 and not t["jsonl_total_matches_server_info"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_soak_runs_both_servers_at_once_against_the_stand_in(tmp_path):
    env = dict(os.environ, SPECPROF_BENCH_LAUNCH="fake_sglang_server",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "overlay")]))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--out", str(tmp_path),
                           "--logs", str(tmp_path / "logs"), "--seconds", "5", "--sample-s", "1", "--warmup-s", "1",
                           "--concurrency", "4", "--prompt", "50", "60", "--new", "20", "40", "--tag=-t"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = tmp_path.glob("soak-*-t.json")
    r = json.loads(path.read_text())
    assert r["complete"] and r["command"].startswith("python bench/soak.py ") and "OUT/logs" in r["command"]
    assert len(r["samples"]) >= 6 and r["samples"][0]["t"] < 0
    for n in ("on", "off"):
        last = r["samples"][-1][n]
        # the stand-in runs in one process: its launcher is the "scheduler"
        assert last["found_by"] == "launcher" and last["sched_rss_mb"] > 5 and last["requests"] > 0
        assert r["clients"][n]["errors"] == 0 and r["analysis"][n]["rss_mb_per_min"]["n"] >= 4
    w = r["analysis"]["windows"]
    assert w["windows"] > 0 and w["first"] == 0 and w["missing"] == 0 and w["torn_lines"] == []
    assert w["published_last"] == w["last"]
    assert r["analysis"]["tokens"]["profile_committed_tokens"] > 0
    t = r["analysis"]["tokens"]
    # the stand-in never idles, so its open window stays open: the JSONL's total is behind
    assert 0 < t["jsonl_last_total"] <= t["profile_committed_tokens"] + 10**9 and "exact" in t
    assert "on - off" in proc.stdout and "windows" in proc.stdout


def test_the_excess_is_given_per_kernel_sample_and_per_event_torch_recorded(tmp_path):
    """2 MB a minute more on the on server over 10 minutes, 10 samples of 1000 events: 2 MB a
    sample, about 2 KB an event."""
    path = tmp_path / "on.jsonl"
    lines = []
    for i in range(30):
        over = {"kernel_samples": {"taken": (i + 1) // 3, "skipped": 0, "max": 100}}
        if i % 3 == 2:
            over["kernels"] = {"records": 1000, "cycles": 4}
        lines.append(json.dumps(_window(i, **over)))
    path.write_text("\n".join(lines) + "\n")
    read = soak.read_windows([str(path)])
    samples = [{"t": t, "on": {"sched_rss_mb": 1000 + 2.0 * t / 60}, "off": {"sched_rss_mb": 1000.0 + (t % 20) * 1e-3}}
               for t in range(0, 601, 10)]
    out = soak.analyse(samples, 0, read=read)
    assert out["windows"]["kernel_records"] == 10_000 and out["windows"]["kernel_blocks"] == 10
    assert out["rss_excess_per_kernel_sample_kb"] == pytest.approx(2 * 1024, rel=0.01)
    assert out["rss_excess_per_kernel_record_b"] == pytest.approx(2 * 1024 * 1024 / 1000, rel=0.01)


def test_the_slopes_after_the_kernel_sample_limit_are_fitted_apart():
    """The on server grows 6 MB a minute while it takes kernel samples and not after its limit
    (reached at window 40, 200 s into the load): over the whole run it grows faster than off,
    after the limit it does not."""
    t_epoch = 10_000.0
    windows = [{"window": i, "rank": 0, "time": t_epoch + 5.0 * i,
                "kernel_samples": {"taken": min(i // 4, 10), "skipped": 0, "max": 10}} for i in range(120)]
    samples = []
    for t in range(0, 601, 10):
        on = 1000 + 6.0 * min(t, 200) / 60 + (t % 30) * 1e-2
        samples.append({"t": t, "epoch": t_epoch + t, "on": {"sched_rss_mb": on},
                        "off": {"sched_rss_mb": 1000.0 + (t % 20) * 1e-2}})
    read = {"windows": [dict(w, file="p", closed_idle=False, committed_tokens=None, kernels=None,
                             kernel_records=None) for w in windows], "lines": 120, "torn": [], "bad": [], "files": []}
    out = soak.analyse(samples, 0, read=read)
    assert out["rss_slope_on_minus_off"]["diff"] > 1.0  # the whole run: the samples' growth shows
    after = out["after_kernel_limit"]
    assert after["limit_epoch"] == t_epoch + 200 and after["from_t"] == 230
    assert abs(after["on_rss_mb_per_min"]["slope"]) < 0.1 and after["verdict"]["on_within_off"]
    assert soak.after_kernel_limit(samples, [dict(w, kernel_samples={"taken": 3, "max": 10}) for w in windows]) is None
