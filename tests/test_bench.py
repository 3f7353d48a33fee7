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
    out = run("advisor_check.py", tmp_path, "--sglang", "0.5.12", "--acc", "2.5", "--steps", "1", "2", "3", "--profile-steps", "3",
              "--concurrency", "1", "4", "--rounds", "3", "--new-tokens", "160",
              "--publish", "--publish-to", str(tmp_path / "advisor_error.json"))
    result = json.loads((tmp_path / "advisor-0.5.12-acc2.5.json").read_text())
    published = json.loads((tmp_path / "advisor_error.json").read_text())  # this run's error, for the package
    assert set(published["by_concurrency"]) == {"1", "4"} and published["results"] == ["advisor-0.5.12-acc2.5.json"]
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
    run("overhead.py", tmp_path, "--sglang", "0.5.12", "--rounds", "3", "--concurrency", "2", "--new-tokens", "96")
    r = json.loads((tmp_path / "overhead-0.5.12-c2.json").read_text())
    assert len(r["tok_s_off"]) == len(r["tok_s_on"]) == len(r["ratios"]) == r["rounds"] == 3
    assert r["median_ratio_ci95"][0] <= r["median_ratio"] <= r["median_ratio_ci95"][1]
    assert r["command"].startswith("python bench/overhead.py ") and "OUT" in r["command"]
    assert 0.8 < r["median_ratio"] < 1.2  # the same stand-in both ways


def test_overhead_aa_puts_a_second_unpatched_server_in_the_rotation(tmp_path):
    up = tmp_path / "unpatched"
    up.mkdir()
    run("overhead.py", tmp_path, "--sglang", "0.5.12", "--rounds", "3", "--concurrency", "2", "--new-tokens", "96",
        "--upstream-path", str(up), "--aa", "--shape", "1b", "--start-order", "upstream2,on,upstream,off")
    r = json.loads((tmp_path / "overhead-0.5.12-c2.json").read_text())
    assert r["start_order"] == ["upstream2", "on", "upstream", "off"]
    logs = tmp_path / "logs"  # started in that order: each log begun before the next
    began = [(logs / f"server-{n}.log").stat().st_ctime_ns for n in r["start_order"]]
    assert began == sorted(began)
    assert len(r["tok_s_upstream"]) == len(r["tok_s_upstream2"]) == len(r["ratios_aa"]) == 3
    # the ratios come from the unrounded rates, the recorded rates are rounded to 2 decimals
    assert r["ratios_aa"] == pytest.approx([b / u for b, u in zip(r["tok_s_upstream2"], r["tok_s_upstream"])],
                                           abs=2e-4)
    assert r["median_ratio_aa_ci95"][0] <= r["median_ratio_aa"] <= r["median_ratio_aa_ci95"][1]
    assert len(r["ratios_on_vs_upstream"]) == 3
    v = r["aa_verdict"]  # the other ratios read against the A/A pair's
    assert v["aa_interval"] == r["median_ratio_aa_ci95"]
    assert v["off_vs_upstream_within_aa"] == (v["aa_interval"][0] <= r["median_ratio_off_vs_upstream"]
                                              <= v["aa_interval"][1])
    config = json.loads((tmp_path / "logs" / "models" / "target" / "config.json").read_text())
    assert config["hidden_size"] == 2048 and config["num_hidden_layers"] == 16  # the 1B shape
    # without an unpatched copy there is no A/A pair: one sentence, exit 2, before any server starts
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--aa", "--out", str(tmp_path / "x"),
                           "--logs", str(tmp_path / "x" / "logs")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--aa needs --upstream-path" in proc.stderr
    assert not (tmp_path / "x").exists()
    # a start order that leaves a server out (or names one the run has not): the same
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--start-order", "on,upstream",
                           "--out", str(tmp_path / "x"), "--logs", str(tmp_path / "x" / "logs")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--start-order names on,upstream, but this run starts off,on" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_overhead_on_env_reaches_the_on_server_only(tmp_path):
    """--on-env KEY=VALUE: the `on` server's environment alone (with --off-profile, on / off is the
    cost of what the setting leaves out: here the draft-step events); a value without a key is
    refused before any server starts."""
    run("overhead.py", tmp_path, "--sglang", "0.5.12", "--rounds", "2", "--concurrency", "2", "--new-tokens", "96",
        "--off-profile", "--on-env", "SGLANG_SPECPROF_DRAFT_STEPS=0")
    r = json.loads((tmp_path / "overhead-0.5.12-c2.json").read_text())
    assert r["on_env"] == ["SGLANG_SPECPROF_DRAFT_STEPS=0"] and r["off_profile"] is True
    configs = {}
    for name in ("on", "off"):
        first = (tmp_path / "logs" / f"{name}.jsonl").read_text().splitlines()[0]
        configs[name] = json.loads(first)["config"]
    assert configs["on"].get("draft_steps") is False and "draft_steps" not in configs["off"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--on-env", "=1", "--out",
                           str(tmp_path / "x"), "--logs", str(tmp_path / "x" / "logs")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--on-env takes KEY=VALUE, not '=1'" in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flag, kept, left", [("--no-off", "on", "off"), ("--no-on", "off", "on")])
