#!/usr/bin/env python3
"""What the phase marks cost the GPU, read from a profile taken with phases in one cycle of K.

In each window and batch-size bucket, the cycles timed phase by phase (`phase_cycle_gpu_ms`)
record about ten events more than those timed whole; the difference of their mean GPU spans
is what those events and the marks' host time add to a cycle where the GPU is the bottleneck
or waits for the host. Also the time between cycles on the GPU and the draft graphs' step
reads made only at the next replay. Prints one JSON line.

    python bench/profile_marks.py PROFILE.jsonl[.xz]
"""
import json
import lzma
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "overlay"))
from sglang_specprof.report import marks_added  # noqa: E402


def main():
    path = sys.argv[1]
    rows, graphs, last = {}, {}, {}
    with (lzma.open if path.endswith(".xz") else open)(path, "rt") as f:
        for line in f:
            w = json.loads(line)
            graphs = w.get("graphs", graphs)
            last = w
            for key, b in w.get("buckets", {}).items():
                n, nd = b.get("cycle_gpu_ms", {}).get("n", 0), b.get("phase_cycle_gpu_ms", {}).get("n", 0)
                added = marks_added(b)
                if added is not None and n > 20 and nd > 3:
                    detail = b["phase_cycle_gpu_ms"]["mean"]
                    gap = b.get("between_cycles_gpu_ms", {}).get("mean")
                    rows.setdefault(key, []).append((detail, detail - added, gap))
    out = {"profile": path.rsplit("/", 1)[-1], "buckets": {}}
    for key, rs in rows.items():
        out["buckets"][key] = {
            "windows": len(rs),
            "phase_cycle_gpu_ms": round(statistics.median(r[0] for r in rs), 4),
            "whole_cycle_gpu_ms": round(statistics.median(r[1] for r in rs), 4),
            "marks_add_us": round(statistics.median((r[0] - r[1]) * 1000 for r in rs), 1),
            "between_cycles_gpu_ms": round(statistics.median(r[2] for r in rs if r[2] is not None), 4),
        }
    out["draft_replays"] = graphs.get("draft_replays")
    out["steps_read_late"] = graphs.get("steps_read_late")
    # the last window's counts since start: cycles run against cycles timed
    totals = last.get("totals", {})
    out["decode_cycles"] = totals.get("decode_cycles")
    out["phase_cycles"] = totals.get("phase_cycles")
    out["dropped_cycles"] = last.get("dropped_cycles")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
