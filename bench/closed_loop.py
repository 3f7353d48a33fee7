#!/usr/bin/env python3
"""The closed loop: the cost policy with no config file against every static step count,
upstream's adaptive rule (its default config, the same candidates, and a config written from
the profile), and a server without speculation, in interleaved rounds.

One speculative server (8B-shaped dummy target, 1-layer EAGLE3 dummy draft,
SGLANG_SIMULATE_ACC_METHOD=multinomial) runs `--speculative-adaptive` with no config file,
launched at `--launch-steps`, with `--speculative-profile` and SGLANG_SPECPROF_POLICY_FILE.
Before each run the benchmark writes the mode there and waits until /server_info took it:

- `0`..`N` (`--statics`): every tier pinned to that step count (a static setting on the same graphs);
- `ema`: upstream's rule on upstream's default config (0.5.16: [1, 3, 7] at 1, [0, 1, 3] at 8,
  [0, 1] at 32, [0] at 64), as upstream runs it;
- `ema-all`: upstream's rule with the cost policy's candidates (0..N in every tier);
- `cfg`: upstream's rule with the config `sglang-specprof report --adaptive-config` wrote
  from this server's own profile after the warm-up round;
- `cost`: the cost policy.

`plain`: a second server, the same model without speculation, on the same GPU; `up` (with
`--upstream-server`): a third, upstream's adaptive speculation as a user launches it
(`--speculative-adaptive`, its default config, no profile, and upstream's own step-0 path:
SGLANG_SPECPROF_ZERO_STEP_DECODE=0). Every server takes the same `--max-running-requests`.
Before the rounds, the same greedy requests go to the speculative server at 0 steps and to
the server without speculation: a step-0 cycle verifies the target's own next token, so the
two must answer alike (`step0_vs_plain` in the result). Loads: `--concurrency` requests at once, and with
`--alternate` one that alternates between 1 request and `--alternate` at once, twice. After
each run the benchmark reads the profile's totals (its committed tokens and decode GPU time
in that run) and, in `cost` runs, the policy's figure for the step count each tier ran: the
figures the clients can check.

    python bench/closed_loop.py --out OUT --logs OUT/logs --concurrency 1 32 128 --alternate 128 \
        --rounds 12 --max-seconds 1000
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from adaptive import Mode  # noqa: E402
from gpu_models import bench_dirs  # noqa: E402
from serving import (SETTLE_S, eagle3_args, http, installed_sglang, load, machine, median_ci,  # noqa: E402
                     portable_command, round_args, start_all, stop_all)

POLICIES = ["ema", "ema-all", "cfg", "cost"]
TOKENS = {1: 192, 32: 96, 128: 48}  # new tokens a request, by concurrency (others: 64)


def new_tokens(c, scale=1.0):
    return max(8, int(TOKENS.get(c, 64) * scale))


def plain_args(argv):
    """The same server without speculation: every --speculative-* flag and its value dropped."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.startswith("--speculative-"):
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def alternate_load(port, high, scale):
    """1 request, then `high` at once, twice: (tokens, seconds, requests)."""
    tok = secs = reqs = 0
    for c in (1, high, 1, high):
        t, s = load(port, c, new_tokens(c, scale) if c == 1 else max(8, new_tokens(high, scale) // 2))
        tok, secs, reqs = tok + t, secs + s, reqs + c
    return tok, secs, reqs


def output_ids(port, n, new):
    """`n` greedy requests at once (distinct prompts): their output ids, in order."""
    got = [None] * n

    def one(i):
        ids = [200 + (i * 13 + j * 7) % 5000 for j in range(48 + 8 * i)]
        got[i] = http(port, "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True}})["output_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def same_answers(a, b):
    """How far two servers' answers to the same requests agree: requests identical, and tokens
    equal up to each request's first difference."""
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return {"requests": len(a), "identical": sum(p == q for p, q in zip(a, b)),
            "tokens_before_first_difference": sum(prefix), "tokens": sum(len(p) for p in a)}


def totals(mode):
    t = mode.state()["totals"]
    return t["committed_tokens"], t["decode_gpu_ms"]


def plain_totals(port):
    """The committed tokens a profiled server without speculation counted since it started."""
    st = http(port, "/server_info")["internal_states"][0]["speculative_profile"]
    return st["totals"]["committed_tokens"]


def capped_run(port, a, profile):
    """The --alternate concurrency on the server at the default cap, twice, then its report's
    cap lines (after the idle close wrote the window)."""
    c = a.alternate or 128
    rates = []
    for _ in range(2):
        tok, secs = load(port, c, new_tokens(c, a.tokens_scale))
        rates.append(round(tok / secs, 1))
    time.sleep(SETTLE_S)  # the idle close: the window reaches the file
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-m", "sglang_specprof", "report", profile], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(here), "overlay")))
    lines = [ln.strip() for ln in proc.stdout.splitlines() if "running-request cap" in ln]
    print("capped:", rates, *lines, sep="\n  ", flush=True)
    return {"concurrency": c, "tok_s": rates, "cap_lines": lines, "report_rc": proc.returncode}


def policy_figures(st):
    """{tier: [steps, the policy's tokens/s for it]} from /server_info's adaptive_policy."""
    out = {}
    for k, t in (st.get("tiers") or {}).items():
        if isinstance(t, dict):
            fig = (t.get("tokens_per_s") or {}).get(str(t.get("steps")))
            out[k] = [t.get("steps"), fig[0] if isinstance(fig, list) else fig]
    return out


def analyse(by_mode, statics, capped=None):
    """Per load: each mode's median tok/s, the best static, and paired ratios with intervals (with `capped`, the
    static of that step count on the raised cap against the capped server)."""
    n = min((len(v) for v in by_mode.values() if v), default=0)
    if n == 0:
        return None
    med = {m: statistics.median(v[:n]) for m, v in by_mode.items() if len(v) >= n}
    static = {m: med[m] for m in statics if m in med}
    best = max(static, key=static.get)
    res = {"rounds": n, "median_tok_s": {m: round(v, 1) for m, v in med.items()}, "best_static": int(best)}
    pairs = [("cost", best), ("cost", "ema"), ("cost", "ema-all"), ("cost", "cfg"), ("cfg", "ema"),
             ("ema", best), (best, "plain"), ("0", "plain"), ("cost", "plain"), ("cost", "up"), ("ema", "up"),
             ("cfg", "up"), ("up", best), ("up", "plain")] + ([(str(capped), "capped")] if capped is not None else [])
    for a, b in pairs:
        if a in med and b in med and len(by_mode[a]) >= n and len(by_mode[b]) >= n:
            r = [x / y for x, y in zip(by_mode[a][:n], by_mode[b][:n])]
            key = f"{a if a != best or b == 'capped' else 'best_static'}_vs_{b if b != best else 'best_static'}"
            res[key] = {"median": round(statistics.median(r), 4), "ci95": [round(x, 4) for x in median_ci(r)]}
    return res


def write_config(profile, path, log):
    """`report --adaptive-config` from the profile so far: True once written."""
    cmd = [sys.executable, "-m", "sglang_specprof", "report", profile, "--adaptive-config", path]
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(log, "w") as f:
        f.write(p.stdout + p.stderr)
    return p.returncode == 0 and os.path.exists(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mean", type=float, default=3.0, help="the simulated acceptance (multinomial)")
    ap.add_argument("--launch-steps", type=int, default=7,
                    help="0.5.16's default config reaches 7 steps: launched below, its graphs at large batch "
                         "sizes stop the server at capture (its shared logits buffer)")
    ap.add_argument("--statics", type=int, nargs="+", default=None, help="static step counts run (default 0..launch)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--alternate", type=int, default=128, help="the load alternating 1 and N (0: none)")
    ap.add_argument("--max-running", type=int, default=128, help="--max-running-requests of both servers")
    ap.add_argument("--graph-bs", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 96, 128])
    ap.add_argument("--tokens-scale", type=float, default=1.0, help="scales each load's new tokens")
    ap.add_argument("--no-plain", action="store_true", help="no server without speculation")
    ap.add_argument("--policies", nargs="*", default=POLICIES, choices=POLICIES, help="the adaptive modes run")
    ap.add_argument("--step0-control", action="store_true",
                    help="a server like the speculative one with upstream's step-0 path, answering the same "
                         "greedy requests at 0 steps (not in the rounds); both with SGLANG_SIMULATE_ACC_TOKEN_MODE="
                         "real-draft-token, so that a 0-step cycle commits the target's own token")
    ap.add_argument("--profile-plain", action="store_true",
                    help="the server without speculation runs --speculative-profile too (each forward timed whole, "
                         "logs/profile-plain.jsonl): `sglang-specprof compare profile.jsonl profile-plain.jsonl` "
                         "gives the zero-step tax by part; its committed tokens are checked against its clients'")
    ap.add_argument("--capped-server", type=int, default=None, metavar="STEPS",
                    help="one more server at STEPS static steps with the release's default running-request cap "
                         "and the profile (logs/profile-capped.jsonl), in every round (against the static STEPS "
                         "on the raised cap: `STEPS_vs_capped`) and at the --alternate concurrency after them: "
                         "its report names the cap and the requests waiting for a slot")
    ap.add_argument("--profiled-server", type=int, default=None, metavar="STEPS",
                    help="one more server at STEPS static steps (the same cap) with the profile and the kernel "
                         "sampler (logs/profile-static.jsonl), in every round as `profiled`: the profile a user "
                         "of a static server reads, with its kernel view")
    ap.add_argument("--profiled-kernels", type=int, default=1, metavar="N",
                    help="the profiled server's --speculative-profile-kernels (a sample every N windows)")
    ap.add_argument("--upstream-server", action="store_true",
                    help="a third server: upstream's adaptive speculation with its default config and step-0 path")
    round_args(ap)
    a = ap.parse_args()
    t0 = time.time()
    target, draft = bench_dirs(a.out, a.logs)
    profile = os.path.join(a.logs, "profile.jsonl")
    common = eagle3_args(target, draft, steps=a.launch_steps, topk=1, graph_bs=a.graph_bs, max_tokens=60000) + [
        "--max-running-requests", str(a.max_running)]
    argv = common + ["--speculative-adaptive", "--speculative-adaptive-policy", "cost", "--speculative-profile",
                     "--speculative-profile-output", profile]
    mode_path = os.path.join(a.logs, "mode")
    env = dict(os.environ, SGLANG_SIMULATE_ACC_METHOD="multinomial", SGLANG_SIMULATE_ACC_LEN=str(a.mean),
               SGLANG_SPECPROF_POLICY_FILE=mode_path)
    if a.step0_control:
        env["SGLANG_SIMULATE_ACC_TOKEN_MODE"] = "real-draft-token"
    plan = {"spec": (argv, env)}
    fixed_env = {k: v for k, v in env.items() if k != "SGLANG_SPECPROF_POLICY_FILE"}  # servers not steered
    if a.step0_control:
        ctl_mode = os.path.join(a.logs, "mode-control")
        ctl_argv = [x if x != profile else os.path.join(a.logs, "profile-control.jsonl") for x in argv]
        plan["control"] = (ctl_argv, dict(env, SGLANG_SPECPROF_POLICY_FILE=ctl_mode,
                                          SGLANG_SPECPROF_ZERO_STEP_DECODE="0"))
    plain_profile = os.path.join(a.logs, "profile-plain.jsonl")
    capped_profile = os.path.join(a.logs, "profile-capped.jsonl")
    if not a.no_plain:
        plan["plain"] = (plain_args(common) + (["--speculative-profile", "--speculative-profile-output", plain_profile]
                                               if a.profile_plain else []), dict(os.environ))
    if a.capped_server is not None:
        capped = eagle3_args(target, draft, steps=a.capped_server, topk=1, graph_bs=a.graph_bs, max_tokens=60000)
        plan["capped"] = (capped + ["--speculative-profile", "--speculative-profile-output", capped_profile],
                          fixed_env)
    if a.profiled_server is not None:
        prof = eagle3_args(target, draft, steps=a.profiled_server, topk=1, graph_bs=a.graph_bs, max_tokens=60000)
        plan["profiled"] = (prof + ["--max-running-requests", str(a.max_running), "--speculative-profile",
                                    "--speculative-profile-output", os.path.join(a.logs, "profile-static.jsonl"),
                                    "--speculative-profile-kernels", str(a.profiled_kernels)],
                            fixed_env)
    if a.upstream_server:
        plan["up"] = (common + ["--speculative-adaptive"], dict(fixed_env, SGLANG_SPECPROF_ZERO_STEP_DECODE="0"))
    servers = start_all(plan, a.logs)
    print(f"{len(servers)} servers ready in {time.time() - t0:.0f} s "
          f"({', '.join(f'{n} {s.ready_s} s' for n, s in servers.items())})", flush=True)
    statics = [str(s) for s in (a.statics if a.statics is not None else range(0, a.launch_steps + 1))]
    others = ([] if a.no_plain else ["plain"]) + (["up"] if a.upstream_server else []) + (
        ["capped"] if a.capped_server is not None else []) + (["profiled"] if a.profiled_server is not None else [])
    modes = statics + list(a.policies) + others
    loads = [f"c{c}" for c in a.concurrency] + ([f"alt{a.alternate}"] if a.alternate else [])
    runs = {ld: {m: [] for m in modes} for ld in loads}
    checks = {ld: [] for ld in loads}  # per cost run: clients' tok/s, the profile's, the policy's figures
    decode = {ld: {m: [] for m in modes if m not in others} for ld in loads}  # the profile's decode rate a run
    spec = servers["spec"]
    mode = Mode(spec.port, mode_path)
    cfg_path = os.path.join(a.logs, "adaptive-config.json")
    result_path = os.path.join(a.out, f"closed-loop-{installed_sglang()}{a.tag}.json")
    client_decode = 0
    plain_check = None
    if a.profile_plain and "plain" in servers:  # the plain server's clients against its own profile
        plain_check = {"client_decode_tokens": 0, "profile_committed_tokens": None, "_before": None}
    step0 = None
    try:
        for c in sorted(set(a.concurrency) | ({a.alternate} if a.alternate else set())):
            for name, srv in servers.items():  # each batch size's kernels compiled before anything is timed
                load(srv.port, c, 16)
        if "plain" in servers:
            mode.set("0")
            sizes = sorted({1, 16, min(a.max_running, max(a.graph_bs) + 32)})  # the last above the graphs
            plain = {n: output_ids(servers["plain"].port, n, 64) for n in sizes}
            step0 = {str(n): same_answers(output_ids(spec.port, n, 64), plain[n]) for n in sizes}
            if "control" in servers:
                Mode(servers["control"].port, ctl_mode).set("0")
                step0 = {"decode_route": step0, "upstream_route": {
                    str(n): same_answers(output_ids(servers["control"].port, n, 64), plain[n]) for n in sizes}}
                servers.pop("control").stop()  # not in the rounds
            print("step 0 against the server without speculation:", json.dumps(step0), flush=True)
        time.sleep(1.0)
        before = totals(mode)[0]
        if plain_check is not None:
            plain_check["_before"] = plain_totals(servers["plain"].port)
        for r in range(-a.warmup_rounds, a.rounds):
            if r >= 0 and a.max_seconds and time.time() - t0 > a.max_seconds:
                print(f"stopping after {r} rounds (--max-seconds)", flush=True)
                break
            if r == 0 and "cfg" in modes:  # the profile of the warm-up: every static at every load
                time.sleep(SETTLE_S)  # the idle close: the open window reaches the file
                ok = write_config(profile, cfg_path, os.path.join(a.logs, "adaptive-config.log"))
                if ok:
                    print("cfg:", json.dumps({k: v for k, v in json.load(open(cfg_path)).items() if k.isdigit()}),
                          flush=True)
                    try:
                        mode.set(f"ema:{cfg_path}")  # the server refuses a config it has no graphs for
                    except SystemExit as e:
                        print(f"cfg refused ({e}): see the server's log", flush=True)
                        ok = False
                if not ok:
                    print("no cfg mode: report --adaptive-config failed or the server refused it", flush=True)
                    modes.remove("cfg")
                    for ld in loads:
                        runs[ld].pop("cfg", None)
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for ld in loads:
                got = {}
                for m in order:
                    if m == "cfg" and r < 0:
                        continue  # written after the warm-up
                    srv = servers[m] if m in others else spec
                    if m not in others:
                        mode.set(f"ema:{cfg_path}" if m == "cfg" else m)
                        tok0, ms0 = totals(mode)
                    if ld.startswith("alt"):
                        tok, secs, reqs = alternate_load(srv.port, a.alternate, a.tokens_scale)
                    else:
                        c = int(ld[1:])
                        tok, secs = load(srv.port, c, new_tokens(c, a.tokens_scale))
                        reqs = c
                    got[m] = round(tok / secs, 2)
                    if m == "plain" and plain_check is not None:
                        plain_check["client_decode_tokens"] += tok - reqs
                    if m not in others:
                        client_decode += tok - reqs  # the first token of each is its prefill's
                        st = mode.state()
                        tok1, ms1 = st["totals"]["committed_tokens"], st["totals"]["decode_gpu_ms"]
                        if r >= 0 and ms1 > ms0:
                            decode[ld][m].append(round((tok1 - tok0) / (ms1 - ms0) * 1000.0, 1))
                        if m == "cost" and r >= 0:
                            checks[ld].append({"clients_tok_s": got[m], "clients_decode_tokens": tok - reqs,
                                               "profile_tokens": tok1 - tok0,
                                               "profile_decode_tok_s": round((tok1 - tok0) / (ms1 - ms0) * 1000.0, 1)
                                               if ms1 > ms0 else None,
                                               "policy": policy_figures(st["adaptive_policy"])})
                if r >= 0:
                    for m, v in got.items():
                        runs[ld][m].append(v)
                print(f"{ld} {'round' if r >= 0 else 'warm-up'} {r}: " + " ".join(f"{m} {got[m]:.0f}" for m in modes
                                                                                   if m in got), flush=True)
            _write(result_path, a, runs, checks, statics, client_decode, None, servers, step0, decode)
        time.sleep(SETTLE_S)  # the idle close: the open window's tokens in the totals
        mode.set("cost")
        st = mode.state()
        exact = {"client_decode_tokens": client_decode,
                 "profile_committed_tokens": st["totals"]["committed_tokens"] - before,
                 "policy": st["adaptive_policy"]}
        if plain_check is not None:
            plain_check["profile_committed_tokens"] = plain_totals(servers["plain"].port) - plain_check.pop("_before")
            exact["plain"] = plain_check
        if "capped" in servers:
            exact["capped"] = capped_run(servers["capped"].port, a, capped_profile)
        _write(result_path, a, runs, checks, statics, client_decode, exact, servers, step0, decode)
        print(json.dumps({ld: analyse(runs[ld], statics, a.capped_server) or {} for ld in loads}, indent=1))
        print(json.dumps({k: v for k, v in exact.items() if k != "policy"}))
    finally:
        stop_all(servers)


def _write(path, a, runs, checks, statics, client_decode, exact, servers, step0, decode=None):
    res = {"benchmark": "closed-loop", "sglang": installed_sglang(), "mean": a.mean, "launch_steps": a.launch_steps,
           "max_running_requests": a.max_running, "graph_bs": a.graph_bs,
           "new_tokens": {str(c): new_tokens(c, a.tokens_scale) for c in a.concurrency},
           "ready_s": {n: s.ready_s for n, s in servers.items()},
           "runs": runs, "profile_decode_tok_s": decode or {}, "analysis": {ld: analyse(v, statics, a.capped_server) for ld, v in runs.items()}, "checks": checks,
           "exact": exact, "step0_vs_plain": step0, "command": portable_command("bench/closed_loop.py", sys.argv[1:]), "machine": machine(),
           "date": datetime.date.today().isoformat()}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
