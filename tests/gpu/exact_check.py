#!/usr/bin/env python3
"""The profiler's counts and rates against what the clients received, on real servers.

    python tests/gpu/exact_check.py --out DIR [--servers NAME ...] [--quick] [--kernels N]
                                    [--cost-rounds N --cost-tokens T]

Starts one dummy-weight server per setting (side by side on one GPU; EAGLE3, or STANDALONE
with a 1B-shaped draft, NGRAM, multi-layer EAGLE, DFLASH or DSPARK: SETTINGS and ALGORITHM below),
sends each the loads below, reads `/server_info` totals before and after each load, and writes DIR/check.json:
per server and load, the decode tokens the clients received (completion tokens - 1 per request,
the first token being the prefill's), the profiler's committed tokens over the same stretch
(the difference must be 0), the phases present, and the profiler's decode tokens/s next to
the clients' decode-only rate (streamed, from each request's first token to its last, the
prefills of later arrivals taken out: client_rate.py), and the profiler's partition of the
GPU time (decode, drain, prefill, beside the prefills) against the server's busy time as the
clients saw it (each request from its send to its last token). With --kernels, each server's
kernel samples summed up (their coverage and phases); with --cost-rounds, the same servers
started again without samples and measured at one request with the profiler on and paused
(SIGUSR2), N rounds alternating which runs first.

Needs an NVIDIA GPU and an installed sglang-X.Y.Z+specprof.N (PYTHONPATH or site-packages).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from gpu_models import write_dflash_draft, write_mimo_v2, write_models, write_standalone_draft  # noqa: E402
from serving import eagle3_args, http, ratio_summary, start_all, stop_all  # noqa: E402
from client_rate import client_decode_seconds  # noqa: E402
from sglang_specprof.kernels import merge as merge_kernels, union_length  # noqa: E402  (the installed sglang-specprof)

# name: (steps, topk, draft tokens, extra flags)
SETTINGS = {
    "s6k1": (6, 1, 7, []),
    "s1k1": (1, 1, 2, []),
    "s3k4": (3, 4, 8, []),
    "s8k1": (8, 1, 9, []),
    "s3k1": (3, 1, 4, []),
    "s4k2v1": (4, 2, 8, ["--disable-overlap-schedule"]),
    "s3k1e": (3, 1, 4, ["--disable-cuda-graph"]),  # every forward eager
    # the other algorithms (ALGORITHM below): a 1B-shaped Llama as the 8B target's draft, and
    # n-gram matching with no draft model (8 tokens matched a cycle)
    "sa3": (3, 1, 4, []),
    "sa3k2": (3, 2, 6, []),
    "ng8": (None, None, 8, []),
    # multi-layer EAGLE: a small dense MiMoV2 target whose 3 MTP layers draft (gpu_models.write_mimo_v2);
    # hybrid SWA memory off (the dummy has no sliding window)
    "ml3": (3, 1, 4, ["--enable-multi-layer-eagle", "--disable-hybrid-swa-memory"]),
    # DFLASH and DSPARK: 1-layer block drafters of the 8B target's width, verifying 8 tokens a
    # request (gpu_models.write_dflash_draft)
    "df8": (1, 1, 8, []),
    "dp8": (1, 1, 8, []),
}
ALGORITHM = {"sa3": "STANDALONE", "sa3k2": "STANDALONE", "ng8": "NGRAM", "ml3": "EAGLE",
             "df8": "DFLASH", "dp8": "DSPARK"}  # the rest: EAGLE3
GRAPH_BS = [1, 2, 4, 8, 12, 16]  # captured batch sizes: 3 pads to 4, 24 concurrent runs eager


def post_quietly(port, path, body):
    """A POST whose answer is not JSON (/abort_request, /start_profile): its status only."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def stream_one(port, ids, params, rid, rec, abort_after=None):
    """One streamed /generate; `rec` gets the time of every chunk and the last meta_info."""
    body = {"input_ids": ids, "sampling_params": params, "stream": True, "rid": rid}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    rec.update(rid=rid, sent=time.perf_counter(), chunks=[], meta=None, error=None)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                rec["chunks"].append(time.perf_counter())
                rec["meta"] = obj.get("meta_info")
                if abort_after and len(rec["chunks"]) == abort_after:
                    threading.Thread(target=post_quietly, args=(port, "/abort_request", {"rid": rid}),
                                     daemon=True).start()
    except Exception as e:  # recorded; the check reports it
        rec["error"] = f"{type(e).__name__}: {e}"


