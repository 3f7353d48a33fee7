#!/usr/bin/env python3
"""Does the step-count advisor pick the fastest setting? Its predictions against real runs.

Starts, side by side on one GPU, one server per `--speculative-num-steps` in --steps
(topk 1, steps + 1 draft tokens), all with the same forced acceptance
(`SGLANG_SIMULATE_ACC_LEN`, --acc) and with --speculative-profile. Then, for each
concurrency, runs the same decode-heavy load on every server in rounds, the order
rotating each round, and records tokens/s per run.

The prediction: `sglang-specprof report --json` on the profile of the --profile-steps
server alone (what a user would have: one profiled run), its advice for the batch-size
bucket of that concurrency. The verdict, per concurrency:

  - noise: the run-to-run spread, the median over settings of each setting's relative
    interquartile range (its runs' IQR over their median);
  - pick within noise: the measured median of the advisor's pick is at most `noise` below
    the best measured median;
  - each prediction within 10%: |predicted - measured median| / measured median <= 0.10.

    python bench/advisor_check.py --acc 2.5 --steps 1 2 3 4 5 --profile-steps 5 \\
        --concurrency 1 8 --rounds 5 --new-tokens 1024 --out bench/results

Writes bench/results/advisor-SGLANG-accACC.json. Needs an NVIDIA GPU and the built wheel.
With --publish, also writes the error it measured into the package
(overlay/sglang_specprof/advisor_error.json), where the report shows it beside the advice;
`--publish RESULT...` does that from results written before, with no servers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import write_models  # noqa: E402
from serving import (eagle3_args, installed_sglang, interleaved_runs, machine, portable_command, quartiles,  # noqa: E402
                     start_all, stop_all, write_json)

TOLERANCE = 0.10
ERROR_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "overlay", "sglang_specprof",
                          "advisor_error.json")


def bucket_key(concurrency):
    """The profile's batch-size bucket that a steady load of `concurrency` requests fills."""
    from sglang_specprof.window import bucket_of

    return bucket_of(concurrency)


