#!/usr/bin/env python3
"""What --speculative-profile costs, and whether its times agree with an independent timer.

Starts, side by side on one GPU, servers of the same dummy-weight models that differ in
one thing each:

  off       the built wheel, no --speculative-profile
  on        the built wheel, --speculative-profile (JSONL output too)
  upstream  unpatched SGLang (with --upstream-path), no profiler
  check     --speculative-profile plus SGLang's own device timer (--check): the same
            forwards timed a second way, by upstream code

then, for each concurrency, runs the same decode-heavy load on off / on / upstream in
rounds, rotating the order each round (A B C, B C A, C A B, ...), so that drift of the
machine falls on all of them alike. Each run's tokens/s is total generated tokens over
the wall time of the run. Ratios are paired within a round (on/off, upstream/off); the
result is their median and spread.

    python bench/overhead.py --rounds 8 --concurrency 1 8 --new-tokens 1024 --out bench/results

Needs an NVIDIA GPU, the built wheel importable, and (for `upstream`) a folder whose
`sglang` is the unpatched release, first on PYTHONPATH for that server only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import write_models  # noqa: E402


def http(port, path, data=None, timeout=900):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=None if data is None else json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if path != "/metrics" else body.decode()


def load(port, concurrency, new_tokens):
    """`concurrency` requests at once, each `new_tokens` long; returns tokens/s over the run."""
    got = []

    def one(i):
        ids = [100 + (i * 7 + j) % 1000 for j in range(64)]
        out = http(port, "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
        got.append(len(out["output_ids"]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if len(got) != concurrency:
        raise RuntimeError(f"{concurrency - len(got)} requests failed on port {port}")
    return sum(got) / secs


class Server:
    def __init__(self, name, port, argv, env, log_dir):
        self.name, self.port = name, port
        self.cmd = [sys.executable, "-m", "sglang.launch_server", *argv, "--port", str(port)]
        self.log = open(os.path.join(log_dir, f"server-{name}.log"), "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_log(self, text, deadline):
        """Until the server's log shows `text` (its memory pools are allocated by then)."""
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.name} exited with {self.proc.returncode}; see server-{self.name}.log")
            with open(self.log.name) as f:
                if text in f.read():
                    return
            time.sleep(1)
        raise SystemExit(f"server {self.name} never logged {text!r}")

    def wait_ready(self, deadline):
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.name} exited with {self.proc.returncode}; see server-{self.name}.log")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5)
                return
            except Exception:
                time.sleep(2)
        raise SystemExit(f"server {self.name} not ready in time")

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except Exception:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except Exception:
                pass


def _portable_args(argv):
    """The command line as recorded: the run's own folders named, not spelled out."""
    out, names = [], {"--out": "OUT", "--logs": "OUT/logs", "--upstream-path": "UNPATCHED"}
    for i, a in enumerate(argv):
        out.append(names[argv[i - 1]] if i and argv[i - 1] in names else a)
    return " ".join(shlex.quote(x) for x in out)


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(name, ratios):
    lo, hi = quartiles(ratios)
    return {f"median_ratio{name}": round(statistics.median(ratios), 4),
            f"ratio{name}_iqr": [round(lo, 4), round(hi, 4)],
            f"ratio{name}_min_max": [round(min(ratios), 4), round(max(ratios), 4)],
            f"ratios{name}": [round(r, 4) for r in ratios]}


