#!/usr/bin/env python3
"""What the draft graphs' step events cost the GPU, from two profiles of the same load.

Each draft graph captured with step times holds an event node at every step boundary, and
every replay runs them, timed or not. Two servers of one load, one profiled as by default and
one with `SGLANG_SPECPROF_DRAFT_STEPS=0` (no nodes), time the same replay as their `draft`
phase: the difference is what the nodes cost a replay, that is a cycle. For each batch-size
bucket, the median over the windows of each profile's draft p50, their difference with a 95%
bootstrap interval (windows resampled in each profile), and that difference as a share of the
bucket's cycle; one JSON object.

    PYTHONPATH=overlay python3 bench/draft_nodes.py WITH_STEPS.jsonl WITHOUT_STEPS.jsonl
"""
from __future__ import annotations

import json
import random
import statistics
import sys

from sglang_specprof import report
from sglang_specprof.schema import ProfileError, SourceError

MIN_PHASE_CYCLES = 5  # a window's draft p50 from fewer phase-timed cycles is left out


def draft_p50s(windows: list) -> dict:
    """bucket -> the draft phase's GPU p50 (ms) of each window that timed it often enough."""
    out: dict = {}
    for w in windows:
        for name, b in (w.get("buckets") or {}).items():
            g = ((b.get("phases") or {}).get("draft") or {}).get("gpu_ms") or {}
            if (g.get("n") or 0) >= MIN_PHASE_CYCLES and g.get("p50") is not None:
                out.setdefault(name, []).append(g["p50"])
    return out


def interval(a: list, b: list, reps: int = 2000, seed: int = 1) -> list:
    """95% bootstrap interval of median(a) - median(b), each resampled on its own."""
    rnd = random.Random(seed)
    d = sorted(statistics.median(rnd.choices(a, k=len(a))) - statistics.median(rnd.choices(b, k=len(b)))
               for _ in range(reps))
    return [d[int(0.025 * reps)], d[int(0.975 * reps) - 1]]


def compare(with_steps: list, without: list) -> dict:
    """Per bucket both profiles hold: the nodes' cost a replay in µs, its interval, its share of a cycle."""
    a, b = draft_p50s(with_steps), draft_p50s(without)
    cycles = {n: (s.get("cycle_gpu_ms") or {}).get("mean") for n, s in report.summarize(with_steps)["buckets"].items()}
    out = {}
    for name in sorted(set(a) & set(b), key=lambda n: (len(n), n)):
        ma, mb = statistics.median(a[name]), statistics.median(b[name])
        diff = ma - mb
        lo, hi = interval(a[name], b[name])
        row = {"windows": [len(a[name]), len(b[name])], "draft_p50_ms": [round(ma, 4), round(mb, 4)],
               "nodes_us": round(diff * 1000, 1), "nodes_us_ci95": [round(lo * 1000, 1), round(hi * 1000, 1)]}
        cyc = cycles.get(name)
        if cyc:
            row["share_of_cycle"] = round(diff / cyc, 5)
        out[name] = row
    return out


def main(argv: list) -> dict:
    if len(argv) != 2:
        sys.exit("usage: bench/draft_nodes.py WITH_STEPS.jsonl WITHOUT_STEPS.jsonl")
    try:
        loaded = [report.load(p)[0] for p in argv]
    except (ProfileError, SourceError) as e:
        sys.exit(str(e))
    for p, w in zip(argv, loaded):
        if not w:
            sys.exit(f"{p}: no window in this profile.")
    return {"profiles": argv, "buckets": compare(*loaded)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
