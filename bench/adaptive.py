#!/usr/bin/env python3
"""The cost policy against every static step count and upstream's adaptive rule, in one server.

One server per acceptance mean (`--means`, SGLANG_SIMULATE_ACC_METHOD=multinomial) runs
SGLang's `--speculative-adaptive` with the same candidates [1..5] in every batch-size tier,
`--speculative-profile` and `--speculative-adaptive-policy cost`, and SGLANG_SPECPROF_POLICY_FILE: before each run the
benchmark writes the mode there (`1`..`5`: every tier pinned to that step count; `ema`:
upstream's rule; `cost`: the cost policy) and reads /server_info, which takes it, until it
says it did. So the static settings and both
policies run on the same process, graphs and memory, round by round in rotating order; each
policy keeps its own state from one of its runs to the next (the cost policy learns only in
its own runs).

Loads: `--concurrency` requests at once (`--new-tokens` each), and with `--shift` one that
changes regime within the run: 1 request, then 32 at once, twice over. Each run's tokens/s
is the clients' tokens over the run's wall time. Across the whole benchmark the clients'
decode tokens are compared with the profile's committed tokens (they must be equal).

    python bench/adaptive.py --out OUT --logs OUT/logs --means 3 --concurrency 1 8 16 32 --shift \
        --rounds 8 --max-seconds 540
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import bench_dirs  # noqa: E402
from serving import (eagle3_args, http, installed_sglang, load, machine, median_ci, portable_command,  # noqa: E402
                     round_args, start_all, stop_all)

MODES = ["1", "2", "3", "4", "5", "ema", "cost"]
CANDIDATES = [1, 2, 3, 4, 5]
TIERS = [1, 8, 16, 32]  # the tiers and the captured graph batch sizes: the loads run at these


class Mode:
    def __init__(self, port, path):
        self.port, self.path = port, path

    def state(self):
        return http(self.port, "/server_info")["internal_states"][0]["speculative_profile"]

    def set(self, mode):
        self.seq = getattr(self, "seq", 0) + 1
        with open(self.path, "w") as f:
            f.write(f"{mode} {self.seq}\n")  # a new text each time: the server reads it when it changed
        want = f"pinned {mode}" if mode.isdigit() else mode
        deadline = time.time() + 10
        while self.state()["adaptive_policy"]["mode"] != want:
            if time.time() > deadline:
                raise SystemExit(f"the server did not take mode {mode}")
            time.sleep(0.05)


def shift_load(port, new_tokens):
    """1 request, then 32 at once, twice: (tokens, seconds, requests)."""
    tok = secs = reqs = 0
    for c in (1, 32, 1, 32):
        t, s = load(port, c, new_tokens if c == 1 else max(new_tokens // 2, 16))
        tok, secs, reqs = tok + t, secs + s, reqs + c
    return tok, secs, reqs


def analyse(runs):
    """Per load: each mode's median tok/s, the best static, and paired ratios with intervals."""
    out = {}
    for lname, by_mode in runs.items():
        n = min(len(v) for v in by_mode.values())
        if n == 0:
            continue
        med = {m: statistics.median(v[:n]) for m, v in by_mode.items()}
        static = {m: med[m] for m in MODES if m.isdigit()}
        best = max(static, key=static.get)
        res = {"rounds": n, "median_tok_s": {m: round(v, 1) for m, v in med.items()}, "best_static": int(best)}
        for pol in ("cost", "ema"):
            for vs in (best, "ema") if pol == "cost" else (best,):
                r = [a / b for a, b in zip(by_mode[pol][:n], by_mode[vs][:n])]
                key = f"{pol}_vs_{'best_static' if vs == best else vs}"
                res[key] = {"median": round(statistics.median(r), 4), "ci95": [round(x, 4) for x in median_ci(r)]}
        out[lname] = res
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--means", type=float, nargs="+", default=[3.0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--shift", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=256)
    round_args(ap)
    a = ap.parse_args()
    t0 = time.time()
    target, draft = bench_dirs(a.out, a.logs)
    cfg_path = os.path.join(a.logs, "adaptive.json")
    with open(cfg_path, "w") as f:
        json.dump({str(t): {"candidate_steps": CANDIDATES} for t in TIERS}, f)
    plan = {}
    for m in a.means:
        argv = eagle3_args(target, draft, steps=max(CANDIDATES), topk=1, graph_bs=TIERS, max_tokens=60000) + [
            "--speculative-adaptive", "--speculative-adaptive-config", cfg_path,
            "--speculative-adaptive-policy", "cost", "--speculative-profile",
            "--speculative-profile-output", os.path.join(a.logs, f"profile-m{m:g}.jsonl")]
        env = dict(os.environ, SGLANG_SIMULATE_ACC_METHOD="multinomial", SGLANG_SIMULATE_ACC_LEN=str(m),
                   SGLANG_SPECPROF_POLICY_FILE=os.path.join(a.logs, f"mode-m{m:g}"))
        plan[f"m{m:g}"] = (argv, env)
    servers = start_all(plan, a.logs)
    print(f"{len(servers)} servers ready in {time.time() - t0:.0f} s", flush=True)
    loads = [f"c{c}" for c in a.concurrency] + (["shift"] if a.shift else [])
    runs = {s: {ld: {m: [] for m in MODES} for ld in loads} for s in servers}
    client_decode = {s: 0 for s in servers}
    result_path = os.path.join(a.out, f"adaptive-{installed_sglang()}{a.tag}.json")
    try:
        modes = {}
        before = {}
        for name, srv in servers.items():
            modes[name] = Mode(srv.port, plan[name][1]["SGLANG_SPECPROF_POLICY_FILE"])
            for c in a.concurrency:  # compile each batch size's kernels before anything is timed
                load(srv.port, c, 32)
            time.sleep(1.0)
            before[name] = modes[name].state()["totals"]["committed_tokens"]
        for r in range(-a.warmup_rounds, a.rounds):
            if r >= 0 and a.max_seconds and time.time() - t0 > a.max_seconds:
                print(f"stopping after {r} rounds (--max-seconds)", flush=True)
                break
            for name, srv in servers.items():
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                for ld in loads:
                    got = {}
                    for m in order:
                        modes[name].set(m)
                        if ld == "shift":
                            tok, secs, reqs = shift_load(srv.port, a.new_tokens)
                        else:
                            c = int(ld[1:])
                            tok, secs = load(srv.port, c, a.new_tokens)
                            reqs = c
                        client_decode[name] += tok - reqs  # the first token of each is its prefill's
                        got[m] = round(tok / secs, 2)
                    if r >= 0:  # warm-up rounds: each shape's kernels compiled, each policy settled in
                        for m, v in got.items():
                            runs[name][ld][m].append(v)
                    print(f"{name} {ld} {'round' if r >= 0 else 'warm-up'} {r}: " +
                          " ".join(f"{m} {got[m]:.0f}" for m in MODES), flush=True)
            _write(result_path, a, runs, client_decode, None, servers)
        time.sleep(1.0)
        exact = {}
        for name in servers:
            modes[name].set("cost")
            st = modes[name].state()
            exact[name] = {"client_decode_tokens": client_decode[name],
                           "profile_committed_tokens": st["totals"]["committed_tokens"] - before[name],
                           "policy": st["adaptive_policy"]}
        _write(result_path, a, runs, client_decode, exact, servers)
        print(json.dumps({n: {ld: {k: v for k, v in x.items() if k != "median_tok_s"} for ld, x in analyse(runs[n]).items()}
                          for n in servers}, indent=1))
        print(json.dumps({n: {k: v for k, v in e.items() if k != "policy"} for n, e in exact.items()}))
    finally:
        stop_all(servers)


def _write(path, a, runs, client_decode, exact, servers):
    res = {"benchmark": "adaptive", "sglang": installed_sglang(), "means": a.means, "candidates": CANDIDATES,
           "tiers": TIERS, "new_tokens": a.new_tokens, "runs": runs,
           "analysis": {n: analyse(runs[n]) for n in runs}, "exact": exact,
           "command": portable_command("bench/adaptive.py", sys.argv[1:]), "machine": machine(),
           "date": datetime.date.today().isoformat()}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
