#!/usr/bin/env python3
"""Where a step-0 cycle's time goes: the kernels of each phase at 0 steps and at K steps.

One speculative server (8B-shaped dummy target, 1-layer EAGLE3 dummy draft, multinomial
acceptance) with `--speculative-adaptive` restricted to 0 and K steps, the profiler's kernel
sampler on (`--speculative-profile-kernels`), SGLANG_SPECPROF_POLICY_FILE pinning each run to
0 or K. Each concurrency runs at 0 steps, then at K, for `--seconds` each; the profile's
kernel samples then say, per bucket ("65-128@0", ...), each phase's kernel time by class
(GEMM, attention, ...): what the target's verify forward costs at one token a request.

    python bench/zero_step.py --out OUT --logs OUT/logs --concurrency 1 128 --seconds 12
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from adaptive import Mode  # noqa: E402
from gpu_models import bench_dirs  # noqa: E402
from serving import eagle3_args, load, start_all, stop_all  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--graph-bs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    a = ap.parse_args()
    target, draft = bench_dirs(a.out, a.logs)
    cfg = os.path.join(a.logs, "adaptive.json")
    with open(cfg, "w") as f:
        json.dump({"1": {"candidate_steps": [0, a.steps]}}, f)
    profile = os.path.join(a.logs, "profile.jsonl")
    mode_path = os.path.join(a.logs, "mode")
    argv = eagle3_args(target, draft, steps=a.steps, graph_bs=a.graph_bs, max_tokens=60000) + [
        "--max-running-requests", str(max(a.graph_bs)), "--speculative-adaptive", "--speculative-adaptive-config", cfg,
        "--speculative-profile", "--speculative-profile-output", profile, "--speculative-profile-interval", "50",
        "--speculative-profile-kernels", "2"]
    env = dict(os.environ, SGLANG_SIMULATE_ACC_METHOD="multinomial", SGLANG_SIMULATE_ACC_LEN="3",
               SGLANG_SPECPROF_POLICY_FILE=mode_path)
    servers = start_all({"spec": (argv, env)}, a.logs)
    srv = servers["spec"]
    mode = Mode(srv.port, mode_path)
    runs = []
    try:
        for c in a.concurrency:
            load(srv.port, c, 16)
            for steps in (0, a.steps):
                mode.set(str(steps))
                t0 = time.time()
                tok = secs = 0.0
                while time.time() - t0 < a.seconds:
                    t, s = load(srv.port, c, a.new_tokens)
                    tok, secs = tok + t, secs + s
                runs.append({"concurrency": c, "steps": steps, "tok_s": round(tok / secs, 1)})
                print(runs[-1], flush=True)
        time.sleep(3.5)
    finally:
        stop_all(servers)
    with open(os.path.join(a.out, "zero-step-runs.json"), "w") as f:
        json.dump({"runs": runs, "argv": sys.argv[1:]}, f, indent=1)


if __name__ == "__main__":
    main()
