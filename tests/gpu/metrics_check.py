#!/usr/bin/env python3
"""The Prometheus gauges on a real server, and the Grafana dashboard's queries against them.

    python tests/gpu/metrics_check.py --out DIR

Starts one dummy-weight EAGLE3 server with --enable-metrics --speculative-profile (windows of
20 cycles), sends loads at 1 and 8 concurrent, reads /metrics and writes DIR/metrics.txt and
DIR/check.json: the sglang:specprof_* samples the server exported, each gauge the sink defines
with its count of samples, each dashboard query with the gauges it names and whether they are
there, and the tokens/s gauge next to the last window in /server_info. Exits 1 if a gauge or a
query's gauge is missing. Needs an NVIDIA GPU and an installed sglang-X.Y.Z+specprof.N.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_models import write_models  # noqa: E402
from serving import eagle3_args, http, load, start_all, stop_all  # noqa: E402
from sglang.specprof.metrics import GAUGES  # noqa: E402  (the installed wheel's)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    target, draft = write_models(os.path.join(a.out, "models"), "8b")
    argv = eagle3_args(target, draft, 3, 1, 4, (1, 2, 4, 8)) + [
        "--enable-metrics", "--speculative-profile", "--speculative-profile-interval", "20"]
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN="3.0", SGLANG_SIMULATE_ACC_METHOD="multinomial")
    servers = start_all({"m": (argv, env)}, os.path.join(a.out, "logs"), timeout=420)
    try:
        port = servers["m"].port
        for c, n in ((1, 200), (8, 200), (1, 100)):
            load(port, c, n)
        time.sleep(2)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        info = http(port, "/server_info")
    finally:
        stop_all(servers)
    with open(os.path.join(a.out, "metrics.txt"), "w") as f:
        f.write(text)
    samples = [ln for ln in text.splitlines() if ln.startswith("sglang:specprof_")]
    names = {re.match(r"[\w:]+", ln).group(0) for ln in samples}
    dash = json.load(open(os.path.join(ROOT, "dashboards", "grafana-specprof.json")))
    queries = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    latest = (info.get("internal_states") or [{}])[0].get("speculative_profile", {}).get("latest") or {}
    tok = [float(ln.rsplit(" ", 1)[1]) for ln in samples if ln.startswith("sglang:specprof_tokens_per_s")]
    check = {
        "samples": len(samples),
        "gauges": {g: sum(1 for ln in samples if re.match(re.escape(g) + r"[{ ]", ln)) for g in GAUGES},
        "queries": [{"expr": q, "gauges": sorted(set(re.findall(r"sglang:specprof_\w+", q))),
                     "present": all(n in names for n in re.findall(r"sglang:specprof_\w+", q))} for q in queries],
        "tokens_per_s_gauge": tok, "tokens_per_s_latest_window": latest.get("tokens_per_s"),
        "latest_window": latest.get("window"),
    }
    with open(os.path.join(a.out, "check.json"), "w") as f:
        json.dump(check, f, indent=1)
    missing = [g for g, n in check["gauges"].items() if not n] + [q["expr"] for q in check["queries"] if not q["present"]]
    print(json.dumps({k: v for k, v in check.items() if k != "queries"}, indent=1))
    if missing:
        print("missing:", missing)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
