#!/usr/bin/env python3
"""Where in a decode cycle host time costs throughput: a spin at one hook, the profiler off.

One server of the patched build runs with --speculative-profile off, so every hook is the
null profiler's. A `sitecustomize` this script writes makes the null profiler spin
(`--spin-us`, holding the GIL, as Python work does) at one hook place at a time, chosen by a
signal between runs; each round runs the same load once per place and once with no spin,
in rotating order, in this one process. The ratio spin / none per place and round says
what that much host time there costs: about spin / cycle where the GPU waits for the host
at that point (the host paces the GPU there), about nothing where the host is ahead.

    python bench/host_sensitivity.py --out OUT --logs OUT/logs --places begin draft_replay_begin \\
        mark:verify end --spin-us 50 --concurrency 1 16 --rounds 30 --new-tokens 256

A place is a null-profiler method (`begin`, `draft_replay_begin`, `end`, `harvest`, ...), or
`mark:NAME` for the mark of that phase. Needs an NVIDIA GPU and the built wheel importable.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import write_models  # noqa: E402
from serving import (eagle3_args, installed_sglang, load, machine, median_ci, out_of_time,  # noqa: E402
                     pin_schedulers, portable_command, rotations, start_all, stop_all, tok_s, write_json)

SIGNAL = "SIGUSR2"

# Loaded by every Python process of the server (PYTHONPATH): once sglang.specprof.null is
# imported, its NullProfiler spins at the place named in the file WANT, read on SIGNAL; the
# process then writes the place it took to HAVE-<pid>.
SITECUSTOMIZE = r'''
import importlib.abc, importlib.util, os, signal, sys, threading, time

_DIR = os.environ["SPECPROF_SENSITIVITY_DIR"]
_SPIN = float(os.environ.get("SPECPROF_SENSITIVITY_US", "50")) / 1e6
_state = {"place": "none"}


def _spin():
    t = time.perf_counter() + _SPIN
    while time.perf_counter() < t:
        pass


def _patch(cls):
    def wrap(name):
        orig = getattr(cls, name)
        if name == "mark":
            def f(self, n, _o=orig):
                if _state["place"] == "mark:" + n:
                    _spin()
                return _o(self, n)
        else:
            def f(self, *a, _o=orig, _n=name):
                if _state["place"] == _n:
                    _spin()
                return _o(self, *a)
        setattr(cls, name, f)

    for name in ("begin", "mark", "draft_end", "end", "graph", "draft_replay_begin", "draft_replay_end",
                 "harvest", "commit_begin", "commit_end", "draft_step"):
        if hasattr(cls, name):
            wrap(name)

    def on_signal(signum, frame):
        try:
            with open(os.path.join(_DIR, "WANT")) as f:
                _state["place"] = f.read().strip()
            with open(os.path.join(_DIR, "HAVE-%d" % os.getpid()), "w") as f:
                f.write(_state["place"])
        except OSError:
            pass

    if threading.current_thread() is threading.main_thread():
        signal.signal(getattr(signal, os.environ["SPECPROF_SENSITIVITY_SIGNAL"]), on_signal)
        with open(os.path.join(_DIR, "HAVE-%d" % os.getpid()), "w") as f:
            f.write("none")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sglang.specprof.null":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        orig = spec.loader.exec_module

        def exec_module(module):
            orig(module)
            _patch(module.NullProfiler)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def processes(folder, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = [int(p.rsplit("-", 1)[1]) for p in glob.glob(os.path.join(folder, "HAVE-*"))]
        if pids:
            return sorted(pids)
        time.sleep(0.5)
    raise SystemExit("no server process loaded the null profiler's spin (sitecustomize not on its path?)")


def set_place(folder, pids, place):
    with open(os.path.join(folder, "WANT"), "w") as f:
        f.write(place)
    for pid in pids:
        os.kill(pid, getattr(signal, SIGNAL))
    deadline = time.time() + 10
    while True:
        have = []
        for pid in pids:
            try:
                with open(os.path.join(folder, f"HAVE-{pid}")) as f:
                    have.append(f.read().strip())
            except OSError:
                have.append(None)
        if all(h == place for h in have):
            return
        if time.time() > deadline:
            raise SystemExit(f"the server did not take the place {place!r} (it has {have})")
        time.sleep(0.02)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--places", nargs="+", default=["begin", "draft_replay_begin", "mark:verify", "end"])
    ap.add_argument("--spin-us", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default="bench-logs")
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--sglang", default=installed_sglang())
    ap.add_argument("--tag", default="")
    ap.add_argument("--pin-schedulers", action="store_true",
                    help="the scheduler thread on a CPU (and core) of its own, the rest elsewhere")
    a = ap.parse_args()
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.logs, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="sensitivity-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    target, draft = write_models(os.path.join(a.logs, "models"), a.shape)
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN="3.0", SPECPROF_SENSITIVITY_DIR=folder,
               SPECPROF_SENSITIVITY_US=str(a.spin_us), SPECPROF_SENSITIVITY_SIGNAL=SIGNAL,
               PYTHONPATH=folder + os.pathsep + os.environ.get("PYTHONPATH", ""))
    servers = start_all({"off": (eagle3_args(target, draft, steps=3, topk=1, graph_bs=a.concurrency), env)}, a.logs)
    try:
        pinned = pin_schedulers(servers) if a.pin_schedulers else None
        port = servers["off"].port
        pids = processes(folder)
        print(f"server ready in {time.time() - t0:.0f} s; spin processes {pids}", flush=True)
        names = ["none"] + a.places
        for ci, c in enumerate(a.concurrency):
            budget = (t0 + a.max_seconds - time.time()) / (len(a.concurrency) - ci) if a.max_seconds else None
            tc = time.time()
            load(port, c, 64)
            runs = {n: [] for n in names}
            for r, order in rotations(names, a.rounds):
                if out_of_time(tc, r, budget, c):
                    break
                for n in order:
                    set_place(folder, pids, n)
                    runs[n].append(tok_s(port, c, a.new_tokens))
                print(f"c={c} round {r}: " + "  ".join(f"{n} {runs[n][-1]:.1f}" for n in names), flush=True)
            set_place(folder, pids, "none")
            res = {"benchmark": "host_sensitivity", "sglang": a.sglang, "concurrency": c, "spin_us": a.spin_us,
                   "rounds": len(runs["none"]), "new_tokens": a.new_tokens, "schedulers_pinned": pinned,
                   "tok_s_none_median": round(statistics.median(runs["none"]), 2), "places": {}}
            for p in a.places:
                ratios = [x / y for x, y in zip(runs[p], runs["none"])]
                res["places"][p] = {"median_ratio": round(statistics.median(ratios), 4),
                                    "ci95": [round(x, 4) for x in median_ci(ratios)],
                                    "ratios": [round(x, 4) for x in ratios]}
            res.update({"tok_s": {n: [round(x, 2) for x in v] for n, v in runs.items()},
                        "command": portable_command("bench/host_sensitivity.py", sys.argv[1:]),
                        "machine": machine(), "date": datetime.date.today().isoformat()})
            print(json.dumps({k: ({p: {"median_ratio": v["median_ratio"], "ci95": v["ci95"]}
                                   for p, v in res["places"].items()} if k == "places" else res[k])
                              for k in ("concurrency", "rounds", "tok_s_none_median", "places")}), flush=True)
            write_json(os.path.join(a.out, f"host-sensitivity-{a.sglang}-c{c}{a.tag}.json"), res)
    finally:
        stop_all(servers)


if __name__ == "__main__":
    main()