def test_overhead_without_one_build_runs_three_servers(tmp_path, flag, kept, left):
    """--no-off: on, upstream, upstream2 (on / upstream against the A/A pair); --no-on: off, upstream,
    upstream2 (what the patched build costs with the flag off). Three 8B-shaped servers fit an 80 GB
    GPU where four do not; nothing is read of the server left out, and a run that cannot compare is
    refused before any server starts."""
    up = tmp_path / "unpatched"
    up.mkdir()
    run("overhead.py", tmp_path, "--sglang", "0.5.12", "--rounds", "3", "--concurrency", "2", "--new-tokens", "96",
        "--upstream-path", str(up), "--aa", flag, "--shape", "1b")
    r = json.loads((tmp_path / "overhead-0.5.12-c2.json").read_text())
    assert r["start_order"] == [kept, "upstream", "upstream2"]
    assert not (tmp_path / "logs" / f"server-{left}.log").exists()
    assert f"tok_s_{left}" not in r and "median_ratio" not in r and f"median_ratio_{left}_vs_upstream" not in r
    assert r["rounds"] == len(r[f"tok_s_{kept}"]) == len(r[f"ratios_{kept}_vs_upstream"]) == len(r["ratios_aa"]) == 3
    verdict = {"on": "on_vs_upstream_low_at_or_above_aa_low", "off": "off_vs_upstream_within_aa"}
    assert verdict[kept] in r["aa_verdict"] and verdict[left] not in r["aa_verdict"]
    refused = [[flag]] + ([[flag, "--upstream-path", str(up), "--no-off"], [flag, "--upstream-path", str(up), "--check"]]
                          if flag == "--no-on" else [])
    for args in refused:
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), *args, "--out", str(tmp_path / "x"),
                               "--logs", str(tmp_path / "x" / "logs")], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"{flag} needs --upstream-path" in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "x").exists()


