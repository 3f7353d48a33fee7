"""The advisor's result as text: the table of step counts, the trees, the recommendation."""

from __future__ import annotations

from .model import setting


def error_line(err: dict | None) -> str | None:
    """One line on the advisor's last measured error, or None where `err` is not given."""
    if not err:
        return None
    if "unknown" in err:
        return f"advisor's last measured error: unknown ({err['unknown']})"
    return (f"advisor's last measured error: within {100 * err['max_abs_error']:.1f}% at {err['concurrency']} "
            f"concurrent (median {100 * err['median_abs_error']:.1f}%; {err.get('release')}, {err.get('date')})")


def is_profiled(adv: dict, r: dict) -> bool:
    """Whether chain row `r` is the profiled setting (never, where a tree was profiled)."""
    return r["steps"] == adv["profiled_steps"] and (adv.get("profiled_setting") or {}).get("topk", 1) <= 1


def named_setting(st: dict) -> str:
    """A setting as the flags that run it."""
    topk = f" --speculative-eagle-topk {st['topk']}" if st.get("topk", 1) > 1 else ""
    return f"--speculative-num-steps {st['steps']}{topk} --speculative-num-draft-tokens {st['draft_tokens']}"


def format_advice(adv: dict) -> str:
    best = next(r for r in adv["rows"] if r["steps"] == adv["best"])
    g = adv.get("verify_ms_per_token")
    per_token = f", {g[0]:.4f} ms per verified token ({g[1]:.4f}-{g[2]:.4f})" if g else ""
    trees = adv.get("trees")
    tree = f", topk {trees['topk']}, {trees['draft_tokens']} draft tokens" if trees else ""
    lines = [f"advisor (profiled at {adv['profiled_steps']} steps{tree}, batch {adv['batch']}, verify growth "
             f"{adv['verify_growth']}{per_token}):"]
    if trees:
        t = trees["topk"]
        lines.append(f"  topk 1 chains: a level's acceptance at most the tree's (high) and at least 1/{t} of it "
                     f"(low: the draft's first choice winning at least its share), central halfway; a draft step "
                     f"costs from 1/{t} of the tree's to the tree's")
    lines.append(f"  {'steps':>5} {'tokens':>6} {'E[tok]':>7} {'cycle ms':>9} {'tok/s':>9} {'low':>9} {'high':>9}")
    for r in adv["rows"]:
        mark = " <- best" if r["steps"] == adv["best"] else (" (profiled)" if is_profiled(adv, r) else "")
        if r.get("measured"):
            mark += f" (measured: {r['measured']} cycles at these batch sizes)"
        ext = "*" if r["extrapolated"] else " "
        lines.append(f"  {r['steps']:>5}{ext}{r['draft_tokens']:>6} {r['expected_tokens']:>7.3f} {r['cycle_ms']:>9.3f} "
                     f"{r['tokens_per_s']:>9.1f} {r['low']:>9.1f} {r['high']:>9.1f}{mark}")
    if trees:
        lines += _format_trees(adv, trees)
    gain = adv["expected_gain"]
    lines.append(f"  best{' topk 1 chain' if trees else ''}: --speculative-num-steps {best['steps']} "
                 f"--speculative-num-draft-tokens {best['draft_tokens']}"
                 + (f", expected {100 * gain:+.1f}% tokens/s" if gain is not None else "")
                 + (" against the profiled tree" if trees and gain is not None else ""))
    if trees:
        b = adv["best_setting"]
        lines.append(f"  best of all predicted: {named_setting(b)}, {b['tokens_per_s']:.1f} tok/s "
                     f"({b['low']:.1f}-{b['high']:.1f})")
    if adv["within_uncertainty"]:
        lines.append(f"  within the uncertainty of the best: steps {', '.join(map(str, adv['within_uncertainty']))}")
    lines += _recommended(adv)
    if adv.get("profile_next") is not None:
        lines.append(f"  profile next at --speculative-num-steps {adv['profile_next']}: the best predicted lies "
                     f"beyond the draft positions measured, where acceptance is extrapolated")
    err = error_line(adv.get("last_measured_error"))
    if err:
        lines.append(f"  {err}" + ("; measured on topk 1 step counts: the trees' ranges only against simulated acceptance, "
                                   "which ignores a tree's shape (docs/report.md, Trees)"
                                   if trees and "unknown" not in adv["last_measured_error"] else ""))
    lines.append("  * beyond the measured draft positions, where acceptance is extrapolated: each further position's "
                 "rate is the one before it times r, the last measured rate over the one before that (r at most 1: "
                 "a rise is held level; with one position measured, r = 1); low: 0; high: the last measured rate "
                 "held")
    lines += [f"  note: {n}" for n in adv["notes"]]
    return "\n".join(lines)


