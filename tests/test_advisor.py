"""The advisor for a tree profile (topk > 1), and its published error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import advisor, cli, measured_error, report, table

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
V1 = DATA / "profile-0.5.12-eagle3-v1-topk2.jsonl"  # topk 2, 3 steps, 4 draft tokens


def tree_inputs(per_position=(0.8, 0.7, 0.6), growth=advisor.Growth(0.05, 0.03, 0.07, "measured"), tokens=8):
    """A tree of topk 2, 3 steps, `tokens` verified a request, at one request a cycle."""
    return advisor.Inputs(
        steps=3, batch=1.0, phases={"draft_prep": 0.1, "draft": 1.0, "tree": 0.05, "verify": 10.0, "accept": 0.1,
                                    "draft_extend": 0.5},
        between_ms=0.1, wall_ms=12.0, step_ms=[0.3, 0.3, 0.02], per_position=list(per_position), growth=growth,
        draft_tokens=tokens, topk=2)


def rows_of(adv):
    return {(r["steps"], r["draft_tokens"]): r for r in adv["trees"]["rows"]}


def test_the_profiled_tree_is_predicted_as_measured_and_its_pruned_trees_within_ranges():
    inp = tree_inputs()
    adv = advisor.predict(inp)
    rows = rows_of(adv)
    e = advisor.expected_tokens([0.8, 0.7, 0.6], 3)
    here = rows[(3, 8)]
    assert here["profiled"] and here["expected_range"] == [pytest.approx(e, abs=1e-4)] * 2
    # the profiled setting's own figure: the measured acceptance over the measured cycle, no range
    assert here["low"] == here["tokens_per_s"] == here["high"] == pytest.approx(1000 * e / 12.0, rel=1e-3)
    assert adv["profiled_setting"] == {"topk": 2, "steps": 3, "draft_tokens": 8, "tokens_per_s": here["tokens_per_s"]}
    for r in rows.values():
        lo, hi = r["expected_range"]
        assert lo <= r["expected_tokens"] <= hi and r["low"] <= r["tokens_per_s"] <= r["high"]
        assert r["topk"] == 2 and r["steps"] <= 3 and r["draft_tokens"] <= 8  # nothing larger than measured
        assert r["draft_tokens"] - 1 >= r["steps"] or r["profiled"]
        # central: the model's figure, E halfway between its bounds over the predicted cycle
        assert r["tokens_per_s"] == pytest.approx(1000 * r["expected_tokens"] / r["cycle_ms"], rel=1e-3)
    # pruned at the profiled depth: acceptance at most what was measured, and the range widens
    # the further the tree is cut from the one measured
    pruned = [rows[(3, n)] for n in (8, 6, 4)]
    widths = [r["expected_range"][1] - r["expected_range"][0] for r in pruned]
    assert widths == sorted(widths) and widths[0] == 0 < widths[1]
    assert all(r["expected_range"][1] <= e + 1e-9 for r in pruned)
    assert [r["expected_tokens"] for r in pruned] == sorted((r["expected_tokens"] for r in pruned), reverse=True)
    # fewer steps make room for candidates never verified: only the high end counts on them
    seen = advisor.expected_tokens([0.8, 0.7], 2)
    assert rows[(2, 7)]["expected_tokens"] == pytest.approx(seen, abs=1e-4)
    assert rows[(2, 7)]["expected_range"][1] > seen + 0.5
    # verify grows with tokens and drafting with steps: a smaller tree's cycle is shorter
    assert rows[(3, 4)]["cycle_ms"] < rows[(3, 6)]["cycle_ms"] < here["cycle_ms"]
    assert rows[(2, 6)]["cycle_ms"] < rows[(3, 6)]["cycle_ms"]


def test_a_tree_profile_says_what_it_cannot_predict():
    trees = advisor.predict(tree_inputs())["trees"]
    said = " | ".join(trees["not_predicted"])
    # up to every candidate, 2 + 2 * 4 nodes and the root
    assert "more than 8 draft tokens at topk 2" in said and "--speculative-num-draft-tokens 11" in said
    assert "more than 3 steps at topk 2" in said and "--speculative-num-steps 4" in said
    assert "topk 3 or more" in said and "--speculative-eagle-topk 3" in said
    inp = tree_inputs()
    inp.topk = 4
    assert "topk 2 to 3" in " ".join(advisor.predict(inp)["trees"]["not_predicted"])
    # every candidate of 3 steps at topk 2 verified (2 + 2 * 4 = 10 nodes): more tokens need more steps
    full = advisor.predict(tree_inputs(tokens=11))["trees"]["not_predicted"]
    assert not any("draft tokens at topk" in x for x in full)


def test_chains_from_a_tree_get_ranges_that_hold_the_trees_acceptance_as_their_top():
    inp = tree_inputs(growth=advisor.Growth(0.0, 0.0, 0.0, "measured"))
    adv = advisor.predict(inp)
    chain = {r["steps"]: r for r in adv["rows"]}
    e_tree = advisor.expected_tokens([0.8, 0.7, 0.6], 2)
    # at most the tree's acceptance by level, at least half of it (topk 2), central halfway
    assert chain[2]["expected_tokens"] == pytest.approx(1 + 0.8 * 0.75 + 0.8 * 0.75 * 0.7 * 0.75, abs=1e-4)
    assert chain[2]["high"] >= 1000 * e_tree / chain[2]["cycle_ms"] - 0.01
    # the low end: the least acceptance over the longest cycle, a chain's step and width-bound work
    # costing what the tree's did (flat); the central cycle between that and their shares
    from sglang_specprof.model import cycle_ms

    scale = (inp.wall_ms / cycle_ms(inp, 3, 0.0, inp.verified())) if inp.wall_ms else 1.0
    flat = cycle_ms(inp, 2, 0.0, step_share=1.0, width=1.0) * scale
    assert chain[2]["low"] == pytest.approx(1000 * (1 + 0.4 + 0.4 * 0.35) / flat, rel=1e-3)
    assert chain[2]["cycle_ms"] < flat
    assert all(r["low"] < r["tokens_per_s"] < r["high"] for r in adv["rows"])
    # the chain row at the profiled step count is not the profiled setting
    assert not any(advisor.is_profiled(adv, r) for r in adv["rows"])
    assert adv["profiled_setting"]["topk"] == 2


def test_a_tree_is_recommended_only_where_its_low_end_beats_the_profiled_tree():
    # the third level never accepts: the third step costs and commits nothing, so the same
    # tokens at 2 steps beat it even at their low end
    adv = advisor.predict(tree_inputs(per_position=(0.9, 0.8, 0.0), growth=advisor.Growth(0.0, 0.0, 0.0, "measured")))
    here = rows_of(adv)[(3, 8)]["tokens_per_s"]
    rec = adv["recommend_setting"]
    assert rec["topk"] == 2 and rec["steps"] == 2 and rec["low"] > here
    assert rec["tokens_per_s"] == max(r["tokens_per_s"] for r in adv["trees"]["rows"] + adv["rows"]
                                      if r["low"] > here and r is not rows_of(adv)[(3, 8)])
    text = advisor.format_advice(adv)
    assert f"recommended: {advisor.named_setting(rec)}, {rec['low']:.1f}-{rec['high']:.1f} tok/s against " \
           f"{here:.1f} as profiled" in text
    # acceptance that goes on paying at depth, and verify flat: nothing's low end beats the tree
    flat = advisor.Growth(0.0, 0.0, 0.0, "measured")
    adv = advisor.predict(tree_inputs(per_position=(0.95, 0.95, 0.95), growth=flat))
    here = rows_of(adv)[(3, 8)]["tokens_per_s"]
    assert adv["recommend_setting"] is None
    assert all(r["low"] <= here for r in adv["trees"]["rows"] + adv["rows"])
    assert "recommended: keep the profiled tree, --speculative-num-steps 3 --speculative-eagle-topk 2 " \
           "--speculative-num-draft-tokens 8: no other setting's low end beats it" in advisor.format_advice(adv)


def test_the_recorded_tree_profile_is_compared_in_the_report_the_json_and_the_log(capsys):
    windows, _ = report.load(str(V1))
    summary = report.summarize(windows)
    advice = report.advise(summary)
    for key, adv in advice.items():
        trees = adv["trees"]
        assert (trees["topk"], trees["steps"], trees["draft_tokens"]) == (2, 3, 4)
        here = next(r for r in trees["rows"] if r["profiled"])
        # the profiled tree reproduces what the bucket measured
        assert here["tokens_per_s"] == pytest.approx(summary["buckets"][key]["tokens_per_s"], rel=0.02)
        assert not any(r["draft_tokens"] > 4 or r["steps"] > 3 for r in trees["rows"])
    assert cli.main(["report", str(V1)]) == 0
    out = capsys.readouterr().out
    assert "bs 1 advisor (profiled at 3 steps, topk 2, 4 draft tokens" in out
    assert "  trees at topk 2, the profiled one pruned" in out and "(profiled)" in out
    assert "  not predicted: more than 4 draft tokens at topk 2" in out
    assert "larger trees not predicted (topk above 2, more steps or draft tokens)" in out  # the bucket's line
    assert cli.main(["report", str(V1), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["advice"]["1"]["trees"]["rows"] == advice["1"]["trees"]["rows"]
    # the live log's table, each bucket predicted from the window alone
    line = table.format_summary(windows[0])
    assert "advisor: " in line and "larger trees not predicted" in line


def test_the_shipped_error_is_what_the_recorded_sweeps_measure_with_this_advisor():
    """The error the report shows is the H100 sweeps' (0.5.16, profiles read at 3 and 6 steps,
    against the clients' medians): 2026-12-06 (means 2-4 at 1, 16 and 48 concurrent) and, at 48,
    2026-12-07 too (mean 2, one load of 48, 28 rounds), whose reading at 6 steps put fewer steps
    up to 19.9% low; the advisor as it is now, replayed on their profiles, measures the same.
    Each load says which sweeps measured it and when."""
    sys.path.insert(0, str(ROOT / "bench"))
    import advisor_sweep

    names = ["advisor-sweep-0.5.16-h100-2026-12-06.json", "advisor-sweep-0.5.16-h100-c48-2026-12-07.json"]
    shipped = json.loads(Path(advisor.ERROR_FILE).read_text())
    recorded = [json.loads((ROOT / "bench" / "results" / n).read_text()) for n in names]
    assert shipped == advisor_sweep.published(recorded, names)
    replayed = [json.loads(json.dumps(advisor_sweep.analyse(str(DATA / "advisor-sweep" / d), [1, 3, 6])))
                for d in ("0.5.16-h100", "0.5.16-h100-c48")]
    assert advisor_sweep.published(replayed, names)["by_concurrency"] == shipped["by_concurrency"]
    by = shipped["by_concurrency"]
    assert shipped["release"] == "0.5.16" and set(by) == {"1", "16", "48"}
    assert by["1"]["results"] == by["16"]["results"] == names[:1] and by["1"]["date"] == "2026-12-06"
    assert by["48"]["results"] == names and by["48"]["date"] == "2026-12-07" and by["48"]["max_abs_error"] > 0.15
    # one sweep alone publishes its own loads: 48 from the first sweep only was 12.3%
    assert advisor_sweep.published(recorded[0], names[0])["by_concurrency"]["48"]["max_abs_error"] == 0.123
    near48 = measured_error.last_error(40.0)
    assert near48["date"] == "2026-12-07" and near48["results"] == names
    assert measured_error.last_error(1.0)["date"] == "2026-12-06"


def synthetic_result(path):
    """A sweep at 1 and 8 concurrent, profiled at 3 steps, with errors relative to it that a test
    can work out by hand."""
    def setting(k, pred, med):
        return {"steps": k, "measured_tok_s": [med] * 3, "measured_median": med, "predicted": pred,
                "predicted_low": pred, "predicted_high": pred, "error": round(pred / med - 1, 4)}
    result = {"benchmark": "advisor", "sglang": "0.5.99", "profiled_steps": 3, "date": "2027-01-02",
              "command": "python bench/advisor_check.py --acc 3 --out OUT", "simulated_accept_length": 3.0,
              "concurrency": {
                  # the profiled setting predicted 10% high: relative to it, steps 1 is 0% and steps 2 is +10%
                  "1": {"settings": [setting(1, 110.0, 100.0), setting(2, 242.0, 200.0), setting(3, 330.0, 300.0)]},
                  "8": {"settings": [setting(1, 95.0, 100.0), setting(2, 200.0, 200.0), setting(3, 300.0, 300.0)]},
                  "16": {"error": "the profile has no bucket 9-16"}}}
    path.write_text(json.dumps(result))
    return path


def test_publish_computes_the_error_from_a_result(tmp_path):
    res = synthetic_result(tmp_path / "advisor-0.5.99-acc3.0.json")
    out = tmp_path / "advisor_error.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "advisor_check.py"), "--publish", str(res),
                           "--publish-to", str(out)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "overlay")))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["by_concurrency"] == {"1": {"max_abs_error": 0.1, "median_abs_error": 0.05, "predictions": 2,
                                            "rounds": 3},
                                      "8": {"max_abs_error": 0.05, "median_abs_error": 0.025, "predictions": 2,
                                            "rounds": 3}}
    assert (data["release"], data["date"], data["results"]) == ("0.5.99", "2027-01-02", [res.name])
    assert data["sweeps"][0]["command"].startswith("python bench/advisor_check.py")
    assert "at 1 concurrent within 10.0% (median 5.0%" in proc.stdout
    # what the report makes of it: the nearest load by ratio
    assert advisor.last_error(1.0, str(out))["max_abs_error"] == 0.1
    assert advisor.last_error(30.0, str(out))["concurrency"] == 8
    assert advisor.last_error(2.0, str(out))["concurrency"] == 1


def test_the_report_carries_the_error_from_the_file(tmp_path, monkeypatch, capsys):
    res = synthetic_result(tmp_path / "r.json")
    sys.path.insert(0, str(ROOT / "bench"))
    import advisor_check

    advisor_check.publish([str(res)], str(tmp_path / "err.json"))
    capsys.readouterr()
    monkeypatch.setattr(measured_error, "ERROR_FILE", str(tmp_path / "err.json"))
    prof = DATA / "profile-0.5.16-eagle3-v2-topk1.jsonl"
    assert cli.main(["report", str(prof), "--json"]) == 0
    adv = json.loads(capsys.readouterr().out)["advice"]
    assert adv["1"]["last_measured_error"]["max_abs_error"] == 0.1
    assert adv["1"]["last_measured_error"]["release"] == "0.5.99"
    assert adv["3-4"]["last_measured_error"]["concurrency"] == 8
    assert cli.main(["report", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "  advisor's last measured error: within 10.0% at 1 concurrent (median 5.0%; 0.5.99, 2027-01-02)" in out
    assert "; last measured error within 5.0% at 8 concurrent" in out  # the bucket's line


@pytest.mark.parametrize("content", [None, "{not json", '{"by_concurrency": {"1": {"max_abs_error": "a lot"}}}',
                                     "[]", '{"by_concurrency": {}}'])
def test_a_missing_or_broken_error_file_leaves_the_error_unknown(tmp_path, monkeypatch, capsys, content):
    path = tmp_path / "advisor_error.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(measured_error, "ERROR_FILE", str(path))
    assert cli.main(["report", str(V1)]) == 0
    out = capsys.readouterr().out
    assert "  advisor's last measured error: unknown (advisor_error.json " in out
    assert "; its last measured error unknown" in out
    assert cli.main(["report", str(V1), "--json"]) == 0
    adv = json.loads(capsys.readouterr().out)["advice"]["1"]
    assert set(adv["last_measured_error"]) == {"unknown"}


def test_a_live_window_advises_no_bucket_of_too_few_cycles(tmp_path):
    """The live log's advice (and the gauges', `window_advice`) comes from each bucket alone: a
    bucket of fewer than 20 decode cycles (a warm-up's, a batch size passed through) gets the
    line that says so and no advice; the same bucket with 20 gets its advice."""
    import copy
    import lzma

    from sglang_specprof import schema
    from sglang_specprof.fit import LOCAL_MIN_CYCLES

    path = tmp_path / "p.jsonl"
    path.write_bytes(lzma.decompress((DATA / "exact" / "0.5.16-a" / "profile-s3k4.jsonl.xz").read_bytes()))
    windows, _ = schema.read(str(path))
    last = windows[-1]
    assert last["buckets"]["1"]["cycles"] >= LOCAL_MIN_CYCLES > last["buckets"]["3-4"]["cycles"] > 0
    live = advisor.window_advice(last)
    assert "1" in live and "3-4" not in live
    text = table.format_summary(last)
    assert f"advisor: {last['buckets']['3-4']['cycles']} cycles, too few to predict from (20 at least)" in text
    assert text.count("too few to predict from") == 1
    few = copy.deepcopy(last)
    few["buckets"]["1"]["cycles"] = LOCAL_MIN_CYCLES - 1
    assert "1" not in advisor.window_advice(few) and text.count("advisor: the profiled tree") == 1
    assert "advisor: the profiled tree" not in table.format_summary(few)
    enough = copy.deepcopy(last)
    enough["buckets"]["3-4"]["cycles"] = LOCAL_MIN_CYCLES
    assert "3-4" in advisor.window_advice(enough)


def test_without_step_times_a_draft_step_is_the_drafts_replay_over_its_forwards():
    """A bucket whose draft steps were not timed (SGLANG_SPECPROF_DRAFT_STEPS=0) or never read (on
    0.5.16's overlap most reads are lost) prices a draft step as the draft's replay over its forward
    steps: in the recorded 8B-shaped profile (3 steps) every step count's prediction stays within
    0.5% of the one made from the measured step times, where the draft extend (the fallback for a
    profile at 1 step) put a step 19-33% too dear and 6 steps 3-4% too slow."""
    import copy

    path = ROOT / "bench" / "results" / "profiles" / "overhead-0.5.16-8b-aa-noff-h100-on-2026-12-07.jsonl.xz"
    windows, _ = report.load(str(path))
    summary = report.summarize(windows)
    stripped = copy.deepcopy(summary)
    for b in stripped["buckets"].values():
        assert len(b["draft_steps_gpu_ms"]) == (3 if b["cycles"] else 0)  # measured here
        b["draft_steps_gpu_ms"] = []
    timed, untimed = report.advise(summary), report.advise(stripped)
    assert set(timed) == set(untimed) == {"1", "5-8", "9-16"}
    for key in timed:
        a = {r["steps"]: r["tokens_per_s"] for r in timed[key]["rows"]}
        b = {r["steps"]: r["tokens_per_s"] for r in untimed[key]["rows"]}
        assert set(a) == set(b) and {1, 2, 3, 6, 8} <= set(a)
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=0.005), (key, k)
        assert untimed[key]["best_setting"]["steps"] == timed[key]["best_setting"]["steps"]


def test_step_pricing_sets_both_estimates_against_the_measured_steps():
    """bench/step_pricing.py over the recorded 8B-shaped profile: three graph buckets, the draft phase
    over its forward steps within 2% of the measured steps in each, the draft extend above by 15% or
    more, and the first nearer in all three."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_pricing.py"), str(
        ROOT / "bench" / "results" / "profiles" / "overhead-0.5.16-8b-aa-noff-h100-on-2026-12-07.jsonl.xz")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT / "overlay")))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    g = out["graph"]
    assert out["profiles"] == 1 and g["buckets"] == 3 and out["eager"] == {"buckets": 0}
    assert 0.98 <= g["draft_over_forwards"]["min"] <= g["draft_over_forwards"]["max"] <= 1.02
    assert g["draft_extend"]["min"] >= 1.15 and g["phase_estimate_nearer"] == 3


