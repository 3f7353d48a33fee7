#!/usr/bin/env python3
"""Host time the profiler's hooks add to one decode cycle, on a real GPU stream.

Runs the calls a v2 decode cycle makes (begin, 8 marks and the draft graph's three replay
hooks, end, harvest, the scheduler's commit of `--bs` requests) with real CUDA events and
no GPU work, and the same calls on the profiler that --speculative-profile off installs,
and prints microseconds per cycle spent inside the hooks (median of --reps runs of
--cycles; also the p99 and the longest cycle).
That is the most the profiler can slow a cycle whose host work is on the critical path.

`--threaded` folds and closes windows on the helper thread, as the server does; then
`--wait-us` spins that long between `end` and `harvest` (untimed) with the GIL released, as
the v2 scheduler waits there for the GPU, so the reader's work can fall there. `--buckets`
spreads the cycles over that many batch-size buckets (a window close costs more with more).

    python bench/hook_cost.py [--cycles 5000] [--reps 7] [--cpu] [--threaded --wait-us 2000 [--wait-kind cuda]]
                              [--phases-every K] [--ctx tensor] [--against DIR] [--cprofile PATH]
                              [--cycle-times PATH]

`--against DIR` (a folder holding another tree's `sglang/specprof`, e.g. from `git archive`)
times that tree's profiler in the same process, interleaved with this one's rep by rep in
alternating order: the same host, caches and clocks for both, and a paired difference per rep.
Only the hooks' package is the other tree's: the analysis package `sglang_specprof` (the windows
and buckets the cycles are folded into) is this tree's for both, so a change there is timed by
running each tree in a process of its own (`PYTHONPATH=TREE/overlay`), alternating.
`--against-gil` does the same with this tree's profiler on records that hold the GIL.
"""
import argparse
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import statistics
import sys
import time
from operator import methodcaller

from sglang.specprof.folder import AT_HAND_OVER, INLINE, READER_THREAD
from sglang.specprof.profiler import NullProfiler, Profiler

MARKS = ["draft_prep", "draft_inputs", "draft", "draft_outputs", "tree", "verify_prep", "verify", "accept",
         "draft_extend_prep", "draft_extend", "draft_extend_post"]
RUNNER = object()  # the draft graph runner the replay hooks are given (no graph captured here)


def hook_calls(p, bs):
    """A cycle's hooks after `begin`, as the v2 worker calls them: the draft graph's replay
    hooks close `draft_inputs`, `draft` and `draft_outputs`, the other marks are marks. Each is
    looked up on the profiler at its call, as the patched files do (`specprof.P.mark(...)`): the
    profiler may change what its hooks are from one cycle to the next (Recorder.show_marks)."""
    graph = {"draft_inputs": ("draft_replay_begin", (RUNNER, bs)), "draft": ("draft_replay_end", ()),
             "draft_outputs": ("draft_end", ())}
    return [(methodcaller(name, *args), (p,)) for name, args in (graph.get(m, ("mark", (m,))) for m in MARKS)]
BUCKET_BS = [1, 2, 4, 8, 16, 32]


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

    query_captured = query
    elapsed_captured = elapsed

    def capturing(self):
        return False


class Req:
    """What the commit hooks read of a request."""

    __slots__ = ("output_ids", "finished_len", "is_retracted")

    def __init__(self):
        self.output_ids = [0]
        self.finished_len = None
        self.is_retracted = False

    def finished(self):
        return False


_BUF = bytes(1 << 16)


def gil_events(cuda_backend):
    """The driver's events (`cuda_backend.DriverEvents`) with a record through ctypes that holds
    the GIL (`ctypes.PyDLL`): at a mark no other Python thread can take the GIL, which
    `cuda.bindings` and torch release in every call (`bench/event_cost.py`)."""
    import ctypes

    class GilEvents(cuda_backend.DriverEvents):
        kind = "ctypes"

        def __init__(self):
            f = ctypes.PyDLL("libcuda.so.1").cuEventRecord
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            f.restype = ctypes.c_int
            self._crec = f
            self._craw = None
            super().__init__()

        def refresh(self):
            raw = self._raw()
            if raw != self._craw:
                cuda_backend.DriverEvents.refresh(self)
                self._craw = raw

        def record(self, event):
            err = self._crec(int(event), self._craw)
            if err:
                raise RuntimeError(f"cuEventRecord failed: CUresult {err}")

    return GilEvents()


