#!/usr/bin/env python3
"""What the torch profiler (CUPTI through kineto) gives for a short stretch of decode-like cycles.

    python bench/kernel_probe.py --out DIR

A CUDA graph of matmuls (the "verify") and eager kernels around it ("prep", "accept"), with a
zero-length user annotation at every phase boundary, as the kernel sampler places them.
For each activity set (CUDA alone; CPU and CUDA) it starts and stops the profiler a few
times around 8 cycles and writes DIR/probe.json: the host cost of start, stop and reading
the events (the kineto events API and the Chrome trace export), whether graph-replayed
kernels come back with the correlation of their cudaGraphLaunch, whether the annotations
are recorded, and each phase's span by CUDA events against its span from the kernels'
timestamps. Needs an NVIDIA GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = x
            for _ in range(16):
                y = torch.relu(y @ w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(16):
            y = torch.relu(y @ w)
    torch.cuda.synchronize()

    def annotate(name):
        with torch.profiler.record_function(name):
            pass

    def cycle(evs, marks):
        stream = torch.cuda.current_stream()
        evs[0].record(stream)
        annotate("specprof/begin")
        marks.append(("begin", time.time_ns()))
        z = x * 2 + 1  # prep
        z = torch.cumsum(z, dim=-1)
        evs[1].record(stream)
        annotate("specprof/prep")
        marks.append(("prep", time.time_ns()))
        g.replay()  # verify
        evs[2].record(stream)
        annotate("specprof/verify")
        marks.append(("verify", time.time_ns()))
        t = torch.topk(y.float(), 4, dim=-1).values  # accept
        t = t.sum()
        evs[3].record(stream)
        annotate("specprof/accept")
        marks.append(("accept", time.time_ns()))
        return t

    results = {"torch": torch.__version__, "kineto": torch.autograd.kineto_available(), "runs": []}
    for acts_name, acts in (("cuda", [torch.profiler.ProfilerActivity.CUDA]),
                            ("cpu+cuda", [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])):
        for rep in range(a.repeats):
            # host time per cycle without the profiler, for the slowdown
            evsets = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(a.cycles)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(a.cycles):
                cycle(evsets[i], [])
            torch.cuda.synchronize()
            off_s = time.perf_counter() - t0
            prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            t0 = time.perf_counter()
            prof.start()
            t_start = time.perf_counter() - t0
            marks = []
            evsets = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(a.cycles)]
            t0 = time.perf_counter()
            for i in range(a.cycles):
                cycle(evsets[i], marks)
            t_cycles_host = time.perf_counter() - t0
            torch.cuda.synchronize()
            on_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            prof.stop()
            t_stop = time.perf_counter() - t0
            t0 = time.perf_counter()
            kev = prof.profiler.kineto_results.events()
            t_events = time.perf_counter() - t0
            attrs = [n for n in dir(kev[0]) if not n.startswith("_")] if kev else []
            rows = []
            t0 = time.perf_counter()
            for e in kev:
                rows.append((e.name(), str(e.device_type()), e.start_ns(), e.duration_ns(), e.correlation_id(),
                             getattr(e, "linked_correlation_id", lambda: None)(),
                             getattr(e, "activity_type", lambda: None)() if callable(getattr(e, "activity_type", None)) else None))
            t_rows = time.perf_counter() - t0
            path = os.path.join(a.out, f"trace-{acts_name}-{rep}.json")
            t0 = time.perf_counter()
            prof.export_chrome_trace(path)
            t_export = time.perf_counter() - t0
            with open(path) as f:
                trace = json.load(f)
            evs = trace.get("traceEvents", [])
            cats = {}
            for e in evs:
                cats[e.get("cat")] = cats.get(e.get("cat"), 0) + 1
            runtime = {e["args"].get("correlation"): e for e in evs if e.get("cat") == "cuda_runtime" and "args" in e}
            driver = {e["args"].get("correlation"): e for e in evs if e.get("cat") == "cuda_driver" and "args" in e}
            kernels = [e for e in evs if e.get("cat") == "kernel"]
            linked = {}
            for k in kernels:
                c = k.get("args", {}).get("correlation")
                r = runtime.get(c) or driver.get(c)
                linked[r["name"] if r else None] = linked.get(r["name"] if r else None, 0) + 1
            ann = sorted((e["ts"], e["name"]) for e in evs if e.get("cat") == "user_annotation")
            # each phase's span from the kernels: kernels launched (runtime ts) between the
            # annotation before and the phase's own annotation; span = end of its last kernel
            # minus end of the previous phase's last kernel
            spans = []
            ph_ann = [(ts, n.split("/", 1)[1]) for ts, n in ann if n.startswith("specprof/")]
            launches = []
            for k in kernels:
                c = k.get("args", {}).get("correlation")
                r = runtime.get(c) or driver.get(c)
                if r is not None:
                    launches.append((r["ts"], k["ts"], k["ts"] + k["dur"], k["name"]))
            launches.sort()
            import bisect
            ann_ts = [t for t, _ in ph_ann]
            phase_end = {}
            for lts, ks, ke, name in launches:
                j = bisect.bisect_left(ann_ts, lts)  # the first annotation after the launch closes its phase
                if j < len(ph_ann):
                    phase_end[j] = max(phase_end.get(j, 0), ke)
            for i in range(a.cycles):
                e = evsets[i]
                base = 4 * i
                row = {}
                for k, nm in ((1, "prep"), (2, "verify"), (3, "accept")):
                    ev_ms = e[k - 1].elapsed_time(e[k])
                    cur, prev = phase_end.get(base + k), phase_end.get(base + k - 1)
                    row[nm] = [round(ev_ms, 4), round((cur - prev) / 1000.0, 4) if cur and prev else None]
                spans.append(row)
            # clock: annotation ts (us) against time.time_ns() at the same mark
            base_ns = trace.get("baseTimeNanoseconds")
            offs = []
            if ph_ann and marks and len(ph_ann) == len(marks):
                for (ts, _), (_, tn) in zip(ph_ann, marks):
                    offs.append(tn / 1000.0 - (ts + (base_ns or 0) / 1000.0))
            results["runs"].append({
                "activities": acts_name, "repeat": rep, "start_s": t_start, "stop_s": t_stop,
                "events_s": t_events, "rows_s": t_rows, "export_s": t_export, "n_kineto": len(kev),
                "kineto_attrs": attrs, "cycles_host_s": t_cycles_host, "cycles_on_s": on_s, "cycles_off_s": off_s,
                "cats": cats, "kernels_by_launch": linked, "annotations": len(ann), "spans_event_vs_kernel": spans,
                "clock_offset_us": [min(offs), max(offs)] if offs else None, "base_ns": base_ns,
                "trace_bytes": os.path.getsize(path), "sample_rows": [list(map(str, r)) for r in rows[:6]],
            })
            if rep > 0:
                os.remove(path)
            print(acts_name, rep, {k: results["runs"][-1][k] for k in ("start_s", "stop_s", "events_s", "export_s",
                                                                         "annotations", "kernels_by_launch")}, flush=True)
    with open(os.path.join(a.out, "probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