def test_draft_nodes_reads_the_step_events_cost_from_two_profiles():
    """bench/draft_nodes.py: a draft phase 10 µs longer in every window of the profile with step
    events reads as 10 µs a replay, its share of the cycle as 10 µs over the cycle; windows whose
    draft was timed in too few cycles are left out; and on the recorded pair of 2026-12-07 (one
    server with the step events, one without, the same load) the events cost 7-10 µs a replay at
    every batch size, an interval that excludes none."""
    sys.path.insert(0, str(ROOT / "bench"))
    import draft_nodes

    def window(i, p50, n=12):
        return {"window": i, "buckets": {"1": {"phases": {"draft": {"gpu_ms": {"p50": p50, "n": n}}}}}}

    with_steps = [window(i, 0.850 + 0.001 * (i % 3)) for i in range(9)] + [window(9, 5.0, n=2)]
    without = [window(i, 0.840 + 0.001 * (i % 3)) for i in range(9)]
    summary = {"buckets": {"1": {"cycle_gpu_ms": {"mean": 5.0}}}}
    orig = draft_nodes.report.summarize
    draft_nodes.report.summarize = lambda windows: summary
    try:
        row = draft_nodes.compare(with_steps, without)["1"]
    finally:
        draft_nodes.report.summarize = orig
    assert row["windows"] == [9, 9] and row["nodes_us"] == pytest.approx(10.0)
    assert row["nodes_us_ci95"][0] <= 10.0 <= row["nodes_us_ci95"][1]
    assert row["share_of_cycle"] == pytest.approx(0.002)

    prof = ROOT / "bench" / "results" / "profiles"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "draft_nodes.py"),
                           str(prof / "overhead-0.5.16-8b-steps0-aa-h200-steps-2026-12-07.jsonl.xz"),
                           str(prof / "overhead-0.5.16-8b-steps0-aa-h200-nosteps-2026-12-07.jsonl.xz")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT / "overlay")))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["buckets"]
    assert set(rows) == {"1", "5-8", "9-16"}
    for r in rows.values():
        assert 7.0 <= r["nodes_us"] <= 10.0 and r["nodes_us_ci95"][0] > 5.0, r
        assert 0.0008 <= r["share_of_cycle"] <= 0.0013

    # a profile that is not there: one sentence, no traceback, a non-zero exit
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "draft_nodes.py"), str(prof / "none.jsonl"),
                          str(prof / "none.jsonl")], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "overlay")))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "none.jsonl" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