def run_load(port, name, n, prompt, new, rounds=1, stagger_s=0.0, abort_every=0, stop_ids=None):
    """`n` requests per round (started `stagger_s` apart), `rounds` rounds one after another."""
    recs = []
    for r in range(rounds):
        threads = []
        for i in range(n):
            ids = [100 + (i * 7 + j * 13 + r) % 30000 for j in range(prompt)]
            params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": stop_ids is None}
            if stop_ids is not None:
                params["stop_token_ids"] = stop_ids[i % len(stop_ids)]
            rec = {}
            recs.append(rec)
            abort = 6 if abort_every and i % abort_every == 0 else None
            t = threading.Thread(target=stream_one, args=(port, ids, params, f"{name}-{r}-{i}-{time.time_ns()}",
                                                          rec, abort))
            threads.append(t)
            t.start()
            if stagger_s:
                time.sleep(stagger_s)
        for t in threads:
            t.join()
    return recs


def stop_tokens(port):
    """For each of 4 requests, a token its greedy run first emits about 30 tokens in: as its
    stop token, the run ends there, inside a verified run (the tail past it is cut)."""
    out = []
    for i in range(4):
        ids = [100 + (i * 7 + j * 13) % 30000 for j in range(256)]
        got = http(port, "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}})["output_ids"]
        pick = next((t for p, t in enumerate(got) if p >= 20 and t not in got[:p]), got[-1] if got else 0)
        out.append([int(pick)])
    return out


def totals(port):
    info = http(port, "/server_info")
    states = info.get("internal_states") or [{}]
    return states[0].get("speculative_profile") or {}


def judge(name, recs, before, after, windows):
    errors = [r["error"] for r in recs if r.get("error")]
    t0 = min((r["sent"] for r in recs), default=0.0)
    done = [r for r in recs if r.get("meta")]
    client = sum(max(0, r["meta"]["completion_tokens"] - 1) for r in done)
    tb, ta = before.get("totals") or {}, after.get("totals") or {}
    committed = ta.get("committed_tokens", 0) - tb.get("committed_tokens", 0)
    intervals = [(r["chunks"][0], r["chunks"][-1]) for r in done if len(r["chunks"]) >= 2]
    span = union_length(intervals)
    decode_s = client_decode_seconds([r["chunks"] for r in done])
    client_rate = client / decode_s if decode_s > 0 else None
    gpu_ms = ta.get("decode_gpu_ms", 0) - tb.get("decode_gpu_ms", 0)
    prof_rate = committed / (gpu_ms / 1000.0) if gpu_ms > 0 else None
    # the server's whole time as the clients saw it (each request from its send to its last
    # token) against the profiler's partition of the GPU time over the same stretch
    busy = union_length([(r["sent"], r["chunks"][-1]) for r in done if r["chunks"]])
    part = {k: (ta.get(k, 0) - tb.get(k, 0)) / 1000.0
            for k in ("decode_gpu_ms", "drain_gpu_ms", "prefill_gpu_ms", "beside_prefill_gpu_ms")}
    accounted = sum(part.values())
    ws = [w for w in windows if w["host_start_s"] is not None]
    phases = sorted({p for w in ws for b in w["buckets"].values() for p in b["phases"]})
    return {
        "load": name, "requests": len(recs), "errors": errors[:3], "client_decode_tokens": client,
        "committed_tokens": committed, "difference": committed - client,
        "finish_reasons": sorted({json.dumps((r["meta"] or {}).get("finish_reason")) for r in done}),
        "verified_requests": ta.get("verified_requests", 0) - tb.get("verified_requests", 0),
        "skipped_requests": ta.get("skipped_requests", 0) - tb.get("skipped_requests", 0),
        "cut_tokens": ta.get("cut_tokens", 0) - tb.get("cut_tokens", 0),
        "decode_cycles": ta.get("decode_cycles", 0) - tb.get("decode_cycles", 0),
        "client_decode_tok_s": None if client_rate is None else round(client_rate, 1),
        "client_span_s": round(span, 4), "client_decode_s": round(decode_s, 4),
        "profile_decode_gpu_s": round(gpu_ms / 1000.0, 4),
        "profile_decode_tok_s": None if prof_rate is None else round(prof_rate, 1),
        "rate_ratio": round(prof_rate / client_rate, 4) if prof_rate and client_rate else None,
        "admissions": ta.get("admissions", 0) - tb.get("admissions", 0),
        "profile_partition_s": {k[:-3]: round(v, 4) for k, v in part.items()},
        "client_busy_s": round(busy, 4),
        "accounted_ratio": round(accounted / busy, 4) if busy > 0 and "admissions" in ta else None,
        "phases_seen": phases,
        # every request's chunk times (ms from the load's first request), for judging the
        # clients' side of the rate again
        "chunks_ms": [[round((t - t0) * 1000.0, 2) for t in r["chunks"]] for r in done],
        "sent_ms": [round((r["sent"] - t0) * 1000.0, 2) for r in done],
    }


def loads_for(quick):
    """(name, kwargs for run_load) — the issue's four loads, aborts, stops, staggered arrivals."""
    out = [
        ("c1-long", dict(n=1, prompt=3000, new=1024 if not quick else 256)),
        ("c16-256", dict(n=16, prompt=256, new=256 if not quick else 96)),
        ("c24-eager", dict(n=24, prompt=256, new=128 if not quick else 64)),
        ("c16x24x4", dict(n=16, prompt=256, new=24, rounds=4)),
        ("c8-stagger", dict(n=8, prompt=256, new=192, stagger_s=0.15)),
        # the same again: what the first one paid for new prefill shapes is not paid twice
        ("c8-stagger-again", dict(n=8, prompt=256, new=192, stagger_s=0.15)),
        ("c16-stagger", dict(n=16, prompt=256, new=128, stagger_s=0.04)),
        ("c8-abort", dict(n=8, prompt=256, new=400, abort_every=2)),
    ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--servers", nargs="+", default=["s6k1", "s1k1", "s3k4", "s8k1"], choices=SETTINGS)
    ap.add_argument("--quick", action="store_true", help="shorter loads")
    ap.add_argument("--acc", default="3.5", help="SGLANG_SIMULATE_ACC_LEN")
    ap.add_argument("--acc-method", default="multinomial", help="SGLANG_SIMULATE_ACC_METHOD")
    ap.add_argument("--max-tokens", type=int, default=30000)
    ap.add_argument("--warm-each", action="store_true",
                    help="send each load once unmeasured first (its batch shapes' first-use costs out of the figures)")
    ap.add_argument("--trace", default=None, help="server name: a torch profiler trace of a few cycles at bs 1")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="--speculative-profile-kernels N on every server (kernel samples every N windows)")
    ap.add_argument("--first-port", type=int, default=31000,
                    help="the first server's port (several checks on one GPU at once need apart ports)")
    ap.add_argument("--cost-rounds", type=int, default=0, metavar="N",
                    help="then the same servers started again without kernel samples, the profiler on and paused "
                         "(SIGUSR2) in N interleaved rounds of one request each: the cost on / off")
    ap.add_argument("--cost-tokens", type=int, default=512, help="new tokens of each cost run")
    ap.add_argument("--logs", default=None, help="server logs (default: OUT/logs)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    logs = a.logs or os.path.join(a.out, "logs")
    os.makedirs(logs, exist_ok=True)
    models = os.path.join(a.out, "models")
    target, draft = write_models(models, "8b")
    small = write_standalone_draft(models, "1b")
    mimo = write_mimo_v2(models)
    block = {"DFLASH": write_dflash_draft(models, "8b", SETTINGS["df8"][2]),
             "DSPARK": write_dflash_draft(models, "8b", SETTINGS["dp8"][2], dspark=True)}
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN=a.acc, SGLANG_SIMULATE_ACC_METHOD=a.acc_method)

    def server_argv(name, prof, kernels):
        steps, topk, dt, extra = SETTINGS[name]
        algo = ALGORITHM.get(name, "EAGLE3")
        tgt, drf = (mimo, mimo) if name.startswith("ml") else (target, dict(block, STANDALONE=small).get(algo, draft))
        return eagle3_args(tgt, drf, steps, topk, dt, GRAPH_BS, a.max_tokens, algorithm=algo) + [
            "--speculative-profile", "--speculative-profile-output", prof, "--speculative-profile-interval", "50",
            "--context-length", "8192", *extra] + (["--speculative-profile-kernels", str(kernels)] if kernels else [])

    plan = {}
    for name in a.servers:
        prof = os.path.join(a.out, f"profile-{name}.jsonl")
        if os.path.exists(prof):
            os.remove(prof)
        argv = server_argv(name, prof, a.kernels)
        if a.trace == name:
            env_t = dict(env, SGLANG_TORCH_PROFILER_DIR=os.path.join(a.out, "trace"))
            plan[name] = (argv, env_t)
        else:
            plan[name] = (argv, env)
    check = {"argv": sys.argv[1:], "env": {"SGLANG_SIMULATE_ACC_LEN": a.acc, "SGLANG_SIMULATE_ACC_METHOD": a.acc_method},
             "servers": {}}
    t0 = time.time()
    servers = start_all(plan, logs, first_port=a.first_port, timeout=420)
    check["startup_s"] = round(time.time() - t0, 1)
    try:
        for name, srv in servers.items():
            steps, topk, dt, extra = SETTINGS[name]
            entry = {"algorithm": ALGORITHM.get(name, "EAGLE3"), "steps": steps, "topk": topk, "draft_tokens": dt,
                     "extra": extra, "loads": []}
            check["servers"][name] = entry
            port = srv.port
            run_load(port, "warm", 4, 64, 32)  # first use compiles kernels
            run_load(port, "warm", 24, 64, 16)
            one = run_load(port, "ttft", 1, 256, 8)
            ttft = (one[0]["chunks"][0] - one[0]["sent"]) if one[0].get("chunks") else 0.0
            entry["ttft_s"] = round(ttft, 4)
            prof = os.path.join(a.out, f"profile-{name}.jsonl")
            stops = stop_tokens(port)
            entry["stop_token_ids"] = stops
            for lname, kw in loads_for(a.quick) + [("c4-stop", None)]:
                if kw is None:
                    kw = dict(n=4, prompt=256, new=60, stop_ids=stops)
                if a.warm_each:
                    run_load(port, "w" + lname, **kw)
                    time.sleep(0.5)
                before = totals(port)
                nlines = sum(1 for _ in open(prof)) if os.path.exists(prof) else 0
                recs = run_load(port, lname, **kw)
                time.sleep(1.0)
                after = totals(port)
                windows = [json.loads(x) for x in open(prof)][nlines:] if os.path.exists(prof) else []
                r = judge(lname, recs, before, after, windows)
                entry["loads"].append(r)
                print(name, json.dumps(r), flush=True)
            if a.kernels and os.path.exists(prof):
                entry["kernels"] = kernel_summary(prof)
            if a.trace == name:
                entry["trace"] = post_quietly(port, "/start_profile", {"num_steps": 12, "activities": ["CPU", "GPU"]})
                run_load(port, "trace", 1, 256, 200)
                time.sleep(5)
    finally:
        stop_all(servers)
    write_check(a.out, check)
    if a.cost_rounds:
        check["cost"] = cost_on_off(a, plan, server_argv, logs)
        write_check(a.out, check)


def write_check(out, check):
    with open(os.path.join(out, "check.json"), "w") as f:
        json.dump(check, f, indent=1)


def kernel_summary(prof):
    """The profile's kernel samples as one: how many, the share of their kernel time that ran
    inside a named phase (coverage), and the phases they saw."""
    blocks, errors = [], 0
    with open(prof) as f:
        for line in f:
            k = json.loads(line).get("kernels")
            if isinstance(k, dict):
                if "error" in k:
                    errors += 1
                else:
                    blocks.append(k)
    m = merge_kernels(blocks) or {}
    return {"samples": len(blocks), "errors": errors, "coverage": m.get("coverage"),
            "kernel_ms": m.get("kernel_ms"), "phases": sorted(m.get("phases") or {})}


def cost_on_off(a, plan, server_argv, logs):
    """The servers of the check started again without kernel samples, each with its profiler
    paused and resumed by SIGUSR2 between runs of one request: tokens/s on and off in one
    process, `a.cost_rounds` rounds, which runs first alternating."""
    from overhead import PAUSE_SIGNAL, paused_runs, scheduler_pids  # bench/overhead.py

    again = {}
    for name, (argv, env) in plan.items():
        prof = os.path.join(a.out, f"cost-{name}.jsonl")
        again[name] = (server_argv(name, prof, 0), dict(env, SGLANG_SPECPROF_PAUSE_SIGNAL=PAUSE_SIGNAL))
    cost_logs = os.path.join(logs, "cost")
    os.makedirs(cost_logs, exist_ok=True)
    servers = start_all(again, cost_logs, first_port=a.first_port + 10, timeout=420)
    out = {}
    try:
        for name, srv in servers.items():
            runs = paused_runs(srv.port, scheduler_pids(srv.log_path), 1, a.cost_tokens, a.cost_rounds)
            res = {"tok_s_on": [round(x, 2) for x in runs["on"]], "tok_s_off": [round(x, 2) for x in runs["off"]],
                   "rounds": len(runs["on"]), "new_tokens": a.cost_tokens, "concurrency": 1}
            res.update(ratio_summary("", [x / y for x, y in zip(runs["on"], runs["off"])]))
            out[name] = res
            print(name, "cost", json.dumps({k: v for k, v in res.items() if not k.startswith(("tok_s", "ratios"))}),
                  flush=True)
        time.sleep(3.5)  # the open windows close idle
    finally:
        stop_all(servers)
    return out


if __name__ == "__main__":
    main()
