# Hook timing inside a live server (bench/server_hooks): put this folder first on PYTHONPATH and set
# HOOKTIME_OUT=PREFIX; each scheduler process wraps the running profiler's hooks with perf_counter and
# follows the garbage collector in both states (on / paused), and writes PREFIX-PID.json every
# 2000 cycles: per hook n/mean/p50/p90/p99 us, the hooks before the draft replay (`cycle_head`,
# split by cycles timed by phase and whole) and all hooks of a cycle (`cycle_all`). The wrappers
# cost the ratio something of their own: time hooks with it, measure throughput without it.
# HOOKTIME_CREC=1 also times each event record's C call (`crec:first`, the cycle's first, and
# `crec:N`, its N-th), a ctypes call that does nothing just before the first (`ctypes:first`), and the
# first record made again at once (`crec:again`, the same call warm): what the first call after
# the cycle's start costs the driver, ctypes and the caches apart.
import gc, importlib.abc, importlib.util, json, os, statistics, sys, threading, time

_OUT = os.environ.get("HOOKTIME_OUT")
_clock = time.perf_counter
_S = {"t": {}, "head": [], "head_d": [], "head_n": [], "all": [], "all_d": [], "all_n": [],
      "cyc": {"on": 0, "off": 0}, "gc": {"on": {}, "off": {}}, "gc_t0": None, "state": "off"}
_cur = {"head": 0.0, "all": 0.0, "detail": None, "ncrec": 0}
_CREC = os.environ.get("HOOKTIME_CREC") == "1"
HEAD = ("begin", "draft_replay_begin")


