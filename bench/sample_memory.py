#!/usr/bin/env python3
"""What a kernel sample leaves behind in host memory, without a server: short torch profiler
sessions as the kernel sampler runs them (CPU and CUDA activity, a few thousand small kernels
each, the recorded events read through `kineto_results.events()`), in a process with a
serving process's heap (`--heap` million long-lived objects, which Python's cyclic garbage
collector walks, as in the scheduler).

Each mode runs in a process of its own, the modes one after another, `--rounds` times in
alternating order:

  drop      the profile object dropped after the read (as the sampler did before)
  release   `kernel_sampler.release(prof)` after the read (what the sampler does now)
  trim      release, then glibc's malloc_trim(0) (`--modes`; freed memory the allocator still held)

and records the process's RSS (VmRSS, MB) every `--every` sessions, and how many full
collections ran. The result: each mode's RSS growth per session after the first
`--warm` sessions (least squares), and its full collections.

  PYTHONPATH=overlay python bench/sample_memory.py --out OUT [--sessions 300 --kernels 3000] [--device cpu]

`--device cpu`: CPU activity only, the ops on the CPU (no GPU needed): the same profile
object and reference cycle, with the host's op events in place of the kernels.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def child(mode: str, sessions: int, kernels: int, heap: int, every: int, device: str) -> dict:
    import torch

    from sglang.specprof.kernel_sampler import release  # overlay/ on PYTHONPATH

    keep = [(i, str(i)) for i in range(heap * 1_000_000 // 2)]  # the scheduler's long-lived heap
    gc.collect()
    full = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(1))
    tp = torch.profiler
    cuda = device == "cuda"
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    x = torch.ones(64, device=device)
    samples, events_seen, trim_s = [], 0, []
    t0 = time.time()
    for s in range(sessions):
        prof = tp.profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
        prof.start()
        with tp.record_function("specprof:verify"):
            for _ in range(kernels):
                x.add_(1.0)
        if cuda:
            torch.cuda.synchronize()
        prof.stop()
        events = prof.profiler.kineto_results.events()
        events_seen += sum(1 for e in events if str(e.device_type()).endswith("CUDA")) if cuda else len(events)
        del events
        if mode in ("release", "trim"):
            release(prof)
        del prof
        if mode == "trim":
            t1 = time.perf_counter()
            trim()
            trim_s.append(time.perf_counter() - t1)
        if s % every == 0 or s == sessions - 1:
            samples.append((s, round(rss_mb(), 1), len(full)))
    before_trim = rss_mb()
    trim()  # what the allocator gives back at the end: freed memory it held, as against memory still in use
    after_trim = rss_mb()
    del keep
    return {"mode": mode, "samples": samples, "full_collections": len(full), "seconds": round(time.time() - t0, 1),
            "events_per_session": round(events_seen / sessions, 1), "rss_mb_before_after_final_trim":
            [round(before_trim, 1), round(after_trim, 1)],
            "trim_ms_median": round(sorted(trim_s)[len(trim_s) // 2] * 1e3, 3) if trim_s else None}


def trim() -> None:
    """glibc's malloc_trim(0): free memory in every arena handed back to the system."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def slope(points, warm):
    pts = [(s, r) for s, r, _ in points if s >= warm]
    n = len(pts)
    if n < 2:
        return None
    mx = sum(s for s, _ in pts) / n
    my = sum(r for _, r in pts) / n
    sxx = sum((s - mx) ** 2 for s, _ in pts)
    return sum((s - mx) * (r - my) for s, r in pts) / sxx if sxx else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--kernels", type=int, default=3000, help="kernels launched inside each session")
    ap.add_argument("--heap", type=int, default=4, help="million long-lived objects in the process")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--warm", type=int, default=30, help="sessions left out of the slope")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: CPU activity only, the ops on the CPU (events: the host's ops)")
    ap.add_argument("--modes", nargs="+", choices=("drop", "release", "trim"), default=["drop", "release"])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.sessions, a.kernels, a.heap, a.every, a.device)))
        return
    os.makedirs(a.out, exist_ok=True)
    runs = []
    for r in range(a.rounds):
        for mode in a.modes if r % 2 == 0 else a.modes[::-1]:
            proc = subprocess.run([sys.executable, __file__, "--out", a.out, "--child", mode, "--sessions",
                                   str(a.sessions), "--kernels", str(a.kernels), "--heap", str(a.heap),
                                   "--every", str(a.every), "--device", a.device], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} failed: {proc.stderr.strip().splitlines()[-1:]}")
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            run["round"] = r
            run["mb_per_session"] = slope(run["samples"], a.warm)
            runs.append(run)
            first, last = run["samples"][0], run["samples"][-1]
            print(f"round {r} {mode:8s} RSS {first[1]:.0f} -> {last[1]:.0f} MB, "
                  f"{run['mb_per_session']:.3f} MB/session after {a.warm}, full collections "
                  f"{run['full_collections']}, {run['events_per_session']} events/session, "
                  f"{run['seconds']} s", flush=True)
    import torch

    result = {"benchmark": "sample_memory", "command": "python bench/sample_memory.py " + " ".join(sys.argv[1:]),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(0) if a.device == "cuda" else f"cpu ({os.cpu_count()} cores)",
              "settings": {k: v for k, v in vars(a).items() if k not in ("out", "child")}, "runs": runs}
    path = os.path.join(a.out, f"sample-memory-{time.strftime('%Y-%m-%d')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
