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
result is their median, their spread, and a bootstrap 95% interval of the median (how
well the runs pin it down).

    python bench/overhead.py --rounds 8 --concurrency 1 8 --new-tokens 1024 --out bench/results

`--same-process` measures on and off in one server instead: it runs with the profiler and
SGLANG_SPECPROF_PAUSE_SIGNAL=SIGUSR2, and each round runs the load once with the profiler
on and once paused (the hooks on the null profiler, as with the flag off), alternating which
goes first, so that what differs between two server processes (which CPUs, which memory)
falls out of the ratio. With `--upstream-path` as well, unpatched SGLang's server takes a
turn in each round (the three in rotating order): off (paused) against upstream says the
paused hooks are upstream's speed.

Needs an NVIDIA GPU, the built wheel importable, and (for `upstream`) a folder whose
`sglang` is the unpatched release, first on PYTHONPATH for that server only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import write_models  # noqa: E402
from serving import (GpuClocks, eagle3_args, installed_sglang, http, interleaved_runs, load, machine, median_ci,  # noqa: E402
                     out_of_time, pin_schedulers, portable_command, profiler_fingerprint, ratio_summary,
                     rotations, start_all, stop_all, tok_s, write_json)

PAUSE_SIGNAL = "SIGUSR2"


def scheduler_pids(log_path, timeout=30.0):
    """The scheduler processes that follow the pause signal, from the line each logs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(log_path, errors="replace") as f:
            pids = sorted({int(m) for m in re.findall(r"to pid (\d+) pauses it", f.read())})
        if pids:
            return pids
        time.sleep(0.5)
    raise SystemExit(f"no scheduler follows {PAUSE_SIGNAL} (see {log_path})")


def paused_runs(port, pids, concurrency, new_tokens, rounds, budget=None, upstream=None, log=None):
    """Tokens/s of one server with its profiler on and paused, alternating which runs first;
    with `upstream` (a port), unpatched SGLang's server takes its turn in each round too, the
    three in rotating order, so that off (paused) is also compared with upstream."""
    state = {"on": True}

    def profiling():
        return bool(http(port, "/server_info")["internal_states"][0]["speculative_profile"]["enabled"])

    def set_on(want):
        if state["on"] != want:
            for pid in pids:
                os.kill(pid, getattr(signal, PAUSE_SIGNAL))
            state["on"] = want
        deadline = time.time() + 10
        while profiling() != want:
            if time.time() > deadline:
                raise SystemExit(f"the profiler did not {'resume' if want else 'pause'} on {PAUSE_SIGNAL}")
            time.sleep(0.05)

    t0 = time.time()
    load(port, concurrency, 64)
    runs = {"on": [], "off": []}
    names = ["on", "off"]
    if upstream is not None:
        load(upstream, concurrency, 64)
        runs["upstream"] = []
        names.append("upstream")
    for r, order in rotations(dict.fromkeys(names), rounds):
        if out_of_time(t0, r, budget, concurrency):
            break
        for n in order:
            if n == "upstream":
                runs[n].append(tok_s(upstream, concurrency, new_tokens, log, n))
                continue
            set_on(n == "on")
            runs[n].append(tok_s(port, concurrency, new_tokens, log, n))
        print(f"c={concurrency} round {r}: " + "  ".join(f"{n} {runs[n][-1]:.1f}" for n in names), flush=True)
    set_on(True)
    return runs


def clock_summary(log, clocks, t_ref, pairs=("on", "off")):
    """Each run with the GPU's clocks during it, and how tokens/s follows the SM clock: the
    slope of log tokens/s on log SM clock within each arm (pooled), and the on/off ratio of
    each round taken at equal clocks with that slope. The verdict stays the raw ratio; this
    says how much of its spread the GPU's clock explains."""
    rows = [{"arm": n, "t": [round(t0 - t_ref, 2), round(t1 - t_ref, 2)], "tok_s": round(v, 2),
             **clocks.during(t0, t1)} for n, t0, t1, v in log]
    out = {"t_ref_epoch": round(t_ref, 3), "runs": rows}
    by = {}
    for r in rows:
        if r.get("sm_mhz"):
            by.setdefault(r["arm"], []).append((math.log(r["sm_mhz"]), math.log(r["tok_s"])))
    xs, ys = [], []
    for pts in by.values():
        mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
        xs += [p[0] - mx for p in pts]
        ys += [p[1] - my for p in pts]
    sxx = sum(x * x for x in xs)
    if sxx <= 0 or any(len(by.get(a, [])) != sum(r["arm"] == a for r in rows) for a in pairs):
        return out
    k = sum(x * y for x, y in zip(xs, ys)) / sxx
    out["tok_s_per_sm_clock_elasticity"] = round(k, 3)
    out["share_of_variance_from_clock"] = round(k * k * sxx / sum(y * y for y in ys), 3) if any(ys) else None
    a, b = ([r for r in rows if r["arm"] == x] for x in pairs)
    adj = [(ra["tok_s"] / rb["tok_s"]) * (rb["sm_mhz"] / ra["sm_mhz"]) ** k for ra, rb in zip(a, b)]
    if adj:
        out["median_ratio_at_equal_clock"] = round(statistics.median(adj), 4)
        out["median_ratio_at_equal_clock_ci95"] = [round(x, 4) for x in median_ci(adj)]
    return out


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
    # `draft` is the draft graph's replay, what SGLang's timer wraps; `draft_inputs`, the
    # graph runner's preparation before it, is outside that timer and shown apart.
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
    if "draft_inputs" in ours:
        out["draft_inputs_ms_per_cycle"] = round(ours["draft_inputs"] / cycles, 4)
    return out


