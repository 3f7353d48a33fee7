#!/usr/bin/env python3
"""Host time the profiler's hooks add to one decode cycle, on a real GPU stream.

Runs the calls a v2 decode cycle makes (begin, 11 marks, end, harvest) with real CUDA
events and no GPU work, and the same calls on the profiler that --speculative-profile
off installs, and prints microseconds per cycle (median of --reps runs of --cycles).
That is the most the profiler can slow a cycle whose host work is on the critical path.

    python bench/hook_cost.py [--cycles 5000] [--reps 7] [--cpu]
"""
import argparse
import json
import logging
import statistics
import time

from sglang.specprof.profiler import NullProfiler, Profiler

MARKS = ["draft_prep", "draft_inputs", "draft", "draft_outputs", "tree", "verify_prep", "verify", "accept",
         "draft_extend_prep", "draft_extend", "draft_extend_post"]


class _Event:
    __slots__ = ("t",)


class CpuBackend:
    """Events that cost nothing: what remains is the profiler's own Python."""

    def __init__(self):
        self.t = 0.0

    def refresh(self):
        pass

    def new_event(self, external=False):
        return _Event()

    def record(self, ev):
        self.t += 0.1
        ev.t = self.t

    def query(self, ev):
        return True

    def elapsed(self, a, b):
        return b.t - a.t

    def capturing(self):
        return False


def per_cycle_us(p, cycles, sync, bs=8):
    correct = [2] * bs
    sync()
    t = time.perf_counter()
    for _ in range(cycles):
        p.begin("decode", bs, 8000)
        for m in MARKS:
            p.mark(m)
        p.end()
        p.harvest(correct)
    secs = time.perf_counter() - t
    sync()
    return secs / cycles * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cpu", action="store_true",
                    help="no GPU: events that cost nothing, so only the profiler's Python is timed")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, handlers=[logging.NullHandler()])
    config = {"algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "draft_tokens": 4}
    if a.cpu:
        import platform

        backend, sync, device = CpuBackend(), (lambda: None), platform.processor()
    else:
        import torch

        from sglang.specprof.cuda_backend import CudaBackend

        torch.cuda.set_stream(torch.cuda.Stream())  # a stream of its own, as the scheduler's forward stream
        backend, sync, device = CudaBackend(), torch.cuda.synchronize, torch.cuda.get_device_name()
    on = Profiler(backend, interval=100, config=config)
    off = NullProfiler()
    per_cycle_us(on, 500, sync)  # warm up
    res = {"off": [], "on": []}
    for _ in range(a.reps):  # interleaved
        res["off"].append(per_cycle_us(off, a.cycles, sync))
        res["on"].append(per_cycle_us(on, a.cycles, sync))
    out = {k: round(statistics.median(v), 2) for k, v in res.items()}
    out["added_us_per_cycle"] = round(out["on"] - out["off"], 2)
    out["runs_us"] = {k: [round(x, 2) for x in v] for k, v in res.items()}
    out["device"] = device or "cpu"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