def advice_for(profile, python=sys.executable):
    """`sglang-specprof report --json` on one profile: {bucket: advice}."""
    r = subprocess.run([python, "-m", "sglang_specprof", "report", profile, "--json"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise SystemExit(f"sglang-specprof report failed on {profile}: {r.stderr.strip()}")
    return json.loads(r.stdout)["advice"]


def verdict(measured: dict[int, list[float]], advice: dict, tolerance=TOLERANCE) -> dict:
    """Measured runs per step count against the advisor's rows for the same bucket."""
    med = {k: statistics.median(v) for k, v in measured.items()}
    spread = []
    for k, v in measured.items():
        lo, hi = quartiles(v)
        spread.append((hi - lo) / med[k])
    noise = statistics.median(spread)
    best = max(med, key=med.get)
    rows = {r["steps"]: r for r in advice["rows"]}
    pick = advice["best"]
    settings = []
    for k in sorted(measured):
        row = rows[k]
        err = row["tokens_per_s"] / med[k] - 1
        settings.append({"steps": k, "measured_tok_s": [round(x, 2) for x in measured[k]],
                         "measured_median": round(med[k], 2),
                         "measured_iqr": [round(x, 2) for x in quartiles(measured[k])],
                         "predicted": row["tokens_per_s"], "predicted_low": row["low"],
                         "predicted_high": row["high"], "error": round(err, 4),
                         "within_tolerance": abs(err) <= tolerance,
                         "measured_inside_bounds": row["low"] <= med[k] <= row["high"]})
    in_range = pick in med
    shortfall = (1 - med[pick] / med[best]) if in_range else None
    return {"advisor_pick": pick, "best_measured": best, "noise": round(noise, 4),
            "pick_shortfall": None if shortfall is None else round(shortfall, 4),
            "pick_within_noise": bool(in_range and shortfall <= noise),
            "predicted_gain": advice.get("expected_gain"), "verify_growth": advice.get("verify_growth"),
            "all_within_tolerance": all(s["within_tolerance"] for s in settings),
            "max_abs_error": round(max(abs(s["error"]) for s in settings), 4), "settings": settings}


def judge(result, runs, profile):
    advice = advice_for(profile)
    for c, measured in runs.items():
        key = bucket_key(c)
        if key not in advice:
            result["concurrency"][str(c)] = {"error": f"the profile has no bucket {key}"}
            continue
        v = verdict(measured, advice[key])
        v["bucket"] = key
        v["advice"] = advice[key]
        result["concurrency"][str(c)] = v
        print(f"acc {result['simulated_accept_length']} c={c}: advisor picks {v['advisor_pick']}, best measured "
              f"{v['best_measured']} (shortfall {v['pick_shortfall']}, noise {v['noise']}); "
              f"max |error| {v['max_abs_error']}; verify growth {v['verify_growth']}", flush=True)
        for s in v["settings"]:
            print(f"  steps {s['steps']}: measured {s['measured_median']:.1f} predicted {s['predicted']:.1f} "
                  f"[{s['predicted_low']:.1f}, {s['predicted_high']:.1f}] error {100 * s['error']:+.1f}%", flush=True)


def rejudge(result_path, profile):
    with open(result_path) as f:
        result = json.load(f)
    runs = {int(c): {s["steps"]: s["measured_tok_s"] for s in v["settings"]}
            for c, v in result["concurrency"].items() if "settings" in v}
    judge(result, runs, profile)
    result["judged_with"] = "python bench/advisor_check.py --rejudge RESULT PROFILE"
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def relative_errors(v: dict, profiled: int) -> list[float]:
    """Each prediction's error relative to the profiled setting, in one concurrency's verdict:
    (predicted / predicted at the profiled step count) over (measured median / measured median
    there), less 1, for each other step count (the profiled one's is the profile against the
    sweep, not the advisor's)."""
    s = {x["steps"]: x for x in v.get("settings") or []}
    here = s.get(profiled)
    if not here or not here["predicted"] or not here["measured_median"]:
        return []
    return [(x["predicted"] / here["predicted"]) / (x["measured_median"] / here["measured_median"]) - 1
            for k, x in sorted(s.items()) if k != profiled and x["measured_median"]]


def published(paths: list[str]) -> dict:
    """What advisor_error.json holds, from the results of one or more sweeps (pooled by
    concurrency): the largest and the median |error| relative to the profiled setting."""
    sweeps, pooled = [], {}
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        rounds = {}
        for c, v in sorted(r.get("concurrency", {}).items(), key=lambda kv: int(kv[0])):
            errs = relative_errors(v, r["profiled_steps"])
            if not errs:
                continue
            pooled.setdefault(int(c), []).append((errs, min(len(x["measured_tok_s"]) for x in v["settings"])))
            rounds[c] = pooled[int(c)][-1][1]
        sweeps.append({"results": os.path.basename(path), "release": r.get("sglang"), "date": r.get("date"),
                       "command": r.get("command"), "simulated_accept_length": r.get("simulated_accept_length"),
                       "profiled_steps": r.get("profiled_steps"), "rounds": rounds, "machine": r.get("machine")})
    if not pooled:
        raise SystemExit(f"{', '.join(paths)}: no concurrency with predictions and measurements to publish")
    by = {}
    for c, parts in sorted(pooled.items()):
        errs = [abs(e) for es, _ in parts for e in es]
        by[str(c)] = {"max_abs_error": round(max(errs), 4), "median_abs_error": round(statistics.median(errs), 4),
                      "predictions": len(errs), "rounds": min(n for _, n in parts)}
    return {"what": "the step-count advisor's error as bench/advisor_check.py measured it against an interleaved "
                    "sweep: for each setting other than the profiled one, its predicted tokens/s relative to the "
                    "profiled setting's against the same ratio of the sweep's measured medians",
            "release": ", ".join(dict.fromkeys(str(s["release"]) for s in sweeps)),
            "date": max(str(s["date"]) for s in sweeps), "results": [s["results"] for s in sweeps],
            "by_concurrency": by, "sweeps": sweeps}


def publish(paths: list[str], out: str = ERROR_FILE) -> dict:
    return write_published(published(paths), out)


def write_published(data: dict, out: str = ERROR_FILE) -> dict:
    """`data` (what advisor_error.json holds) written to `out`, and a line for each load."""
    write_json(out, data)
    for c, e in data["by_concurrency"].items():
        print(f"published to {out}: at {c} concurrent within {100 * e['max_abs_error']:.1f}% "
              f"(median {100 * e['median_abs_error']:.1f}%, {e['predictions']} predictions)", flush=True)
    return data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--acc", type=float, help="SGLANG_SIMULATE_ACC_LEN for every server (needed to run the sweep)")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--profile-steps", type=int, default=5, help="the server whose profile the advisor reads")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--max-tokens", type=int, default=16384, help="KV pool of each server, in tokens")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="from the start, startup included: stop starting rounds after this long, "
                         "sharing what is left among the concurrencies (the rounds done are reported)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default="bench-logs")
    ap.add_argument("--sglang", default=installed_sglang(), help="the release the results are named by "
                    "(default: the sglang installed)")
    ap.add_argument("--cpus", metavar="A-B", help="pin the servers to these CPUs, each to its own share")
    ap.add_argument("--rejudge", nargs=2, metavar=("RESULT", "PROFILE"),
                    help="no servers: judge the runs of an earlier RESULT anew against PROFILE "
                         "(after a change of the advisor), and write RESULT again")
    ap.add_argument("--publish", nargs="*", metavar="RESULT",
                    help="write the error measured into the package (overlay/sglang_specprof/advisor_error.json), "
                         "where the report shows it: with no RESULT, this run's (or --rejudge's) result; with "
                         "RESULTs, theirs (pooled by concurrency), and no servers")
    ap.add_argument("--publish-to", default=ERROR_FILE, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.publish:
        return publish(a.publish, a.publish_to)
    if a.rejudge:
        rejudge(*a.rejudge)
        if a.publish is not None:
            publish([a.rejudge[0]], a.publish_to)
        return
    if a.acc is None:
        ap.error("the sweep needs --acc (SGLANG_SIMULATE_ACC_LEN for every server)")
    if a.profile_steps not in a.steps:
        ap.error("--profile-steps must be one of --steps")
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.logs, exist_ok=True)
    target, draft = write_models(os.path.join(a.logs, "models"), a.shape)
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN=str(a.acc))
    profiles = {k: os.path.join(a.logs, f"acc{a.acc}-steps{k}.jsonl") for k in a.steps}
    for p in profiles.values():
        if os.path.exists(p):
            os.remove(p)
    plan = {f"acc{a.acc}-steps{k}": (eagle3_args(target, draft, steps=k, topk=1, graph_bs=a.concurrency,
                                                 max_tokens=a.max_tokens)
                                     + ["--speculative-profile", "--speculative-profile-output", profiles[k]], env)
            for k in a.steps}
    servers = start_all(plan, a.logs, first_port=32000, cpus=a.cpus)
    by_steps = dict(zip(a.steps, servers.values()))
    result = {"benchmark": "advisor", "sglang": a.sglang, "simulated_accept_length": a.acc,
              "profiled_steps": a.profile_steps, "new_tokens": a.new_tokens, "tolerance": TOLERANCE,
              "command": portable_command("bench/advisor_check.py", sys.argv[1:]),
              "machine": machine(), "date": datetime.date.today().isoformat(),
              "startup_s": round(time.time() - t0, 1), "concurrency": {}}
    runs = {}
    try:
        print(f"{len(servers)} servers ready in {result['startup_s']} s", flush=True)
        for ci, c in enumerate(a.concurrency):
            budget = (t0 + a.max_seconds - time.time()) / (len(a.concurrency) - ci) if a.max_seconds else None
            by_label = interleaved_runs({f"steps {k}": by_steps[k].port for k in a.steps}, c, a.new_tokens,
                                        a.rounds, budget)
            runs[c] = {k: by_label[f"steps {k}"] for k in a.steps}
    finally:
        stop_all(servers)  # the profiles' last lines are complete once the servers are gone
    judge(result, runs, profiles[a.profile_steps])
    name = os.path.join(a.out, f"advisor-{a.sglang}-acc{a.acc}.json")
    with open(name, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {name}", flush=True)
    if a.publish is not None:
        publish([name], a.publish_to)


if __name__ == "__main__":
    main()