def independent_check(server, concurrency, new_tokens):
    """Profiler totals against SGLang's device timer over the same stretch of cycles."""
    def snap():
        states = http(server.port, "/server_info")["internal_states"]
        totals = states[0]["speculative_profile"]["totals"]
        counters = {}
        for line in http(server.port, "/metrics").splitlines():
            if line.startswith("sglang:forward_execution_seconds_total{"):
                cat = line.split('category="', 1)[1].split('"', 1)[0]
                counters[cat] = counters.get(cat, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals, counters

    load(server.port, concurrency, 64)
    time.sleep(1)
    t0, c0 = snap()
    load(server.port, concurrency, new_tokens)
    time.sleep(1)
    t1, c1 = snap()
    cycles = t1["decode_cycles"] - t0["decode_cycles"]
    ours = {k: t1["phase_gpu_ms"].get(k, 0.0) - t0["phase_gpu_ms"].get(k, 0.0) for k in t1["phase_gpu_ms"]}
    theirs = {k: (c1.get(k, 0.0) - c0.get(k, 0.0)) * 1000.0 for k in c1}
    pairs = {"verify": ("verify", "target_verify"), "draft": ("draft", "eagle_draft"),
             "draft_extend": ("draft_extend", "eagle_draft_extend")}
    out = {"concurrency": concurrency, "decode_cycles": cycles, "phases": {}}
    for label, (mine, upstream) in pairs.items():
        if mine in ours and theirs.get(upstream):
            out["phases"][label] = {
                "profiler_ms_per_cycle": round(ours[mine] / cycles, 4),
                "device_timer_ms_per_cycle": round(theirs[upstream] / cycles, 4),
                "ratio": round(ours[mine] / theirs[upstream], 4),
            }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--upstream-path", help="folder whose sglang is the unpatched release")
    ap.add_argument("--check", action="store_true", help="also start the device-timer server and compare")
    ap.add_argument("--out", default="bench/results", help="folder for the JSON results")
    ap.add_argument("--logs", default="bench-logs", help="folder for server logs and models")
    ap.add_argument("--mem-fraction", type=float, default=0.2,
                    help="GPU memory per server; the servers start one after another, each allowed "
                         "this much more of the GPU than the one before (SGLang counts the others' use)")
    ap.add_argument("--sglang", default="0.5.12")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.logs, exist_ok=True)
    target, draft = write_models(os.path.join(a.logs, "models"), a.shape)
    common = ["--model-path", target, "--load-format", "dummy", "--speculative-algorithm", "EAGLE3",
              "--speculative-draft-model-path", draft, "--speculative-draft-load-format", "dummy",
              "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
              "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
              "--skip-tokenizer-init", "--cuda-graph-max-bs", str(max(a.concurrency)),
              "--disable-piecewise-cuda-graph"]
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN="3.0")
    prof = ["--speculative-profile", "--speculative-profile-output", os.path.join(a.logs, "on.jsonl")]
    plan = {"off": (common, env), "on": (common + prof, env)}
    if a.upstream_path:
        up_env = dict(env, PYTHONPATH=a.upstream_path + os.pathsep + env.get("PYTHONPATH", ""))
        plan["upstream"] = (common, up_env)
    if a.check:
        plan["check"] = (common + ["--speculative-profile", "--enable-metrics"],
                         dict(env, SGLANG_ENABLE_METRICS_DEVICE_TIMER="1"))
    servers = {}
    t0 = time.time()
    try:
        for i, (name, (argv, e)) in enumerate(plan.items()):
            frac = round(a.mem_fraction * (i + 1), 3)
            servers[name] = Server(name, 31000 + i, argv + ["--mem-fraction-static", str(frac)], e, a.logs)
            # start the next once this one has taken its memory
            servers[name].wait_log("Capture draft cuda graph begin", time.time() + 600)
        for s in servers.values():
            s.wait_ready(time.time() + 600)
        print(f"{len(servers)} servers ready in {time.time() - t0:.0f} s", flush=True)
        compared = [n for n in ("off", "on", "upstream") if n in servers]
        machine = f"{platform.node()}: " + subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True).stdout.strip()
        results = []
        for c in a.concurrency:
            for n in compared:
                load(servers[n].port, c, 64)  # compile this batch size's shapes on every server
            runs = {n: [] for n in compared}
            for r in range(a.rounds):
                order = compared[r % len(compared):] + compared[:r % len(compared)]
                for n in order:
                    runs[n].append(load(servers[n].port, c, a.new_tokens))
                print(f"c={c} round {r}: " + "  ".join(f"{n} {runs[n][-1]:.1f}" for n in compared), flush=True)
            res = {"benchmark": "overhead", "sglang": a.sglang, "concurrency": c,
                   "tok_s_off": [round(x, 2) for x in runs["off"]], "tok_s_on": [round(x, 2) for x in runs["on"]]}
            res.update(summarize("", [on / off for on, off in zip(runs["on"], runs["off"])]))
            if "upstream" in runs:
                res["tok_s_upstream"] = [round(x, 2) for x in runs["upstream"]]
                res.update(summarize("_off_vs_upstream", [off / up for off, up in zip(runs["off"], runs["upstream"])]))
            res.update({"rounds": a.rounds, "new_tokens": a.new_tokens,
                        "command": "python bench/overhead.py " + _portable_args(sys.argv[1:]),
                        "machine": machine, "date": datetime.date.today().isoformat()})
            if "check" in servers:
                res["independent_check"] = independent_check(servers["check"], c, a.new_tokens)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if not k.startswith(("tok_s", "ratios"))}), flush=True)
            with open(os.path.join(a.out, f"overhead-{a.sglang}-c{c}.json"), "w") as f:
                json.dump(res, f, indent=1)
                f.write("\n")
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