def _dump():
    if not _OUT:
        return
    def st(v):
        if not v:
            return None
        v = sorted(v)
        return {"n": len(v), "mean": round(sum(v) / len(v), 3), "p50": round(v[len(v) // 2], 3),
                "p90": round(v[int(len(v) * 0.9)], 3), "p99": round(v[int(len(v) * 0.99)], 3)}
    out = {"hooks": {k: st(v) for k, v in _S["t"].items()},
           "cycle_head": st(_S["head"]), "cycle_head_detail": st(_S["head_d"]), "cycle_head_whole": st(_S["head_n"]),
           "cycle_all": st(_S["all"]), "cycle_all_detail": st(_S["all_d"]), "cycle_all_whole": st(_S["all_n"]),
           "cycles": _S["cyc"], "gc": _S["gc"], "wrap_us": _S.get("wrap_us")}
    try:
        with open("%s-%d.json" % (_OUT, os.getpid()), "w") as f:
            json.dump(out, f, indent=1)
    except OSError:
        pass


def _gc_cb(phase, info):
    if phase == "start":
        _S["gc_t0"] = _clock()
    elif _S["gc_t0"] is not None:
        d = _S["gc"][_S["state"]].setdefault(str(info.get("generation")), [0, 0.0, 0.0])
        dt = (_clock() - _S["gc_t0"]) * 1e6
        d[0] += 1; d[1] += dt; d[2] = max(d[2], dt)
        _S["gc_t0"] = None


def _owner(mod, name):
    """The class whose method the running profiler's hook `name` is: its recorder's for the
    cycle's marks and the draft graphs' hooks (profiler.RECORDER_HOOKS), else the profiler's."""
    rec = getattr(mod, "Recorder", None)
    return rec if rec is not None and name in getattr(mod, "RECORDER_HOOKS", ()) else mod.Profiler


def _patch(mod):
    t = _S["t"]

    def wrap(name):
        cls = _owner(mod, name)
        orig = getattr(cls, name)
        lst = t.setdefault(name, [])
        if name == "mark":
            def f(self, n, _o=orig):
                t0 = _clock(); r = _o(self, n); dt = (_clock() - t0) * 1e6
                t.setdefault("mark:" + n, []).append(dt)
                _cur["all"] += dt
                if n == "draft_prep":
                    _cur["head"] += dt
                return r
        elif name == "begin":
            def f(self, *a, _o=orig):
                _S["state"] = "on"
                _cur["ncrec"] = 0
                if _CREC and getattr(self, "_crec", None) is not None and not hasattr(self._crec, "timed"):
                    self._crec = _timed_crec(self._crec)
                t0 = _clock(); r = _o(self, *a); dt = (_clock() - t0) * 1e6
                lst.append(dt); _cur["head"] = dt; _cur["all"] += dt
                s = self.cur
                _cur["detail"] = None if s is None else bool(s.detail)
                return r
        elif name == "end":
            def f(self, _o=orig):
                t0 = _clock(); r = _o(self); dt = (_clock() - t0) * 1e6
                lst.append(dt); _cur["all"] += dt
                d = _cur["detail"]
                _S["head"].append(_cur["head"]); _S["all"].append(_cur["all"])
                if d is not None:
                    (_S["head_d"] if d else _S["head_n"]).append(_cur["head"])
                    (_S["all_d"] if d else _S["all_n"]).append(_cur["all"])
                _cur["head"] = 0.0; _cur["all"] = 0.0
                _S["cyc"]["on"] += 1
                if _S["cyc"]["on"] % 2000 == 0:
                    _dump()
                return r
        else:
            def f(self, *a, _o=orig, _n=name):
                t0 = _clock(); r = _o(self, *a); dt = (_clock() - t0) * 1e6
                lst.append(dt); _cur["all"] += dt
                if _n in HEAD:
                    _cur["head"] += dt
                return r
        setattr(cls, name, f)

    for name in ("begin", "mark", "draft_end", "end", "graph", "draft_replay_begin", "draft_replay_end",
                 "harvest", "commit_begin", "commit_end", "draft_step"):
        if hasattr(_owner(mod, name), name):
            wrap(name)
    # what one timed call adds (two clock reads and the wrapper's frame)
    def _empty(): pass
    w = []
    for _ in range(2000):
        t0 = _clock(); _empty(); w.append((_clock() - t0) * 1e6)
    _S["wrap_us"] = round(statistics.median(w), 3)
    gc.callbacks.append(_gc_cb)


def _timed_crec(c):
    import ctypes
    noop = ctypes.pythonapi.Py_IsInitialized
    t = _S["t"]
    first, again, ct = (t.setdefault(k, []) for k in ("crec:first", "crec:again", "ctypes:first"))
    later = [None] + [t.setdefault("crec:%d" % i, []) for i in range(1, 16)]  # the first goes to crec:first

    def timed(h, st):
        if _cur["ncrec"] == 0:
            t0 = _clock(); noop(); t1 = _clock(); r = c(h, st); t2 = _clock(); c(h, st); t3 = _clock()
            ct.append((t1 - t0) * 1e6); first.append((t2 - t1) * 1e6); again.append((t3 - t2) * 1e6)
        else:
            t0 = _clock(); r = c(h, st); later[min(_cur["ncrec"], 15)].append((_clock() - t0) * 1e6)
        _cur["ncrec"] += 1
        return r
    timed.timed = True
    return timed


def _patch_null(mod):
    cls = mod.NullProfiler
    orig = cls.begin
    def begin(self, *a, _o=orig):
        _S["state"] = "off"
        _S["cyc"]["off"] += 1
        if _S["cyc"]["off"] % 2000 == 0:
            _dump()
        return _o(self, *a)
    cls.begin = begin


class _Finder(importlib.abc.MetaPathFinder):
    want = {"sglang.specprof.profiler": _patch, "sglang.specprof.null": _patch_null}

    def find_spec(self, name, path, target=None):
        fn = self.want.pop(name, None)
        if fn is None:
            return None
        if not self.want:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        orig = spec.loader.exec_module

        def exec_module(module):
            orig(module)
            fn(module)

        spec.loader.exec_module = exec_module
        return spec


if _OUT:
    sys.meta_path.insert(0, _Finder())
