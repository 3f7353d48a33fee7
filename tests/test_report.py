"""The offline tools: the advisor's model, report, compare, and their bad input."""
import copy
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import advisor, cli, compare, fit, report, source

DATA = Path(__file__).resolve().parent / "data"
V2 = DATA / "profile-0.5.12-eagle3-v2-topk1.jsonl"
V1 = DATA / "profile-0.5.12-eagle3-v1-topk2.jsonl"


def test_expected_tokens_formula():
    assert advisor.expected_tokens([1.0, 1.0, 0.0], 3) == 3.0
    assert advisor.expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    # beyond the measured positions the last rate carries on
    assert advisor.expected_tokens([0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def story_inputs(growth):
    """A cycle like the one in the story: verify 95% of it (24 ms at 6 tokens), acceptance ~47%."""
    return advisor.Inputs(
        steps=5, batch=1.0,
        phases={"draft_prep": 0.1, "draft": 1.2, "tree": 0.05, "verify": 24.0, "accept": 0.1, "draft_extend": 0.35},
        between_ms=0.2, wall_ms=26.0, step_ms=[0.22, 0.22, 0.22, 0.22, 0.02],
        per_position=[0.7, 0.55, 0.45, 0.4, 0.35], growth=growth)


def test_story_two_steps_beat_five_when_verify_grows_with_tokens():
    # verify measured to grow 2 ms per extra token (MoE experts, TP communication)
    adv = advisor.predict(story_inputs(advisor.Growth(2.0, 1.8, 2.2, "measured")))
    rows = {r["steps"]: r for r in adv["rows"]}
    assert adv["best"] == 2
    assert rows[2]["tokens_per_s"] > rows[5]["tokens_per_s"] * 1.15
    assert adv["expected_gain"] > 0.15
    assert rows[5]["tokens_per_s"] == pytest.approx(1000 * advisor.expected_tokens([0.7, 0.55, 0.45, 0.4, 0.35], 5) / 26.0, rel=1e-3)


def test_flat_verify_favours_more_steps_and_the_bounds_say_so():
    adv = advisor.predict(story_inputs(None))
    assert adv["verify_growth"].startswith("bounded")
    assert adv["best"] >= 5
    assert 2 in adv["within_uncertainty"]  # proportional growth would favour 2: the answer is uncertain
    for r in adv["rows"]:
        assert r["low"] <= r["tokens_per_s"] <= r["high"]


def test_simulated_acceptance_of_three_advises_two_steps():
    windows, _ = report.load(str(V2))
    summary = report.summarize(windows[1:10])  # one request at a time
    adv = report.advise(summary)["1"]
    assert adv["profiled_steps"] == 3 and adv["best"] == 2
    rows = {r["steps"]: r for r in adv["rows"]}
    assert rows[2]["expected_tokens"] == rows[3]["expected_tokens"] == 3.0
    assert rows[3]["tokens_per_s"] == pytest.approx(summary["buckets"]["1"]["tokens_per_s"], rel=0.02)


def dense_points(per_token=0.0, steps=5):
    """Windows of a dense model at 1 and 8 requests: verify = 5 ms + attention over the KV
    tokens (0.0015 ms each) + `per_token` ms for each verified token."""
    pts = []
    for bs in (1, 8):
        for w in range(12):
            ctx = bs * (64 + 80 * w)
            pts.append([bs, ctx, 5.0 + 0.0015 * ctx + per_token * bs * (steps + 1) + 0.01 * (-1) ** w, 100])
    return pts


def test_fit_verify_tells_attention_from_the_cost_of_a_token():
    flat = advisor.fit_verify(dense_points(0.0), 5)
    assert flat.how == "measured" and flat.low == 0.0
    assert flat.per_token == pytest.approx(0.0, abs=2e-3) and flat.high < 5e-3
    moe = advisor.fit_verify(dense_points(0.05), 5)  # each verified token costs 0.05 ms more
    assert moe.how == "measured"
    assert moe.low <= 0.05 <= moe.high and moe.per_token == pytest.approx(0.05, abs=3e-3)


def test_without_context_lengths_the_batch_size_line_only_bounds_the_growth():
    pts = [[bs, None, v, c] for bs, _, v, c in dense_points(0.0)]
    g = advisor.fit_verify(pts, 5)
    assert g.how.startswith("bounded above") and g.per_token == 0.0 and g.low == 0.0
    assert g.high > 0.01  # attention over 8 sequences, read as if it were the tokens' cost
    one_size = [p for p in dense_points(0.0) if p[0] == 1]
    assert advisor.fit_verify(one_size, 5) is None  # one batch size: nothing to fit


def test_several_step_counts_measure_the_growth_without_context_lengths():
    """An adaptive profile without context lengths (as 0.5.16's were): at one number
    of requests the step counts verify different numbers of tokens, so verify time against
    tokens, with a level for each number of requests, measures what a token costs apart
    from what each request's attention costs, which the batch-size line alone mixes up."""
    import random

    rng, pts = random.Random(1), []
    for w in range(60):
        bs, k = (1, 4, 16, 32)[w % 4], 1 + (w // 4) % 5
        ctx = bs * rng.uniform(250, 350)  # attention: the more requests, the more KV read
        pts.append([bs, None, 5.0 + 0.0015 * ctx + 0.009 * bs * (k + 1) + rng.gauss(0, 0.02), 50, k])
    g = advisor.fit_verify(pts, 5)
    assert g.how.startswith("measured across step counts")
    assert g.low <= 0.009 <= g.high and g.per_token == pytest.approx(0.009, abs=4e-3)
    one_count = [p[:4] + [3] for p in pts]  # the same points at one step count: not separable
    assert advisor.fit_verify(one_count, 3).how.startswith("bounded above")
    # a step count of its own for each batch size (upstream's tiers, settled): tokens and
    # requests vary together again, and the growth is not taken as measured
    tiered = [p[:4] + [{1: 5, 4: 4, 16: 2, 32: 1}[p[0]]] for p in pts]
    assert advisor.fit_verify(tiered, 5).how.startswith("bounded above")


def test_acceptance_beyond_the_profile_goes_on_falling_between_its_bounds():
    inp = story_inputs(advisor.Growth(0.0, 0.0, 0.0, "measured"))
    inp.steps, inp.per_position = 2, [0.9, 0.6]  # a_2 / a_1 = 2/3
    rows = {r["steps"]: r for r in advisor.predict(inp)["rows"]}
    # central: 0.6 * 2/3 = 0.4 at position 3, then 0.267; high holds 0.6; low takes 0
    e3 = 1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.4
    assert rows[3]["expected_tokens"] == pytest.approx(e3, abs=1e-4)
    assert rows[4]["expected_tokens"] == pytest.approx(e3 + 0.9 * 0.6 * 0.4 * (0.4 * 2 / 3), abs=1e-4)
    hold = advisor.expected_tokens([0.9, 0.6, 0.6], 3)
    assert rows[3]["high"] == pytest.approx(1000 * hold / rows[3]["cycle_ms"], rel=1e-3)
    assert rows[3]["low"] == pytest.approx(1000 * (1 + 0.9 + 0.54) / rows[3]["cycle_ms"], rel=1e-3)
    inp.per_position = [0.5, 0.8]  # rising: never extrapolated upward, a_2 held
    rows = {r["steps"]: r for r in advisor.predict(inp)["rows"]}
    assert rows[3]["expected_tokens"] == pytest.approx(advisor.expected_tokens([0.5, 0.8, 0.8], 3), abs=1e-4)


def test_a_profile_at_one_step_takes_a_draft_step_to_cost_its_draft_extend():
    """At 1 step no draft step runs the draft model, so none is timed; a step is taken to
    cost what the draft model's extend does (an upper figure: on the H200 0.43 against 0.52
    ms at 1 request), where it was taken to cost nothing and 8 steps came out best."""
    inp = story_inputs(advisor.Growth(0.0, 0.0, 0.0, "measured"))
    inp.steps, inp.step_ms, inp.per_position = 1, [0.02], [0.7]
    rows = {r["steps"]: r for r in advisor.predict(inp)["rows"]}
    assert rows[2]["cycle_ms"] - rows[1]["cycle_ms"] == pytest.approx(0.35, rel=1e-3)  # the draft extend
    assert rows[8]["cycle_ms"] - rows[1]["cycle_ms"] == pytest.approx(7 * 0.35, rel=1e-3)


def test_a_tree_profile_counts_the_draft_tokens_it_verified():
    """topk 2, 5 steps, 10 draft tokens a request: the advice for topk 1 at 5 steps verifies
    6 tokens, 4 fewer than the profile did, and costs 4 tokens' growth less; the cycle as
    profiled (10 tokens) still reproduces the measured one."""
    inp = story_inputs(advisor.Growth(2.0, 2.0, 2.0, "measured"))
    inp.draft_tokens = 10
    rows = {r["steps"]: r for r in advisor.predict(inp)["rows"]}
    extend = 0.35 * (24.0 - 4 * 2.0) / 24.0  # draft extend grows as verify does
    assert rows[5]["cycle_ms"] == pytest.approx(26.0 - 4 * 2.0 - (0.35 - extend), rel=1e-4)
    assert advisor.draft_tokens({"num_steps": 5, "num_draft_tokens": 10}, 5) == 10
    assert advisor.draft_tokens({"num_steps": 5, "num_draft_tokens": 10}, 3) is None  # another step count's bucket
    pts = [[bs, None, 5.0 + 2.0 * bs * 10, 100] for bs in (1, 2, 4)]  # verify grows 2 ms a verified token
    assert advisor.fit_verify(pts, 5, 10).high == pytest.approx(2.0, rel=1e-6)
    assert advisor.fit_verify(pts, 5).high == pytest.approx(2.0 * 10 / 6, rel=1e-6)  # as 6 a request: too steep


def test_a_dense_profile_is_not_talked_out_of_more_steps_by_attention():
    """Verify that grows only with the KV read: the batch-size line would have cut verify at
    fewer steps; the plane sees no growth per token, and predicts the same verify time."""
    inp = story_inputs(advisor.fit_verify(dense_points(0.0), 5))
    inp.per_position = [1.0, 1.0, 1.0, 0.0, 0.0]  # acceptance 4.0
    adv = advisor.predict(inp)
    rows = {r["steps"]: r for r in adv["rows"]}
    assert adv["best"] == 3
    assert rows[3]["cycle_ms"] == pytest.approx(26.0 - 2 * 0.22, abs=0.05)  # two draft steps fewer, verify as is


def test_merge_is_exact_for_counts_and_means():
    windows, _ = report.load(str(V2))
    merged = report.summarize(windows)["buckets"]["1"]
    ones = [w["buckets"]["1"] for w in windows if "1" in w["buckets"]]
    assert merged["cycles"] == sum(b["cycles"] for b in ones)
    assert merged["accept"]["committed_tokens"] == sum(b["accept"]["committed_tokens"] for b in ones)
    n = sum(b["phases"]["verify"]["gpu_ms"]["n"] for b in ones)
    mean = sum(b["phases"]["verify"]["gpu_ms"]["mean"] * b["phases"]["verify"]["gpu_ms"]["n"] for b in ones) / n
    assert merged["phases"]["verify"]["gpu_ms"]["mean"] == pytest.approx(mean, abs=1e-3)
    assert merged["accept"]["per_position"] == pytest.approx([1.0, 1.0, 0.0], abs=0.03)


def run_cli(*argv, capsys):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_report_prints_table_and_advice(capsys):
    code, out, err = run_cli("report", str(V1), capsys=capsys)
    assert code == 0 and err == ""
    assert "EAGLE3 v1 steps=3 topk=2" in out and "    verify " in out and "free_kv" in out
    assert "best topk 1 chain: --speculative-num-steps" in out and "trees at topk 2, the profiled one pruned" in out


def test_report_json(capsys):
    code, out, _ = run_cli("report", str(V2), "--last", "3", "--json", capsys=capsys)
    data = json.loads(out)
    assert code == 0 and data["summary"]["decode_cycles"] == 300 and "3-4" in data["advice"]


def test_truncated_profile_is_reported_and_read(tmp_path, capsys):
    p = tmp_path / "cut.jsonl"
    text = V2.read_text()
    p.write_text(text + text.splitlines()[0][:99])
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 0 and f"{p} line 21 is cut short" in err and "window 0-19" in out


@pytest.mark.parametrize("content, says", [
    ('{"not": "a profile"}\n', "line 1 is not a sglang-specprof/2 window"),
    ("[1, 2, 3]\n", "line 1 is not a sglang-specprof/2 window: not a JSON object"),
    ("", "holds no profile window"),
])
def test_foreign_input_is_one_error_naming_the_line(tmp_path, capsys, content, says):
    p = tmp_path / "x.jsonl"
    p.write_text(V2.read_text().splitlines()[0] + "\n" + content if content else "")
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("sglang-specprof: error: ")
    assert says.replace("line 1", "line 2") in err if content else says in err


def test_missing_file_and_bad_flags(tmp_path, capsys):
    code, _, err = run_cli("report", str(tmp_path / "none.jsonl"), capsys=capsys)
    assert code == 1 and "no such file" in err and "http://" not in err
    code, _, err = run_cli("report", "localhost:30000", capsys=capsys)  # a server's address without the scheme
    assert code == 1 and err.strip().endswith("no such file (a running server is read as http://localhost:30000)")
    code, _, err = run_cli("report", str(V2), "--last", "0", capsys=capsys)
    assert code == 1 and "--last must be 1 or more" in err
    code, _, err = run_cli("report", "http://127.0.0.1:9", capsys=capsys)
    assert code == 1 and "cannot read http://127.0.0.1:9/server_info" in err


def test_compare_with_itself_is_within_noise():
    windows, _ = report.load(str(V2))
    result = compare.compare(windows[11:20], windows[11:20])
    for r in result["buckets"]["3-4"]:
        assert r["delta"] == 0 and r["verdict"] == "no change"
    assert result["settings_differ"] == {} and result["only_in"] == {}


def slower_verify(windows, factor):
    b = copy.deepcopy(windows)
    for w in b:
        w["buckets"]["3-4"]["phases"]["verify"]["gpu_ms"]["mean"] *= factor
    return b


def test_compare_finds_a_slower_verify_and_weighs_it_against_the_drift():
    windows, _ = report.load(str(V2))
    a = windows[11:20]  # verify drifts from 5.9 to 10.8 ms over these windows as the context grows
    rows = {r["metric"]: r for r in compare.compare(a, slower_verify(a, 1.5))["buckets"]["3-4"]}
    assert rows["verify gpu ms"]["verdict"] == "beyond noise"
    assert rows["verify gpu ms"]["relative"] == pytest.approx(0.5, abs=1e-3)
    assert rows["draft gpu ms"]["verdict"] == "no change"  # the same figures: delta 0
    rows = {r["metric"]: r for r in compare.compare(a, slower_verify(a, 1.1))["buckets"]["3-4"]}
    assert rows["verify gpu ms"]["verdict"] == "within noise"  # 10% is inside this run's own spread
    b = slower_verify(a, 1.5)
    few = compare.compare(a[:2], b[:2])["buckets"]["3-4"]
    assert {r["verdict"] for r in few} == {"too few windows to judge", "no change"}
    assert next(r for r in few if r["metric"] == "verify gpu ms")["verdict"] == "too few windows to judge"


def test_the_advisor_line_is_the_advisor_table(capsys):
    """report prints a line per bucket and the advisor's table: the same prediction (the
    line once came from the bucket alone and gave a range the table did not)."""
    import re

    prof = DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl"
    code, out, _ = run_cli("report", str(prof), capsys=capsys)
    assert code == 0
    windows, _ = report.load(str(prof))
    advice = report.advise(report.summarize(windows))
    lines = re.findall(r"advisor: --speculative-num-steps (\d+) predicted ([\d.]+) tok/s \(([^)]*)\)", out)
    assert len(lines) == len(advice) >= 2
    for (steps, tok, rest), adv in zip(lines, advice.values()):
        best = next(r for r in adv["rows"] if r["steps"] == adv["best"])
        assert int(steps) == best["steps"] and float(tok) == pytest.approx(best["tokens_per_s"], abs=0.05)
        if "range" in rest:
            lo, hi = map(float, rest.split("range ")[1].split("-"))
            assert (lo, hi) == (pytest.approx(best["low"], abs=0.05), pytest.approx(best["high"], abs=0.05))
        else:
            assert best["low"] == pytest.approx(best["high"], abs=0.05)


def test_compare_prints_the_figures_report_prints():
    """For the same profile, compare's A column is report's figure (the windows merged with
    their weights), not a plain mean of the window means."""
    windows, _ = report.load(str(V2))
    merged = report.summarize(windows)["buckets"]
    result = compare.compare(windows, windows)
    for key, rows in result["buckets"].items():
        got = {r["metric"]: r["a"] for r in rows}
        b = merged[key]
        for name, p in b["phases"].items():
            assert got[f"{name} gpu ms"] == pytest.approx(p["gpu_ms"]["mean"], abs=1e-3), (key, name)
        assert got["accept length"] == pytest.approx(b["accept"]["mean_length"], abs=1e-3)
        assert got["tokens/s"] == pytest.approx(b["tokens_per_s"], rel=1e-4)
        assert got["cycle wall ms"] == pytest.approx(b["cycle_wall_ms"]["mean"], abs=1e-3)


def test_compare_figures_folded_one_window_at_a_time_are_the_two_pass_ones():
    """A figure's mean and standard error from sums added window by window equal the ones
    computed from all windows' values at once, also for values far from zero with a small
    spread (a tokens/s of 10^6 moving by 0.01) and weights up to 10^200."""
    import math
    import random

    rng = random.Random(7)
    for base, spread, wmax in ((5.0, 1.0, 100.0), (1e6, 0.01, 5000.0), (3.0, 0.5, 1e200), (2.0, 0.0, 10.0)):
        vals = [(base + spread * rng.gauss(0, 1), rng.uniform(1, wmax)) for _ in range(50)]
        f = compare._Figure()
        for v, w in vals:
            f.add(v, w)
        tot = sum(w for _, w in vals)
        m = sum(v * w for v, w in vals) / tot
        k = len(vals)
        se = math.sqrt(sum((w / wmax * (v - m)) ** 2 for v, w in vals) * k / (k - 1)) / (tot / wmax)
        got_m, got_se = f.stat()
        assert got_m == m  # added in the same order
        assert got_se == pytest.approx(se, rel=1e-6, abs=1e-12), (base, spread, wmax)
    one = compare._Figure()
    one.add(4.0, 2.0)
    assert one.stat() == (4.0, None) and compare._Figure().stat() == (None, None)


def test_compare_says_what_it_cannot_compare(capsys):
    """A v1 profile against a v2 one: the settings that differ, the phases only one side has
    and the batch sizes only one side ran are named, not dropped without a word."""
    code, out, _ = run_cli("compare", str(V1), str(V2), capsys=capsys)
    assert code == 0
    wa, _ = report.load(str(V1), keep=compare.fields)
    wb, _ = report.load(str(V2), keep=compare.fields)
    result = compare.compare(wa, wb)
    assert result["settings_differ"]["worker"] == ["v1", "v2"]
    assert "note: the runs differ in their settings (" in out and "worker v1 vs v2" in out
    only = {n for o in result["only_in"].values() for side in o.values() for n in side}
    assert only and "phases only in" in out
    for n in only:
        assert n in out
    shown = {r["metric"].rsplit(" gpu ms", 1)[0] for rows in result["buckets"].values() for r in rows}
    assert not shown & only


def test_a_change_below_the_precision_is_no_change():
    windows, _ = report.load(str(V2))
    a = windows[11:20]
    b = slower_verify(a, 1.00001)  # -0.000 ms: was once "beyond noise"
    rows = {r["metric"]: r for r in compare.compare(a, b)["buckets"]["3-4"]}
    assert rows["verify gpu ms"]["verdict"] == "no change"


def test_console_script_runs_with_only_the_wheel(tmp_path, built_wheel):
    """pip install --no-deps: no torch, no numpy; the command must still read a profile."""
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(built_wheel)],
                   check=True)
    proc = subprocess.run([str(env / "bin" / "sglang-specprof"), "report", str(V2), "--last", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "advisor (profiled at 3 steps" in proc.stdout
    assert "advisor's last measured error: within " in proc.stdout  # the package's data file came along
    proc = subprocess.run([str(env / "bin" / "python"), "-m", "sglang_specprof", "compare", str(V2), str(V1)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "compare A = " in proc.stdout


def test_the_analysis_wheel_installs_with_pip_and_reads_profiles(tmp_path, built_wheel):
    """build.py writes sglang_specprof-V-py3-none-any.whl beside the sglang wheel: a plain
    `pip install` of it (dependencies resolved, none needed) gives the same command; --plot
    without matplotlib says how to get it, and with it draws the figure."""
    from specprof_build import analysis

    import zipfile

    (lite,) = built_wheel.parent.glob("sglang_specprof-*-py3-none-any.whl")
    assert lite.name == f"sglang_specprof-{analysis.version()}-py3-none-any.whl"
    # the sglang wheel's analysis package, file for file
    with zipfile.ZipFile(lite) as a, zipfile.ZipFile(built_wheel) as b:
        mine = {n: a.read(n) for n in a.namelist() if n.startswith("sglang_specprof/")}
        assert mine and mine == {n: b.read(n) for n in b.namelist() if n.startswith("sglang_specprof/")}
        assert "sglang_specprof/advisor_error.json" in mine  # the advisor's published error, beside its code
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    py, cmd = str(env / "bin" / "python"), str(env / "bin" / "sglang-specprof")
    proc = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", str(lite)], capture_output=True, text=True)
    assert proc.returncode == 0 and "ERROR" not in proc.stderr, proc.stderr
    assert subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True).returncode == 0
    proc = subprocess.run([cmd, "report", str(V2), "--last", "2"], capture_output=True, text=True)
    assert proc.returncode == 0 and "advisor (profiled at 3 steps" in proc.stdout, proc.stderr
    proc = subprocess.run([cmd, "report", str(V2), "--plot", str(tmp_path / "f.png")], capture_output=True, text=True)
    assert proc.returncode == 1 and "sglang-specprof[plot]" in proc.stderr
    # with matplotlib there (the tests' own, on the path)
    import matplotlib

    site = os.path.dirname(os.path.dirname(matplotlib.__file__))
    proc = subprocess.run([cmd, "report", str(V2), "--plot", str(tmp_path / "f.png")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=site))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def fake_profile(path, windows=3, bs=2):
    """A profile written by the real profiler and JSONL writer, driven by fake events."""
    from sglang.specprof.jsonl import JsonlSink
    from sglang.specprof.profiler import Profiler
    from test_profiler import run_cycle

    b = FakeBackend()
    p = Profiler(b, interval=10, sink=JsonlSink(str(path)), config={"num_steps": 3, "topk": 1}, clock=b.clock,
                 log_table=False)
    for _ in range(10 * windows + 1):
        run_cycle(p, b, bs=bs, host_scale=0.5)
    return path


def test_report_and_compare_escape_control_characters(tmp_path, capsys):
    """A profile (or a live server's answer) whose phase names or settings hold escape
    sequences is shown with them escaped, in the report, compare and the notes."""
    prof = fake_profile(tmp_path / "p.jsonl")
    text = prof.read_text().replace('"verify"', '"verify\\u001b[2J"').replace('"num_steps"', '"algorithm":"X\\u001b]0;t\\u0007","num_steps"')
    prof.write_text(text + '{"window": 99, "cut')  # a torn last line: a note naming the path
    bad = tmp_path / "p\x1b[31m.jsonl"
    bad.write_text(prof.read_text())
    for argv in (("report", str(bad)), ("compare", str(bad), str(bad))):
        code, out, err = run_cli(*argv, capsys=capsys)
        assert code == 0 and "\x1b" not in out + err and "\x07" not in out + err
        assert "verify\\x1b[2J" in out and "p\\x1b[31m.jsonl" in err
    assert "[X\\x1b]0;t\\x07" in run_cli("report", str(bad), capsys=capsys)[1]


def test_trace_of_sampled_cycles(tmp_path, capsys):
    prof = fake_profile(tmp_path / "p.jsonl")
    out = tmp_path / "trace.json"
    code, _, err = run_cli("report", str(prof), "--trace", str(out), capsys=capsys)
    assert code == 0 and "trace of 24 cycles" in err
    tr = json.loads(out.read_text())
    slices = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "GPU (CUDA events)", "host"}
    cycles = [e for e in slices if e["name"].startswith("cycle bs=2")]
    assert len(cycles) == 2 * 24  # one slice on the GPU track, one on the host track
    gpu_cycles = [e for e in cycles if e["tid"] == 1]
    for c in gpu_cycles:
        inside = [e for e in slices if e["tid"] == 1 and not e["name"].startswith("cycle")
                  and c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 1e-3]
        assert [e["name"] for e in inside] == ["draft_prep", "draft", "tree", "verify", "accept", "draft_extend"]
        assert [e["dur"] for e in inside] == pytest.approx([500, 700, 100, 6000, 300, 1000])
        assert c["dur"] == pytest.approx(8600)
    host_verify = [e for e in slices if e["tid"] == 2 and e["name"] == "verify"]
    assert all(e["dur"] == pytest.approx(3000) for e in host_verify)  # the host ran at half the GPU's pace
    starts = sorted(c["ts"] for c in gpu_cycles)
    assert starts == sorted(set(starts))  # cycles do not sit on top of one another


def test_trace_of_a_profile_without_samples_is_one_error(tmp_path, capsys):
    code, out, err = run_cli("report", str(V2), "--trace", str(tmp_path / "t.json"), capsys=capsys)
    assert code == 1 and "holds no sampled cycles to trace" in err and not (tmp_path / "t.json").exists()


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from sglang_specprof.plot import plot

    windows, _ = report.load(str(V2))
    summary = report.summarize(windows)
    drawn = plot(summary, str(tmp_path / "direct.png"))
    assert drawn["phases"]["verify"] == [summary["buckets"][k]["phases"]["verify"]["gpu_ms"]["mean"] for k in ("1", "3-4")]
    assert drawn["per_position"]["1"] == pytest.approx([1.0, 1.0, 0.0], abs=0.03)
    code, _, err = run_cli("report", str(V2), "--plot", str(tmp_path / "fig.png"), capsys=capsys)
    assert code == 0 and "figure in" in err
    img = matplotlib.image.imread(str(tmp_path / "fig.png"))
    assert img.shape[0] > 1000 and img.shape[1] > 900  # a row per panel
    code, _, err = run_cli("report", str(V2), "--plot", str(tmp_path / "no" / "fig.png"), capsys=capsys)
    assert code == 1 and "cannot write" in err
    code, _, err = run_cli("report", str(V2), "--plot", str(tmp_path / "bare"), capsys=capsys)
    assert code == 0 and f"figure in {tmp_path / 'bare.png'}" in err and (tmp_path / "bare.png").is_file()
    code, _, err = run_cli("report", str(V2), "--plot", str(tmp_path / "fig.xyz"), capsys=capsys)
    assert code == 1 and ".xyz is not a figure format" in err and "Traceback" not in err


@pytest.mark.parametrize("acc", ["2.5", "4.0"])
def test_advisor_reproduces_its_recorded_gpu_validation(tmp_path, acc):
    """The steps-5 profile of a GPU run against the tokens/s measured at steps 1-5 in the same
    run (bench/results/advisor-0.5.12-accA.json): the pick is the fastest measured setting
    and every prediction is within 10%. A change to the model that breaks this fails here."""
    import lzma

    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    profile = tmp_path / "steps5.jsonl"
    profile.write_bytes(lzma.decompress((results / "profiles" / f"advisor-0.5.12-acc{acc}-steps5.jsonl.xz").read_bytes()))
    recorded = json.loads((results / f"advisor-0.5.12-acc{acc}.json").read_text())
    windows, _ = report.load(str(profile))
    advice = report.advise(report.summarize(windows))
    for c, v in recorded["concurrency"].items():
        adv = advice[v["bucket"]]
        measured = {s["steps"]: s["measured_median"] for s in v["settings"]}
        assert adv["best"] == max(measured, key=measured.get), (c, adv["best"])
        for row in adv["rows"]:
            if row["steps"] in measured:
                assert row["tokens_per_s"] == pytest.approx(measured[row["steps"]], rel=0.10), (c, row)


def test_a_gpu_profile_with_context_lengths_measures_no_growth_per_token_on_a_dense_model(tmp_path):
    """0.5.12 on the GPU machine, 8B-shaped dense target at 1 and 8 requests, 5 steps: verify
    grows with the context it attends over, not with the tokens it verifies. Its slope with
    the context differs between 1 and 5-8 requests (attention runs wider with more of them),
    so the plane through tokens and context only bounds the growth: still near nothing."""
    import lzma

    results = Path(__file__).resolve().parent.parent / "bench" / "results" / "profiles"
    profile = tmp_path / "p.jsonl"
    profile.write_bytes(lzma.decompress((results / "advisor-0.5.12-acc4.0-steps5.jsonl.xz").read_bytes()))
    windows, _ = report.load(str(profile))
    summary = report.summarize(windows)
    assert summary["buckets"]["1"]["context_tokens"]["mean"] > 64
    adv = report.advise(summary)["5-8"]
    assert adv["verify_growth"].startswith("bounded above by batch sizes at one step count")
    assert not fit.context_slopes_agree([(p[0] * 6, p[1], p[2], p[3], p[0], 5) for p in summary["verify_points"]])
    central, low, high = adv["verify_ms_per_token"]
    assert low == 0.0 and central < 0.005 and high < 0.01


def test_a_016_gpu_profile_splits_the_draft_graph():
    windows, _ = report.load(str(DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl"))
    b = report.summarize(windows)["buckets"]["1"]
    assert list(b["phases"])[:4] == ["draft_prep", "draft_inputs", "draft", "draft_outputs"]
    steps = sum(s["mean"] for s in b["draft_steps_gpu_ms"])
    # the replay is the draft steps plus what the graph does before the first step event
    assert steps <= b["phases"]["draft"]["gpu_ms"]["mean"] <= steps * 1.15


def _long_profile(path, windows, source=None, offset=0):
    lines = [json.loads(x) for x in open(source or V2) if x.strip()]
    with open(path, "w") as f:
        for n in range(windows):
            f.write(json.dumps(dict(lines[(n + offset) % len(lines)], window=n)) + "\n")
    return path.stat().st_size


def test_a_long_profile_is_merged_as_it_is_read(tmp_path):
    """The report holds the merge, not the windows: reading a profile of 600 windows (2 MB)
    peaks under the file's size (the windows held as dicts took 10 times it), and `--last 1`
    under a quarter of it."""
    import tracemalloc

    path = tmp_path / "long.jsonl"
    size = _long_profile(path, 600)
    tracemalloc.start()
    try:
        for last, most in ((1, size / 4), (None, size)):
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            merge = report.Merge()
            for w in report.stream(str(path), last):
                merge.add(w)
            cycles = merge.result()["decode_cycles"]
            peak = tracemalloc.get_traced_memory()[1] - base
            del merge, w
            assert peak < most, (last, peak, size)
            assert cycles == (600 if last is None else 1) * 100
    finally:
        tracemalloc.stop()


def test_compare_of_two_long_profiles_holds_less_than_the_report_of_one(tmp_path, capsys):
    """compare folds each profile into a few sums per bucket and figure as it reads it: two
    profiles of 150 windows peak below what `report` of one needs (it held every window's
    figures of both: 2.5 times the report's peak), and the comparison is the one of the
    windows held in lists."""
    import tracemalloc

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _long_profile(a, 150, DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl")
    _long_profile(b, 150, DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl", offset=7)
    peaks = {}
    for argv in (("report", str(a)), ("compare", str(a), str(b), "--json")):
        tracemalloc.start()
        try:
            code = cli.main(list(argv))
            peaks[argv[0]] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert code == 0
        out = capsys.readouterr().out
    assert peaks["compare"] < peaks["report"], peaks
    wa, wb = (report.load(str(p), keep=compare.fields)[0] for p in (a, b))
    assert json.loads(out) == json.loads(json.dumps(compare.compare(wa, wb)))
    rows = [r for rows in json.loads(out)["buckets"].values() for r in rows]
    assert rows and max(r["windows"][0] for r in rows) > 80


@pytest.mark.full  # 12 s on 2 cores; the test above is its quick form
def test_compare_of_two_profiles_peaks_no_higher_than_the_report_of_one(tmp_path):
    """The peak resident memory of `compare A B` (two profiles of 2,000 windows, 18 MiB each) in
    a process of its own, against `report A`'s: no more than 4 MiB above it (23 MiB against 28 on the 2-core
    CI machine; it was 55, each profile's windows held)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _long_profile(a, 2000, DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl")
    _long_profile(b, 2000, DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl", offset=7)
    code = ("import resource, subprocess, sys; "
            "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = dict(os.environ, PYTHONPATH=str(Path(cli.__file__).resolve().parent.parent))
    peak = {}
    for argv in (("report", str(a)), ("compare", str(a), str(b))):
        out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "sglang_specprof", *argv],
                             capture_output=True, text=True, env=env, check=True).stdout.split()
        assert out[0] == "0"
        peak[argv[0]] = int(out[1]) / 1024  # MiB
    assert peak["compare"] <= peak["report"] + 4, peak


def test_an_endless_line_or_a_slow_server_is_one_sentence(tmp_path, monkeypatch):
    import socket
    import threading
    import time

    from sglang_specprof import schema

    monkeypatch.setattr(schema, "MAX_LINE", 1 << 16)
    path = tmp_path / "endless.jsonl"
    path.write_text("x" * (1 << 17))  # no newline, ever
    with pytest.raises(schema.ProfileError) as e:  # one sentence: the command prints it, exit 1
        report.load(str(path))
    assert "line 1 is over 0.0625 MiB long" in str(e.value) and "not a profile" in str(e.value)

    # a server that answers one byte a second: the whole answer has URL_SECONDS, not each read
    monkeypatch.setattr(source, "URL_SECONDS", 1.0)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    stop = threading.Event()

    def trickle():
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b" ")
            except OSError:
                break
            time.sleep(0.3)
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(report.SourceError, match="no whole answer within 1.0 s"):
            report.load(f"http://127.0.0.1:{srv.getsockname()[1]}")
    finally:
        stop.set()
        srv.close()
    assert time.monotonic() - t0 < 5


def test_the_trace_of_a_long_profile_draws_its_last_windows(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "TRACE_WINDOWS", 50)
    prof = tmp_path / "long.jsonl"
    _long_profile(prof, 120, DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl")  # its windows keep sampled cycles
    windows, _ = report.load(str(prof))
    want = sum(len(w.get("samples") or []) for w in windows[-50:])
    assert want and want < sum(len(w.get("samples") or []) for w in windows)
    out = tmp_path / "trace.json"
    code, _, err = run_cli("report", str(prof), "--trace", str(out), capsys=capsys)
    assert code == 0 and f"trace of {want} cycles" in err and "the last 50 of 120 windows" in err
    tr = json.loads(out.read_text())
    assert tr["otherData"]["cycles"] == want


def _upstream_adaptive(version="0.5.16"):
    """SGLang's own adaptive_spec_params module from the pinned wheel: the loader and the
    batch-size routing that will read the config (its one sglang import, a log helper, stood in)."""
    import types
    import zipfile

    from conftest import pinned_wheel

    with zipfile.ZipFile(pinned_wheel(version)) as z:
        src = z.read("sglang/srt/speculative/adaptive_spec_params.py").decode()
    line = "from sglang.srt.utils import log_info_on_rank0"
    assert line in src
    mod = types.ModuleType("adaptive_spec_params")
    exec(compile(src.replace(line, "def log_info_on_rank0(logger, msg): logger.info(msg)"), "adaptive_spec_params",
                 "exec"), mod.__dict__)
    return mod


def test_adaptive_config_is_what_sglang_loads_and_routes_each_batch_to_its_bucket(tmp_path, capsys):
    from sglang_specprof.window import bucket_bs, bucket_of

    src = tmp_path / "p.jsonl"
    src.write_bytes(__import__("lzma").decompress((DATA / "exact" / "0.5.16-h" / "profile-s3k1.jsonl.xz").read_bytes()))
    out = tmp_path / "adaptive.json"
    code, stdout, err = run_cli("report", str(src), "--adaptive-config", str(out), capsys=capsys)
    assert code == 0 and "advisor" in stdout  # the report as usual, and the config beside it
    conf = json.loads(out.read_text())
    advice = report.advise(report.summarize(report.load(str(src))[0]))
    assert sorted(int(k) for k in conf if k.isdigit()) == sorted(bucket_bs(k) for k in advice) and len(advice) >= 4
    for key, adv in advice.items():
        steps = conf[str(bucket_bs(key))]["candidate_steps"]
        tok = {r["steps"]: r["tokens_per_s"] for r in adv["rows"]}
        assert adv["best"] in steps and steps == sorted(steps) and min(steps) >= 1
        assert all(tok[s] >= 0.97 * tok[adv["best"]] for s in steps)
        assert all(s in steps for s, t in tok.items() if t >= 0.97 * tok[adv["best"]])
    top = max(s for k, v in conf.items() if k.isdigit() for s in v["candidate_steps"])
    assert f"--speculative-adaptive-config {out} --speculative-num-steps {top} --speculative-num-draft-tokens {top + 1}" in err
    # SGLang's loader takes it, and its router sends each batch size to the tier of its bucket
    up = _upstream_adaptive()
    params = up.AdaptiveSpeculativeParams(initial_steps=3, cfg_path=str(out))
    params.set_cuda_graph_bs([1, 2, 4, 8, 12, 16])
    for bs in range(1, 33):
        key = bucket_of(bs)
        if key in advice:
            assert params._route(bs).candidate_steps == conf[str(bucket_bs(key))]["candidate_steps"], bs
            assert params.get_steps_for_batch(bs) in conf[str(bucket_bs(key))]["candidate_steps"]
    assert up.resolve_candidate_steps_from_config(str(out)) == sorted(
        {s for k, v in conf.items() if k.isdigit() for s in v["candidate_steps"]})


def test_adaptive_config_margin_and_bad_paths(tmp_path, capsys):
    out = tmp_path / "a.json"
    code, _, _ = run_cli("report", str(V2), "--adaptive-config", str(out), "--adaptive-margin", "0", capsys=capsys)
    assert code == 0
    conf = json.loads(out.read_text())
    advice = conf["specprof"]["buckets"]
    assert advice and all(conf[k]["candidate_steps"] == [advice_b["best"]]
                          for k, advice_b in zip([k for k in conf if k.isdigit()], advice.values()))
    code, stdout, err = run_cli("report", str(V2), "--adaptive-config", str(tmp_path / "no" / "a.json"), capsys=capsys)
    assert code == 1 and "advisor" in stdout  # the report is not lost
    assert err.strip().splitlines()[-1] == f"sglang-specprof: error: cannot write {tmp_path / 'no' / 'a.json'}: No such file or directory"
    code, _, err = run_cli("report", str(V2), "--adaptive-config", str(out), "--adaptive-margin", "100", capsys=capsys)
    assert code == 1 and "--adaptive-margin must be at least 0 and below 100" in err


def test_report_says_what_timing_by_phase_adds_to_a_cycle(tmp_path, capsys):
    """With phases in one cycle of 4, each window holds cycles of both kinds: if every event
    costs the GPU 2 us, a cycle timed by phase takes 2 us more for each event it records beyond
    a whole cycle's end (its marks but the last, and its 4 draft-step events), and the report
    says so per bucket; with every phase of every cycle it says nothing (there is nothing to
    set them against)."""
    from sglang.specprof.jsonl import JsonlSink
    from sglang.specprof.profiler import Profiler
    from test_profiler import PHASES, run_cycle

    extra_us = 2.0 * (len(PHASES) - 1 + 4)

    class EventsCost(FakeBackend):
        def record(self, ev):
            self.gpu += 0.002
            super().record(ev)

    def profile(path, every):
        b = EventsCost()
        p = Profiler(b, interval=20, sink=JsonlSink(str(path)), config={"num_steps": 3, "topk": 1}, clock=b.clock,
                     log_table=False, phases_every=every)
        for _ in range(20 * 4 + 1):
            run_cycle(p, b, bs=2, host_scale=0.5)
        p.flush()
        return path

    code, out, _ = run_cli("report", str(profile(tmp_path / "k4.jsonl", 4)), "--json", capsys=capsys)
    m = json.loads(out)["summary"]["buckets"]["2"]["phase_marks_added"]
    assert code == 0 and m["windows"] == 4 and m["gpu_ms"] == pytest.approx(extra_us / 1000, abs=1e-6)
    assert 0 < m["share_of_all"] < extra_us / 1000 / 4
    code, out, _ = run_cli("report", str(tmp_path / "k4.jsonl"), capsys=capsys)
    assert f"bs 2: timing by phase adds {extra_us:.1f} us of GPU time to each cycle it times (median of 4 windows" in out
    code, out, _ = run_cli("report", str(profile(tmp_path / "k1.jsonl", 1)), "--json", capsys=capsys)
    assert json.loads(out)["summary"]["buckets"]["2"]["phase_marks_added"] is None
    code, out, _ = run_cli("report", str(tmp_path / "k1.jsonl"), capsys=capsys)
    assert code == 0 and "timing by phase adds" not in out


def test_a_server_address_is_read_as_given_and_its_errors_are_one_line(tmp_path, capsys):
    """The scheme in any case is a server; a #fragment or ?query is refused (the path after it
    would be lost, and the base address read instead); a redirect loop is one line."""
    import http.server
    import threading

    class Loop(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(301)
            self.send_header("Location", self.path)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loop)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        code, _, err = run_cli("report", base, capsys=capsys)
        assert code == 1 and err.count("\n") == 1, err
        assert f"cannot read {base}/server_info: it redirects in a loop (HTTP 301)" in err
        code, _, err = run_cli("report", base.replace("http://", "HTTP://") + "/", capsys=capsys)
        assert code == 1 and f"cannot read {base}/server_info: it redirects in a loop" in err, err
        for given in (base + "/ok2#frag", base + "/?x=1"):
            code, _, err = run_cli("report", given, capsys=capsys)
            assert code == 1 and err.count("\n") == 1, err
            assert f"{given}: a server's address takes no ?query or #fragment" in err
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_window_the_report_cannot_use_is_named_by_its_ordinal(tmp_path, capsys):
    assert [report.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]
    lines = V2.read_text().splitlines()[:2]
    bad = json.loads(lines[1])
    key = next(iter(bad["buckets"]))
    bad["buckets"][key]["cycle_gpu_ms"]["mean"] = "x"
    path = tmp_path / "p.jsonl"
    path.write_text(lines[0] + "\n" + json.dumps(bad) + "\n")
    code, _, err = run_cli("report", str(path), capsys=capsys)
    assert code == 1 and "(the 2nd read) holds a value the report cannot use" in err, err


def _compressed(path, tmp_path, kind):
    import gzip
    import lzma

    data = path.read_bytes()
    if kind == "zst":
        import zstandard

        packed = zstandard.ZstdCompressor().compress(data)
    else:
        packed = {"xz": lzma.compress, "gz": gzip.compress}[kind](data)
    out = tmp_path / f"{path.name}.{kind}"
    out.write_bytes(packed)
    return out


@pytest.mark.parametrize("kind", ["xz", "gz", "zst"])
def test_compressed_profiles_read_as_the_plain_ones(tmp_path, capsys, kind):
    """report, compare and --trace take an .xz, .gz or .zst profile as they take the plain one
    (they once read its first bytes as a JSON line: "line 1 is not JSON")."""
    prof = DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl"  # its windows keep sampled cycles
    packed = _compressed(prof, tmp_path, kind)
    plain = run_cli("report", str(prof), "--json", capsys=capsys)
    assert run_cli("report", str(packed), "--json", capsys=capsys) == plain and plain[0] == 0
    code, out, err = run_cli("compare", str(packed), str(_compressed(V2, tmp_path, kind)), capsys=capsys)
    want = run_cli("compare", str(prof), str(V2), capsys=capsys)[1]
    assert code == 0 and out.splitlines()[1:] == want.splitlines()[1:] and len(want.splitlines()) > 5
    code, _, err = run_cli("report", str(packed), "--trace", str(tmp_path / "t.json"), capsys=capsys)
    assert code == 0 and "trace of " in err
    assert json.loads((tmp_path / "t.json").read_text())["otherData"]["cycles"] > 0


def test_a_recorded_xz_profile_reads_directly(tmp_path, capsys):
    import lzma

    packed = DATA / "exact" / "0.5.16-h" / "profile-s3k1.jsonl.xz"
    plain = tmp_path / "p.jsonl"
    plain.write_bytes(lzma.decompress(packed.read_bytes()))
    code, out, err = run_cli("report", str(packed), capsys=capsys)
    assert code == 0 and err == "" and out == run_cli("report", str(plain), capsys=capsys)[1]


def test_damaged_or_cut_compressed_profiles_and_zstd_without_its_package(tmp_path, capsys, monkeypatch):
    packed = _compressed(V2, tmp_path, "xz").read_bytes()
    cut = tmp_path / "cut.jsonl.xz"
    cut.write_bytes(packed[: len(packed) // 2])
    code, out, err = run_cli("report", str(cut), capsys=capsys)
    assert code == 0 and "window 0-" in out
    assert err.startswith(f"sglang-specprof: note: {cut} is compressed and cut short: read up to line ")
    bad = tmp_path / "bad.jsonl.xz"
    bad.write_bytes(packed[:200] + b"x" * 64 + packed[264:])
    code, out, err = run_cli("report", str(bad), capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"sglang-specprof: error: {bad} is damaged compressed data at its start")
    zst = _compressed(V2, tmp_path, "zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # the package not installed
    code, out, err = run_cli("report", str(zst), capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "is compressed with zstd, which needs the zstandard package to read: pip install zstandard" in err


def test_a_torn_line_in_the_middle_is_skipped_with_a_note(tmp_path, capsys):
    """A full disk cuts a window's line short and the next window is written on after it, or a
    line is left cut: report skips such a line with a note (it refused the whole file, "line 4
    is not JSON"), reads the window written on after a cut one, and still refuses a file in
    which nothing is a window."""
    lines = V2.read_text().splitlines()
    p = tmp_path / "torn.jsonl"
    p.write_text("\n".join(lines[:3] + [lines[3][:500]] + lines[4:]) + "\n")
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["summary"]["decode_cycles"] == 100 * (len(lines) - 1)
    assert err == f"sglang-specprof: note: {p} line 4 is not JSON (a window cut short, as a full disk leaves); skipped.\n"
    p.write_text("\n".join(lines[:3] + [lines[3][:500] + lines[4]] + lines[5:]) + "\n")  # the next one written on
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["summary"]["decode_cycles"] == 100 * (len(lines) - 1)
    assert err == (f"sglang-specprof: note: {p} line 4 holds a window cut short (a full disk?) and then a whole one; "
                   f"the cut one skipped.\n")
    p.write_text("".join(f"{line[:300]}\n" for line in lines))  # every line cut
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1 and f"{p} line 1 is not JSON" in err
    p.write_text("hello\nworld\n")
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and f"{p} line 1 is not JSON" in err
    many = lines[:1] + [x for line in lines[1:] for x in (line, "garbage")]
    p.write_text("\n".join(many) + "\n")
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 0 and err.count("\n") == 6 and err.splitlines()[-1].endswith(
        f"{len(lines) - 1 - 5} more lines that are not JSON skipped (the last, line {len(many)}).")


@pytest.mark.parametrize("flag", ["--trace", "--adaptive-config", "--plot"])
def test_an_output_that_is_the_input_is_refused(tmp_path, capsys, flag):
    """`report p.jsonl --trace p.jsonl` overwrote the profile it read, exit 0: an output that
    is the input (by another spelling, a link) or another output is refused before anything
    is read or written."""
    prof = tmp_path / "p.jsonl"
    prof.write_bytes(V2.read_bytes())
    (tmp_path / "link.jsonl").symlink_to(prof)
    os.link(prof, tmp_path / "hard.png")
    for out in (prof, tmp_path / "." / "p.jsonl", tmp_path / "link.jsonl", tmp_path / "hard.png"):
        if flag == "--plot" and not str(out).endswith(".png"):
            continue
        code, stdout, err = run_cli("report", str(prof), flag, str(out), capsys=capsys)
        assert code == 1 and stdout == "" and err.count("\n") == 1
        assert f"{flag} {out} is the profile being read" in err
        assert prof.read_bytes() == V2.read_bytes()
    code, stdout, err = run_cli("report", str(prof), "--trace", str(tmp_path / "x.png"), "--plot",
                                str(tmp_path / "x.png"), capsys=capsys)
    assert code == 1 and "--plot and --trace name the same file" in err


def _windows_of(path, n):
    from sglang_specprof import schema

    with schema.open_text(str(path)) as f:
        return [json.loads(x) for x in f if x.strip()][:n]


def _write_windows(path, windows):
    path.write_text("".join(json.dumps(w) + "\n" for w in windows))
    return path


def _renamed(path, n, setting, value, phase):
    """The first `n` windows of `path`, config[setting] = value and the verify phase named `phase`."""
    windows = _windows_of(path, n)
    for w in windows:
        w["config"][setting] = value
        for bk in w["buckets"].values():
            bk["phases"][phase] = bk["phases"].pop("verify")
    return windows


def test_values_that_read_alone_but_not_together_are_one_sentence(tmp_path, capsys):
    """Each window passes on its own; together they tracebacked: a field of another type in a
    later window (TypeError in the merge), --last past what an index holds (OverflowError),
    compare with counts -1 and 1 (ZeroDivisionError)."""
    a, b = _windows_of(DATA / "exact" / "0.5.16-h" / "profile-s3k1.jsonl.xz", 2)
    key = next(k for k in a["buckets"] if k in b["buckets"])
    assert a["buckets"][key]["phases"]["verify"]["gpu_ms"]["max"] is not None
    b["buckets"][key]["phases"]["verify"]["gpu_ms"]["max"] = "x"
    p = _write_windows(tmp_path / "p.jsonl", [a, b])
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"error: {p}: window {b['window']} holds a value of another kind than the windows before it" in err
    code, out, err = run_cli("report", str(V2), "--last", "99999999999999999999", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["summary"]["decode_cycles"] == 100 * len(_windows_of(V2, 99))
    a, b = _windows_of(V2, 2)
    for w, n in ((a, -1), (b, 1)):
        for bk in w["buckets"].values():
            bk["phases"]["verify"]["gpu_ms"]["n"] = n
    p = _write_windows(tmp_path / "c.jsonl", [a, b])
    code, out, err = run_cli("compare", str(p), str(p), capsys=capsys)
    assert code == 0 and "verify gpu ms" in out and "Traceback" not in err
    b["buckets"][next(iter(b["buckets"]))]["tokens_per_s"] = []  # no figure: left out of the comparison
    p = _write_windows(tmp_path / "d.jsonl", [a, b])
    code, out, err = run_cli("compare", str(p), str(p), "--json", capsys=capsys)
    assert code == 0 and "Traceback" not in err


def test_plot_draws_names_with_dollar_signs_as_text(tmp_path, capsys):
    """A "$" in a phase or setting name was parsed as matplotlib math: ValueError, traceback."""
    pytest.importorskip("matplotlib")
    windows = _renamed(V2, 3, "algorithm", "EAGLE $x^$", "w$\\undefined{x}$")
    p = _write_windows(tmp_path / "p.jsonl", windows)
    code, _, err = run_cli("report", str(p), "--plot", str(tmp_path / "f.png"), capsys=capsys)
    assert code == 0 and "figure in" in err and (tmp_path / "f.png").is_file()


def _strict(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_figures_that_overflow_when_merged_are_left_out_with_a_note(tmp_path, capsys):
    """Each window's figures are finite; their sums are not: --json wrote Infinity (not JSON)
    and the text inf and inf%. They are left out (null, "-") with a note naming them."""
    windows = _windows_of(V2, 2)
    for w in windows:
        w["seconds"] = 1.7e308
        for bk in w["buckets"].values():
            bk["phases"]["verify"]["gpu_ms"]["mean"] = 1e306
    p = _write_windows(tmp_path / "p.jsonl", windows)
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)
    s = _strict(out)["summary"]
    assert code == 0 and s["seconds"] is None and s["buckets"]["1"]["phases"]["verify"]["gpu_ms"]["mean"] is None
    assert err.startswith("sglang-specprof: note: 3 figures of the windows merged overflowed") and err.count("\n") == 1
    assert "summary.seconds, summary.buckets.1.phases.verify.gpu_ms.mean" in err
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 0 and "inf" not in out.lower() and "nan" not in out.lower() and "in - s," in out
    code, out, err = run_cli("compare", str(p), str(p), "--json", capsys=capsys)
    assert code == 0 and _strict(out)["overflowed"] == ["bs 1 verify gpu ms"]
    assert "1 figure of the comparison overflowed" in err
    code, out, err = run_cli("compare", str(p), str(p), capsys=capsys)
    assert code == 0 and "inf" not in out.lower() and "nan" not in out.lower() and "draft gpu ms" in out


def test_an_older_profile_says_nothing_of_what_it_did_not_record(capsys, tmp_path):
    """Schema 1 records no GPU period and no max: the report printed "period - ms GPU (-%
    between cycles)" and "(max - ms)"; the graph counts were a Python dict printed raw."""
    code, out, _ = run_cli("report", str(V1), capsys=capsys)
    assert code == 0 and "period" not in out and "(max" not in out and "{" not in out
    assert "  bs 1: 1048 cycles, cycle 13.836 ms GPU, host 13.857 ms, accept len 3.00" in out
    assert "    graph replays: draft 1048, verify 1048, draft_extend 1045; eager: draft 0, verify 0, draft_extend 3; " \
           "padding 0.00" in out
    assert "    mean above p99 in draft_prep, draft, verify_prep: fewer than 1 cycle in 100" in out
    windows = _windows_of(DATA / "exact" / "0.5.16-h" / "profile-s3k1.jsonl.xz", 99)
    code, out, _ = run_cli("report", str(_write_windows(tmp_path / "p.jsonl", windows)), capsys=capsys)
    assert code == 0 and "% between cycles), host " in out and " (max " in out


def test_the_advisor_footnote_states_the_rule_it_extrapolates_by():
    inp = story_inputs(advisor.Growth(0.0, 0.0, 0.0, "measured"))
    inp.steps, inp.per_position = 2, [0.9, 0.6]
    adv = advisor.predict(inp)
    text = advisor.format_advice(adv)
    assert "each further position's rate is the one before it times r, the last measured rate over the one " \
           "before that (r at most 1" in text
    a = advisor.acceptance(inp, 4, advisor.CENTRAL)  # the rule the footnote states, r = 0.6 / 0.9
    assert a == pytest.approx([0.9, 0.6, 0.6 * 2 / 3, 0.6 * (2 / 3) ** 2])
    assert advisor.acceptance(inp, 4, advisor.HIGH) == pytest.approx([0.9, 0.6, 0.6, 0.6])
    inp.per_position = [0.7]
    inp.steps = 1
    assert advisor.acceptance(inp, 3, advisor.CENTRAL) == pytest.approx([0.7, 0.7, 0.7])


def test_what_timing_by_phase_adds_is_not_said_from_too_few_cycles_or_within_noise(capsys, tmp_path):
    """A warm-up bucket of 4 cycles printed "adds 247219.7 us ... 87.12%"; a figure below zero
    or within the windows' noise printed as if measured (-7.1 us)."""
    base = _windows_of(DATA / "exact" / "0.5.16-h" / "profile-s3k1.jsonl.xz", 1)[0]
    key = next(k for k, b in base["buckets"].items() if b["cycles"] >= 20)

    def window(n, timed, whole_ms, timed_ms, number):
        w = copy.deepcopy(base)
        w["window"] = number
        b = w["buckets"][key]
        w["buckets"] = {key: b}
        b["cycle_gpu_ms"] = dict(b["cycle_gpu_ms"], n=n, mean=(whole_ms * (n - timed) + timed_ms * timed) / n)
        b["phase_cycle_gpu_ms"] = dict(b["cycle_gpu_ms"], n=timed, mean=timed_ms)
        return w

    def line(windows):
        p = _write_windows(tmp_path / "m.jsonl", windows)
        code, out, _ = run_cli("report", str(p), capsys=capsys)
        assert code == 0
        return next(x for x in out.splitlines() if "timing by phase" in x)

    warm = line([window(4, 1, 1.0, 248.0, 0)])
    assert "not said: it would rest on 1 cycles timed by phase against 3 timed whole, too few" in warm
    assert "us" not in warm.split("(")[0] and "%" not in warm
    noisy = [window(100, 25, 10.0, 10.0 + d, i) for i, d in enumerate((-0.0071, 0.004, -0.009, 0.0085, -0.002))]
    assert "adds no GPU time to a cycle measurable against the noise" in line(noisy)
    assert "-7.1" not in line(noisy)
    steady = [window(100, 25, 10.0, 10.0 + d, i) for i, d in enumerate((0.031, 0.029, 0.030, 0.032, 0.030))]
    assert "timing by phase adds 30.0 us of GPU time to each cycle it times (median of 5 windows" in line(steady)
    assert "not said" in line(steady[:2]) and "too few to judge it against the noise" in line(steady[:2])


def test_where_timing_by_phase_costs_half_a_percent_the_report_gives_the_k_that_halves_it(capsys):
    """A 1B-shaped server's short cycles (0.5.16, topk 4 tree, one request): timing by phase in one
    cycle of 4 added 131.7 us of GPU time to each cycle it timed, 0.79% of all cycles' time; the
    report says --speculative-profile-phases-every 8 would make it about half. At 9-16 requests
    (0.28%) it says nothing more."""
    from sglang_specprof import render

    code, out, _ = run_cli("report", str(DATA / "tree-check" / "0.5.16-h200-topk" / "profile-4-3-8.jsonl.xz"),
                           capsys=capsys)
    assert code == 0
    lines = {x.split(":")[0]: x for x in out.splitlines() if "timing by phase adds" in x}
    assert "0.79% of all cycles' time; --speculative-profile-phases-every 8 would make it about 0.40%" in lines["bs 1"]
    assert lines["bs 9-16"].endswith("0.28% of all cycles' time")
    m = {"gpu_ms": 0.1, "share_of_all": render.MARKS_SHARE_TO_HALVE, "windows": 9, "judged": "measured"}
    assert "phases-every 16 would make it about 0.25%" in render._marks_line(m, 8)
    assert "phases-every" not in render._marks_line(m)  # K unknown: nothing said of it
    assert "phases-every" not in render._marks_line(dict(m, share_of_all=0.0049), 8)


def test_control_characters_in_a_profile_are_shown_escaped(tmp_path, capsys):
    """A phase name or a setting holding an escape sequence went to the terminal raw (it could
    recolour, retitle or rewrite the screen); a newline in a name made a line of its own."""
    windows = _renamed(V2, 3, "worker", "v2\x1b]0;owned\x07", "ver\x1b[2Jify\nfake line")
    p = _write_windows(tmp_path / "p\x1b[31m.jsonl", windows)
    for argv in (("report", str(p)), ("compare", str(p), str(V2))):
        code, out, err = run_cli(*argv, capsys=capsys)
        assert code == 0
        text = out + err
        assert "\x1b" not in text and "\x07" not in text and "fake line" in text
        assert not any(line.startswith("fake line") for line in text.splitlines())
        assert "ver\\x1b[2Jify\\x0afake line" in text
    assert "v2\\x1b]0;owned\\x07" in run_cli("report", str(p), capsys=capsys)[1]
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)  # JSON escapes them itself
    assert code == 0 and "\x1b" not in out and json.loads(out)["summary"]["config"]["worker"] == "v2\x1b]0;owned\x07"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\x1b[2J not json\n")
    code, out, err = run_cli("report", str(bad), capsys=capsys)
    assert code == 1 and "\x1b" not in err and err.count("\n") == 1


def test_a_bucket_name_that_is_no_batch_size_is_refused(tmp_path, capsys):
    windows = _windows_of(V2, 2)
    windows[1]["buckets"]["1\n"] = windows[1]["buckets"].pop("1")
    code, out, err = run_cli("report", str(_write_windows(tmp_path / "p.jsonl", windows)), capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "'1\\n' is not a batch-size bucket" in err


def test_windows_of_other_runs_are_merged_apart_and_repeats_counted_once(tmp_path, capsys):
    """Ranks 0 and 3, releases 0.5.16 and 0.5.12, 3 and 5 steps were merged into one summary
    under "rank 0"; a window repeated was counted twice."""
    a = _windows_of(V2, 4)
    b = copy.deepcopy(a)
    for w in b:
        w["rank"] = 3
        w["config"].update(sglang="0.5.12-other", num_steps=5)
    p = _write_windows(tmp_path / "p.jsonl", a + b)
    code, out, err = run_cli("report", str(p), capsys=capsys)
    assert code == 0 and err.count("\n") == 1
    assert "note: the profile holds windows of 2 runs that differ in their settings (rank 0 and 3, num_steps 3 and " \
           "5, sglang " in err
    assert out.startswith("== run 1 of 2: rank 0, num_steps 3, sglang ") and "\n== run 2 of 2: rank 3, num_steps 5" in out
    assert "window 0-3 rank 0: 400 decode cycles" in out and "window 0-3 rank 3: 400 decode cycles" in out
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)
    data = json.loads(out)
    assert data["summary"]["decode_cycles"] == 400 and data["summary"]["rank"] == 0
    assert [r["summary"]["rank"] for r in data["other_runs"]] == [3]
    assert data["runs_differ"]["num_steps"] == [3, 5]
    p = _write_windows(tmp_path / "twice.jsonl", a + a)  # a file put together with itself
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["summary"]["decode_cycles"] == 400 and "other_runs" not in out
    assert err == f"sglang-specprof: note: {p}: 4 lines repeat an earlier window exactly (line 5, 6, 7 and 1 more): " \
                  f"counted once.\n"


def test_settings_no_server_runs_with_get_no_advice(tmp_path, capsys):
    """num_steps -2 was advised from: "best: 8 steps"."""
    windows = _windows_of(V2, 3)
    for w in windows:
        w["config"]["num_steps"] = -2
    p = _write_windows(tmp_path / "p.jsonl", windows)
    code, out, err = run_cli("report", str(p), "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["advice"] == {}
    assert err == "sglang-specprof: note: the profile's num_steps is -2, which no server runs with: no step-count " \
                  "advice from it\n"
    code, out, _ = run_cli("report", str(p), capsys=capsys)
    assert code == 0 and "advisor" not in out


def test_a_live_answer_nested_too_deep_or_an_address_with_a_space_is_one_sentence(monkeypatch, capsys):
    """Both raised in the reading thread (its traceback printed) and then KeyError: 'info'."""
    import io
    import threading

    hooked = []
    monkeypatch.setattr(threading, "excepthook", lambda a: hooked.append(a))
    deep = b"[" * 100000 + b"]" * 100000
    monkeypatch.setattr(source.urllib.request, "urlopen", lambda url, timeout=None: io.BytesIO(deep))
    code, out, err = run_cli("report", "http://127.0.0.1:1", capsys=capsys)
    assert code == 1 and err == "sglang-specprof: error: cannot read http://127.0.0.1:1/server_info: its answer is " \
                                "JSON nested too deep to be server info\n"
    monkeypatch.undo()
    for url in ("http://127.0.0.1:1/a b", "http://127.0.0.1:1/\x01", "http://127.0.0.1:1\n"):
        code, out, err = run_cli("report", url, capsys=capsys)
        assert code == 1 and err.count("\n") == 1 and "is not a server's address: it holds a space or a control" in err
    assert not hooked


def test_plot_of_thousands_of_buckets_or_positions_draws_a_bounded_figure(tmp_path):
    """2,000 buckets took 248 s and 700 MB, 3M per-position entries past 300 s: the figure
    draws the buckets with the most cycles and the first positions, and says what it left out."""
    import time

    pytest.importorskip("matplotlib")
    from sglang_specprof import plot as plot_mod

    summary = report.summarize(report.load(str(V2))[0])
    one = summary["buckets"]["3-4"]
    summary["buckets"] = {f"{n}": dict(one, cycles=n) for n in range(1, 2001)}
    summary["buckets"]["7"] = dict(one, cycles=5000, accept=dict(one["accept"], per_position=[0.5] * 3_000_000))
    t0 = time.monotonic()
    drawn = plot_mod.plot(summary, str(tmp_path / "f.png"))
    assert time.monotonic() - t0 < 60 and (tmp_path / "f.png").is_file()
    assert len(drawn["cycle_ms"]) == plot_mod.PLOT_BUCKETS and "7" in drawn["cycle_ms"] and "1" not in drawn["cycle_ms"]
    assert len(drawn["per_position"]["7"]) == plot_mod.PLOT_POSITIONS
    assert drawn["left_out"] == [f"{2000 - plot_mod.PLOT_BUCKETS} of 2000 batch-size buckets (those with the fewest "
                                 f"cycles)", "draft positions past 32 (of 3000000)"]


@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_fifo_is_refused_without_waiting_on_it(tmp_path, command):
    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    argv = [str(fifo)] if command == "report" else [str(V2), str(fifo)]
    proc = subprocess.run([sys.executable, "-m", "sglang_specprof", command, *argv], capture_output=True, text=True,
                          timeout=30, env=dict(os.environ, PYTHONPATH=str(Path(report.__file__).parent.parent)))
    assert proc.returncode == 1 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert f"{fifo} is not a regular file (a FIFO, a device or a socket)" in proc.stderr


def test_compare_help_says_what_each_argument_is(capsys):
    from sglang_specprof import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "the first run's profile" in out and "compared with A" in out and "as JSON" in out


def test_a_trace_or_config_that_cannot_be_written_whole_leaves_nothing_partial(tmp_path, capsys, monkeypatch):
    """A full disk part-way through `--trace` (or `--adaptive-config`): one sentence, no partial
    file where there was none, the file before untouched where there was one."""
    from sglang_specprof import page

    prof = fake_profile(tmp_path / "sampled.jsonl")

    real = page.os.fdopen

    def short(fd, *a, **kw):  # writes 4 KB, then the disk is full
        f = real(fd, *a, **kw)
        write = f.write

        def part(text):
            write(text[:4096])
            f.flush()
            raise OSError(28, "No space left on device")

        f.write = part
        return f

    monkeypatch.setattr(page.os, "fdopen", short)
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("the trace before")
    for out in (new, old):
        code, _, err = run_cli("report", str(prof), "--trace", str(out), capsys=capsys)
        assert code == 1 and err.strip().splitlines()[-1].endswith(f"cannot write {out}: No space left on device")
    code, _, err = run_cli("report", str(V2), "--adaptive-config", str(new), capsys=capsys)
    assert code == 1 and "No space left on device" in err
    assert not new.exists() and old.read_text() == "the trace before"
    assert sorted(os.listdir(tmp_path)) == ["old.json", "sampled.jsonl"]
