#!/usr/bin/env python3
"""Where the hand-overs' time goes: the cycles of bench/hook_cost.py read the server's way (v2: at
each hand-over on the scheduler's thread, closed windows on the outputs thread), each hand-over
timed whole, each item it folds timed by its kind (a cycle's slot, its acceptance list, a
window's close; a slot whose events had not completed apart), and each driver call the reads make
counted and timed (the readiness query, the elapsed times, the readiness read as a span).

    python bench/hand_overs.py [--cpu] [--wait-kind overlap|spin|cuda] [--wait-us 300] [--bs 8]
                               [--phases-every 4] [--cycles 2000]

Prints one JSON line. The wrappers that time the items and the calls add about 0.3 us to each
(the 2-core CPU machine), so read the shares, and time two trees each in its own process
(`PYTHONPATH=TREE/overlay`). On the GPU machine the driver calls are the profiler's ctypes ones
(cuda_backend.DriverEvents._hold_gil); with `--cpu` events cost nothing and none is made.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hook_cost  # noqa: E402

from sglang.specprof.profiler import Profiler  # noqa: E402

CALLS = ("query_held", "elapsed_held", "span_held")  # the reader's driver calls, where the backend has them


def instrument(p, clock=time.perf_counter):
    """Wrap `p`'s folder and reader so that each hand-over, each item folded and each driver call
    is counted and timed; returns the record they fill."""
    rec = {"hand_overs": [], "items": [], "by_item": {}, "calls": {}}
    f, r = p.folder, p.reader
    fold_one, submit = f._fold_one, f.submit

    def timed_fold_one(yield_gil):
        kind = f._items[0][0] if f._items else None
        t = clock()
        ok = fold_one(yield_gil)
        a = rec["by_item"].setdefault(kind if ok else f"{kind}, not ready", [0, 0.0])
        a[0] += 1
        a[1] += clock() - t
        return ok

    def timed_submit(items):
        n = len(items)
        t = clock()
        submit(items)
        rec["hand_overs"].append(clock() - t)
        rec["items"].append(n)

    f._fold_one, f.submit = timed_fold_one, timed_submit
    for name in CALLS:
        fn = getattr(r, name, None)
        if fn is None:
            continue
        acc = rec["calls"].setdefault(name.split("_")[0], [0, 0.0])

        def timed(*args, _fn=fn, _acc=acc):
            t = clock()
            v = _fn(*args)
            _acc[1] += clock() - t
            _acc[0] += 1
            return v

        setattr(r, name, timed)
    return rec


def reset(rec):
    rec["hand_overs"].clear()
    rec["items"].clear()
    rec["by_item"].clear()
    for v in rec["calls"].values():
        v[0], v[1] = 0, 0.0


def summary(rec, us, cycles):
    h = [x * 1e6 for x in rec["hand_overs"]]
    per = {k: {"n": n, "us_each": round(s / n * 1e6, 2) if n else None} for k, (n, s) in sorted(rec["by_item"].items())}
    calls = {k: {"n": n, "us_each": round(s / n * 1e6, 3) if n else None} for k, (n, s) in sorted(rec["calls"].items())}
    return {"cycles": cycles, "cycle_mean_us": round(statistics.fmean(us), 2),
            "cycle_median_us": round(statistics.median(us), 2), "hand_overs": len(h),
            "hand_over_median_us": round(statistics.median(h), 1) if h else None,
            "hand_over_mean_us": round(statistics.fmean(h), 1) if h else None,
            "hand_over_p90_us": round(sorted(h)[int(0.9 * len(h))], 1) if h else None,
            "items_median": statistics.median(rec["items"]) if h else None,
            "hand_over_us_per_cycle": round(sum(h) / cycles, 2), "by_item": per, "driver_calls": calls,
            "driver_calls_per_cycle": round(sum(n for n, _ in rec["calls"].values()) / cycles, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--phases-every", type=int, default=4, metavar="K")
    ap.add_argument("--wait-us", type=float, default=300.0)
    ap.add_argument("--wait-kind", choices=["spin", "cuda", "overlap"], default="overlap",
                    help="as bench/hook_cost.py's (default overlap: the v2 scheduler's)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: events that cost nothing (--wait-kind spin)")
    a = ap.parse_args()
    if a.cycles < 16:
        ap.error("--cycles is 16 or more (a hand-over is 16 cycles)")
    config = {"algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "draft_tokens": 4, "worker": "v2"}
    kw = dict(bs=a.bs, wait_s=a.wait_us / 1e6)
    if a.cpu:
        backend, sync, device, kind = hook_cost.CpuBackend(), (lambda: None), "cpu", "spin"
    else:
        import torch

        from sglang.specprof import cuda_backend

        torch.cuda.set_stream(torch.cuda.Stream())  # a stream of its own, as the scheduler's forward stream
        backend, sync, device, kind = cuda_backend.CudaBackend(), torch.cuda.synchronize, torch.cuda.get_device_name(), \
            a.wait_kind
        kw["ctx"] = lambda n: torch.full((n,), 1000, dtype=torch.int64)
        if kind == "overlap":
            kw["wait"] = hook_cost.OverlapWait()
        elif kind == "cuda":
            kw["wait"] = hook_cost.cuda_wait_fn()
    p = Profiler(backend, interval=100, config=config, phases_every=a.phases_every,
                 **hook_cost.reading_kw(Profiler, "outputs"))
    rec = instrument(p)
    hook_cost.run(p, 500, sync, **kw)  # warm up
    p.flush()
    reset(rec)
    us = hook_cost.run(p, a.cycles, sync, **kw)
    out = summary(rec, us, a.cycles)
    out.update(device=device, wait_kind=kind, wait_us=a.wait_us, bs=a.bs, phases_every=a.phases_every,
               elapsed_symbol=getattr(backend, "elapsed_symbol", None))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
