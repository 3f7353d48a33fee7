"""Dummy-weight EAGLE3 servers on one GPU, and the load the benchmarks send them.

Shared by bench/overhead.py, bench/advisor_check.py and tests/gpu/serve_check.py.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

# `sglang.launch_server` by default; the harness tests point it at a stand-in server.
LAUNCH = os.environ.get("SPECPROF_BENCH_LAUNCH", "sglang.launch_server")

# Logged once a server's target KV pool is allocated: from then on the next server, starting,
# sees this one's weights and pool in the GPU's free memory.
MEMORY_TAKEN = "Memory pool end"


def http(port, path, data=None, timeout=900):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=None if data is None else json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return body.decode() if path == "/metrics" else json.loads(body)


def load(port, concurrency, new_tokens):
    """`concurrency` requests at once, each `new_tokens` long, input ids only.

    Returns (generated tokens, wall seconds of the whole run)."""
    got, errors = [], []

    def one(i):
        ids = [100 + (i * 7 + j) % 1000 for j in range(64)]
        try:
            out = http(port, "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
            got.append(len(out["output_ids"]))
        except Exception as e:  # reported below, with the port
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors or len(got) != concurrency:
        raise RuntimeError(f"{concurrency - len(got)} of {concurrency} requests failed on port {port}: "
                           f"{errors[0] if errors else 'no answer'}")
    return sum(got), secs


def tok_s(port, concurrency, new_tokens, log=None, name=None):
    """Tokens/s of one run; with `log` (a list), (name, start, end, tokens/s) is appended."""
    t0 = time.time()
    tokens, secs = load(port, concurrency, new_tokens)
    if log is not None:
        log.append((name, t0, time.time(), tokens / secs))
    return tokens / secs


class GpuClocks:
    """The GPU's SM clock, power and the reasons the clock is held down, from `nvidia-smi -lms`,
    each sample stamped when it arrives; `during(t0, t1)` summarises a run. Reading only: the
    clocks are left as the machine sets them. Without nvidia-smi it records nothing."""

    FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

    def __init__(self, gpu=0, period_ms=100):
        self.samples = []
        self.proc = None
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", str(gpu)).split(",")[0] or "0"
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "-i", gpu, "--query-gpu=" + ",".join(self.FIELDS),
                                          "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [x.strip() for x in line.split(",")]
            try:
                sm, mem, power, temp = (float(x) for x in parts[:4])
            except ValueError:
                continue
            self.samples.append((time.time(), sm, mem, power, temp, parts[4] if len(parts) > 4 else ""))

    def during(self, t0, t1):
        got = [x for x in self.samples if t0 <= x[0] <= t1]
        if not got:
            return {}
        return {"sm_mhz": round(statistics.fmean(x[1] for x in got), 1),
                "sm_mhz_min": min(x[1] for x in got), "mem_mhz": round(statistics.fmean(x[2] for x in got), 1),
                "power_w": round(statistics.fmean(x[3] for x in got), 1), "temp_c": max(x[4] for x in got),
                "reasons": sorted({x[5] for x in got}), "samples": len(got)}

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()


def eagle3_args(target, draft, steps=3, topk=1, draft_tokens=None, graph_bs=(1, 8), max_tokens=40960,
                algorithm="EAGLE3"):
    """The flags every benchmark server shares (the offline bundle has triton attention only).

    `algorithm`: EAGLE3 (the default, `draft` an EAGLE3 head), STANDALONE (`draft` a small
    model of its own) or NGRAM (no draft model: `draft` is ignored, `draft_tokens` is the
    budget of tokens matched a cycle). `--sleep-on-idle`: an idle server's scheduler otherwise
    spins on a CPU core, beside the one under load. `--max-total-tokens` bounds each server's
    KV pool, so that servers that start while others are still capturing graphs cannot take
    more than their share."""
    if algorithm == "NGRAM":
        spec = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(draft_tokens or 8)]
    else:
        spec = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft,
                "--speculative-draft-load-format", "dummy", "--speculative-num-steps", str(steps),
                "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(draft_tokens or steps + 1)]
    return ["--model-path", target, "--load-format", "dummy", *spec,
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--skip-tokenizer-init", "--cuda-graph-bs", *map(str, sorted(set(graph_bs))),
            "--disable-piecewise-cuda-graph", "--sleep-on-idle", "--max-total-tokens", str(max_tokens)]


class Server:
    def __init__(self, name, port, argv, env, log_dir, cpus=None):
        self.name, self.port = name, port
        pin = ["taskset", "-c", cpus] if cpus else []
        self.cmd = [*pin, sys.executable, "-m", LAUNCH, *argv, "--port", str(port)]
        self.log_path = os.path.join(log_dir, f"server-{name}.log")
        self.log = open(self.log_path, "w")
        self.started = time.time()
        self.ready_s = None
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def _check_alive(self):
        if self.proc.poll() is not None:
            raise SystemExit(f"server {self.name} exited with {self.proc.returncode}; see {self.log_path}")

    def wait_log(self, text, deadline):
        """Until the server's log shows `text`."""
        while time.time() < deadline:
            self._check_alive()
            with open(self.log_path, errors="replace") as f:
                if text in f.read():
                    return
            time.sleep(0.5)
        raise SystemExit(f"server {self.name} never logged {text!r}; see {self.log_path}")

    def wait_ready(self, deadline):
        while time.time() < deadline:
            self._check_alive()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5)
                self.ready_s = round(time.time() - self.started, 1)
                return
            except Exception:
                time.sleep(1)
        raise SystemExit(f"server {self.name} not ready in time; see {self.log_path}")

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except Exception:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except Exception:
                pass


