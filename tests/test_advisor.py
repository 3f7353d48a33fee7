"""The advisor for a tree profile (topk > 1)."""

import json
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import advisor, cli, report, table

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
    assert chain[2]["low"] == pytest.approx(1000 * (1 + 0.4 + 0.4 * 0.35) / chain[2]["cycle_ms"], rel=1e-3)
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
