#!/usr/bin/env python3
"""The advisor's comparison of whole settings (topk, steps, draft tokens) against real runs.

Starts, side by side on one GPU, one server per setting in --settings, each
`[v2/]TOPK:STEPS[:DRAFT]` (DRAFT: --speculative-num-draft-tokens, steps + 1 where left out;
`v2/`: SGLANG_ENABLE_SPEC_V2=1, the overlap worker of the releases where it is not the
default), all with --speculative-profile and the same simulated acceptance (--acc, and
--acc-method for SGLANG_SIMULATE_ACC_METHOD). Then, for each concurrency, runs the same
decode load on every server in rotating rounds, and records tokens/s per run.

Each group of settings (the default worker, and `v2/`) is judged against the profile of its
`--profiled` setting alone, what a user would have: `sglang-specprof report --json`, the
advice for the batch-size bucket of that concurrency. For every setting of the group:

  - predicted: the advisor's row for it (a chain's from `rows`, a tree's from `trees`), or
    the advisor's own sentence for why it does not predict it (`not_predicted`);
  - relative_error: the prediction relative to the profiled setting's, against the same ratio
    of the measured medians (what the advice is used for: which setting is faster);
  - inside_range: the measured ratio lies within the prediction's low and high ends, taken
    relative to the profiled setting's central figure.

    python bench/tree_check.py --acc 3 --acc-method multinomial --shape 1b \\
        --settings 4:3:8 4:3:4 2:3:8 2:3:4 1:3 1:7 --profiled 4:3:8 --concurrency 1 16 --rounds 10

Writes OUT/tree-check-SGLANG-accACC[-TAG].json. Needs an NVIDIA GPU and the built wheel (or, for
the harness's own tests, tests/fake_sglang_server.py as SPECPROF_BENCH_LAUNCH).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from advisor_check import advice_for, bucket_key  # noqa: E402
from gpu_models import write_models  # noqa: E402
from serving import (eagle3_args, installed_sglang, interleaved_runs, machine, portable_command, quartiles,  # noqa: E402
                     start_all, stop_all, write_json)

GROUPS = {"": {}, "v2": {"SGLANG_ENABLE_SPEC_V2": "1"}}


class Setting(NamedTuple):
    group: str  # "" (the release's default worker) or "v2"
    topk: int
    steps: int
    draft: int

    @property
    def label(self) -> str:
        return f"{self.group + '/' if self.group else ''}{self.topk}:{self.steps}:{self.draft}"


def parse_setting(text: str) -> Setting:
    """`[v2/]TOPK:STEPS[:DRAFT]`, checked as SGLang would: a tree needs its draft-token count."""
    group, _, rest = text.rpartition("/")
    try:
        parts = [int(x) for x in rest.split(":")]
    except ValueError:
        parts = []
    if group not in GROUPS or len(parts) not in (2, 3) or parts[0] < 1 or parts[1] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a setting: write [v2/]TOPK:STEPS[:DRAFT], e.g. 4:3:8")
    topk, steps = parts[0], parts[1]
    if len(parts) == 2 and topk > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a tree (topk {topk}) needs its draft-token count, TOPK:STEPS:DRAFT")
    draft = parts[2] if len(parts) == 3 else steps + 1
    if topk == 1 and draft != steps + 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at topk 1 SGLang verifies steps + 1 = {steps + 1} draft tokens")
    return Setting(group, topk, steps, draft)


def prediction_for(adv: dict, s: Setting) -> tuple[dict | None, str | None]:
    """The advisor's row for `s` in one bucket's advice, or None and the advisor's sentence for
    why it does not predict it."""
    trees = adv.get("trees")
    if trees:
        row = next((r for r in trees["rows"] if (r["topk"], r["steps"], r["draft_tokens"]) == (s.topk, s.steps, s.draft)),
                   None)
        if row is not None:
            return row, None
    if s.topk == 1:
        row = next((r for r in adv["rows"] if r["steps"] == s.steps), None)
        if row is not None:
            return row, None
    if not trees:
        return None, "the profile is of chains (topk 1): the advisor predicts no tree from it"
    said = trees.get("not_predicted") or []
    T, S, N = trees["topk"], trees["steps"], trees["draft_tokens"]
    for reason in said:
        if ((s.topk > T and reason.startswith(f"topk {T + 1} or more"))
                or (1 < s.topk < T and reason.startswith("topk 2 to"))
                or (s.steps > S and reason.startswith(f"more than {S} steps"))
                or (s.draft > N and reason.startswith(f"more than {N} draft tokens"))):
            return None, reason
    return None, "not among the advisor's rows: " + "; ".join(said)


def verdict(measured: dict[Setting, list[float]], adv: dict, profiled: Setting) -> dict:
    """One group's measured runs at one concurrency against one bucket's advice."""
    med = {s: statistics.median(v) for s, v in measured.items()}
    spread = [(lambda q: (q[1] - q[0]) / med[s])(quartiles(v)) for s, v in measured.items()]
    best = max(med, key=med.get)
    here, _ = prediction_for(adv, profiled)
    base = here["tokens_per_s"] if here else None
    pick = adv.get("recommend_setting") or adv.get("profiled_setting") or {}
    pick_s = next((s for s in measured if (s.topk, s.steps, s.draft) == (pick.get("topk"), pick.get("steps"),
                                                                            pick.get("draft_tokens"))), None)
    settings = []
    for s in sorted(measured, key=lambda x: (-x.topk, x.steps, x.draft)):
        row, why = prediction_for(adv, s)
        e = {"setting": s.label, "topk": s.topk, "steps": s.steps, "draft_tokens": s.draft, "profiled": s == profiled,
             "measured_tok_s": [round(x, 2) for x in measured[s]], "measured_median": round(med[s], 2),
             "measured_iqr": [round(x, 2) for x in quartiles(measured[s])]}
        if row is None:
            e.update(predicted=None, not_predicted=why)
        else:
            e.update(predicted=row["tokens_per_s"], predicted_low=row["low"], predicted_high=row["high"],
                     error=round(row["tokens_per_s"] / med[s] - 1, 4))
            if base and s != profiled:
                ratio = med[s] / med[profiled]
                e.update(relative_error=round((row["tokens_per_s"] / base) / ratio - 1, 4),
                         measured_ratio=round(ratio, 4),
                         predicted_ratio=[round(row["low"] / base, 4), round(row["tokens_per_s"] / base, 4),
                                          round(row["high"] / base, 4)],
                         inside_range=row["low"] / base <= ratio <= row["high"] / base)
        settings.append(e)
    rel = [abs(e["relative_error"]) for e in settings if "relative_error" in e]
    shortfall = 1 - med[pick_s] / med[best] if pick_s else None
    return {"profiled": profiled.label, "best_measured": best.label, "advised": pick_s.label if pick_s else None,
            "advised_setting": pick, "noise": round(statistics.median(spread), 4),
            "advised_shortfall": None if shortfall is None else round(shortfall, 4),
            "advised_within_noise": None if shortfall is None else shortfall <= statistics.median(spread),
            "max_abs_relative_error": round(max(rel), 4) if rel else None,
            "ranges_hold": all(e.get("inside_range", True) for e in settings), "settings": settings,
            "not_predicted": (adv.get("trees") or {}).get("not_predicted")}


def own_figures(profiles: dict) -> dict:
    """{setting: {bucket: (cycle ms, tokens a request commits a cycle)}}: what each server's own
    profile measured at its own setting (the report's row for it), to split an error into the
    cycle's and the acceptance's."""
    out = {}
    for s, path in profiles.items():
        advice = advice_for(path) if os.path.exists(path) else {}
        out[s] = {}
        for key, adv in advice.items():
            row, _ = prediction_for(adv, s)
            if row is not None:
                out[s][key] = (row["cycle_ms"], row["expected_tokens"])
    return out


def split_errors(v: dict, adv: dict, own: dict, key: str, profiled: Setting) -> None:
    """Each predicted setting of verdict `v`, its relative error split in two: the cycle's (the
    predicted cycle against the one the setting's own server measured, both relative to the
    profiled setting's) and the acceptance's (the predicted tokens a request commits a cycle
    against the measured, and whether the measured lies in the predicted range)."""
    here = own.get(profiled, {}).get(key)
    if not here:
        return
    for e in v["settings"]:
        s = Setting(profiled.group, e["topk"], e["steps"], e["draft_tokens"])
        mine = own.get(s, {}).get(key)
        row, _ = prediction_for(adv, s)
        if row is None or not mine or e["profiled"]:
            continue
        base, _ = prediction_for(adv, profiled)
        e["cycle_error"] = round((row["cycle_ms"] / base["cycle_ms"]) / (mine[0] / here[0]) - 1, 4)
        e["measured_cycle_ms"], e["measured_expected_tokens"] = mine
        e["expected_tokens_error"] = round(row["expected_tokens"] / mine[1] - 1, 4)
        lo, hi = row.get("expected_range") or (row["expected_tokens"], row["expected_tokens"])
        e["expected_tokens_range"] = [lo, hi]
        e["expected_tokens_inside_range"] = lo - 0.005 <= mine[1] <= hi + 0.005


def judge(result: dict, runs: dict, profiles: dict, profiled: list) -> None:
    """`result["checks"]`: each profiled setting's verdict on the settings of its group at each
    concurrency, printed as it goes."""
    result["checks"] = []
    own = own_figures(profiles)
    for prof in profiled:
        g = prof.group
        advice = advice_for(profiles[prof])
        check = {"group": g or "default", "profiled": prof.label, "concurrency": {}}
        for c, measured in runs.items():
            key = bucket_key(c)
            mine = {s: v for s, v in measured.items() if s.group == g}
            if key not in advice:
                check["concurrency"][str(c)] = {"error": f"the profile has no bucket {key}"}
                continue
            v = verdict(mine, advice[key], prof)
            split_errors(v, advice[key], own, key, prof)
            v["bucket"] = key
            check["concurrency"][str(c)] = v
            print(f"{check['group']} c={c}: profiled {prof.label}, advised {v['advised']}, best measured "
                  f"{v['best_measured']} (shortfall {v['advised_shortfall']}, noise {v['noise']}); max |relative "
                  f"error| {v['max_abs_relative_error']}; ranges hold: {v['ranges_hold']}", flush=True)
            for e in v["settings"]:
                if e["predicted"] is None:
                    print(f"  {e['setting']:>10}: measured {e['measured_median']:.1f}, not predicted: "
                          f"{e['not_predicted'][:90]}", flush=True)
                elif "relative_error" in e:
                    lo, mid, hi = e["predicted_ratio"]
                    split = (f"; cycle {100 * e['cycle_error']:+.1f}%, tokens a cycle {100 * e['expected_tokens_error']:+.1f}%"
                             f" (measured {e['measured_expected_tokens']:.3f}, range {e['expected_tokens_range'][0]:.3f}-"
                             f"{e['expected_tokens_range'][1]:.3f})" if "cycle_error" in e else "")
                    print(f"  {e['setting']:>10}: measured x{e['measured_ratio']:.3f}, predicted x{mid:.3f} "
                          f"[{lo:.3f}, {hi:.3f}] ({100 * e['relative_error']:+.1f}%{split})", flush=True)
                else:
                    print(f"  {e['setting']:>10}: measured {e['measured_median']:.1f} (profiled)", flush=True)
        result["checks"].append(check)


def rejudge(path: str) -> dict:
    with open(path) as f:
        result = json.load(f)
    folder = os.path.dirname(os.path.abspath(path))
    where = lambda name: next((p for d in (folder, os.path.join(folder, "logs")) for p in  # noqa: E731
                               (os.path.join(d, name), os.path.join(d, name + ".xz")) if os.path.exists(p)),
                              os.path.join(folder, name))
    settings = {x: parse_setting(x) for x in result["settings"]}
    profiles = {settings[x]: where(name) for x, name in result["profiles"].items()}
    runs = {}
    for check in result["checks"]:
        for c, v in check["concurrency"].items():
            for e in v.get("settings", []):
                s = Setting(parse_setting(check["profiled"]).group, e["topk"], e["steps"], e["draft_tokens"])
                runs.setdefault(int(c), {})[s] = e["measured_tok_s"]
    judge(result, runs, profiles, [parse_setting(x) for x in result["profiled"]])
    result["judged_with"] = "python bench/tree_check.py --rejudge RESULT"
    write_json(path, result)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", type=parse_setting, nargs="+")
    ap.add_argument("--profiled", type=parse_setting, nargs="+",
                    help="the settings read as profiles (each judged on the settings of its group): at least one "
                         "for each group in --settings")
    ap.add_argument("--acc", type=float, help="SGLANG_SIMULATE_ACC_LEN for every server")
    ap.add_argument("--rejudge", metavar="RESULT", help="no servers: judge the runs of RESULT anew (after a change "
                    "of the advisor) from the profiles beside it (RESULT's folder, or its logs/), and write it again")
    ap.add_argument("--acc-method", default=None, help="SGLANG_SIMULATE_ACC_METHOD (e.g. multinomial)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--max-tokens", type=int, default=16384, help="KV pool of each server, in tokens")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="from the start, startup included: no round starts past it (the rounds done are reported)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default="bench-logs")
    ap.add_argument("--tag", default="")
    ap.add_argument("--sglang", default=installed_sglang())
    ap.add_argument("--cpus", metavar="A-B", help="pin the servers to these CPUs, each to its own share")
    a = ap.parse_args()
    if a.rejudge:
        return rejudge(a.rejudge)
    if not (a.settings and a.profiled and a.acc is not None):
        ap.error("a sweep needs --settings, --profiled and --acc")
    settings = list(dict.fromkeys(a.settings))
    profiled = list(dict.fromkeys(a.profiled))
    for p in profiled:
        if p not in settings:
            ap.error(f"--profiled {p.label} is not one of --settings")
    lost = sorted({s.group or "default" for s in settings} - {p.group or "default" for p in profiled})
    if lost:
        ap.error(f"no --profiled setting for the group {', '.join(lost)}")
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.logs, exist_ok=True)
    target, draft = write_models(os.path.join(a.logs, "models"), a.shape)
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN=str(a.acc))
    if a.acc_method:
        env["SGLANG_SIMULATE_ACC_METHOD"] = a.acc_method
    name = lambda s: s.label.replace("/", "-").replace(":", "-")  # noqa: E731
    profiles = {s: os.path.join(a.logs, f"profile-{name(s)}.jsonl") for s in settings}
    for p in profiles.values():
        if os.path.exists(p):
            os.remove(p)
    plan = {name(s): (eagle3_args(target, draft, steps=s.steps, topk=s.topk, draft_tokens=s.draft,
                                  graph_bs=a.concurrency, max_tokens=a.max_tokens)
                      + ["--speculative-profile", "--speculative-profile-output", profiles[s]], dict(env, **GROUPS[s.group]))
            for s in settings}
    servers = start_all(plan, a.logs, first_port=33000, cpus=a.cpus, together=True)
    by_setting = dict(zip(settings, servers.values()))
    result = {"benchmark": "tree-check", "sglang": a.sglang, "simulated_accept_length": a.acc,
              "simulated_accept_method": a.acc_method or "match-expected", "shape": a.shape,
              "new_tokens": a.new_tokens, "settings": [s.label for s in settings],
              "profiled": [p.label for p in profiled], "profiles": {s.label: os.path.basename(p) for s, p in profiles.items()},
              "command": portable_command("bench/tree_check.py", sys.argv[1:]), "machine": machine(),
              "date": datetime.date.today().isoformat(), "startup_s": round(time.time() - t0, 1)}
    runs = {}
    try:
        print(f"{len(servers)} servers ready in {result['startup_s']} s", flush=True)
        for ci, c in enumerate(a.concurrency):
            budget = (t0 + a.max_seconds - time.time()) / (len(a.concurrency) - ci) if a.max_seconds else None
            got = interleaved_runs({s.label: by_setting[s].port for s in settings}, c, a.new_tokens, a.rounds, budget)
            runs[c] = {s: got[s.label] for s in settings}
    finally:
        stop_all(servers)  # the profiles' last lines are complete once the servers are gone
    judge(result, runs, profiles, profiled)
    out = os.path.join(a.out, f"tree-check-{a.sglang}-acc{a.acc:g}{'-' + a.tag if a.tag else ''}.json")
    write_json(out, result)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
