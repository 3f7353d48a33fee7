#!/usr/bin/env python3
"""How well a draft step is priced without its step times, over recorded profiles.

Where a bucket has no draft-step times (none read, or `SGLANG_SPECPROF_DRAFT_STEPS=0`), the
advisor prices a draft step as the draft phase over its forward steps (steps - 1: the last step
only selects). For every bucket that has step times (20 cycles or more), this sets that
estimate, and the draft extend (the estimate before), against the mean of the forward steps
measured, split by whether the draft ran as a graph or eagerly; one JSON object.

    PYTHONPATH=overlay python3 bench/step_pricing.py PROFILE [PROFILE ...]
"""
from __future__ import annotations

import json
import statistics
import sys

from sglang_specprof import report
from sglang_specprof.schema import ProfileError, SourceError

MIN_CYCLES = 20


def bucket_ratios(summary: dict):
    """(eager, draft phase over forward steps / measured step, draft extend / measured step) of
    each bucket with step times."""
    for b in summary["buckets"].values():
        steps = [s["mean"] for s in b.get("draft_steps_gpu_ms") or []]
        ph = {n: p["gpu_ms"]["mean"] for n, p in b["phases"].items()}
        if len(steps) < 2 or not ph.get("draft") or (b.get("cycles") or 0) < MIN_CYCLES:
            continue
        forwards = steps[:-1]
        measured = sum(forwards) / len(forwards)
        if measured <= 0:
            continue
        eager = ((b.get("graph") or {}).get("eager") or {}).get("draft", 0) > 0
        yield eager, ph["draft"] / len(forwards) / measured, (ph.get("draft_extend") or 0.0) / measured


def summarize(rows: list) -> dict:
    if not rows:
        return {"buckets": 0}
    phase = [r for _, r, _ in rows]
    extend = [e for _, _, e in rows]
    return {"buckets": len(rows),
            "draft_over_forwards": {"median": round(statistics.median(phase), 3), "min": round(min(phase), 3),
                                    "max": round(max(phase), 3),
                                    "within_5pct": sum(abs(r - 1) <= 0.05 for r in phase)},
            "draft_extend": {"median": round(statistics.median(extend), 3), "min": round(min(extend), 3),
                             "max": round(max(extend), 3)},
            "phase_estimate_nearer": sum(abs(r - 1) < abs(e - 1) for _, r, e in rows)}


def main(paths: list[str]) -> dict:
    rows, read = [], 0
    for path in paths:
        try:
            windows, _ = report.load(path)
        except (ProfileError, SourceError) as e:
            sys.exit(str(e))
        if not windows:
            continue
        read += 1
        rows += list(bucket_ratios(report.summarize(windows)))
    return {"profiles": read, "graph": summarize([r for r in rows if not r[0]]),
            "eager": summarize([r for r in rows if r[0]])}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: bench/step_pricing.py PROFILE [PROFILE ...]")
    print(json.dumps(main(sys.argv[1:]), indent=1))
