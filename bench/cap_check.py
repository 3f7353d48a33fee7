#!/usr/bin/env python3
"""The running-request cap, named by the profile and checked by raising it.

Two speculative servers of the same model (8B-shaped dummy pair, multinomial acceptance,
`--speculative-num-steps` 3) on one GPU: `capped` with 0.5.16's default cap (48 for a
speculative server) and `--speculative-profile`, `raised` with `--max-running-requests
--raised`. `--concurrency` requests at once run on each in turn for `--rounds` rounds; the
paired ratio of their tokens/s is what raising the cap gave. Then `sglang-specprof report`
of the capped server's profile, whose cap line (if any) is printed, and its committed tokens
against the clients' decode tokens.

    python bench/cap_check.py --out OUT --logs OUT/logs --concurrency 128 --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import bench_dirs  # noqa: E402
from serving import SETTLE_S, eagle3_args, http, load, start_all, stop_all  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--raised", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    a = ap.parse_args()
    target, draft = bench_dirs(a.out, a.logs)
    profile = os.path.join(a.logs, "profile.jsonl")
    base = eagle3_args(target, draft, steps=3, graph_bs=[1, 8, 16, 32, 48, 64, 96, 128], max_tokens=60000)
    env = dict(os.environ, SGLANG_SIMULATE_ACC_METHOD="multinomial", SGLANG_SIMULATE_ACC_LEN="3")
    plan = {"capped": (base + ["--speculative-profile", "--speculative-profile-output", profile], env),
            "raised": (base + ["--max-running-requests", str(a.raised)], env)}
    servers = start_all(plan, a.logs)
    runs = {n: [] for n in servers}
    client_decode = 0
    try:
        for s in servers.values():
            load(s.port, a.concurrency, 16)
        before = http(servers["capped"].port, "/server_info")["internal_states"][0]["speculative_profile"]["totals"]
        for r in range(a.rounds):
            for n in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                tok, secs = load(servers[n].port, a.concurrency, a.new_tokens)
                runs[n].append(round(tok / secs, 1))
                if n == "capped":
                    client_decode += tok - a.concurrency
            print(r, {n: v[-1] for n, v in runs.items()}, flush=True)
        time.sleep(SETTLE_S)  # the idle close: the open window's tokens in the totals
        after = http(servers["capped"].port, "/server_info")["internal_states"][0]["speculative_profile"]["totals"]
    finally:
        stop_all(servers)
    ratios = [b / c for b, c in zip(runs["raised"], runs["capped"])]
    rep = subprocess.run([sys.executable, "-m", "sglang_specprof", "report", profile], capture_output=True, text=True)
    cap = [line for line in rep.stdout.splitlines() if "running-request cap" in line]
    res = {"runs": runs, "raised_over_capped": {"median": round(statistics.median(ratios), 4), "all": ratios},
           "client_decode_tokens": client_decode,
           "profile_committed_tokens": after["committed_tokens"] - before["committed_tokens"],
           "cap_lines": cap, "report_rc": rep.returncode, "argv": sys.argv[1:]}
    with open(os.path.join(a.out, "cap-check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
