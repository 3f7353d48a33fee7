"""Chrome / Perfetto trace events for the cycles a profile sampled (the trace-event JSON format).

Each rank is a process with two threads: "GPU (CUDA events)" and "host"; a profile with
kernel samples adds two more, the sampled cycles' phases as their kernels bound them and
the kernels themselves (named, with their class), on the kernels' own clock, placed at
the start of the window that carries the sample. A sampled cycle
becomes a slice on each, its phases slices inside it. The host track is the host clock.
CUDA events give durations, not a clock shared with the host, so the GPU track is built
from them: a cycle starts where the one before it ended plus the measured GPU time
between the two, and never before the host started it (the first sampled cycle of a
window starts with its host start).
"""

from __future__ import annotations

GPU_TID, HOST_TID = 1, 2
KPHASE_TID, KERNEL_TID = 3, 4  # a kernel sample's cycles: phases as the kernels bound them, the kernels


def _x(name, pid, tid, ts_ms, dur_ms, args=None):
    ev = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(ts_ms * 1000.0, 3),
          "dur": round(max(dur_ms, 0.0) * 1000.0, 3), "cat": "specprof"}
    if args:
        ev["args"] = args
    return ev


FIELDS = ("window", "rank", "time", "wall_seconds", "host_start_s", "samples")  # what the trace reads of a window


def fields(w: dict) -> dict:
    """What `trace` reads of a window (its sampled cycles, its kernel sample's tracks): a
    report that draws a long profile keeps this much of each window, not the whole."""
    out = {k: w[k] for k in FIELDS if k in w}
    k = w.get("kernels")
    if isinstance(k, dict) and k.get("tracks"):
        out["kernels"] = {f: k.get(f) for f in ("tracks", "names", "classes")}
    return out


def trace(windows: list[dict]) -> dict:
    """The trace of every sampled cycle in `windows` (one file may hold several ranks)."""
    events = []
    ranks = sorted({w.get("rank", 0) for w in windows})
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": GPU_TID, "args": {"name": "GPU (CUDA events)"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": HOST_TID, "args": {"name": "host"}})
        if any((w.get("kernels") or {}).get("tracks") for w in windows if w.get("rank", 0) == r):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": KPHASE_TID,
                           "args": {"name": "kernel sample: phases"}})
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": KERNEL_TID,
                           "args": {"name": "kernel sample: kernels"}})
    def origin(w):
        # the profiler's monotonic host clock at the window's first cycle (same in every window
        # of a process); else the window's close time less its length
        if w.get("host_start_s") is not None:
            return w["host_start_s"]
        return w["time"] - (w.get("wall_seconds") or 0)

    cycles = 0
    gpu_end = {}
    for r in ranks:
        mine = sorted((w for w in windows if w.get("rank", 0) == r), key=lambda w: w["window"])
        t0 = min(origin(w) for w in mine)
        for w in mine:
            cycles += _window_events(events, w, r, (origin(w) - t0) * 1000.0, gpu_end)
            _kernel_events(events, w, r, (origin(w) - t0) * 1000.0)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "sglang-specprof", "cycles": cycles}}


def _window_events(events, w, pid, start, gpu_end) -> int:
    cycles = 0
    for smp in w.get("samples") or []:
        at = start + (smp["t_ms"] or 0.0)
        rows = smp["phases"]
        gpu_total = sum(p[2] or 0 for p in rows)
        host_total = (rows[-1][3] or 0) + (rows[-1][4] or 0) if rows else 0.0
        end = gpu_end.get(pid)
        gpu_at = at if end is None else max(at, end + (smp.get("gap_ms") or 0.0))
        gpu_end[pid] = gpu_at + gpu_total
        label = f"cycle bs={smp['bs']} (window {w['window']})"
        events.append(_x(label, pid, GPU_TID, gpu_at, gpu_total, {"draft_steps_gpu_ms": smp.get("steps_gpu_ms")}))
        events.append(_x(label, pid, HOST_TID, at, host_total))
        for name, g_at, g, h_at, h in rows:
            events.append(_x(name, pid, GPU_TID, gpu_at + (g_at or 0), g or 0, {"gpu_ms": g}))
            events.append(_x(name, pid, HOST_TID, at + (h_at or 0), h or 0, {"host_ms": h}))
        cycles += 1
    return cycles


def _kernel_events(events, w, pid, start) -> None:
    k = w.get("kernels") or {}
    names, classes = k.get("names") or [], k.get("classes") or []
    at = start
    for t in k.get("tracks") or []:
        end = at
        label = f"sampled cycle {t.get('cycle')} bs={t.get('bs')} (window {k.get('window')})"
        for pname, off, dur in t.get("phases") or []:
            events.append(_x(pname, pid, KPHASE_TID, at + off / 1000.0, dur / 1000.0, {"span_us": dur, "cycle": label}))
            end = max(end, at + (off + dur) / 1000.0)
        for off, dur, ph, cls, ni in t.get("kernels") or []:
            name = names[ni] if ni < len(names) else "?"
            events.append(_x(name, pid, KERNEL_TID, at + off / 1000.0, dur / 1000.0,
                             {"class": classes[cls] if cls < len(classes) else cls,
                              "phase": (t["phases"][ph][0] if ph < len(t["phases"]) else None)}))
            end = max(end, at + (off + dur) / 1000.0)
        at = end + 0.05
