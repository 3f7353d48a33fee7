#!/usr/bin/env python3
"""Host time the profiler's hooks add to one decode cycle, on a real GPU stream.

Runs the calls a v2 decode cycle makes (begin, 11 marks, end, harvest) with real CUDA
events and no GPU work, and the same calls on the profiler that --speculative-profile
off installs, and prints microseconds per cycle (median of --reps runs of --cycles).
That is the most the profiler can slow a cycle whose host work is on the critical path.

    python bench/hook_cost.py [--cycles 5000] [--reps 7]
"""
import argparse
import json
import logging
import statistics
import time

import torch

from sglang.specprof.cuda_backend import CudaBackend
from sglang.specprof.profiler import NullProfiler, Profiler

MARKS = ["draft_prep", "draft_inputs", "draft", "draft_outputs", "tree", "verify_prep", "verify", "accept",
         "draft_extend_prep", "draft_extend", "draft_extend_post"]


def per_cycle_us(p, cycles, bs=8):
    correct = [2] * bs
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(cycles):
        p.begin("decode", bs, 8000)
        for m in MARKS:
            p.mark(m)
        p.end()
        p.harvest(correct)
    secs = time.perf_counter() - t
    torch.cuda.synchronize()
    return secs / cycles * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, handlers=[logging.NullHandler()])
    with torch.cuda.stream(torch.cuda.Stream()):
        on = Profiler(CudaBackend(), interval=100, config={"algorithm": "EAGLE3", "num_steps": 3, "topk": 1,
                                                           "draft_tokens": 4})
        off = NullProfiler()
        per_cycle_us(on, 500)  # warm up
        res = {"off": [], "on": []}
        for _ in range(a.reps):  # interleaved
            res["off"].append(per_cycle_us(off, a.cycles))
            res["on"].append(per_cycle_us(on, a.cycles))
    out = {k: round(statistics.median(v), 2) for k, v in res.items()}
    out["added_us_per_cycle"] = round(out["on"] - out["off"], 2)
    out["runs_us"] = {k: [round(x, 2) for x in v] for k, v in res.items()}
    out["device"] = torch.cuda.get_device_name()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
