#!/usr/bin/env python3
"""The rounds of several `bench/overhead.py` results pooled into one median and interval.

At a cost of a few tenths of a percent, a run-to-run spread of 2-3% needs a hundred rounds
or more to pin the median ratio down to the goal's bounds, more than one call of the GPU
machine holds. Each round of `overhead.py` is a pair (on and off, plus upstream, in one
rotation), so rounds from several calls pool: their ratios are put together and the median
and its bootstrap 95% interval taken again over all of them. Only results of the same
measurement pool: the same release, load (concurrency, new tokens), way of running
(`--same-process`, extra flags) and machine, and the same profiler code (the `profiler`
fingerprint each result records); anything else is refused with the field that differs.

    python bench/pool.py bench/results/overhead-0.5.12-c1-a.json bench/results/overhead-0.5.12-c1-b.json \\
        --out bench/results/overhead-0.5.12-c1-pooled.json

Results from before the fingerprint was recorded pool only with `--same-profiler`, which
says the caller knows they ran the same profiler code.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import portable_command, ratio_summary, write_json  # noqa: E402

SAME = ("benchmark", "sglang", "concurrency", "new_tokens", "same_process", "on_extra", "off_profile", "machine")


class Refused(Exception):
    pass


def _ratio(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON holds")


def read(path):
    try:
        with open(path) as f:
            r = json.load(f, parse_constant=_no_constant)
    except OSError as e:
        raise Refused(f"cannot read {path}: {e.strerror}") from None
    except RecursionError:
        raise Refused(f"{path} is not a JSON result (nested too deep)") from None
    except ValueError as e:
        raise Refused(f"{path} is not a JSON result ({e})") from None
    if not isinstance(r, dict) or r.get("benchmark") != "overhead" or not isinstance(r.get("ratios"), list):
        raise Refused(f"{path} is not a result of bench/overhead.py (no benchmark 'overhead' with its ratios)")
    for key in ("ratios", "ratios_off_vs_upstream"):
        xs = r.get(key, [1.0])
        if not isinstance(xs, list) or not xs or not all(_ratio(x) for x in xs):
            raise Refused(f"{path} holds no rounds in {key}, or a ratio that is not a finite positive number")
    if not isinstance(r.get("profiler"), (str, type(None))):
        raise Refused(f"{path} records a profiler fingerprint that is not a string ({r['profiler']!r})")
    return r


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def pool(paths, same_profiler=False):
    results = [read(p) for p in paths]
    for i, (p, r) in enumerate(zip(paths, results)):
        for q, other in zip(paths[:i], results[:i]):
            if _same(p, q) or r == other:  # its rounds would count twice
                raise Refused(f"{p} is {q} again ({'the same file' if _same(p, q) else 'the same result'}): "
                              f"give each result once")
    first = results[0]
    for p, r in zip(paths[1:], results[1:]):
        for k in SAME:
            if r.get(k) != first.get(k):
                raise Refused(f"{p} differs from {paths[0]} in {k} ({r.get(k)!r} against {first.get(k)!r}): "
                              "its rounds are another measurement")
    prints = [r.get("profiler") for r in results]
    if None in prints and not same_profiler:
        p = paths[prints.index(None)]
        raise Refused(f"{p} records no profiler fingerprint, so it may have run other profiler code: "
                      "pass --same-profiler if it ran the same")
    if len({x for x in prints if x is not None}) > 1:
        raise Refused(f"the results ran different profiler code (fingerprints {sorted(set(x for x in prints if x))})")
    out = {k: first.get(k) for k in SAME if k in first}
    out["benchmark"] = "overhead-pooled"
    out["pooled_from"] = [{"file": os.path.basename(p), "rounds": len(r["ratios"]), "date": r.get("date"),
                           "command": r.get("command")} for p, r in zip(paths, results)]
    out["profiler"] = next((x for x in prints if x is not None), None)
    out["rounds"] = sum(len(r["ratios"]) for r in results)
    out.update(ratio_summary("", [x for r in results for x in r["ratios"]]))
    with_up = [r for r in results if isinstance(r.get("ratios_off_vs_upstream"), list)]
    if with_up:
        out["rounds_with_upstream"] = sum(len(r["ratios_off_vs_upstream"]) for r in with_up)
        out.update(ratio_summary("_off_vs_upstream", [x for r in with_up for x in r["ratios_off_vs_upstream"]]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="overhead-*.json files of one measurement")
    ap.add_argument("--out", help="write the pooled result here (JSON)")
    ap.add_argument("--same-profiler", action="store_true",
                    help="pool results that record no profiler fingerprint (they ran the same profiler code)")
    ap.add_argument("--goal", nargs=2, type=float, default=[0.997, 0.99], metavar=("MEDIAN", "LOW"),
                    help="the on/off median and the lower end of its interval that count as met")
    a = ap.parse_args(argv)
    try:
        r = pool(a.results, a.same_profiler)
    except Refused as e:
        print(f"pool: {e}", file=sys.stderr)
        return 1
    met = r["median_ratio"] >= a.goal[0] and r["median_ratio_ci95"][0] >= a.goal[1]
    r["goal"] = {"median": a.goal[0], "low": a.goal[1], "met": met}
    r["pooled_by"] = portable_command("bench/pool.py", [os.path.basename(x) if x in a.results else x
                                                        for x in (argv if argv is not None else sys.argv[1:])])
    lo, hi = r["median_ratio_ci95"]
    print(f"{r.get('sglang')} c={r.get('concurrency')}: {r['rounds']} rounds from {len(a.results)} results, "
          f"on/off {r['median_ratio']:.4f} [{lo:.4f}, {hi:.4f}]"
          + (f", off/upstream {r['median_ratio_off_vs_upstream']:.4f} "
             f"[{r['median_ratio_off_vs_upstream_ci95'][0]:.4f}, {r['median_ratio_off_vs_upstream_ci95'][1]:.4f}] "
             f"({r['rounds_with_upstream']} rounds)" if "rounds_with_upstream" in r else "")
          + f"; goal (median >= {a.goal[0]}, low >= {a.goal[1]}) {'met' if met else 'not met'}")
    if a.out:
        try:
            write_json(a.out, r)
        except OSError as e:
            print(f"pool: cannot write {a.out}: {e.strerror}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
