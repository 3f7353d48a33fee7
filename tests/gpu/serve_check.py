#!/usr/bin/env python3
"""Start a --speculative-profile server on dummy models, load it, and check what it reports.

    python tests/gpu/serve_check.py --out DIR [--shape 8b|tiny] [--topk 1] [--concurrency 1 4]

Needs an NVIDIA GPU and an installed sglang-X.Y.Z+specprof.N. Writes into DIR the server
log, the profile JSONL, /server_info's profile key, and check.json: client tokens/s per
concurrency next to what the profiler reported, and the accounting of each window.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from gpu_models import SHAPES, write_models  # noqa: E402
from serving import LAUNCH, http, load  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8b", choices=SHAPES)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--port", type=int, default=30111)
    ap.add_argument("--extra", default="", help="more server flags")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    target, draft = write_models(os.path.join(a.out, "models"), a.shape)
    prof = os.path.join(a.out, "profile.jsonl")
    if os.path.exists(prof):
        os.remove(prof)
    cmd = [sys.executable, "-m", LAUNCH, "--model-path", target, "--load-format", "dummy",
           "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
           "--speculative-draft-load-format", "dummy", "--speculative-num-steps", str(a.steps),
           "--speculative-eagle-topk", str(a.topk), "--speculative-num-draft-tokens", str(a.draft_tokens),
           "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
           "--skip-tokenizer-init", "--cuda-graph-max-bs", "4", "--disable-piecewise-cuda-graph",
           "--mem-fraction-static", "0.6", "--port", str(a.port), "--speculative-profile",
           "--speculative-profile-output", prof, "--speculative-profile-interval", "100", *a.extra.split()]
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN=os.environ.get("SGLANG_SIMULATE_ACC_LEN", "3.0"))
    # The flag with a non-EAGLE algorithm: one sentence, exit status 2, before any GPU work.
    bad = subprocess.run([sys.executable, "-m", LAUNCH, "--model-path", target, "--load-format",
                          "dummy", "--speculative-profile", "--speculative-algorithm", "NGRAM"],
                         capture_output=True, text=True, env=env, timeout=300)
    rejected = {"returncode": bad.returncode, "last_line": (bad.stderr.strip().splitlines() or [""])[-1]}
    log = open(os.path.join(a.out, "server.log"), "w")
    t0 = time.time()
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    check = {"command": " ".join(cmd), "runs": [], "ngram_rejected": rejected}
    try:
        while True:
            if srv.poll() is not None:
                raise SystemExit(f"server exited with {srv.returncode}; see server.log")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=5)
                break
            except Exception:
                time.sleep(2)
        check["startup_s"] = round(time.time() - t0, 1)
        for c in a.concurrency:
            load(a.port, c, 64)  # warm up this batch size (Triton compiles new shapes on first use)
            start = time.time()
            tokens, secs = load(a.port, c, a.new_tokens)
            end = time.time()
            time.sleep(1)
            check["runs"].append({"concurrency": c, "tokens": tokens, "seconds": round(secs, 3),
                                  "client_tok_s": round(tokens / secs, 1), "start": start, "end": end})
        if "--enable-metrics" in a.extra:
            metrics = [l for l in http(a.port, "/metrics").splitlines() if "specprof" in l and not l.startswith("#")]
            with open(os.path.join(a.out, "metrics.txt"), "w") as f:
                f.write("\n".join(metrics) + "\n")
            check["metrics_lines"] = len(metrics)
        info = http(a.port, "/server_info")
        states = info.get("internal_states", [{}])
        with open(os.path.join(a.out, "server_info_profile.json"), "w") as f:
            json.dump([s.get("speculative_profile") for s in states], f, indent=1)
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
    windows = [json.loads(l) for l in open(prof)] if os.path.exists(prof) else []
    check["windows"] = [{"window": w["window"], "tok_s": w["tokens_per_s"], "buckets": {
        k: {"cycles": b["cycles"], "accounted": b["accounted"],
            "phases_gpu_ms": {n: p["gpu_ms"]["mean"] for n, p in b["phases"].items()},
            "between_cycles_ms": b["between_cycles_gpu_ms"]["mean"], "accept": b["accept"]["mean_length"],
            "per_position": b["accept"]["per_position"], "tok_s": b["tokens_per_s"],
            "cycle_gpu_ms": b["cycle_gpu_ms"]["mean"], "wall_ms": b["cycle_wall_ms"]["mean"],
            "steps": [s["mean"] for s in b["draft_steps_gpu_ms"]], "graph": b["graph"]}
        for k, b in w["buckets"].items()}} for w in windows]
    # Tokens/s: the client's, against the profiler's over the windows that lie inside the run.
    for run in check["runs"]:
        inside = [w for w in windows if w["time"] - (w.get("wall_seconds") or 0) >= run["start"]
                  and w["time"] <= run["end"] + 0.5]
        committed = sum(b["accept"]["committed_tokens"] for w in inside for b in w["buckets"].values())
        busy = sum(w["seconds"] or 0 for w in inside)
        run["profile_windows"] = [w["window"] for w in inside]
        run["profile_tok_s"] = round(committed / busy, 1) if busy else None
        run["ratio"] = round(run["profile_tok_s"] / run["client_tok_s"], 4) if busy else None
    with open(os.path.join(a.out, "check.json"), "w") as f:
        json.dump(check, f, indent=1)
    print(json.dumps(check, indent=1))


if __name__ == "__main__":
    main()