def split_cpus(spec, n):
    """'0-15' among n servers: n contiguous, equal, disjoint sets ('0-7', '8-15' for n = 2)."""
    lo, hi = (int(x) for x in spec.split("-"))
    per = (hi - lo + 1) // n
    if per < 1:
        raise SystemExit(f"--cpus {spec} has fewer CPUs than the {n} servers")
    return [f"{lo + i * per}-{lo + (i + 1) * per - 1}" for i in range(n)]


def server_processes(pgid):
    """The processes of process group `pgid` (a server is started in a session of its own)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp, ...
            if int(fields[2]) == pgid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    return out


def is_scheduler(pid) -> bool:
    """SGLang names its scheduler processes `sglang::scheduler...` (setproctitle)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return False
    return comm.startswith("sglang::sched") or cmd.startswith("sglang::scheduler")


def _siblings(cpu):
    """The CPUs that share `cpu`'s core (its hyperthreads), from sysfs; {cpu} where it says none."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out | {cpu}


def pin_schedulers(servers):
    """Each server's scheduler thread (its process's main thread) on a CPU of its own, its core's
    other hyperthreads left idle where there are CPUs enough; every other thread of the servers,
    and this thread (the clients' threads it starts after), on the CPUs left. Returns
    {server: CPU}. Upstream's scheduler paces the GPU from one thread; a CPU it shares with the
    clients or the other server makes its cycles vary from window to window."""
    allowed = sorted(os.sched_getaffinity(0))
    procs = {name: server_processes(s.proc.pid) for name, s in servers.items()}
    scheds = {name: [p for p in ps if is_scheduler(p)] for name, ps in procs.items()}
    if any(len(v) != 1 for v in scheds.values()):
        raise SystemExit(f"--pin-schedulers: not one scheduler process a server ({scheds})")
    own, taken = {}, set()
    for name in servers:
        free = [c for c in reversed(allowed) if c not in taken]
        if len(free) < 2:
            raise SystemExit(f"--pin-schedulers: {len(allowed)} CPUs are too few for {len(servers)} schedulers and the rest")
        own[name] = free[0]
        taken.add(free[0])
        sib = _siblings(free[0]) & set(allowed)
        if len(set(allowed) - taken - sib) >= 1:
            taken |= sib
    rest = set(allowed) - taken
    for name, ps in procs.items():
        for pid in ps:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:  # gone meanwhile
                continue
            for tid in tids:
                try:
                    os.sched_setaffinity(int(tid), rest)
                except OSError:
                    pass
        os.sched_setaffinity(scheds[name][0], {own[name]})
    os.sched_setaffinity(0, rest)
    return own


def start_all(plan, log_dir, first_port=31000, mem_fraction=0.88, timeout=600, cpus=None, together=False):
    """Start the servers of `plan` ({name: (argv, env)}) side by side on one GPU.

    Each starts once the one before has allocated its KV pool; their CUDA graph captures,
    the slow part, overlap. Every server may use `mem_fraction` of the GPU counting what
    the others already hold, and its KV pool is bounded by --max-total-tokens. `cpus`
    ('A-B'): each server's processes pinned to its own share of those CPUs. `together`: the
    first server alone until it is ready (its kernels compiled into the shared triton
    cache), then all the others at once (small models: each takes about 50 s to reach its
    KV pool, serially minutes)."""
    servers = {}
    sets = split_cpus(cpus, len(plan)) if cpus else [None] * len(plan)
    deadline = time.time() + timeout
    try:
        for i, (name, (argv, env)) in enumerate(plan.items()):
            servers[name] = Server(name, first_port + i, argv + ["--mem-fraction-static", str(mem_fraction)],
                                   env, log_dir, sets[i])
            if together and i == 0:
                servers[name].wait_ready(deadline)
            elif not together:
                servers[name].wait_log(MEMORY_TAKEN, deadline)
        for s in servers.values():
            s.wait_ready(deadline)
    except BaseException:
        stop_all(servers, settle_s=0)
        raise
    return servers


# A profile's open window closes once its server sat idle 1.5 s (`settlement.IDLE_CLOSE_S`), at the
# next idle housekeeping (about once a second with --sleep-on-idle); a server stopped sooner loses
# it (SGLang kills its scheduler: nothing flushes then). The last server of a rotation stops right
# after its run, so the servers are given this long first.
SETTLE_S = 3.5


def stop_all(servers, settle_s=SETTLE_S):
    """Stop every server, after `settle_s` seconds for their profiles' open windows to close."""
    if servers and settle_s:
        time.sleep(settle_s)
    for s in servers.values():
        s.stop()


def installed_sglang() -> str:
    """The sglang release importable here (its version without a +specprof suffix), or "unknown"."""
    from importlib import metadata

    try:
        return metadata.version("sglang").split("+", 1)[0]
    except metadata.PackageNotFoundError:
        return "unknown"


def profiler_fingerprint() -> str | None:
    """The profiler the servers import: the first 12 hex digits of a sha256 over its files
    (`sglang/specprof/*.py`, by name), found without importing sglang; None where there is
    none. Results of one fingerprint ran the same profiler code, so their rounds pool."""
    import hashlib
    from importlib.util import find_spec

    try:
        spec = find_spec("sglang")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        folder = os.path.join(root, "specprof")
        if os.path.isdir(folder):
            h = hashlib.sha256()
            for name in sorted(n for n in os.listdir(folder) if n.endswith(".py")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read() + b"\0")
            return h.hexdigest()[:12]
    return None


def machine():
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader",
                              "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = "no nvidia-smi"
    return f"{platform.node()}: {gpu or 'no GPU'}, {os.cpu_count()} CPUs"


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


BOOTSTRAP_MAX = 1000  # ratios up to which the interval is bootstrapped; beyond, the order statistics give it


def median_ci(ratios, n=4000, seed=0):
    """A 95% bootstrap interval of the median: how well the runs pin the median down. Each
    resample sorts all the ratios, so above BOOTSTRAP_MAX of them (a pool of many results:
    200,000 ratios took minutes) the interval is the distribution-free one the bootstrap
    tends to: the order statistics at ranks n/2 -+ 1.96 sqrt(n)/2."""
    if len(ratios) > BOOTSTRAP_MAX:
        xs = sorted(ratios)
        k = len(xs)
        half = 1.96 * math.sqrt(k) / 2
        return xs[max(int(k / 2 - half), 0)], xs[min(int(math.ceil(k / 2 + half)), k - 1)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def ratio_summary(name, ratios):
    """Paired ratios as a result file keeps them: their median, quartiles, extremes, the
    ratios, and the median's 95% bootstrap interval; `name` suffixes each key."""
    lo, hi = quartiles(ratios)
    return {f"median_ratio{name}": round(statistics.median(ratios), 4),
            f"ratio{name}_iqr": [round(lo, 4), round(hi, 4)],
            f"ratio{name}_min_max": [round(min(ratios), 4), round(max(ratios), 4)],
            f"ratios{name}": [round(r, 4) for r in ratios],
            f"median_ratio{name}_ci95": [round(x, 4) for x in median_ci(ratios)]}


def rotations(names, rounds):
    """The order of each round: A B C, B C A, C A B, ... so that drift falls on all alike."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names)
        yield r, names[k:] + names[:k]


def out_of_time(t0, r, budget, concurrency) -> bool:
    """With `budget` (seconds from t0), whether round `r` would end past it; two rounds at least."""
    elapsed = time.time() - t0
    if budget and r >= 2 and elapsed * (r + 1) / r > budget:
        print(f"c={concurrency}: stopping after {r} rounds (--max-seconds)", flush=True)
        return True
    return False


def interleaved_runs(ports, concurrency, new_tokens, rounds, budget=None, log=None):
    """Tokens/s of each server ({label: port}) over `rounds` rotating rounds of the same load.

    Each server first gets a short run (its first use of this batch size compiles kernels).
    With `budget` (seconds), no round starts that would end past it; two rounds at least."""
    t0 = time.time()
    for port in ports.values():
        load(port, concurrency, 64)
    runs = {n: [] for n in ports}
    for r, order in rotations(ports, rounds):
        if out_of_time(t0, r, budget, concurrency):
            break
        for n in order:
            runs[n].append(tok_s(ports[n], concurrency, new_tokens, log, n))
        print(f"c={concurrency} round {r}: " + "  ".join(f"{n} {runs[n][-1]:.1f}" for n in ports), flush=True)
    return runs


def round_args(ap):
    """The options of a benchmark that runs interleaved rounds against servers it starts: how
    many rounds, the warm-up, the time limit, and where results and logs go."""
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not recorded")
    ap.add_argument("--max-seconds", type=float, default=None, help="from the start: no round starts after this")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default="bench-logs")
    ap.add_argument("--tag", default="")


def portable_command(script, argv):
    """The command line as recorded: the run's own folders named, not spelled out."""
    out, names = [], {"--out": "OUT", "--logs": "OUT/logs", "--upstream-path": "UNPATCHED", "--publish-to": "FILE"}
    for i, a in enumerate(argv):
        out.append(names[argv[i - 1]] if i and argv[i - 1] in names else a)
    return " ".join(["python", script, *(shlex.quote(x) for x in out)])


def write_json(path, obj):
    """A result file: indented JSON, one trailing newline."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
