#!/usr/bin/env python3
"""The profiler soaked beside a server without it: scheduler memory, the JSONL, lost windows.

Two servers of the same 8B-shaped dummy EAGLE3 pair (SGLANG_SIMULATE_ACC_METHOD=multinomial,
`--speculative-num-steps` 3) on one GPU, both alive at once and both under load at once:

  on   --speculative-profile --speculative-profile-kernels 3 (a kernel sample every 3 windows)
       --speculative-profile-output PATH, with SGLANG_SPECPROF_OUTPUT_MAX_MB small (`--max-mb`,
       1 by default, the least the writer takes) so that PATH rotates to PATH.1 within the run
  off  the same build and flags without --speculative-profile

Windows are 25 decode cycles (`--interval`; at the server's default 100, the JSONL would grow by
about a megabyte in 10 minutes, short of a rotation), so a kernel sample comes every 75 cycles,
four times as often as at the default interval: memory that follows the windows or the samples
grows faster here than it would there, and the result gives the excess per window and per sample.
Both take the same `--max-running-requests` (64: 0.5.16 caps a speculative server at 48 unless
told). `--concurrency` client threads per server (64) send one request after another for
`--seconds`: each a random prompt of 50-1000 input ids and 50-300 new tokens (`--seed`; the
two servers get the same sequence of requests). Every `--sample-s` seconds the benchmark
records the RSS (VmRSS, and RssAnon) of each server's scheduler process (SGLang names it
`sglang::scheduler`; without one, every child of launch_server), the rest of the server's
processes, the on server's JSONL and its rotated file, and the tokens the clients received.
About once a second it copies a newly rotated PATH.1 aside (`rotated/` in the logs), since
the writer keeps only one: every window written is then on disk at the end.

At the end, the analysis (functions that need no GPU, tested in tests/test_soak.py):

- each scheduler's RSS slope (least squares, MB/min) over the samples after `--warmup-s`,
  with a 95% interval widened for the samples' lag-1 autocorrelation; the slope of on
  minus off, with its interval, and that excess per hour, per window and per kernel sample;
- the windows: every line of the rotated copies and PATH read (a line cut short at a file's
  end counted, not fatal), gaps in the window numbers, the last window against the one
  /server_info published, and the profile's own loss counters (dropped_cycles, steps_lost,
  marks_lost, backlog_dropped; kernel samples taken and skipped);
- the committed tokens the profile counted over the run against the tokens the on server's
  clients received (less each request's first, its prefill's), as bench/closed_loop.py does;
- each server log's warnings (lines with WARNING, a Python `...Warning:`, or the profiler's
  own `speculative profile:` / `speculative profile disabled`) and errors (Traceback,
  `Error`), counted, the distinct ones kept (the first 20).

The result, `soak-RELEASE-DATE.json` in `--out`, holds every sample, the command line, the
machine, the date and the analysis; it is rewritten after each sample (`"complete": false`)
so that a run cut short still leaves what it measured.

    python bench/soak.py --out OUT --logs OUT/logs --seconds 600

On a machine that runs a command 600 s at most (the results packed 60 s before it ends), from the
repository root with the offline bundle at .gpu-bundle/site-0.5.16.tar.xz (sent along), through
bench/run_soak.sh, which unpacks the bundle, patches it in place (`build.py --into`) and runs
this in a session of its own, as bench/run_closed_loop.sh does:

- the 10-minute soak, across two calls (the benchmark outlives the first; the second, on the
  machine still warm, waits for its end): about 30 s to unpack and patch, 170-240 s for the
  two servers to start, 600 s of load, about 15 s to drain and analyse; it ends some 300 s
  into the second call:

      bench/run_soak.sh start 540 PACK_DIR        # --seconds 600, the default
      bench/run_soak.sh finish 540 PACK_DIR

- in one call, a shorter soak: 540 s less the start-up leaves about 300 s of load, so
  `bench/run_soak.sh start 540 PACK_DIR --seconds 300` (330 fits only when the servers start in
  170 s; a soak still running at the pack is collected by `finish`).

Each call leaves PACK_DIR/soak.tar.xz: out/ (the result), logs/ (both server logs, on.jsonl and
rotated/), bench.log (this script's output).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import SETTLE_S  # noqa: E402  (the open window closes idle: waited for before reading the totals)

MB = 1024.0 * 1024.0
LOSS_COUNTERS = ("dropped_cycles", "steps_lost", "marks_lost", "backlog_dropped")


# -- the analysis (no GPU) -------------------------------------------------------------

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """Student's t at 0.975 for `df` degrees of freedom (a table to 30, then 1.96 + 2.4/df,
    within 0.002 of the exact value)."""
    if df < 1:
        return math.inf
    if df <= 30:
        return _T975[int(df) - 1]
    return 1.96 + 2.4 / df


def fit_slope(points, warmup_s: float = 0.0, per_s: float = 60.0) -> dict:
    """Least-squares slope of (t seconds, y) pairs with t >= `warmup_s`, in y per `per_s` seconds
    (MB/min for MB and 60). The 95% interval is the regression's, with its standard error
    widened for the residuals' lag-1 autocorrelation r1 > 0 (the effective number of samples
    n (1 - r1) / (1 + r1)): memory that moves in steps leaves correlated residuals, and the
    plain interval would be too narrow. Fewer than 3 points: the slope alone (or None)."""
    pts = sorted((float(t), float(y)) for t, y in points if t >= warmup_s)
    n = len(pts)
    out = {"n": n, "warmup_s": warmup_s, "slope": None, "ci95": None, "ci95_plain": None}
    if n < 2:
        return out
    ts, ys = [p[0] for p in pts], [p[1] for p in pts]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx <= 0:
        return out
    b = sum((t - mt) * (y - my) for t, y in pts) / sxx
    a = my - b * mt
    out.update(slope=b * per_s, intercept=a, first_t=ts[0], last_t=ts[-1])
    if n < 3:
        return out
    res = [y - (a + b * t) for t, y in pts]
    sse = sum(r * r for r in res)
    se = math.sqrt(sse / (n - 2) / sxx)
    r1 = 0.0
    if sse > 0:
        r1 = sum(res[i] * res[i - 1] for i in range(1, n)) / sse
    r1 = max(-1.0, min(r1, 0.99))
    n_eff = n * (1 - r1) / (1 + r1) if r1 > 0 else float(n)
    df = max(n_eff - 2, 1.0)
    se_adj = se * math.sqrt((n - 2) / df) if r1 > 0 else se
    half_plain = t975(n - 2) * se * per_s
    half = t975(df) * se_adj * per_s
    out.update(se=se_adj * per_s, df=round(df, 2), lag1_autocorr=round(r1, 4), n_eff=round(n_eff, 2),
               ci95=[b * per_s - half, b * per_s + half], ci95_plain=[b * per_s - half_plain, b * per_s + half_plain])
    return out


def slope_difference(on: dict, off: dict) -> dict:
    """on's slope minus off's, with a 95% interval from both standard errors (the fewer degrees
    of freedom of the two: the conservative choice)."""
    if on.get("slope") is None or off.get("slope") is None:
        return {"diff": None, "ci95": None}
    d = on["slope"] - off["slope"]
    if on.get("se") is None or off.get("se") is None:
        return {"diff": d, "ci95": None}
    se = math.hypot(on["se"], off["se"])
    half = t975(min(on["df"], off["df"])) * se
    return {"diff": d, "se": se, "ci95": [d - half, d + half]}


def rss_verdict(on: dict, off: dict, diff: dict) -> dict:
    """Whether on's slope is within off's: at or below the top of off's interval, or the
    difference's interval holds zero. `bounded_mb_per_hour`: the most the difference's interval
    allows on to grow faster than off, in an hour."""
    if on.get("slope") is None or off.get("slope") is None:
        return {"on_within_off": None}
    below = off.get("ci95") is not None and on["slope"] <= off["ci95"][1]
    zero_in = diff.get("ci95") is not None and diff["ci95"][0] <= 0 <= diff["ci95"][1]
    hi = diff["ci95"][1] if diff.get("ci95") else diff["diff"]
    return {"on_within_off": bool(below or zero_in), "on_below_off_upper": bool(below),
            "difference_interval_holds_zero": bool(zero_in),
            "excess_mb_per_hour": diff["diff"] * 60.0, "bounded_mb_per_hour": max(hi, 0.0) * 60.0}


def profile_files(path: str, archive: str | None = None) -> list[str]:
    """The files that hold the profile's windows, oldest first: the copies of each rotated
    PATH.1 in `archive` (as `RotationArchive` names them), then PATH. Without an archive (or no
    copy in it), PATH.N ... PATH.1 (any the writer left), then PATH."""
    out = []
    if archive and os.path.isdir(archive):
        base = os.path.basename(path)
        copies = []
        for name in os.listdir(archive):
            m = re.fullmatch(re.escape(base) + r"\.1\.(\d+)", name)
            if m:
                copies.append((int(m.group(1)), os.path.join(archive, name)))
        out = [p for _, p in sorted(copies)]
    if not out:
        rotated = []
        folder = os.path.dirname(path) or "."
        base = os.path.basename(path)
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            m = re.fullmatch(re.escape(base) + r"\.(\d+)", name)
            if m:
                rotated.append((int(m.group(1)), os.path.join(folder, name)))
        out = [p for _, p in sorted(rotated, reverse=True)]
    if os.path.exists(path):
        out.append(path)
    return out


class RotationArchive:
    """Copies each new PATH.1 (a rotation: the writer renamed PATH there) to
    `archive/NAME.1.K`, K = 1, 2, ...; the writer keeps one PATH.1 and replaces it at the next
    rotation, so without the copies the windows of every rotation but the last are gone.
    A PATH.1 is known by its inode and size (a rotated file is no longer written)."""

    def __init__(self, path: str, archive: str):
        self.path, self.archive = path, archive
        self.seen = None
        self.copies = 0
        os.makedirs(archive, exist_ok=True)

    def poll(self) -> bool:
        try:
            st = os.stat(self.path + ".1")
        except FileNotFoundError:
            return False
        key = (st.st_dev, st.st_ino, st.st_size)
        if key == self.seen:
            return False
        self.copies += 1
        shutil.copyfile(self.path + ".1", os.path.join(self.archive, f"{os.path.basename(self.path)}.1.{self.copies}"))
        self.seen = key
        return True


def read_windows(paths) -> dict:
    """Each line of `paths` in order, as the few fields the soak counts. A line that is not JSON
    is counted: as `torn` when it is a file's last line without its newline (a writer killed
    mid-write), else as `bad`. Returns {"windows": [...], "lines", "torn", "bad", "files"}."""
    windows, torn, bad, lines, files = [], [], [], 0, []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        parts = data.split(b"\n")
        ends_cut = bool(parts) and parts[-1] != b""
        if not ends_cut:
            parts = parts[:-1]
        count = 0
        for i, raw in enumerate(parts):
            if not raw.strip():
                continue
            lines += 1
            last = ends_cut and i == len(parts) - 1
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict) or not isinstance(obj.get("window"), int):
                    raise ValueError("not a window")
            except ValueError:
                (torn if last else bad).append(f"{os.path.basename(path)}:{i + 1}")
                continue
            count += 1
            k = obj.get("kernels")
            windows.append({
                "window": obj["window"], "rank": obj.get("rank", 0), "time": obj.get("time"),
                "file": os.path.basename(path), "closed_idle": bool(obj.get("closed_idle")),
                "committed_tokens": (obj.get("totals") or {}).get("committed_tokens"),
                "kernel_samples": obj.get("kernel_samples"),
                "kernels": None if not isinstance(k, dict) else ("error" if "error" in k else "ok"),
                "kernel_records": k.get("records") if isinstance(k, dict) else None,
                **{c: obj.get(c) for c in LOSS_COUNTERS + ("uncut_cycles",)}})
        files.append({"file": os.path.basename(path), "bytes": len(data), "windows": count})
    return {"windows": windows, "lines": lines, "torn": torn, "bad": bad, "files": files}


def window_accounting(read: dict, published_last: int | None = None) -> dict:
    """What `read_windows` found: windows written (distinct numbers), repeated ones, the numbers
    missing between the first and the last (per rank), the last against `published_last` (the
    window /server_info showed last), and the profile's loss counters as the last window has
    them (they count from the server's start)."""
    ws = read["windows"]
    by_rank: dict = {}
    for w in ws:
        by_rank.setdefault(w["rank"], []).append(w["window"])
    missing, repeated, first, last = [], 0, None, None
    for rank, nums in sorted(by_rank.items()):
        got = set(nums)
        repeated += len(nums) - len(got)
        missing += [n for n in range(min(got), max(got) + 1) if n not in got]
    if by_rank:  # rank 0's (the only one at tp 1) first and last
        nums = by_rank[min(by_rank)]
        first, last = min(nums), max(nums)
    out = {"windows": len({(w["rank"], w["window"]) for w in ws}), "lines": read["lines"], "repeated": repeated,
           "first": first, "last": last, "missing": len(missing), "missing_first": missing[:20],
           "torn_lines": read["torn"], "bad_lines": read["bad"], "files": read["files"]}
    if first not in (None, 0):
        out["missing_before_first"] = first  # windows 0..first-1 are in no file
    if published_last is not None:
        out["published_last"] = published_last
        out["missing_at_end"] = max(published_last - (last if last is not None else -1), 0)
    final = max(ws, key=lambda w: (w["window"], w["rank"] == 0)) if ws else {}
    out["counters"] = {c: final.get(c) for c in LOSS_COUNTERS + ("uncut_cycles",)}
    out["kernel_samples"] = final.get("kernel_samples")
    out["kernel_blocks"] = sum(w["kernels"] == "ok" for w in ws)
    out["kernel_errors"] = sum(w["kernels"] == "error" for w in ws)
    recs = [w["kernel_records"] for w in ws if w["kernels"] == "ok"]
    if recs and all(isinstance(r, int) for r in recs):  # what torch recorded in every sample read
        out["kernel_records"] = sum(recs)
    lost = out["missing"] + out.get("missing_before_first", 0) + out.get("missing_at_end", 0) + len(read["torn"]) \
        + len(read["bad"]) + sum(out["counters"].get(c) or 0 for c in LOSS_COUNTERS)
    out["lost_total"] = lost
    return out


_WARN = re.compile(r"\bWARNING\b|\b[A-Z]\w*Warning:|speculative profile:|speculative profile disabled")
_ERROR = re.compile(r"Traceback|\b\w*Error\b")
_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*")  # SGLang's "[2026-12-05 10:00:00 TP0] "
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+(\.\d+)?")


def scan_log(path: str, keep: int = 20) -> dict:
    """A server log's warnings and errors: how many lines, and the distinct ones (the first
    `keep`, each with its count), two lines being one when they differ only in their
    timestamp prefix and their numbers."""
    out = {}
    kinds = {"warnings": _WARN, "errors": _ERROR}
    seen = {k: {} for k in kinds}
    totals = dict.fromkeys(kinds, 0)
    profiler_warnings = 0
    try:
        f = open(path, errors="replace")
    except FileNotFoundError:
        return {"log": None}
    with f:
        for line in f:
            line = line.rstrip("\n")
            for kind, pat in kinds.items():
                if not pat.search(line):
                    continue
                if kind == "errors" and _WARN.search(line):
                    continue  # a warning that names an error is counted once, as a warning
                totals[kind] += 1
                text = _PREFIX.sub("", line)
                if kind == "warnings" and "speculative profile" in text:
                    profiler_warnings += 1
                key = _VARYING.sub("#", text)
                if key in seen[kind]:
                    seen[kind][key][1] += 1
                else:
                    seen[kind][key] = [text[:400], 1]
    for kind in kinds:
        distinct = list(seen[kind].values())
        out[kind] = totals[kind]
        out[f"distinct_{kind}"] = len(distinct)
        out[f"{kind}_first"] = [{"line": t, "count": c} for t, c in distinct[:keep]]
    out["profiler_warnings"] = profiler_warnings
    return out


def analyse(samples: list, warmup_s: float, read: dict | None = None, published_last: int | None = None,
            cap_bytes: int | None = None) -> dict:
    """The soak's figures from its samples (see `Sampler.sample`) and the profile's windows."""
    out = {}
    fits = {}
    loaded = [s for s in samples if not s.get("drained")]  # the sample after the load ended: not in the slopes
    for name in ("on", "off"):
        pts = [(s["t"], s[name]["sched_rss_mb"]) for s in loaded if s.get(name) and s[name].get("sched_rss_mb")]
        anon = [(s["t"], s[name]["sched_anon_mb"]) for s in loaded if s.get(name) and s[name].get("sched_anon_mb")]
        rest = [(s["t"], s[name]["other_rss_mb"]) for s in loaded if s.get(name) and s[name].get("other_rss_mb")]
        fits[name] = fit_slope(pts, warmup_s)
        after = [y for t, y in pts if t >= warmup_s]
        out[name] = {"rss_mb_per_min": fits[name], "anon_mb_per_min": fit_slope(anon, warmup_s),
                     "others_rss_mb_per_min": fit_slope(rest, warmup_s),
                     "rss_mb_first_last": [pts[0][1], pts[-1][1]] if pts else None,
                     "rss_mb_after_warmup_min_max": [min(after), max(after)] if after else None}
    diff = slope_difference(fits["on"], fits["off"])
    out["rss_slope_on_minus_off"] = diff
    out["rss_verdict"] = rss_verdict(fits["on"], fits["off"], diff)
    jsonl = [s["jsonl"] for s in samples if s.get("jsonl")]
    if jsonl:
        on_disk = max(j["bytes"] + j.get("rotated_bytes", 0) for j in jsonl)
        out["jsonl"] = {"rotations": max(j.get("rotations", 0) for j in jsonl), "max_bytes_on_disk": on_disk,
                        "cap_bytes": cap_bytes,
                        "within_twice_the_cap": None if not cap_bytes else on_disk <= 2 * cap_bytes + 64 * 1024}
    if read is not None:
        acc = window_accounting(read, published_last)
        out["windows"] = acc
        ks = (acc.get("kernel_samples") or {}).get("taken")
        run_s = max((s["t"] for s in samples), default=0)
        if diff.get("diff") is not None and acc["windows"] and run_s > 0:
            # the excess over the run at the slopes' difference, spread over what the on server did in it
            excess_kb = diff["diff"] * run_s / 60.0 * 1024
            out["rss_excess_per_window_kb"] = excess_kb / acc["windows"]
            if ks:
                out["rss_excess_per_kernel_sample_kb"] = excess_kb / ks
            limit = after_kernel_limit(loaded, read["windows"])
            if limit is not None:
                out["after_kernel_limit"] = limit
            if acc.get("kernel_records") and acc["kernel_blocks"]:
                # per event torch recorded, the samples not read (skipped, failed) taken as the read ones
                per_sample = acc["kernel_records"] / acc["kernel_blocks"]
                out["rss_excess_per_kernel_record_b"] = excess_kb * 1024 / (per_sample * (ks or acc["kernel_blocks"]))
    return out


def after_kernel_limit(samples: list, windows: list, settle_s: float = 30.0) -> dict | None:
    """Where the on server took the last kernel sample its limit allows (the first window whose
    `kernel_samples.taken` reached `max`): each scheduler's RSS slope over the samples from
    `settle_s` after it, and on minus off there (what the samples kept, left behind)."""
    at = None
    for w in sorted(windows, key=lambda w: (w["window"], w["rank"])):
        ks = w.get("kernel_samples") or {}
        if isinstance(ks, dict) and ks.get("max") and (ks.get("taken") or 0) >= ks["max"] and w.get("time"):
            at = w["time"]
            break
    if at is None:
        return None
    later = [s for s in samples if (s.get("epoch") or 0) >= at + settle_s]
    if len(later) < 3:
        return {"limit_epoch": at, "samples": len(later)}
    t0 = later[0]["t"]
    fits = {n: fit_slope([(s["t"], s[n]["sched_rss_mb"]) for s in later if (s.get(n) or {}).get("sched_rss_mb")], t0)
            for n in ("on", "off")}
    diff = slope_difference(fits["on"], fits["off"])
    return {"limit_epoch": at, "from_t": t0, "samples": len(later), "on_rss_mb_per_min": fits["on"],
            "off_rss_mb_per_min": fits["off"], "on_minus_off": diff, "verdict": rss_verdict(fits["on"], fits["off"], diff)}


def token_check(client_decode: int, before: dict | None, after: dict | None, last_window_committed=None) -> dict:
    """The profile's committed tokens over the run against what the clients received."""
    out = {"client_decode_tokens": client_decode}
    if before and after:
        got = after.get("committed_tokens", 0) - before.get("committed_tokens", 0)
        out.update(profile_committed_tokens=got, difference=got - client_decode, exact=got == client_decode)
    if after and last_window_committed is not None:
        # every cycle is in a window once the last one closed idle: the JSONL's total is /server_info's
        out["jsonl_last_total"] = last_window_committed
        out["jsonl_total_matches_server_info"] = last_window_committed == after.get("committed_tokens")
    return out


# -- the servers' processes ------------------------------------------------------------

def proc_memory(pid: int) -> dict | None:
    """VmRSS and RssAnon of a process in MB, from /proc/PID/status; None once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) / 1024.0
    except (OSError, ValueError):
        return None
    return {"rss_mb": out.get("VmRSS", 0.0), "anon_mb": out.get("RssAnon", 0.0)}


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def split_processes(leader: int) -> tuple[list, list, str]:
    """A server's processes as (schedulers, the others, how the schedulers were found): those
    SGLang names `sglang::scheduler...`; else every child of the launch process; else itself."""
    from serving import is_scheduler, server_processes

    procs = server_processes(leader)
    sched = [p for p in procs if is_scheduler(p)]
    how = "name"
    if not sched:
        sched, how = [p for p in procs if p != leader and _ppid(p) == leader], "children"
    if not sched:
        sched, how = [leader], "launcher"
    return sorted(sched), sorted(p for p in procs if p not in sched), how


# -- the load --------------------------------------------------------------------------

class Clients:
    """`n` threads that each send one request after another to `port` until `stop` is set:
    a prompt of `prompt` (lo, hi) random input ids and `new` (lo, hi) new tokens, from a
    generator seeded by `seed` and the thread's number (the same sequence for every server)."""

    def __init__(self, port, n, seed, prompt=(50, 1000), new=(50, 300), timeout=600):
        self.port, self.n, self.seed, self.prompt, self.new, self.timeout = port, n, seed, prompt, new, timeout
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.tokens = self.requests = self.decode = self.errors = 0
        self.first_errors: list = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()

    def _run(self, i):
        from serving import http

        rng = random.Random(self.seed * 100003 + i)
        while not self.stop.is_set():
            ids = [rng.randrange(100, 32000) for _ in range(rng.randint(*self.prompt))]
            new = rng.randint(*self.new)
            try:
                out = http(self.port, "/generate", {"input_ids": ids, "sampling_params": {
                    "max_new_tokens": new, "temperature": 0, "ignore_eos": True}}, timeout=self.timeout)
                got = len(out["output_ids"])
                with self.lock:
                    self.requests += 1
                    self.tokens += got
                    self.decode += max(got - 1, 0)  # the first token of each is its prefill's
            except Exception as e:
                with self.lock:
                    self.errors += 1
                    if len(self.first_errors) < 5:
                        self.first_errors.append(f"{type(e).__name__}: {e}"[:300])
                time.sleep(1)

    def finish(self, timeout=600) -> bool:
        """Stop sending; the requests in flight end. True when every thread ended in time."""
        self.stop.set()
        deadline = time.time() + timeout
        for t in self.threads:
            t.join(max(deadline - time.time(), 0.1))
        return not any(t.is_alive() for t in self.threads)

    def counts(self):
        with self.lock:
            return {"tokens": self.tokens, "requests": self.requests, "decode_tokens": self.decode,
                    "errors": self.errors}


def sample(t, servers, clients, profile=None, archive=None) -> dict:
    """One sample: for each server its schedulers' memory, the rest of its processes', and its
    clients' counts; the on server's JSONL sizes."""
    out = {"t": round(t, 2), "epoch": round(time.time(), 2)}
    for name, s in servers.items():
        sched, others, how = split_processes(s.proc.pid)
        mem = {p: proc_memory(p) for p in sched}
        rest = [proc_memory(p) for p in others]
        out[name] = {"sched_pids": sched, "found_by": how,
                     "sched_rss_mb": round(sum(m["rss_mb"] for m in mem.values() if m), 2),
                     "sched_anon_mb": round(sum(m["anon_mb"] for m in mem.values() if m), 2),
                     "other_rss_mb": round(sum(m["rss_mb"] for m in rest if m), 2),
                     **(clients[name].counts() if name in clients else {})}
    if profile:
        def size(p):
            try:
                return os.stat(p).st_size
            except OSError:
                return 0
        out["jsonl"] = {"bytes": size(profile), "rotated_bytes": size(profile + ".1"),
                        "rotations": archive.copies if archive else None}
    return out


# -- the run ---------------------------------------------------------------------------

def server_profile(port):
    from serving import http

    st = http(port, "/server_info", timeout=60)["internal_states"][0].get("speculative_profile") or {}
    return st


def main():
    from gpu_models import bench_dirs
    from serving import eagle3_args, installed_sglang, machine, portable_command, start_all, stop_all, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600, help="of load, after both servers are up")
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=60, help="samples before this are left out of the slopes")
    ap.add_argument("--concurrency", type=int, default=64, help="client threads per server")
    ap.add_argument("--max-running", type=int, default=64, help="--max-running-requests of both servers")
    ap.add_argument("--prompt", type=int, nargs=2, default=[50, 1000], metavar=("LO", "HI"))
    ap.add_argument("--new", type=int, nargs=2, default=[50, 300], metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kernels", type=int, default=3, help="--speculative-profile-kernels N of the on server")
    ap.add_argument("--interval", type=int, default=25,
                    help="--speculative-profile-interval of the on server (default 25: at the server's default 100, "
                         "about a megabyte of windows in 10 minutes, short of a rotation)")
    ap.add_argument("--max-mb", type=float, default=1, help="SGLANG_SPECPROF_OUTPUT_MAX_MB of the on server")
    ap.add_argument("--kernels-max", type=int, default=None,
                    help="SGLANG_SPECPROF_KERNELS_MAX of the on server (default: the profiler's); the analysis "
                         "then also fits both slopes after the limit was reached (`after_kernel_limit`)")
    ap.add_argument("--acc", type=float, default=3.0, help="SGLANG_SIMULATE_ACC_LEN")
    ap.add_argument("--max-total-tokens", type=int, default=88000,
                    help="each server's KV pool (64 requests of 1300 tokens at most: 83200)")
    ap.add_argument("--graph-bs", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default="bench-logs")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    t_start = time.time()
    target, draft = bench_dirs(a.out, a.logs, a.shape)
    profile = os.path.join(a.logs, "on.jsonl")
    archive_dir = os.path.join(a.logs, "rotated")
    for p in set(profile_files(profile) + profile_files(profile, archive_dir)):
        os.remove(p)  # a rerun into the same folder starts from no profile
    base = eagle3_args(target, draft, steps=3, graph_bs=a.graph_bs, max_tokens=a.max_total_tokens) + [
        "--max-running-requests", str(a.max_running)]
    env = dict(os.environ, SGLANG_SIMULATE_ACC_METHOD="multinomial", SGLANG_SIMULATE_ACC_LEN=str(a.acc))
    on_env = dict(env, SGLANG_SPECPROF_OUTPUT_MAX_MB=str(a.max_mb))
    if a.kernels_max is not None:
        on_env["SGLANG_SPECPROF_KERNELS_MAX"] = str(a.kernels_max)
    plan = {"on": (base + ["--speculative-profile", "--speculative-profile-kernels", str(a.kernels),
                           "--speculative-profile-interval", str(a.interval),
                           "--speculative-profile-output", profile], on_env),
            "off": (base, env)}
    sglang = installed_sglang()
    result_path = os.path.join(a.out, f"soak-{sglang}-{datetime.date.today().isoformat()}{a.tag}.json")
    res = {"benchmark": "soak", "complete": False, "sglang": sglang,
           "command": portable_command("bench/soak.py", sys.argv[1:]), "machine": machine(),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "settings": {k: getattr(a, k) for k in ("seconds", "sample_s", "warmup_s", "concurrency", "max_running",
                                                    "prompt", "new", "seed", "kernels", "kernels_max", "interval",
                                                    "max_mb", "acc", "max_total_tokens", "graph_bs", "shape")},
           "samples": []}
    servers = start_all(plan, a.logs, timeout=a.start_timeout)
    clients = {}
    archive = RotationArchive(profile, archive_dir)
    try:
        res["ready_s"] = {n: s.ready_s for n, s in servers.items()}
        res["startup_s"] = round(time.time() - t_start, 1)
        print(f"servers ready in {res['startup_s']} s ({res['ready_s']})", flush=True)
        time.sleep(SETTLE_S)  # launch's own warm-up request is over, its window closed
        before = server_profile(servers["on"].port).get("totals")
        res["samples"].append(sample(-1.0, servers, {}, profile, archive))
        clients = {n: Clients(s.port, a.concurrency, a.seed, tuple(a.prompt), tuple(a.new)) for n, s in servers.items()}
        t0 = time.time()
        for c in clients.values():
            c.start()
        next_sample = 0.0
        while True:
            now = time.time() - t0
            if now >= next_sample:
                s = sample(now, servers, clients, profile, archive)
                res["samples"].append(s)
                write_json(result_path, res)
                print(f"t={now:.0f}s  " + "  ".join(
                    f"{n} sched {s[n]['sched_rss_mb']:.0f} MB tok {s[n].get('tokens', 0)} err {s[n].get('errors', 0)}"
                    for n in servers) + f"  jsonl {s['jsonl']['bytes']} B rot {s['jsonl']['rotations']}", flush=True)
                next_sample += a.sample_s
            if now >= a.seconds:
                break
            try:
                for srv in servers.values():
                    srv._check_alive()
            except SystemExit as e:  # a server died: what was measured stays, with why it ended
                res["aborted"] = f"{e} at t={now:.0f} s"
                write_json(result_path, res)
                raise
            archive.poll()
            time.sleep(min(1.0, max(a.seconds - now, 0.05)))
        load_s = time.time() - t0
        drained = {n: c.finish(timeout=120) for n, c in clients.items()}
        res["samples"].append(dict(sample(time.time() - t0, servers, clients, profile, archive), drained=True))
        time.sleep(SETTLE_S)
        after_state = server_profile(servers["on"].port)
        archive.poll()
        res["load_s"] = round(load_s, 1)
        res["drained"] = drained
        res["clients"] = {n: dict(c.counts(), first_errors=c.first_errors) for n, c in clients.items()}
        latest = after_state.get("latest") or {}
        read = read_windows(profile_files(profile, archive_dir))
        last_committed = None
        if read["windows"]:
            last = max(read["windows"], key=lambda w: w["window"])
            last_committed = last["committed_tokens"]
        cap = int(a.max_mb * MB) if a.max_mb else None
        res["analysis"] = analyse(res["samples"], a.warmup_s, read, latest.get("window"), cap)
        res["analysis"]["tokens"] = token_check(clients["on"].counts()["decode_tokens"], before,
                                                after_state.get("totals"), last_committed)
        res["analysis"]["logs"] = {n: scan_log(s.log_path) for n, s in servers.items()}
        res["analysis"]["profile_enabled_at_end"] = after_state.get("enabled")
        res["complete"] = True
        write_json(result_path, res)
        print(summary(res), flush=True)
        print(f"wrote {result_path}", flush=True)
    finally:
        for c in clients.values():
            c.stop.set()
        stop_all(servers)


def _f(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


def summary(res) -> str:
    """A few lines for the log: the slopes, the windows, the tokens, the warnings."""
    an = res["analysis"]
    lines = []
    for n in ("on", "off"):
        f = an[n]["rss_mb_per_min"]
        ci = f.get("ci95") or [None, None]
        lines.append(f"{n:3s} scheduler RSS {_f(f['slope'], 3)} MB/min [{_f(ci[0], 3)}, {_f(ci[1], 3)}] "
                     f"(n={f['n']}, first/last {an[n]['rss_mb_first_last']})")
    d, v = an["rss_slope_on_minus_off"], an["rss_verdict"]
    ci = d.get("ci95") or [None, None]
    lines.append(f"on - off {_f(d['diff'], 3)} MB/min [{_f(ci[0], 3)}, {_f(ci[1], 3)}]; within off: "
                 f"{v.get('on_within_off')}; at most {_f(v.get('bounded_mb_per_hour'), 1)} MB/hour more")
    w = an.get("windows") or {}
    j = an.get("jsonl") or {}
    lines.append(f"windows {w.get('windows')} (last {w.get('last')}, published {w.get('published_last')}), "
                 f"missing {w.get('missing')}, torn {len(w.get('torn_lines', []))}, lost in all {w.get('lost_total')}; "
                 f"counters {w.get('counters')}; kernel samples {w.get('kernel_samples')}")
    lines.append(f"jsonl rotations {j.get('rotations')}, most on disk {j.get('max_bytes_on_disk')} B "
                 f"(cap {j.get('cap_bytes')})")
    t = an["tokens"]
    lines.append(f"tokens: clients {t['client_decode_tokens']}, profile {t.get('profile_committed_tokens')} "
                 f"(exact {t.get('exact')})")
    for n, lg in an["logs"].items():
        lines.append(f"{n} log: {lg.get('warnings')} warnings ({lg.get('distinct_warnings')} distinct, "
                     f"{lg.get('profiler_warnings')} the profiler's), {lg.get('errors')} errors")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