def load_tree(folder):
    """Another tree's `sglang/specprof` under the name `specprof_against` (its imports are
    relative): its profiler module."""
    pkg = os.path.join(folder, "sglang", "specprof")
    if not os.path.isfile(os.path.join(pkg, "profiler.py")):
        raise SystemExit(f"--against {folder}: no sglang/specprof/profiler.py there")
    spec = importlib.util.spec_from_file_location("specprof_against", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["specprof_against"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("specprof_against.profiler")


def gpu_wait(seconds):
    """What the scheduler's thread does while the GPU works: spin in C with the GIL released
    (hashing 64 KB at a time releases it), as a blocking CUDA synchronisation does; a sleep
    would let the CPU cool and slow every later instruction."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha256(_BUF).digest()


def sleep_cycles_per_s():
    """`torch.cuda._sleep`'s cycles a second, measured after a first launch (which loads the
    kernel: timed with it, a wait came out a tenth of what was asked)."""
    import torch

    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10 ** 7)
    stop.record()
    stop.synchronize()
    return 10 ** 7 / (start.elapsed_time(stop) / 1000.0)


def cuda_wait_fn():
    """The scheduler's own kind of wait: a kernel that runs for the given time on the stream,
    then a synchronisation (which releases the GIL, and in which the driver polls)."""
    import torch

    per_s = sleep_cycles_per_s()

    def wait(seconds):
        torch.cuda._sleep(int(seconds * per_s))
        torch.cuda.current_stream().synchronize()

    return wait


class OverlapWait:
    """v2 with the overlap on, as the scheduler runs it: each cycle's GPU work (a kernel of the
    wait's length) is launched inside the cycle, after `begin`, and after `end` the host waits
    for the cycle before it (an event after its `end`), so host and GPU work at once and the
    host waits only for what the GPU has left. A cycle's wall time is then the longer of the
    two, and what the hooks add to it is what they put on the critical path: with a short
    kernel the host is the bottleneck, with a long one the GPU."""

    def __init__(self):
        import torch

        self.torch = torch
        self.per_s = sleep_cycles_per_s()
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.i = 0
        self.prev = None

    def launch(self, seconds):
        self.torch.cuda._sleep(int(seconds * self.per_s))

    def __call__(self, seconds):
        ev = self.events[self.i]
        self.i ^= 1
        ev.record()
        prev, self.prev = self.prev, ev
        if prev is not None:
            prev.synchronize()


_OP_BUF = bytes(4096)


def upstream_op():
    """One of the scheduler's own calls that gives the GIL up for a moment, as each torch
    operation and kernel launch does (hashing 4 KB releases it: about 3 us)."""
    hashlib.sha256(_OP_BUF).digest()


class _Cold:
    __slots__ = ("a",)

    def __init__(self):
        self.a = 1


def polluter(kb):
    """What upstream's work between two cycles does to the caches, roughly: reads through `kb`
    KB of distinct small Python objects and writes a cache line in every 64 bytes of a buffer
    as large, so the profiler's objects are out of the caches when the next `begin` runs (in
    the server the hooks before the draft replay take about ten times what a tight loop gives)."""
    objs = [_Cold() for _ in range(kb * 1024 // 56)]
    buf = bytearray(kb * 1024)
    ones = bytes(len(buf[::64]))

    def pollute():
        s = 0
        for o in objs:
            s += o.a
        buf[::64] = ones
        return s

    return pollute


def run(p, cycles, sync, bs=8, buckets=1, wait_s=0.0, ctx=None, wait=gpu_wait, launch=None, walls=None,
        late=None, ops=0, head=None, pollute=None):
    """Microseconds inside the hooks for each cycle (the wait for the GPU not counted).
    `ctx(n)`: what `begin` is given as the batch's sequence lengths (default the number 8000).
    `launch`: a list that takes each cycle's share before the wait (begin, the marks, end: in
    the v2 scheduler that runs while the GPU works on the cycle before, the rest after it).
    `walls`: takes each cycle's whole wall time (hooks, `ops`, the wait); `late`: how much
    longer than asked each wait took (the GIL taken back from a helper thread is in it).
    `ops`: calls of `upstream_op` after each mark, as upstream's work between two hooks.
    A `wait` with a `launch` (OverlapWait) has each cycle's GPU work launched after `begin`.
    `head`: takes each cycle's time in `begin` and the first two marks (draft_prep, draft_inputs):
    the hooks before the draft graph's replay, where 0.5.12's GPU waits for the host (it
    synchronises at each cycle's start; bench/host_sensitivity.py). `pollute`: called, untimed,
    before each cycle's `begin` (`polluter`)."""
    gpu = getattr(wait, "launch", None)
    sizes = [bs] if buckets <= 1 else BUCKET_BS[:buckets]
    reqs = {n: [Req() for _ in range(n)] for n in sizes}
    hooks = {n: hook_calls(p, n) for n in sizes}
    lens = {n: 8000 if ctx is None else ctx(n) for n in sizes}
    clock = time.perf_counter
    out = []
    sync()
    w0 = clock()
    for i in range(cycles):
        n = sizes[i % len(sizes)]
        rs = reqs[n]
        correct = [2] * n
        runs = (0, 0, 0)  # each request's verified run: its 2 correct drafts and the bonus
        if pollute is not None:
            pollute()
        t = clock()
        p.begin("decode", n, lens[n])
        if gpu is not None:  # the cycle's GPU work (not timed: upstream's launch)
            spent = clock() - t
            gpu(wait_s)
            t = clock()
        else:
            spent = 0.0
        calls = hooks[n]
        if ops:
            spent += clock() - t
            for j, (f, args) in enumerate(calls):
                for _ in range(ops):
                    upstream_op()
                t = clock()
                f(*args)
                spent += clock() - t
                if j == 1:
                    hd = spent
            t = clock()
            p.end()
            spent += clock() - t
        else:
            (f0, a0), (f1, a1) = calls[0], calls[1]
            f0(*a0)
            f1(*a1)
            hd = spent + clock() - t
            for f, args in calls[2:]:
                f(*args)
            p.end()
            spent += clock() - t
        if head is not None:
            head.append(hd * 1e6)
        if launch is not None:
            launch.append(spent * 1e6)
        if wait_s:  # v2: after launching a cycle the scheduler waits for the one before
            t = clock()
            wait(wait_s)
            if late is not None:
                late.append((clock() - t - wait_s) * 1e6)
        t = clock()
        p.harvest(correct)
        p.commit_begin(rs)
        spent += clock() - t
        for r in rs:  # the scheduler appends each request's run between the two (not timed)
            r.output_ids.extend(runs)
        t = clock()
        p.commit_end()
        t1 = clock()
        out.append((spent + t1 - t) * 1e6)
        if walls is not None:
            walls.append((t1 - w0) * 1e6)
            w0 = t1
    sync()
    return out


# this script's modes (False: inline, True: a reader thread, "outputs": at each hand-over) as
# the profiler takes them: `reading=` by name, or, in a tree from before it, `threaded=`
READING_NAMES = {False: INLINE, True: READER_THREAD, "outputs": AT_HAND_OVER}


def reading_kw(cls, mode) -> dict:
    if "reading" in inspect.signature(cls).parameters:
        return {"reading": READING_NAMES[mode]}
    return {"threaded": mode}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--buckets", type=int, default=1, help="batch-size buckets the cycles cycle through (1-6)")
    ap.add_argument("--threaded", action="store_true",
                    help="read and fold on a reader thread, close windows on the outputs thread (the server before "
                    "--outputs-thread)")
    ap.add_argument("--outputs-thread", action="store_true",
                    help="read and fold at each hand-over on the calling thread, close windows on the outputs thread "
                    "(the server's: at hand-over)")
    ap.add_argument("--against-reader-thread", action="store_true",
                    help="in place of --against: this tree with a reader thread (--threaded), interleaved")
    ap.add_argument("--wait-us", type=float, default=0.0,
                    help="between end and harvest, spin this long with the GIL released (the GPU wait), untimed")
    ap.add_argument("--wait-kind", choices=["spin", "cuda", "overlap"], default="spin",
                    help="how --wait-us waits: spin hashing in C with the GIL released (default); on a GPU, a "
                    "kernel of that length and a stream synchronisation (cuda); or the v2 overlap: each cycle "
                    "launches a kernel of that length and then waits for the cycle before (OverlapWait)")
    ap.add_argument("--torch-events", action="store_true", help="torch's events, not cuda.bindings")
    ap.add_argument("--gil-events", action="store_true",
                    help="records through ctypes holding the GIL (gil_events), not cuda.bindings")
    ap.add_argument("--phases-every", type=int, default=4, metavar="K",
                    help="time the phases in one cycle of K, as --speculative-profile-phases-every (default 4; "
                    "1: every phase of every cycle)")
    ap.add_argument("--ctx", choices=["number", "tensor"], default=None,
                    help="the sequence lengths `begin` gets: a number, or a CPU tensor as 0.5.16 and later pass "
                    "(default: tensor on a GPU, number with --cpu)")
    ap.add_argument("--against", metavar="DIR", help="another tree's sglang/specprof under DIR, timed interleaved")
    ap.add_argument("--against-gil", action="store_true",
                    help="in place of --against: this tree with records that hold the GIL (gil_events), interleaved")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="after each mark, N calls that give the GIL up for a moment (upstream_op: about 3 us each), "
                    "as the scheduler's torch calls between two hooks do; a helper thread can take the GIL there")
    ap.add_argument("--pollute-kb", type=int, default=0, metavar="KB",
                    help="before each cycle (untimed), read KB of other Python objects and write as much memory: "
                    "the hooks then find their own data out of the caches, as in a server")
    ap.add_argument("--cprofile", metavar="PATH", help="then one more run of the profiler under cProfile: where its "
                    "host time goes, by function (tottime, cumulative), written to PATH")
    ap.add_argument("--cycle-times", metavar="PATH", help="then one more run of `off` and of `on`, each cycle's "
                    "microseconds in the hooks (and of them before the GPU wait) written to PATH as JSON: where the "
                    "long cycles fall (the hand-overs, a window's close, the GIL taken back from the outputs thread)")
    ap.add_argument("--cpu", action="store_true",
                    help="no GPU: events that cost nothing, so only the profiler's Python is timed")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, handlers=[logging.NullHandler()])
    config = {"algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "draft_tokens": 4, "worker": "v2"}
    mode = "outputs" if a.outputs_thread else a.threaded
    trees = {"on": (Profiler, None, mode)}
    if a.against:
        trees["against"] = (load_tree(a.against).Profiler, "specprof_against.cuda_backend", mode)
    elif a.against_gil:
        trees["against"] = (Profiler, "gil", mode)
        a.against = "GilEvents"
    elif a.against_reader_thread:
        trees["against"] = (Profiler, None, True)
        a.against = "reader thread"

    if a.cpu:
        import platform

        sync, device = (lambda: None), platform.processor()

        def make_backend(mod):
            return CpuBackend()
    else:
        import torch

        from sglang.specprof import cuda_backend

        torch.cuda.set_stream(torch.cuda.Stream())  # a stream of its own, as the scheduler's forward stream
        sync, device = torch.cuda.synchronize, torch.cuda.get_device_name()

        def make_backend(mod):
            if mod == "gil":
                return gil_events(cuda_backend)
            mod = importlib.import_module(mod) if mod else cuda_backend
            if a.gil_events:
                return gil_events(mod)
            return mod.TorchEvents() if a.torch_events else mod.CudaBackend()
    profs = {name: cls(make_backend(mod), interval=100, config=config, phases_every=a.phases_every,
                       **reading_kw(cls, md)) for name, (cls, mod, md) in trees.items()}
    backend = make_backend(None)
    off = NullProfiler()
    ctx = a.ctx or ("number" if a.cpu else "tensor")
    kw = dict(bs=a.bs, buckets=a.buckets, wait_s=a.wait_us / 1e6, ops=a.ops,
              pollute=polluter(a.pollute_kb) if a.pollute_kb else None)
    if a.wait_kind in ("cuda", "overlap"):
        if a.cpu:
            ap.error(f"--wait-kind {a.wait_kind} needs a GPU (not --cpu)")
        kw["wait"] = cuda_wait_fn() if a.wait_kind == "cuda" else OverlapWait()
    if ctx == "tensor":
        import torch

        kw["ctx"] = lambda n: torch.full((n,), 1000, dtype=torch.int64)
    for p in profs.values():
        run(p, 500, sync, **kw)  # warm up
    names = ["off", *profs]
    res = {k: [] for k in names}
    tails = {k: [] for k in names}
    mids = {k: [] for k in names}  # each rep's median cycle: the hooks without the rare long ones
    before = {k: [] for k in names}  # each rep's mean share before the GPU wait
    walls = {k: [] for k in names}  # each rep's mean wall time a cycle: hooks, upstream's ops, the wait
    lates = {k: [] for k in names}  # each rep's mean overrun of the wait (the GIL taken back in it)
    heads = {k: [] for k in names}  # each rep's mean time in begin and the first two marks
    for rep in range(a.reps):  # interleaved; with --against, the two trees in alternating order
        order = names if rep % 2 == 0 else ["off", *reversed(list(profs))]
        for name in order:
            p = off if name == "off" else profs[name]
            pre, wall, late = [], [], []
            hd = []
            us = run(p, a.cycles, sync, launch=pre, walls=wall, late=late, head=hd, **kw)
            res[name].append(statistics.fmean(us))
            heads[name].append(statistics.fmean(hd))
            walls[name].append(statistics.fmean(wall))
            if late:
                lates[name].append(statistics.fmean(late))
            before[name].append(statistics.fmean(pre))
            tails[name].append((sorted(us)[int(0.99 * len(us))], max(us)))
            mids[name].append(statistics.median(us))
            if name != "off":
                p.flush()
    for p in profs.values():
        p.flush()
    on = profs["on"]
    out = {k: round(statistics.median(v), 2) for k, v in res.items()}
    # every cycle read in the end, none dropped: the reader kept up
    out["cycles_read"] = on.totals_now()["decode_cycles"]
    out["cycles_run"] = 500 + a.reps * a.cycles
    out["cycles_untimed"] = on.dropped + on.read_dropped
    out["added_us_per_cycle"] = round(out["on"] - out["off"], 2)
    out["on_p99_us"] = round(statistics.median(t[0] for t in tails["on"]), 2)
    out["on_max_us"] = round(max(t[1] for t in tails["on"]), 1)
    if a.against:
        ag = profs["against"]
        out["against_dir"] = a.against
        out["against_added_us_per_cycle"] = round(out["against"] - out["off"], 2)
        out["against_cycles_untimed"] = ag.dropped + ag.read_dropped
        out["against_p99_us"] = round(statistics.median(t[0] for t in tails["against"]), 2)
        diff = [x - y for x, y in zip(res["on"], res["against"])]  # paired, rep by rep
        out["on_minus_against_us"] = {"median": round(statistics.median(diff), 2), "reps": [round(d, 2) for d in diff]}
    # the whole cycle, on against off rep by rep: what the hooks add with whatever a helper
    # thread takes from the scheduler's thread meanwhile (at the wait's end, at upstream's ops)
    out["wall_added_us"] = {k: round(statistics.median(x - y for x, y in zip(walls[k], walls["off"])), 2)
                            for k in profs}
    if a.wait_us:
        out["wait_late_us"] = {k: round(statistics.median(v), 2) for k, v in lates.items()}
    out["median_cycle_us"] = {k: round(statistics.median(v), 2) for k, v in mids.items()}
    # begin and the marks before the draft replay, the null profiler's taken out rep by rep
    out["head_added_us"] = {k: round(statistics.median(x - y for x, y in zip(heads[k], heads["off"])), 2)
                            for k in profs}
    # of the mean, what came before the GPU wait (begin, marks, end) and after (harvest, commit)
    out["before_wait_us"] = {k: round(statistics.median(v), 2) for k, v in before.items()}
    out["runs_us"] = {k: [round(x, 2) for x in v] for k, v in res.items()}
    if a.cprofile:  # after the timed reps, one more run of `on` under cProfile (its times inflated, their shares not)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        run(on, a.cycles, sync, **kw)
        prof.disable()
        on.flush()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).strip_dirs()
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(30)
        with open(a.cprofile, "w") as f:
            f.write(buf.getvalue())
        out["cprofile"] = a.cprofile
    if a.cycle_times:  # each cycle, not a mean: the long ones' place in the sequence
        per = {}
        for name in names:
            p = off if name == "off" else profs[name]
            pre = []
            us = run(p, a.cycles, sync, launch=pre, **kw)
            if name != "off":
                p.flush()
            per[name] = {"us": [round(x, 2) for x in us], "before_wait_us": [round(x, 2) for x in pre]}
        with open(a.cycle_times, "w") as f:
            json.dump({"bs": a.bs, "phases_every": a.phases_every, "wait_us": a.wait_us, "cycles": per}, f)
        out["cycle_times"] = a.cycle_times
    out.update(device=device or "cpu", events=getattr(backend, "kind", "none"),
               elapsed_symbol=getattr(backend, "elapsed_symbol", None), threaded=mode, wait_us=a.wait_us,
               wait_kind=a.wait_kind, buckets=a.buckets, bs=a.bs, phases_every=a.phases_every, ctx=ctx, ops=a.ops,
               pollute_kb=a.pollute_kb)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
