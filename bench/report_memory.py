#!/usr/bin/env python3
"""Peak memory and time of `sglang-specprof report` (and `compare`) on a long profile.

Writes a profile of about --mb megabytes by repeating the windows of a recorded one (each
with its own window index), then runs the report on it in a fresh process for each of the
given argument sets and prints the peak resident memory (the child's ru_maxrss) and the
wall time, one JSON line each. With --compare: `report PROFILE` and `compare PROFILE
PROFILE_B` instead, B a second profile of the same size (the recorded windows from another
offset).

    python bench/report_memory.py [--mb 300] [--profile tests/data/profile-0.5.16-eagle3-v2-topk1.jsonl]
    python bench/report_memory.py --mb 200 --compare

SPECPROF_TREE=/path/to/another/checkout runs that tree's report instead (a before/after).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_profile(src: str, path: str, mb: float, offset: int = 0) -> int:
    lines = [json.loads(x) for x in open(src) if x.strip()]
    n = 0
    with open(path, "w") as f:
        while f.tell() < mb * (1 << 20):
            w = dict(lines[(n + offset) % len(lines)], window=n)
            f.write(json.dumps(w) + "\n")
            n += 1
    return n


def peak(args: list[str]) -> dict:
    """One command (`report ...`, `compare ...`) in a child process: its peak RSS (MiB) and wall seconds."""
    code = ("import resource, subprocess, sys, time, json; t=time.perf_counter(); "
            "p=subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
            "print(json.dumps({'rc': p.returncode, 's': round(time.perf_counter()-t, 2), "
            "'peak_mib': round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024, 1), "
            "'err': p.stderr[-300:]}))")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.environ.get("SPECPROF_TREE", ROOT), "overlay"))
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "sglang_specprof", *args],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=300)
    ap.add_argument("--profile", default=os.path.join(ROOT, "tests", "data", "profile-0.5.16-eagle3-v2-topk1.jsonl"))
    ap.add_argument("--compare", action="store_true",
                    help="run `report PROFILE` and `compare PROFILE PROFILE_B` (two profiles of --mb each) instead")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, other = os.path.join(tmp, "long.jsonl"), os.path.join(tmp, "long-b.jsonl")
        n = write_profile(a.profile, path, a.mb)
        size = os.path.getsize(path) / (1 << 20)
        if a.compare:
            write_profile(a.profile, other, a.mb, offset=7)
            runs = [["report", "PROFILE"], ["compare", "PROFILE", "PROFILE_B"]]
        else:
            runs = [["report", "PROFILE", *extra] for extra in ([], ["--last", "1"], ["--json"], ["--trace", "T.json"])]
        names = {"PROFILE": path, "PROFILE_B": other, "T.json": os.path.join(tmp, "t.json")}
        for shown in runs:
            r = peak([names.get(x, x) for x in shown])
            print(json.dumps({"args": shown, "windows": n, "file_mib": round(size, 1), **r,
                              "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0]}), flush=True)


if __name__ == "__main__":
    main()