TREE_LINES = 12  # tree rows the text shows (--json has them all)


def _format_trees(adv: dict, trees: dict) -> list[str]:
    t, rows = trees["topk"], trees["rows"]
    shown = rows if len(rows) <= TREE_LINES else sorted(
        rows, key=lambda r: (not r["profiled"], -r["tokens_per_s"]))[:TREE_LINES]
    lines = [f"  trees at topk {t}, the profiled one pruned (the draft's scores taken to order the nodes by their "
             f"chance of acceptance): low, the nodes kept holding their share of what the profiled ones accepted; "
             f"central, halfway to the profiled levels; high, nodes the profile never verified (fewer steps make room "
             f"for them) adding at most its mean each",
             f"  {'steps':>5} {'tokens':>6} {'E[tok]':>7} {'E range':>11} {'cycle ms':>9} {'tok/s':>9} {'low':>9} "
             f"{'high':>9}"]
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    for r in rows:
        if r not in shown:
            continue
        mark = " (profiled)" if r["profiled"] else (" <- best" if r is best else "")
        span = f"{r['expected_range'][0]:.2f}-{r['expected_range'][1]:.2f}"
        lines.append(f"  {r['steps']:>5} {r['draft_tokens']:>6} {r['expected_tokens']:>7.3f} {span:>11} "
                     f"{r['cycle_ms']:>9.3f} {r['tokens_per_s']:>9.1f} {r['low']:>9.1f} {r['high']:>9.1f}{mark}")
    if len(shown) < len(rows):
        lines.append(f"  ({len(rows) - len(shown)} slower trees more in --json)")
    lines += [f"  not predicted: {x}" for x in trees["not_predicted"]]
    return lines


def _recommended(adv: dict) -> list[str]:
    """The recommendation: another setting whose low end beats the profiled one's figure, or keep it."""
    here = adv.get("profiled_setting") or {}
    mine = here.get("tokens_per_s")
    if mine is None:  # an older result (a caller's own): the profiled step count's row
        mine = next((r["tokens_per_s"] for r in adv["rows"] if r["steps"] == adv["profiled_steps"]), None)
    rec = adv.get("recommend_setting")
    if rec is None and "recommend_setting" not in adv and adv.get("recommend", adv["best"]) != adv["profiled_steps"]:
        rec = setting(next(r for r in adv["rows"] if r["steps"] == adv["recommend"]))
    if rec is None or mine is None:
        within = " within what the profile measured" if adv.get("profile_next") else ""
        if here.get("topk", 1) > 1:
            return [f"  recommended: keep the profiled tree, {named_setting(here)}: no other setting's low end "
                    f"beats it{within}"]
        return [f"  recommended: keep {adv['profiled_steps']} steps (no other setting's low end beats it{within})"]
    row = next((r for r in adv["rows"] if r["steps"] == rec["steps"]), {}) if rec["topk"] <= 1 else {}
    if rec["steps"] == 0:
        named = "--speculative-num-steps 0 (speculation off at this batch size)"
    else:
        named = named_setting(rec) + (" (topk 1)" if here.get("topk", 1) > 1 and rec["topk"] <= 1 else "")
    figure = (f"{rec['tokens_per_s']:.1f} tok/s measured" if row.get("measured")
              else f"{rec['low']:.1f}-{rec['high']:.1f} tok/s")
    return [f"  recommended: {named}, {figure} against {mine:.1f} as profiled"]
