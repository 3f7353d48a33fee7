#!/usr/bin/env python3
"""The advisor against an interleaved sweep of static step counts, one server per acceptance mean.

For each --means value, `bench/closed_loop.py` runs one speculative server (multinomial
acceptance of that mean, launched with --speculative-adaptive so that every step count's graphs
are captured) with the static step counts set round by round through the policy's mode file,
each load in every round, the order rotating: the sweep, by the clients' tokens/s and by the
profile's decode rate of each run.

The prediction: the same server's profile cut to what a server run at K steps alone would have
written (each window's buckets at K steps, the configuration of a static K-step server), read by
the advisor, for each K in --profiled. For each load's batch-size bucket, each step count's
tokens/s relative to K, against the sweep's medians relative to K; the pick (`recommend`)
against the sweep's best; the recommendation's low end against what the sweep measured.

    python bench/advisor_sweep.py --means 2 3 4 --seconds-per-mean 420 -- \\
        --statics 1 2 3 4 5 6 --policies --no-plain --alternate 0 --concurrency 1 16 48 \\
        --max-running 48 --tokens-scale 2 --rounds 10
    python bench/advisor_sweep.py --analyse OUT        # again, from the recorded runs (no GPU)
    python bench/advisor_sweep.py --publish OUT/advisor-sweep.json [MORE.json]   # the error the report shows

Needs an NVIDIA GPU for the runs; the analysis runs anywhere. Writes OUT/advisor-sweep.json.
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "overlay"))
TOLERANCE = 0.05  # each prediction relative to the profiled step count, against the sweep's


def as_static(windows: list[dict], k: int) -> list[dict]:
    """The windows a server run at `k` steps alone would have written: each window's buckets
    run at k steps (under their batch-size keys), the configuration of a static k-step server.
    Windows with no bucket at k are left out."""
    out = []
    for w in windows:
        buckets = {key.partition("@")[0]: dict(b) for key, b in (w.get("buckets") or {}).items()
                   if key.endswith(f"@{k}")}
        if not buckets:
            continue
        for b in buckets.values():
            b.pop("steps", None)
        v = copy.copy(w)
        v["buckets"] = buckets
        v["config"] = dict(w.get("config") or {}, num_steps=k, num_draft_tokens=k + 1, topk=1, adaptive=False)
        v.pop("adaptive", None)
        out.append(v)
    return out


def noise(runs: dict[str, list[float]]) -> float:
    """The run-to-run spread: the median, over the settings, of each one's interquartile range
    over its median."""
    spreads = []
    for xs in runs.values():
        if len(xs) >= 4:
            q = statistics.quantiles(xs, n=4)
            spreads.append((q[2] - q[0]) / statistics.median(xs))
    return statistics.median(spreads) if spreads else 0.0


def paired(runs: dict[int, list[float]], k: int) -> dict[int, list[float]]:
    """Each step count's tokens/s over the profiled one's, round by round (the rounds interleave
    them, so a round's pair shares the machine's state): the median ratio and its 95% bootstrap
    interval, {step count: [median, low, high]}. What the sweep resolves of each ratio."""
    from serving import median_ci

    out = {}
    for s, xs in sorted(runs.items()):
        ratios = [a / b for a, b in zip(xs, runs.get(k) or []) if b]
        if s != k and len(ratios) >= 4:
            lo, hi = median_ci(ratios)
            out[s] = [round(statistics.median(ratios), 4), round(lo, 4), round(hi, 4)]
    return out


def judge(advice: dict, measured: dict[int, float], spread: float, k: int, runs: dict | None = None) -> dict:
    """One bucket's advice (profiled at k) against the sweep's medians by step count; with the
    sweep's `runs` (each step count's tokens/s round by round), each prediction relative to k
    against the interval of the paired ratios (`paired`)."""
    pred = {r["steps"]: r for r in advice["rows"]}
    errors = {}
    for s, m in sorted(measured.items()):
        if s in pred and k in measured and pred[k]["tokens_per_s"]:
            got = pred[s]["tokens_per_s"] / pred[k]["tokens_per_s"]
            want = m / measured[k]
            errors[s] = round(got / want - 1, 4)
    intervals = {}
    if runs and pred.get(k, {}).get("tokens_per_s"):
        for s, (med, lo, hi) in paired(runs, k).items():
            if s in pred:
                got = pred[s]["tokens_per_s"] / pred[k]["tokens_per_s"]
                intervals[s] = {"measured": [med, lo, hi], "predicted": round(got, 4), "inside": lo <= got <= hi}
    best = max(measured, key=measured.get)
    rec = advice["recommend"]
    pick_ok = rec in measured and measured[rec] >= measured[best] * (1 - spread)
    low_holds = True
    if rec != k and rec in pred and rec in measured:
        claimed = pred[rec]["low"] / pred[k]["tokens_per_s"]
        low_holds = measured[rec] / measured[k] >= claimed * (1 - spread)
    return {"profiled": k, "errors": errors,
            "largest_error": max((abs(e) for s, e in errors.items() if s != k), default=None),
            "recommend": rec, "best_measured": best, "pick_within_noise": pick_ok,
            "recommendation_low_end_holds": low_holds, "profile_next": advice.get("profile_next"),
            "noise": round(spread, 4), "intervals": intervals}


def bucket_rates(cuts: dict[int, dict]) -> dict[int, dict[str, float]]:
    """{step count: {bucket: tokens/s}}: each static run's decode cycles by batch size, from the
    sweep server's own profile cut to that step count (`cuts`: {step count: its summary}; its
    GPU time alone: no prefill, no ramp up or down)."""
    return {s: {b: v["tokens_per_s"] for b, v in summary["buckets"].items() if v.get("cycles") and v.get("tokens_per_s")}
            for s, summary in cuts.items()}


def analyse_mean(result: dict, windows: list[dict], profiled: list[int], static: list[dict] | None = None) -> dict:
    """Each load's advice from the sweep server's profile cut to each step count of `profiled`,
    and, with `static` (the windows of the static server closed_loop.py --profiled-server ran,
    with its kernel view), from that profile as a user of that server reads it, and from the
    sweep server's profile cut to that step count with the static server's kernel samples.

    Judged against three measures of the same sweep: the clients' medians (which hold each
    request's prefill and the ramp up and down of the load's batch: their ratios between step
    counts lie nearer 1), the profile's decode rate of each run (every batch size the run
    passed through), and the profile's rate in the load's own batch-size bucket at each step
    count (what the advisor predicts)."""
    from sglang_specprof import report
    from sglang_specprof.window import bucket_of

    steps = sorted({int(m) for runs in result["runs"].values() for m in runs if m.isdigit()})
    cuts = {s: report.summarize(as_static(windows, s)) for s in sorted(set(steps) | set(profiled))}
    sources = [(f"profiled at {k}", k, cuts[k]) for k in profiled]
    if static:
        k = (static[0].get("config") or {}).get("num_steps")
        own = report.summarize(static)
        sources.append((f"static server at {k}", k, own))
        if k in cuts:
            sources.append((f"profiled at {k} with the kernel view", k,
                            dict(cuts[k], kernel_points=own["kernel_points"])))
    advice = {name: report.advise(summary) for name, _, summary in sources}
    by_bucket = bucket_rates({s: cuts[s] for s in steps})
    out = {}
    for ld, runs in result["runs"].items():
        if not ld.startswith("c"):
            continue
        statics = {int(m): xs for m, xs in runs.items() if m.isdigit() and xs}
        if not statics:
            continue
        spread = noise({str(s): xs for s, xs in statics.items()})
        bucket = bucket_of(int(ld[1:]))
        decode = {int(m): xs for m, xs in ((result.get("profile_decode_tok_s") or {}).get(ld) or {}).items()
                  if m.isdigit() and xs}
        per_round = {"clients": statics, "profile": decode}  # the bucket's rate is the whole run's: no rounds
        truths = {"clients": {s: statistics.median(xs) for s, xs in statics.items()},
                  "profile": {s: statistics.median(xs) for s, xs in decode.items()},
                  "bucket": {s: r[bucket] for s, r in by_bucket.items() if bucket in r}}
        for name, k, _ in sources:
            adv = advice[name].get(bucket)
            row = out.setdefault(f"{ld} {name}", {"bucket": bucket, "medians": {}, "judged": {}})
            for by, med in truths.items():
                if k not in med:
                    continue
                row["medians"][by] = {str(s): round(v, 1) for s, v in sorted(med.items())}
                if adv is None:
                    row["judged"][by] = None
                    continue
                row["predicted"] = {str(r["steps"]): [r["tokens_per_s"], r["low"], r["high"]] for r in adv["rows"]}
                row["verify_growth"] = adv.get("verify_growth")
                row["judged"][by] = judge(adv, med, spread, k, per_round.get(by))
    return out


def analyse(out_dir: str, profiled: list[int]) -> dict:
    from sglang_specprof import schema

    res = {"benchmark": "advisor-sweep", "means": {}}
    for d in sorted(glob.glob(os.path.join(out_dir, "mean-*"))):
        found = glob.glob(os.path.join(d, "closed-loop-*.json"))
        prof = [p for p in (os.path.join(d, "logs", "profile.jsonl"), os.path.join(d, "logs", "profile.jsonl.xz"))
                if os.path.exists(p)]
        if not found or not prof:
            continue
        result = json.load(open(found[0]))
        windows, _ = schema.read(prof[0])
        st = [p for p in (os.path.join(d, "logs", "profile-static.jsonl"),
                          os.path.join(d, "logs", "profile-static.jsonl.xz")) if os.path.exists(p)]
        static = schema.read(st[0])[0] if st else None
        res["means"][str(result["mean"])] = {"command": result.get("command"), "machine": result.get("machine"),
                                             "date": result.get("date"), "sglang": result.get("sglang"),
                                             "rounds": min((len(v) for r in result["runs"].values() for v in r.values()),
                                                           default=0),
                                             "cases": analyse_mean(result, windows, profiled, static)}
    return res


def verdict_lines(res: dict) -> list[str]:
    lines = []
    for mean, m in res["means"].items():
        for key, row in m["cases"].items():
            for by, j in row["judged"].items():
                if j is None:
                    lines.append(f"mean {mean} {key} ({by}): no advice")
                    continue
                errs = " ".join(f"{s}:{100 * e:+.1f}%" for s, e in j["errors"].items() if s != j["profiled"])
                lines.append(f"mean {mean} {key} ({by}, {m['rounds']} rounds, noise {100 * j['noise']:.1f}%): "
                             f"errors {errs}; recommend {j['recommend']}, best {j['best_measured']}, pick "
                             f"{'within' if j['pick_within_noise'] else 'OUTSIDE'} noise, low end "
                             f"{'holds' if j['recommendation_low_end_holds'] else 'FAILS'}"
                             + inside_line(j.get("intervals")))
    return lines


def inside_line(intervals: dict | None) -> str:
    """"; inside the paired ratios' 95% interval N of M (outside: step count predicted [interval])"."""
    if not intervals:
        return ""
    out = [f"{s}: {v['predicted']:.3f} [{v['measured'][1]:.3f}, {v['measured'][2]:.3f}]"
           for s, v in intervals.items() if not v["inside"]]
    n = sum(v["inside"] for v in intervals.values())
    return f"; inside the paired interval {n} of {len(intervals)}" + (f" (outside: {', '.join(out)})" if out else "")


PUBLISHED_READINGS = ("profiled at 3", "profiled at 6")  # what a user's profile at a middle or high step count gives


def published(res: dict | list, name: str | list, readings=PUBLISHED_READINGS, truth: str = "clients") -> dict:
    """What advisor_error.json holds, from one sweep's result (`analyse`, recorded as `name`) or
    several (lists of both): for each load, the largest and the median |error| of the predictions
    relative to the profiled setting, over every sweep that measured that load, every mean and
    each reading in `readings`, against the `truth` medians (the clients'); each load with the
    date and the results of the sweeps that measured it."""
    pairs = list(zip(res, name)) if isinstance(res, list) else [(res, name)]
    pooled: dict = {}
    sweeps = []
    for r, nm in pairs:
        for mean, m in r["means"].items():
            for key, row in m["cases"].items():
                ld, _, reading = key.partition(" ")
                j = (row.get("judged") or {}).get(truth)
                if reading not in readings or not j or not ld.startswith("c"):
                    continue
                errs = [abs(e) for s, e in j["errors"].items() if int(s) != j["profiled"]]
                v = pooled.setdefault(int(ld[1:]), {"errors": [], "rounds": [], "dates": set(), "results": []})
                v["errors"] += errs
                v["rounds"].append(m["rounds"])
                v["dates"].add(str(m.get("date")))
                if nm not in v["results"]:
                    v["results"].append(nm)
            sweeps.append({"results": nm, "release": m.get("sglang"), "date": m.get("date"),
                           "command": m.get("command"), "simulated_acceptance_mean": float(mean),
                           "readings": list(readings), "rounds": m["rounds"], "machine": m.get("machine")})
    if not pooled:
        raise SystemExit(f"{', '.join(n for _, n in pairs)}: no load with predictions judged against the {truth}' "
                         f"medians to publish")
    by = {str(c): {"max_abs_error": round(max(v["errors"]), 4),
                   "median_abs_error": round(statistics.median(v["errors"]), 4),
                   "predictions": len(v["errors"]), "rounds": min(v["rounds"]), "date": max(v["dates"]),
                   "results": v["results"]} for c, v in sorted(pooled.items())}
    return {"what": "the step-count advisor's error as bench/advisor_sweep.py measured it against an interleaved "
                    "sweep of static step counts: for each step count other than the profiled one, its predicted "
                    "tokens/s relative to the profiled setting's against the same ratio of the clients' medians "
                    f"(profiles read at {', '.join(r.split()[-1] for r in readings)} steps, every acceptance mean)",
            "release": ", ".join(dict.fromkeys(str(s["release"]) for s in sweeps)),
            "date": max(str(s["date"]) for s in sweeps), "results": [n for _, n in pairs],
            "by_concurrency": by, "sweeps": sweeps}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--means", type=float, nargs="+", default=[3.0])
    ap.add_argument("--profiled", type=int, nargs="+", default=[1, 3, 6], help="the step counts read as profiles")
    ap.add_argument("--seconds-per-mean", type=float, default=420.0, help="closed_loop.py's --max-seconds, each")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--logs", default=None, help="unused: each mean's logs go under OUT/mean-M/logs")
    ap.add_argument("--analyse", metavar="OUT", help="only the analysis, of a sweep written before")
    ap.add_argument("--publish", metavar="RESULT", nargs="+",
                    help="write the advisor's error measured by sweeps written before (OUT/advisor-sweep.json) into "
                         "the package's advisor_error.json, which the report shows: each load's figures pooled over "
                         "the sweeps that measured it")
    ap.add_argument("--publish-to", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then closed_loop.py's options")
    a = ap.parse_args()
    if a.publish:
        from advisor_check import ERROR_FILE, write_published

        results = []
        for path in a.publish:
            with open(path) as f:
                results.append(json.load(f))
        write_published(published(results, [os.path.basename(p) for p in a.publish]), a.publish_to or ERROR_FILE)
        return
    if a.analyse:
        res = analyse(a.analyse, a.profiled)
        if not res["means"]:
            sys.exit(f"no sweep under {a.analyse}: expected mean-M/closed-loop-*.json and mean-M/logs/profile.jsonl")
        out_dir = a.analyse
    else:
        rest = [x for x in a.rest if x != "--"]
        for mean in a.means:
            d = os.path.join(a.out, f"mean-{mean:g}")
            os.makedirs(os.path.join(d, "logs"), exist_ok=True)
            cmd = [sys.executable, os.path.join(HERE, "closed_loop.py"), "--out", d, "--logs", os.path.join(d, "logs"),
                   "--mean", str(mean), "--max-seconds", str(a.seconds_per_mean)] + rest
            print(f"mean {mean:g}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.time()
            rc = subprocess.call(cmd)
            print(f"mean {mean:g}: rc {rc} in {time.time() - t0:.0f} s", flush=True)
        res = analyse(a.out, a.profiled)
        out_dir = a.out
    path = os.path.join(out_dir, "advisor-sweep.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print("\n".join(verdict_lines(res)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