def started(a) -> list:
    """The servers this run starts, in the default start order."""
    names = ["on"] if a.same_process or a.no_off else ["off"] if a.no_on else ["off", "on"]
    names += (["upstream"] if a.upstream_path else []) + (["upstream2"] if a.aa else [])
    return names + (["check"] if a.check else [])


def aa_verdict(res: dict) -> dict:
    """The other ratios read against the A/A pair's (two unpatched servers, equal but for chance):
    whether the run resolves anything (the A/A interval holds 1), whether on / upstream's interval
    starts at or above the A/A interval's low end, and whether off / upstream's median lies inside
    the A/A interval."""
    lo, hi = res["median_ratio_aa_ci95"]
    out = {"aa_interval": [lo, hi], "aa_holds_1": lo <= 1.0 <= hi,
           "aa_spread": round(max(1.0 - lo, hi - 1.0), 4)}
    if "median_ratio_on_vs_upstream_ci95" in res:
        out["on_vs_upstream_low_at_or_above_aa_low"] = res["median_ratio_on_vs_upstream_ci95"][0] >= lo
    if "median_ratio_off_vs_upstream" in res:
        out["off_vs_upstream_within_aa"] = lo <= res["median_ratio_off_vs_upstream"] <= hi
    return out


def aa_verdict_line(v: dict) -> str:
    lo, hi = v["aa_interval"]
    head = (f"A/A [{lo:.3f}, {hi:.3f}]: two equal servers differ by up to {100 * v['aa_spread']:.1f}% here"
            if v["aa_holds_1"] else
            f"A/A [{lo:.3f}, {hi:.3f}] excludes 1: two equal servers differed on their own; this run resolves "
            f"no ratio nearer 1 than {100 * v['aa_spread']:.1f}%")
    parts = []
    if "on_vs_upstream_low_at_or_above_aa_low" in v:
        parts.append("on / upstream's low end " + ("at or above" if v["on_vs_upstream_low_at_or_above_aa_low"]
                                                   else "below") + " the A/A's")
    if "off_vs_upstream_within_aa" in v:
        parts.append("off / upstream " + ("within" if v["off_vs_upstream_within_aa"] else "outside") + " the A/A interval")
    return head + ("; " + ", ".join(parts) if parts else "")


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
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="from the start, startup included: stop starting rounds after this long, "
                         "sharing what is left among the concurrencies (the rounds done are reported)")
    ap.add_argument("--sglang", default=installed_sglang(), help="the release the results are named by "
                    "(default: the sglang installed)")
    ap.add_argument("--cpus", metavar="A-B", help="pin the servers to these CPUs, each to its own share")
    ap.add_argument("--pin-schedulers", action="store_true",
                    help="once the servers are up, each one's scheduler thread on a CPU (and core) of its own, "
                         "every other thread of theirs and the clients on the CPUs left")
    ap.add_argument("--on-extra", default="", metavar="FLAGS",
                    help="more flags for the `on` server, e.g. '--speculative-profile-kernels 1'")
    ap.add_argument("--on-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for the `on` server (repeatable), e.g. SGLANG_SPECPROF_DRAFT_STEPS=0: "
                         "with --off-profile, on / off is then the cost of what that setting leaves out")
    ap.add_argument("--off-profile", action="store_true",
                    help="the `off` server runs --speculative-profile too: `on` / `off` is then the cost of --on-extra")
    ap.add_argument("--gpu-clocks", action="store_true",
                    help="sample the GPU's SM clock with nvidia-smi during every run and relate tokens/s to it")
    ap.add_argument("--aa", action="store_true",
                    help="with --upstream-path: a second unpatched server (`upstream2`) in the rotation, the A/A "
                         "control: how far two equal servers differ on their own, beside every other ratio")
    ap.add_argument("--start-order", default=None, metavar="NAMES",
                    help="the servers' start order, comma-separated (e.g. upstream,on,off,upstream2; default: off, "
                         "on, upstream, upstream2): a server's place in the start order (its memory, its graphs' "
                         "capture beside the others) is told apart from its build by running it elsewhere")
    ap.add_argument("--no-off", action="store_true",
                    help="no `off` server (three 8B-shaped servers fit one 80 GB GPU where four do not): on / "
                         "upstream and the A/A pair alone")
    ap.add_argument("--no-on", action="store_true",
                    help="no `on` server: off / upstream and the A/A pair alone (what the patched build costs with "
                         "the flag off, three servers on an 80 GB GPU)")
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--same-process", action="store_true",
                    help="on and off in one server: its profiler paused and resumed by a signal between runs")
    a = ap.parse_args()
    if a.aa and not a.upstream_path:
        ap.error("--aa needs --upstream-path (the A/A pair is two unpatched servers)")
    if a.no_off and (a.same_process or a.off_profile or not a.upstream_path):
        ap.error("--no-off needs --upstream-path (on is compared with upstream), and no --same-process or --off-profile")
    bad_env = [e for e in a.on_env if "=" not in e or not e.split("=", 1)[0]]
    if bad_env:
        ap.error(f"--on-env takes KEY=VALUE, not {bad_env[0]!r}")
    if a.no_on and (a.no_off or a.same_process or a.check or a.on_extra or a.on_env or not a.upstream_path):
        ap.error("--no-on needs --upstream-path (off is compared with upstream), and no --no-off, --same-process, "
                 "--check, --on-extra or --on-env")
    order = a.start_order.split(",") if a.start_order else started(a)
    if sorted(order) != sorted(started(a)):
        ap.error(f"--start-order names {','.join(order)}, but this run starts {','.join(started(a))}: name each once")
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.logs, exist_ok=True)
    target, draft = write_models(os.path.join(a.logs, "models"), a.shape)
    common = eagle3_args(target, draft, steps=3, topk=1, graph_bs=a.concurrency)
    env = dict(os.environ, SGLANG_SIMULATE_ACC_LEN="3.0")
    prof = ["--speculative-profile", "--speculative-profile-output", os.path.join(a.logs, "on.jsonl")]
    off = common + (["--speculative-profile", "--speculative-profile-output", os.path.join(a.logs, "off.jsonl")]
                    if a.off_profile else [])
    on_env = dict(env, **dict(e.split("=", 1) for e in a.on_env))
    plan = {"off": (off, env), "on": (common + prof + shlex.split(a.on_extra), on_env)}
    if a.same_process:
        plan = {"on": (plan["on"][0], dict(plan["on"][1], SGLANG_SPECPROF_PAUSE_SIGNAL=PAUSE_SIGNAL))}
    elif a.no_off:
        del plan["off"]
    elif a.no_on:
        del plan["on"]
    if a.upstream_path:
        up_env = dict(env, PYTHONPATH=a.upstream_path + os.pathsep + env.get("PYTHONPATH", ""))
        plan["upstream"] = (common, up_env)
        if a.aa:
            plan["upstream2"] = (common, up_env)
    if a.check:
        plan["check"] = (common + ["--speculative-profile", "--enable-metrics"],
                         dict(env, SGLANG_ENABLE_METRICS_DEVICE_TIMER="1"))
    plan = {n: plan[n] for n in order}
    servers = start_all(plan, a.logs, cpus=a.cpus)
    clocks = None
    try:
        pinned = pin_schedulers(servers) if a.pin_schedulers else None
        if pinned:
            print(f"schedulers pinned: {pinned}", flush=True)
        print(f"{len(servers)} servers ready in {time.time() - t0:.0f} s "
              f"({', '.join(f'{n} {s.ready_s} s' for n, s in servers.items())})", flush=True)
        compared = [n for n in ("off", "on", "upstream", "upstream2") if n in servers]
        clocks = GpuClocks() if a.gpu_clocks else None
        profiler = profiler_fingerprint()  # the code every result below ran
        for ci, c in enumerate(a.concurrency):
            log, t_ref = [], time.time()
            budget = (t0 + a.max_seconds - time.time()) / (len(a.concurrency) - ci) if a.max_seconds else None
            if a.same_process:
                pids = scheduler_pids(servers["on"].log_path)
                runs = paused_runs(servers["on"].port, pids, c, a.new_tokens, a.rounds, budget,
                                   upstream=servers["upstream"].port if "upstream" in servers else None, log=log)
            else:
                runs = interleaved_runs({n: servers[n].port for n in compared}, c, a.new_tokens, a.rounds, budget,
                                        log=log)
            res = {"benchmark": "overhead", "sglang": a.sglang, "concurrency": c}
            if "on" in runs:
                res["tok_s_on"] = [round(x, 2) for x in runs["on"]]
            if "off" in runs:
                res["tok_s_off"] = [round(x, 2) for x in runs["off"]]
                if "on" in runs:
                    res.update(ratio_summary("", [on / off for on, off in zip(runs["on"], runs["off"])]))
            if "upstream" in runs:
                res["tok_s_upstream"] = [round(x, 2) for x in runs["upstream"]]
                if "off" in runs:
                    up = [off / u for off, u in zip(runs["off"], runs["upstream"])]
                    res.update(ratio_summary("_off_vs_upstream", up))
                if "on" in runs:
                    res.update(ratio_summary("_on_vs_upstream", [on / u for on, u in zip(runs["on"], runs["upstream"])]))
            if "upstream2" in runs:  # the A/A control: two unpatched servers, equal but for chance
                res["tok_s_upstream2"] = [round(x, 2) for x in runs["upstream2"]]
                res.update(ratio_summary("_aa", [b / u for b, u in zip(runs["upstream2"], runs["upstream"])]))
                res["aa_verdict"] = aa_verdict(res)
                print(aa_verdict_line(res["aa_verdict"]), flush=True)
            res.update({"rounds": len(next(iter(runs.values()))), "new_tokens": a.new_tokens, "start_order": order,
                        "command": portable_command("bench/overhead.py", sys.argv[1:]),
                        "machine": machine(), "date": datetime.date.today().isoformat(),
                        "profiler": profiler})
            if clocks is not None:
                res["gpu_clocks"] = clock_summary(log, clocks, t_ref)
            if "check" in servers:
                res["independent_check"] = independent_check(servers["check"], c, a.new_tokens)
            print(json.dumps({k: v for k, v in res.items() if not k.startswith(("tok_s", "ratios", "gpu_clocks"))}),
                  flush=True)
            if clocks is not None:
                print(json.dumps({k: v for k, v in res["gpu_clocks"].items() if k != "runs"}), flush=True)
            if a.on_extra or a.off_profile or a.on_env:
                res["on_extra"], res["off_profile"], res["on_env"] = a.on_extra, a.off_profile, a.on_env
            if a.same_process:
                res["same_process"] = True  # off: the same server with its profiler paused
            if pinned:
                res["schedulers_pinned"] = pinned
            write_json(os.path.join(a.out, f"overhead-{a.sglang}-c{c}{a.tag}.json"), res)
    finally:
        if clocks is not None:
            clocks.stop()
        stop_all(servers)  # after the profile's open window closed idle (serving.SETTLE_S)


if __name__ == "__main__":
    main()
