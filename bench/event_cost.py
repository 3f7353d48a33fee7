#!/usr/bin/env python3
"""Host cost of one CUDA event call, each way the profiler could make it.

For record, query and elapsed time: torch's Event, cuda.bindings' driver API, and the
driver's own functions through ctypes (holding the GIL, and releasing it), on a stream of
its own with no other work. Prints microseconds per call (median of --reps runs of --n
calls each) as one JSON line.

    python bench/event_cost.py [--n 20000] [--reps 7]

`--cold-kb KB` times one record at a time instead, each after the caches were filled with KB
of other objects and memory (`hook_cost.polluter`) and a stream synchronisation, as at 0.5.12's
cycle start: the record's ways against a ctypes call that does nothing and a Python function
that does nothing, in rotating order; microseconds per call, median and mean.
"""
import argparse
import ctypes
import json
import statistics
import time

import torch


def per_call(fn, n, reps, sync):
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return round(statistics.median(out), 3)


class Busy:
    """A thread running pure Python: a call that releases the GIL lets it in, one that holds
    the GIL is interrupted only at the interpreter's switch interval."""

    def __enter__(self):
        import threading

        self.stop = False
        self.t = threading.Thread(target=self.spin, daemon=True)
        self.t.start()
        time.sleep(0.01)
        return self

    def spin(self):
        x = 0
        while not self.stop:
            x += 1

    def __exit__(self, *a):
        self.stop = True
        self.t.join()


