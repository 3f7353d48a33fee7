#!/usr/bin/env python3
"""Where the hooks' host time falls, cycle by cycle: reads what `bench/hook_cost.py --cycle-times PATH`
wrote (optionally .xz) and prints, for the null profiler (`off`) and the profiler (`on`), the mean and
median microseconds a cycle, the share of the time held by cycles above 50, 100, 300 and 1000 µs,
the long cycles' place in the sequence (index mod 16: the cycles timed by phase fall on multiples
of --speculative-profile-phases-every, the hand-overs every 16 cycles), and the median before the
GPU wait by index mod K.

    python bench/cycle_times.py CT.json[.xz] [--json]
"""
import argparse
import collections
import json
import lzma
import statistics


def load(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def analyse(d) -> dict:
    k = d.get("phases_every") or 4
    out = {}
    for name, v in d["cycles"].items():
        us, pre = v["us"], v["before_wait_us"]
        post = [u - p for u, p in zip(us, pre)]
        total = sum(us) or 1.0
        srt = sorted(us)
        r = {"cycles": len(us), "mean_us": round(statistics.fmean(us), 2), "median_us": round(statistics.median(us), 2),
             "before_wait_mean_us": round(statistics.fmean(pre), 2), "after_wait_mean_us": round(statistics.fmean(post), 2),
             "p99_us": round(srt[int(0.99 * (len(us) - 1))], 1), "max_us": round(srt[-1], 1),
             "above": {str(t): {"cycles": sum(u > t for u in us), "share_of_time": round(sum(u for u in us if u > t) / total, 3)}
                       for t in (50, 100, 300, 1000)}}
        long_pre = [i for i, p in enumerate(pre) if p > 100]
        r["long_before_wait_by_index_mod_16"] = dict(sorted(collections.Counter(i % 16 for i in long_pre).items()))
        by = collections.defaultdict(list)
        for i, x in enumerate(pre):
            by[i % k].append(x)
        r[f"before_wait_median_by_index_mod_{k}"] = {j: round(statistics.median(x), 2) for j, x in sorted(by.items())}
        out[name] = r
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    d = load(a.path)
    res = analyse(d)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"bs {d.get('bs')}, K {d.get('phases_every')}, GPU wait {d.get('wait_us')} us")
    for name, r in res.items():
        print(f"{name}: mean {r['mean_us']} us, median {r['median_us']}, before the wait {r['before_wait_mean_us']}, "
              f"after {r['after_wait_mean_us']}, p99 {r['p99_us']}, max {r['max_us']}")
        for t, x in r["above"].items():
            print(f"   above {t} us: {x['cycles']} cycles, {100 * x['share_of_time']:.0f}% of the time")
        if name != "off":
            print("   long (>100 us) before the wait, by index mod 16:", r["long_before_wait_by_index_mod_16"])
            key = next(k for k in r if k.startswith("before_wait_median_by"))
            print(f"   {key.replace('_', ' ')}:", r[key])


if __name__ == "__main__":
    main()