def test_same_process_runs_alternate_on_and_paused_and_confirm_each_switch(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import overhead

    state = {"on": True, "kills": 0}

    def kill(pid, sig):
        assert pid == 4242 and sig == overhead.signal.SIGUSR2
        state["on"] = not state["on"]
        state["kills"] += 1

    monkeypatch.setattr(overhead.os, "kill", kill)
    monkeypatch.setattr(overhead, "http", lambda port, path: {
        "internal_states": [{"speculative_profile": {"enabled": state["on"]}}]})
    monkeypatch.setattr(overhead, "load", lambda *a: None)
    monkeypatch.setattr(overhead, "tok_s", lambda *a: 100.0 if state["on"] else 101.0)
    runs = overhead.paused_runs(1, [4242], 8, 64, rounds=5)
    assert runs == {"on": [100.0] * 5, "off": [101.0] * 5}  # each run in the state it is named for
    assert state["on"] and state["kills"] == 6  # on off | off on | on off | off on | on off, then on again
    log = tmp_path / "server.log"
    log.write_text("x\n[..] speculative profile: SIGUSR2 to pid 4242 pauses it, and the next resumes it\n")
    assert overhead.scheduler_pids(str(log), timeout=1) == [4242]


def test_clock_summary_takes_the_clocks_part_out_of_each_pair():
    sys.path.insert(0, str(ROOT / "bench"))
    import overhead

    class Clocks:  # the SM clock of the run that starts at t
        def during(self, t0, t1):
            return {"sm_mhz": 1980.0 if int(t0) % 3 else 1620.0}

    # tokens/s follows the clock with elasticity 0.5; on is 1% slower than off at equal clocks
    log = []
    for r in range(6):
        for arm, t in (("on", 2 * r), ("off", 2 * r + 1)):
            sm = Clocks().during(t, t)["sm_mhz"]
            log.append((arm, float(t), t + 0.5, 400.0 * (0.99 if arm == "on" else 1.0) * (sm / 1980.0) ** 0.5))
    out = overhead.clock_summary(log, Clocks(), t_ref=0.0)
    assert [r["arm"] for r in out["runs"]] == ["on", "off"] * 6 and out["runs"][0]["t"] == [0.0, 0.5]
    assert out["tok_s_per_sm_clock_elasticity"] == pytest.approx(0.5, abs=0.01)
    assert out["share_of_variance_from_clock"] > 0.95
    raw = sorted(a[3] / b[3] for a, b in zip(log[::2], log[1::2]))
    assert raw[0] < 0.95 or raw[-1] > 1.03  # the clock moves the raw ratios
    assert out["median_ratio_at_equal_clock"] == pytest.approx(0.99, abs=0.002)
    # runs without samples (no nvidia-smi): the runs, and no fit
    class Silent:
        def during(self, t0, t1):
            return {}
    assert set(overhead.clock_summary(log, Silent(), t_ref=0.0)) == {"t_ref_epoch", "runs"}


def test_the_results_are_named_by_the_installed_release(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    from importlib import metadata

    import serving

    monkeypatch.setattr(metadata, "version", lambda name: "0.5.16+specprof.2")
    assert serving.installed_sglang() == "0.5.16"

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert serving.installed_sglang() == "unknown"


def test_hand_overs_times_each_hand_over_and_what_it_folds(tmp_path):
    """`bench/hand_overs.py --cpu`: one hand-over every 16 cycles (a slot and a list each), more
    at the windows' closes; every cycle's slot and list folded once; what the items took is a
    part of what the hand-overs took; no driver call on the CPU's events."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "overlay"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hand_overs.py"), "--cpu", "--cycles", "640",
                           "--wait-us", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["items_median"] == 32 and 640 // 16 <= r["hand_overs"] <= 640 // 16 + 640 // 100 + 2
    items = r["by_item"]
    assert abs(items["slot"]["n"] - 640) <= 16 and abs(items["accept"]["n"] - 640) <= 16
    assert items["close"]["n"] in (6, 7)  # a window of 100 lists
    spent = sum(v["n"] * v["us_each"] for v in items.values())
    assert 0 < spent <= r["hand_over_us_per_cycle"] * 640 * 1.02
    assert r["driver_calls"] == {} and r["driver_calls_per_cycle"] == 0
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "hand_overs.py"), "--cpu", "--cycles", "8"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cycles is 16 or more" in bad.stderr


def test_hand_overs_counts_the_readers_driver_calls():
    """With a backend that reads as the GPU's does (a readiness span, elapsed times), each call is
    counted: a cycle timed whole makes two (its span, the gap before it), one timed by phase
    twelve or so; at K = 4 about 4.8 a cycle."""
    from test_whole_fold import SpanBackend  # (its fakes put overlay/ on the path)

    sys.path.insert(0, str(ROOT / "bench"))
    import hand_overs
    import hook_cost

    from sglang.specprof.profiler import Profiler

    class HeldBackend(SpanBackend):
        def elapsed_held(self, a, b):
            return self.elapsed(a, b)

    b = HeldBackend()
    p = Profiler(b, interval=100, config={"num_steps": 3, "worker": "v2"}, phases_every=4,
                 **hook_cost.reading_kw(Profiler, "outputs"))
    rec = hand_overs.instrument(p)
    hook_cost.run(p, 64, lambda: None, bs=8)
    p.flush()
    hand_overs.reset(rec)
    us = hook_cost.run(p, 320, lambda: None, bs=8)
    r = hand_overs.summary(rec, us, 320)
    calls = r["driver_calls"]
    assert set(calls) == {"elapsed", "span"} and abs(calls["span"]["n"] - 320) <= 16
    assert 4.5 <= r["driver_calls_per_cycle"] <= 5.0, r  # (3 x 2 + 13) / 4 = 4.75


def test_hook_cost_pairs_another_tree_in_one_process(tmp_path):
    """`bench/hook_cost.py --against DIR` times DIR's profiler beside this one's, rep by rep,
    on the CPU's events that cost nothing: every cycle of both read, the reps paired."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "overlay"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hook_cost.py"), "--cpu", "--cycles", "200",
                           "--reps", "3", "--threaded", "--wait-us", "200", "--against", str(ROOT / "overlay")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["cycles_read"] == r["cycles_run"] == 500 + 3 * 200 and r["cycles_untimed"] == 0
    assert r["against_cycles_untimed"] == 0 and len(r["on_minus_against_us"]["reps"]) == 3
    assert [len(v) for v in r["runs_us"].values()] == [3, 3, 3]
    for k in ("off", "on", "against"):  # what came before the wait is a part of the whole
        assert 0 < r["before_wait_us"][k] < r[k]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "hook_cost.py"), "--cpu", "--against", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no sglang/specprof/profiler.py there" in bad.stderr


def test_hook_cost_times_the_servers_way_against_a_reader_thread():
    """`--outputs-thread` (the server's: reading on the scheduler's thread) against the same
    tree with a reader thread, with upstream's GIL-releasing ops between the marks: each
    cycle's whole wall time is timed too, and the reader thread's profiler read every cycle."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "overlay"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hook_cost.py"), "--cpu", "--cycles", "200",
                           "--reps", "2", "--outputs-thread", "--against-reader-thread", "--ops", "1",
                           "--wait-us", "200"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["threaded"] == "outputs" and r["ops"] == 1 and r["against_dir"] == "reader thread"
    assert r["cycles_read"] == r["cycles_run"] == 500 + 2 * 200 and r["against_cycles_untimed"] == 0
    assert set(r["wall_added_us"]) == {"on", "against"} and set(r["wait_late_us"]) == {"off", "on", "against"}
    # a cycle's wall time holds the hooks and the 200 us wait: the wait's overrun is small beside it
    assert all(v > -200 for v in r["wait_late_us"].values())
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "hook_cost.py"), "--cpu", "--wait-kind", "overlap",
                          "--wait-us", "100"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--wait-kind overlap needs a GPU" in bad.stderr


def test_host_sensitivity_spins_at_one_place_at_a_time(tmp_path):
    """`bench/host_sensitivity.py` on the stand-in server, which (as 0.5.12) starts each cycle
    synchronised with the last: 3 ms of host time in `begin` lengthens a cycle of about 6 ms by
    itself, the same at `end` (after the draft's launch) is hidden, and a mark no cycle makes
    costs nothing; the server confirms each place before its run."""
    out = run("host_sensitivity.py", tmp_path, "--sglang", "0.5.12", "--places", "begin", "end", "mark:nothing",
              "--spin-us", "3000", "--concurrency", "1", "--rounds", "4", "--new-tokens", "90")
    r = json.loads((tmp_path / "host-sensitivity-0.5.12-c1.json").read_text())
    assert r["rounds"] == 4 and r["spin_us"] == 3000 and set(r["tok_s"]) == {"none", "begin", "end", "mark:nothing"}
    places = r["places"]
    assert places["begin"]["median_ratio"] < 0.8, out
    assert places["end"]["median_ratio"] > 0.9 and places["mark:nothing"]["median_ratio"] > 0.9, out
    assert r["command"].startswith("python bench/host_sensitivity.py") and "OUT" in r["command"]


def test_profile_marks_sets_phase_timed_cycles_beside_whole_ones(tmp_path):
    """`bench/profile_marks.py`: a bucket's cycles timed whole are its cycles less those timed
    by phase, so their mean comes from the two means and counts; buckets with too few of
    either are left out."""
    windows = []
    for i, (whole, detail) in enumerate([(7.0, 7.04), (7.2, 7.23), (6.9, 6.95)]):
        every_mean = (75 * whole + 25 * detail) / 100
        windows.append({"window": i, "graphs": {"draft_replays": 100 * (i + 1), "steps_read_late": i},
                        "buckets": {
                            "1": {"cycle_gpu_ms": {"mean": every_mean, "n": 100},
                                  "phase_cycle_gpu_ms": {"mean": detail, "n": 25},
                                  "between_cycles_gpu_ms": {"mean": 0.2 + 0.01 * i}},
                            "2": {"cycle_gpu_ms": {"mean": 5.0, "n": 10}, "phase_cycle_gpu_ms": {"mean": 5.1, "n": 3}}}})
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(w) + "\n" for w in windows))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_marks.py"), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert list(r["buckets"]) == ["1"]
    b = r["buckets"]["1"]
    assert b["windows"] == 3 and b["marks_add_us"] == pytest.approx(40.0, abs=0.1)
    assert b["whole_cycle_gpu_ms"] == pytest.approx(7.0, abs=1e-3) and b["between_cycles_gpu_ms"] == 0.21
    assert r["draft_replays"] == 300 and r["steps_read_late"] == 2


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's /proc and two CPUs")
def test_pin_schedulers_gives_each_scheduler_a_cpu_of_its_own():
    """`overhead.py --pin-schedulers`: a server's process named as SGLang names its scheduler is
    found in the server's process group and pinned to one CPU; its other process and this
    thread go to the CPUs left."""
    import time

    sys.path.insert(0, str(ROOT / "bench"))
    import serving

    code = ("import os, subprocess, sys, time\n"
            "kid = subprocess.Popen([sys.executable, '-c', \"open('/proc/self/comm', 'w').write('sglang::schedul')\\n"
            "import time\\ntime.sleep(60)\"])\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    before = os.sched_getaffinity(0)
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            ps = serving.server_processes(proc.pid)
            if len(ps) == 2 and any(serving.is_scheduler(p) for p in ps):
                break
            time.sleep(0.1)
        server = type("S", (), {"proc": proc})()
        pinned = serving.pin_schedulers({"on": server})
        sched = [p for p in serving.server_processes(proc.pid) if serving.is_scheduler(p)]
        assert len(sched) == 1 and os.sched_getaffinity(sched[0]) == {pinned["on"]}
        rest = os.sched_getaffinity(0)
        assert pinned["on"] not in rest and rest and os.sched_getaffinity(proc.pid) == rest
    finally:
        os.sched_setaffinity(0, before)
        os.killpg(proc.pid, 9)
        proc.wait()


def _overhead_result(path, ratios, up=None, **over):
    r = {"benchmark": "overhead", "sglang": "0.5.12", "concurrency": 1, "new_tokens": 256, "same_process": True,
         "machine": "vm: NVIDIA H200", "profiler": "abc123", "ratios": ratios, "date": "2026-12-03",
         "command": "python bench/overhead.py --rounds 3"}
    if up is not None:
        r["ratios_off_vs_upstream"] = up
    r.update(over)
    path.write_text(json.dumps(r))
    return str(path)


def test_pool_puts_the_rounds_of_one_measurement_together_and_refuses_another(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import pool
    import serving

    a = _overhead_result(tmp_path / "a.json", [0.99, 0.995, 1.0], up=[1.0, 1.01, 0.99])
    b = _overhead_result(tmp_path / "b.json", [0.998, 1.002, 0.996, 1.004])
    r = pool.pool([a, b])
    assert r["rounds"] == 7 and r["ratios"] == [0.99, 0.995, 1.0, 0.998, 1.002, 0.996, 1.004]
    assert r["median_ratio"] == 0.998  # the median of all seven, not of the two medians (0.995, 1.0)
    assert r["median_ratio_ci95"][0] <= r["median_ratio"] <= r["median_ratio_ci95"][1]
    assert r["rounds_with_upstream"] == 3 and r["median_ratio_off_vs_upstream"] == 1.0
    assert [f["rounds"] for f in r["pooled_from"]] == [3, 4]
    out = tmp_path / "pooled.json"
    assert pool.main([a, b, "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["goal"] == {"median": 0.997, "low": 0.99, "met": written["median_ratio_ci95"][0] >= 0.99}
    assert str(tmp_path) not in written["pooled_by"]
    # another load, other profiler code, or no fingerprint: refused, and nothing written
    for name, over in (("c8", {"concurrency": 8}), ("other", {"profiler": "def456"}), ("old", {"profiler": None})):
        c = _overhead_result(tmp_path / f"{name}.json", [1.0, 1.0], **over)
        with pytest.raises(pool.Refused):
            pool.pool([a, c])
        assert pool.main([a, c, "--out", str(tmp_path / f"{name}-pooled.json")]) == 1
        assert not (tmp_path / f"{name}-pooled.json").exists()
    assert pool.pool([a, str(tmp_path / "old.json")], same_profiler=True)["rounds"] == 5
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(pool.Refused, match="not a JSON result"):
        pool.pool([a, str(tmp_path / "junk.json")])
    for bad in ([], [1.0, "x"], [1.0, -0.5]):  # a run that stopped before its first round, a damaged file
        with pytest.raises(pool.Refused, match="no rounds"):
            pool.pool([_overhead_result(tmp_path / "bad.json", bad)])

    # the fingerprint is of the profiler the servers import, and follows its files
    pkg = tmp_path / "site" / "sglang" / "specprof"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("raise ImportError('not imported to be found')\n")
    (pkg / "profiler.py").write_text("X = 1\n")
    saved = [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]
    held = {m: sys.modules.pop(m) for m in saved}
    sys.path.insert(0, str(tmp_path / "site"))
    try:
        one = serving.profiler_fingerprint()
        (pkg / "profiler.py").write_text("X = 2\n")
        two = serving.profiler_fingerprint()
    finally:
        sys.path.remove(str(tmp_path / "site"))
        sys.modules.update(held)
    assert one and two and one != two and len(one) == 12


def test_pool_refuses_what_would_count_wrongly_and_pools_many_rounds_fast(tmp_path):
    """An inf ratio was pooled (Infinity written), a list fingerprint a TypeError, deep JSON a
    RecursionError, one file given three times 9 rounds of 3; 200,000 ratios ran past 120 s."""
    import time

    sys.path.insert(0, str(ROOT / "bench"))
    import pool

    a = _overhead_result(tmp_path / "a.json", [0.99, 0.995, 1.0])
    (tmp_path / "inf.json").write_text(json.dumps({"benchmark": "overhead", "ratios": [1.0]}).replace("1.0", "Infinity"))
    with pytest.raises(pool.Refused, match="not a JSON result"):
        pool.pool([a, str(tmp_path / "inf.json")])
    with pytest.raises(pool.Refused, match="not a finite positive number"):
        pool.pool([a, _overhead_result(tmp_path / "bool.json", [True, 1.0])])
    with pytest.raises(pool.Refused, match="fingerprint that is not a string"):
        pool.pool([a, _overhead_result(tmp_path / "list.json", [1.0], profiler=["abc123"])])
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(pool.Refused, match="nested too deep"):
        pool.pool([a, str(tmp_path / "deep.json")])
    with pytest.raises(pool.Refused, match="is .*a.json again \\(the same file\\)"):
        pool.pool([a, a, a])
    (tmp_path / "copy.json").write_text((tmp_path / "a.json").read_text())
    with pytest.raises(pool.Refused, match="the same result"):
        pool.pool([a, str(tmp_path / "copy.json")])
    for path in ("inf.json", "list.json", "deep.json"):
        assert pool.main([a, str(tmp_path / path), "--same-profiler"]) == 1
    import random

    rng = random.Random(3)
    many = [_overhead_result(tmp_path / f"m{i}.json", [rng.gauss(1.0, 0.02) for _ in range(50_000)], date=str(i))
            for i in range(4)]
    t0 = time.monotonic()
    r = pool.pool(many)
    assert time.monotonic() - t0 < 20 and r["rounds"] == 200_000
    lo, hi = r["median_ratio_ci95"]
    assert lo < r["median_ratio"] < hi and hi - lo < 0.001


def test_closed_loop_compares_answers_up_to_each_requests_first_difference(monkeypatch):
    """bench/closed_loop.py's step-0 check: how many requests answered alike, and how many
    tokens agree before each request's first difference (a later agreement does not count)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import closed_loop

    a = [[1, 2, 3, 4], [5, 6, 7], [9, 9]]
    b = [[1, 2, 3, 4], [5, 0, 7], [8, 9]]
    assert closed_loop.same_answers(a, b) == {"requests": 3, "identical": 1, "tokens_before_first_difference": 5,
                                              "tokens": 9}
    assert closed_loop.same_answers([[1, 2, 3]], [[1, 2]]) == {"requests": 1, "identical": 0,
                                                              "tokens_before_first_difference": 2, "tokens": 3}


def test_closed_loop_pairs_the_static_on_the_raised_cap_with_the_capped_server(monkeypatch):
    """With --capped-server 3, each load's analysis holds `3_vs_capped` (the same step count on the raised cap
    against the server at the default cap), round by round, even where 3 is the best static."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import closed_loop

    runs = {"0": [10.0, 11.0, 12.0], "3": [20.0, 22.0, 24.0], "capped": [10.0, 11.0, 8.0], "cost": [19.0, 21.0, 25.0]}
    res = closed_loop.analyse(runs, ["0", "3"], capped=3)
    assert res["best_static"] == 3
    assert res["3_vs_capped"]["median"] == 2.0
    assert res["cost_vs_best_static"]["median"] == round(21 / 22, 4)
    assert "3_vs_capped" not in closed_loop.analyse(runs, ["0", "3"])


def test_sample_memory_fits_each_mode_s_growth_after_the_warm_sessions():
    """bench/sample_memory.py's result: the least-squares MB per session of the samples at
    or after --warm (the first sessions' one-off growth, CUPTI's own buffers, left out)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from sample_memory import slope

    flat_after_warm = [(0, 100.0, 0), (10, 180.0, 0), (30, 200.0, 0), (40, 200.5, 0), (50, 199.5, 0)]
    assert slope(flat_after_warm, warm=30) == pytest.approx(-0.025)
    growing = [(s, 50.0 + 0.4 * s, 0) for s in range(0, 200, 10)]
    assert slope(growing, warm=30) == pytest.approx(0.4)
    assert slope([(0, 1.0, 0), (40, 2.0, 0)], warm=30) is None  # one sample after the warm ones: no slope


def test_the_mimo_v2_dummy_is_dense_full_attention_with_an_mtp_layer_per_step(tmp_path):
    """Multi-layer EAGLE's dummy: SGLang builds one MiMoV2MTP draft per step from the target's
    folder; with hybrid SWA memory off the draft's KV pool is sized from the full-attention
    fields, so the sliding-window ones must be the same, and no layer may be a window or MoE one."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_models import write_mimo_v2

    c = json.loads((Path(write_mimo_v2(str(tmp_path), layers=3, mtp_layers=5)) / "config.json").read_text())
    assert c["architectures"] == ["MiMoV2FlashForCausalLM"] and c["num_nextn_predict_layers"] == 5
    assert c["hybrid_layer_pattern"] == c["moe_layer_freq"] == [0, 0, 0] and c["sliding_window_size"] == -1
    for f in ("num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim"):
        assert c[f"swa_{f}"] == c[f], f


@pytest.mark.parametrize("dspark", [False, True], ids=["dflash", "dspark"])
def test_the_block_drafters_dummies_fit_the_target_they_draft_for(tmp_path, dspark):
    """DFLASH's and DSPARK's dummy drafts (read from SGLang 0.5.16's dflash_utils / dspark_config):
    the target's width, a mask token inside its vocabulary, target layers it has, and, for DSPARK,
    a Markov head and a block one short of the verified tokens (the bonus is the verify's)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_models import SHAPES, write_dflash_draft

    c = json.loads((Path(write_dflash_draft(str(tmp_path), "8b", 8, dspark=dspark)) / "config.json").read_text())
    t = SHAPES["8b"]
    d = c["dflash_config"]
    assert c["hidden_size"] == t["hidden_size"] and c["num_hidden_layers"] == 1
    assert 0 <= d["mask_token_id"] < t["vocab_size"] and d["num_target_layers"] == t["num_hidden_layers"]
    assert all(0 <= i < t["num_hidden_layers"] for i in d["target_layer_ids"])
    if dspark:
        assert c["architectures"] == ["Qwen3DSparkModel"] and c["markov_rank"] > 0 and d["block_size"] == 7
        assert c["markov_head_type"] in ("vanilla", "gated", "rnn")
    else:
        assert c["architectures"] == ["DFlashDraftModel"] and d["block_size"] == 8


def test_each_cycles_host_time_is_written_and_its_long_cycles_placed(tmp_path):
    """`--cycle-times PATH` writes one more run of the null profiler and of the profiler, each
    cycle's microseconds in the hooks and the part before the GPU wait; `bench/cycle_times.py`
    places the long cycles (by index mod 16) and gives the median by index mod K."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cycle_times

    env = dict(os.environ, PYTHONPATH=str(ROOT / "overlay"))
    ct = tmp_path / "ct.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hook_cost.py"), "--cpu", "--cycles", "160",
                           "--reps", "1", "--outputs-thread", "--phases-every", "4", "--cycle-times", str(ct)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(ct.read_text())
    assert d["phases_every"] == 4 and set(d["cycles"]) == {"off", "on"}
    for v in d["cycles"].values():
        assert len(v["us"]) == len(v["before_wait_us"]) == 160
        assert all(0 <= b <= u + 0.01 for b, u in zip(v["before_wait_us"], v["us"]))
    # a made-up run: 1 ms before the wait every 16th cycle, 80 us the other 4th ones, 5 us otherwise; 2 us after
    pre = [1000.0 if i % 16 == 0 else 80.0 if i % 4 == 0 else 5.0 for i in range(64)]
    made = {"phases_every": 4, "cycles": {"on": {"us": [p + 2.0 for p in pre], "before_wait_us": pre}}}
    r = cycle_times.analyse(made)["on"]
    assert r["long_before_wait_by_index_mod_16"] == {0: 4}
    assert r["above"]["300"] == {"cycles": 4, "share_of_time": round(4 * 1002 / (4 * 1002 + 12 * 82 + 48 * 7), 3)}
    assert r["above"]["50"]["cycles"] == 16
    assert r["before_wait_median_by_index_mod_4"] == {0: 80.0, 1: 5.0, 2: 5.0, 3: 5.0}
    assert r["after_wait_mean_us"] == 2.0


def test_servers_are_stopped_after_their_profiles_open_windows_closed(monkeypatch):
    """A profile's open window closes once its server sat idle (settlement.IDLE_CLOSE_S, at the
    next idle housekeeping); the last server of a rotation stops right after its run, so
    `stop_all` waits for that first: a 0.5.16 tree check's last server lost 3568 of its 105322
    tokens without it. A start that failed stops at once."""
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "overlay"))
    import serving
    from sglang.specprof import settlement

    events = []

    class S:
        def stop(self):
            events.append("stop")

    monkeypatch.setattr(serving.time, "sleep", lambda s: events.append(("sleep", s)))
    serving.stop_all({"a": S(), "b": S()})
    assert events == [("sleep", serving.SETTLE_S), "stop", "stop"]
    assert serving.SETTLE_S >= settlement.IDLE_CLOSE_S + 1.0 + 1.0  # the idle close, one loop, a margin
    events.clear()
    serving.stop_all({"a": S()}, settle_s=0)
    assert events == ["stop"]


def test_the_aa_verdict_reads_each_ratio_against_the_aa_interval():
    """The recorded 1B-shaped run of 2026-12-07 at 8 requests: two equal servers 6.6% apart with an
    interval that excludes 1, so the run resolves nothing nearer 1 than 15%; at one request the
    A/A interval holds 1 and is wide (0.811-1.032): on / upstream's low end (0.894) is above its low
    end and off / upstream inside it, which says as little as the interval is wide."""
    sys.path.insert(0, str(ROOT / "bench"))
    import overhead

    got = {}
    for c in (1, 8):
        res = json.loads((ROOT / "bench" / "results" / f"overhead-0.5.16-1b-aa-h200-c{c}-2026-12-07.json").read_text())
        got[c] = overhead.aa_verdict(res)
    assert got[8]["aa_holds_1"] is False and got[8]["aa_spread"] == pytest.approx(0.1537)
    assert "excludes 1" in overhead.aa_verdict_line(got[8]) and "15.4%" in overhead.aa_verdict_line(got[8])
    assert got[1]["aa_holds_1"] and got[1]["on_vs_upstream_low_at_or_above_aa_low"] is True
    assert got[1]["off_vs_upstream_within_aa"] is True
    line = overhead.aa_verdict_line(got[1])
    assert "at or above the A/A's" in line and "within the A/A interval" in line and "18.9%" in line