def cold_calls(calls, kb, n, sync):
    """{name: fn} each called `n` times, one call at a time after `pollute` and `sync`
    (untimed), the names in rotating order: {name: {"median": us, "mean": us}}."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hook_cost import polluter

    pollute = polluter(kb)
    names = list(calls)
    got = {k: [] for k in names}
    clock = time.perf_counter
    for i in range(n):
        k0 = i % len(names)
        for k in names[k0:] + names[:k0]:
            fn = calls[k]
            pollute()
            sync()
            t = clock()
            fn()
            got[k].append((clock() - t) * 1e6)
    return {k: {"median": round(statistics.median(v), 3), "mean": round(statistics.fmean(v), 3)} for k, v in got.items()}


def cold(kb, n):
    from cuda.bindings import driver as drv

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    sync = torch.cuda.synchronize
    ev = torch.cuda.Event(enable_timing=True)
    _, e1 = drv.cuEventCreate(0)
    s = drv.CUstream(stream.cuda_stream)
    lib = ctypes.PyDLL("libcuda.so.1")
    rec = lib.cuEventRecord
    rec.argtypes, rec.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    h1, hs = int(e1), stream.cuda_stream  # the profiler's crec takes the handles as numbers
    noop = ctypes.pythonapi.Py_IsInitialized

    def nothing():
        pass

    calls = {"python_noop": nothing, "ctypes_noop": noop, "ctypes_gil_record": lambda: rec(h1, hs),
             "bindings_record": lambda: drv.cuEventRecord(e1, s), "torch_record_stream": lambda: ev.record(stream)}
    for fn in calls.values():
        fn()
    sync()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cold_kb": kb, "calls": n,
           "us": cold_calls(calls, kb, n, sync)}
    warm = {k: per_call(fn, 2000, 3, sync) for k, fn in calls.items()}
    res["warm_us"] = warm
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cold-kb", type=int, default=0, metavar="KB",
                    help="one record at a time, each after KB of other memory went through the caches")
    a = ap.parse_args()
    if a.cold_kb:
        return cold(a.cold_kb, min(a.n, 3000))
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    sync = torch.cuda.synchronize
    n, reps = a.n, a.reps
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    ev = torch.cuda.Event(enable_timing=True)
    ev2 = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    ev2.record(stream)
    sync()
    res["torch_record_current"] = per_call(lambda: ev.record(), n, reps, sync)
    res["torch_record_stream"] = per_call(lambda: ev.record(stream), n, reps, sync)
    res["torch_query"] = per_call(ev.query, n, reps, sync)
    res["torch_elapsed"] = per_call(lambda: ev.elapsed_time(ev2), n, reps, sync)
    res["torch_current_stream"] = per_call(torch.cuda.current_stream, n, reps, sync)
    dev = torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream
    res["torch_raw_stream"] = per_call(lambda: raw(dev), n, reps, sync)
    assert raw(dev) == stream.cuda_stream

    try:
        from cuda.bindings import driver as drv

        import cuda.bindings
        res["cuda_bindings"] = cuda.bindings.__version__
        err, e1 = drv.cuEventCreate(0)
        err, e2 = drv.cuEventCreate(0)
        s = drv.CUstream(stream.cuda_stream)
        rec = drv.cuEventRecord
        rec(e1, s)
        rec(e2, s)
        sync()
        res["bindings_record"] = per_call(lambda: rec(e1, s), n, reps, sync)
        res["bindings_record_int_stream"] = per_call(lambda: rec(e1, stream.cuda_stream), n, reps, sync)
        q = drv.cuEventQuery
        res["bindings_query"] = per_call(lambda: q(e1), n, reps, sync)
        el = drv.cuEventElapsedTime
        rec(e1, s)
        rec(e2, s)
        sync()
        res["bindings_elapsed"] = per_call(lambda: el(e1, e2), n, reps, sync)
        res["bindings_elapsed_value"] = el(e1, e2)[1]
        with Busy():
            res["bindings_record_busy_thread"] = per_call(lambda: rec(e1, s), n // 10, reps, sync)
    except Exception as e:
        res["cuda_bindings_error"] = f"{type(e).__name__}: {e}"

    for name, lib in (("ctypes_gil", ctypes.PyDLL("libcuda.so.1")), ("ctypes_nogil", ctypes.CDLL("libcuda.so.1"))):
        create = lib.cuEventCreate
        create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        h1, h2 = ctypes.c_void_p(), ctypes.c_void_p()
        assert create(ctypes.byref(h1), 0) == 0 and create(ctypes.byref(h2), 0) == 0
        rec = lib.cuEventRecord
        rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        rec.restype = ctypes.c_int
        hs = ctypes.c_void_p(stream.cuda_stream)
        assert rec(h1, hs) == 0 and rec(h2, hs) == 0
        sync()
        res[name + "_record"] = per_call(lambda: rec(h1, hs), n, reps, sync)
        q = lib.cuEventQuery
        q.argtypes = [ctypes.c_void_p]
        q.restype = ctypes.c_int
        res[name + "_query"] = per_call(lambda: q(h1), n, reps, sync)
        el = lib.cuEventElapsedTime
        el.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        el.restype = ctypes.c_int
        ms = ctypes.c_float()
        ref = ctypes.byref(ms)
        rec(h1, hs)
        rec(h2, hs)
        sync()
        res[name + "_elapsed"] = per_call(lambda: el(ref, h1, h2), n, reps, sync)
        try:  # the current entry point (CUDA 12.8 on), which the profiler takes where the driver has it
            el2 = lib.cuEventElapsedTime_v2
        except AttributeError:
            el2 = None
        if el2 is not None:
            el2.argtypes, el2.restype = el.argtypes, ctypes.c_int
            res[name + "_elapsed_v2"] = per_call(lambda: el2(ref, h1, h2), n, reps, sync)
            if name == "ctypes_gil":  # both read the same times: pairs with GPU work between
                ms2 = ctypes.c_float()
                same = []
                for k in range(200):
                    rec(h1, hs)
                    torch.cuda._sleep(1000 * (k % 7 + 1))
                    rec(h2, hs)
                    sync()
                    assert el(ref, h1, h2) == 0 and el2(ctypes.byref(ms2), h1, h2) == 0
                    same.append(ms.value == ms2.value)
                res["elapsed_v1_v2_same"] = f"{sum(same)} of {len(same)}"
        if name == "ctypes_gil":  # the profiler's form: no argtypes, c_void_p objects made once
            lib2 = ctypes.PyDLL("libcuda.so.1")
            rec2, q2 = lib2.cuEventRecord, lib2.cuEventQuery
            el3 = getattr(lib2, "cuEventElapsedTime_v2", None) or lib2.cuEventElapsedTime
            rec2.restype = q2.restype = el3.restype = ctypes.c_int
            res[name + "_record_ptr"] = per_call(lambda: rec2(h1, hs), n, reps, sync)
            res[name + "_query_ptr"] = per_call(lambda: q2(h1), n, reps, sync)
            rec2(h1, hs)
            rec2(h2, hs)
            sync()
            res[name + "_elapsed_ptr"] = per_call(lambda: el3(ref, h1, h2), n, reps, sync)
            assert el3(ref, h1, h2) == 0 and ms.value >= 0
        with Busy():
            res[name + "_record_busy_thread"] = per_call(lambda: rec(h1, hs), n // 10, reps, sync)
    with Busy():
        res["torch_record_stream_busy_thread"] = per_call(lambda: ev.record(stream), n // 10, reps, sync)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
