"""Merging a profile's windows: one summary a run, each bucket merged (`bucket_merge.py`) as the
windows are read, so that a profile of any length reads in bounded memory."""

from __future__ import annotations

import json

from . import compare, kernels, window
from .bucket_merge import MergedBucket, marks_added  # noqa: F401  (marks_added: part of merge's interface)
from .model import VERIFY
from .schema import UNREADABLE, SourceError, why
from .window import rounded as _r


def add_window(merge: "Merge", w: dict, source: str) -> None:
    """`merge.add(w)`, a value of another type than the windows before it held (each window
    alone passed `readable`) named in one sentence."""
    try:
        merge.add(w)
    except UNREADABLE as e:
        raise SourceError(f"{source}: window {w.get('window')!r} holds a value of another kind than the windows "
                          f"before it, which the report cannot merge ({why(e)})") from None


KERNEL_SOURCES = 16  # windows whose phase means are kept, to compare a kernel sample with the window it was taken in


class Merge:
    """A profile's windows merged one at a time into one summary (`result()`): what the
    report holds is the merge, not the windows, so a profile of any length reads in bounded
    memory (a few arrays that grow by 16 bytes a window and stats object)."""

    def __init__(self):
        self.buckets: dict = {}
        self.first = self.last = None
        self.count = 0
        self.decode_cycles = 0
        self.busy = 0.0
        self.committed = 0
        self.points: list = []
        self.lost = dict.fromkeys(("dropped_cycles", "steps_lost", "marks_lost", "uncut_cycles"), 0)
        self.kernels: list = []
        self.kernel_points: list = []
        self.beside = dict.fromkeys(("prefill_seconds", "beside_prefill_seconds", "admissions"), 0)
        self.switch = dict.fromkeys(("cycles", "gpu_ms", "gap_gpu_ms", "committed_tokens"), 0)
        self.recent: dict = {}  # (rank, window) -> window, the last KERNEL_SOURCES

    def add(self, w: dict) -> None:
        if self.first is None:
            self.first = {k: w.get(k) for k in ("window", "rank", "config")}
        self.last = w["window"]
        self.count += 1
        for key, b in w["buckets"].items():
            acc = self.buckets.get(key)
            if acc is None:
                window.bucket_order(key)  # a key that is no batch size is refused here
                acc = self.buckets[key] = MergedBucket()
            acc.add(b)
            self.committed += b["accept"]["committed_tokens"]
        self.decode_cycles += w["decode_cycles"]
        self.busy += w["seconds"] or 0
        for k, v in (w.get("switch_cycles") or {}).items():
            if k in self.switch and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.switch[k] += v
        for k in self.beside:
            self.beside[k] += w.get(k) or 0
        self.points.extend(verify_points([w]))
        for k in self.lost:
            self.lost[k] = max(self.lost[k], w.get(k) or 0)
        src = (w.get("rank", 0), w["window"])
        self.recent[src] = compare.fields(w)  # its phase means: what against_window reads
        if len(self.recent) > KERNEL_SOURCES:
            self.recent.pop(next(iter(self.recent)))
        k = w.get("kernels")
        if k and "error" not in k and "slowed" not in k:
            # compared with the window it was taken in, where the profile holds it and the
            # sample does not carry the comparison yet
            taken = self.recent.get((w.get("rank", 0), k.get("window")))
            if taken is not None:
                kernels.against_window(k, taken)
        self.kernels.append(k)
        self.kernel_points.extend(kernel_points(k))

    def result(self) -> dict:
        first = self.first or {}
        busy = self.busy
        return {"window": f"{first.get('window')}-{self.last}" if self.count > 1 else self.last,
                "rank": first.get("rank"), "config": first.get("config") or {},
                "decode_cycles": self.decode_cycles, "seconds": _r(busy),
                "tokens_per_s": _r(self.committed / busy) if busy else None,
                **{k: (v if k == "admissions" else _r(v)) for k, v in self.beside.items()},
                "buckets": {k: window.with_steps(k, self.buckets[k].result())
                            for k in sorted(self.buckets, key=window.bucket_order)},
                "verify_points": self.points,
                "kernel_points": self.kernel_points,
                **({"switch_cycles": self._switches()} if self.switch["cycles"] else {}),
                **self.lost,
                "kernels": kernels.merge(self.kernels)}

    def _switches(self) -> dict:
        """The first cycle after each change of step count, summed: what the switches cost beside
        what the other decode cycles took on average."""
        s = dict(self.switch, gpu_ms=_r(self.switch["gpu_ms"]), gap_gpu_ms=_r(self.switch["gap_gpu_ms"]))
        s["mean_gpu_ms"] = _r(self.switch["gpu_ms"] / s["cycles"]) if s["cycles"] else None
        cycles = sum(b.cycles for b in self.buckets.values())
        s["other_cycles_mean_gpu_ms"] = _r(1000.0 * self.busy / cycles) if cycles and self.busy else None
        return s


RUN_FIELDS = ("rank",) + compare.SETTINGS  # windows that differ in one of these are another run's


def run_of(w: dict) -> str:
    """The key of the run a window belongs to: its rank and settings (what one merge may hold)."""
    cfg = w.get("config") or {}
    return json.dumps([w.get("rank", 0)] + [cfg.get(k) for k in compare.SETTINGS], sort_keys=True, default=str)


class Runs:
    """A profile's windows merged by run (`run_of`), in the order the runs first appear: windows
    of another rank, release or setting (a server restarted onto the same file, two ranks'
    files put together) are merged apart, not into one summary under the first one's header."""

    def __init__(self):
        self.merges: dict = {}
        self.count = 0

    def add(self, w: dict, source: str) -> None:
        key = run_of(w)
        m = self.merges.get(key)
        if m is None:
            m = self.merges[key] = Merge()
        add_window(m, w, source)
        self.count += 1

    def differ(self) -> dict:
        """{field: [each run's value]} for each field the runs differ in."""
        firsts = [m.first or {} for m in self.merges.values()]
        vals = {f: [(x.get("rank") if f == "rank" else (x.get("config") or {}).get(f)) for x in firsts]
                for f in RUN_FIELDS}
        return {f: v for f, v in vals.items() if len({json.dumps(x, default=str) for x in v}) > 1}

    def header(self, i: int) -> str:
        m = list(self.merges.values())[i]
        what = ", ".join(f"{f} {v[i]}" for f, v in self.differ().items())
        span = f"windows {m.first.get('window')}-{m.last}" if m.count > 1 else f"window {m.last}"
        return f"== run {i + 1} of {len(self.merges)}: {what} ({span}, {m.count} windows) =="

    def note(self) -> str:
        parts = ", ".join(f"{f} {' and '.join(map(str, dict.fromkeys(map(str, v))))}" for f, v in self.differ().items())
        return (f"the profile holds windows of {len(self.merges)} runs that differ in their settings ({parts}): each "
                f"is merged and reported on its own, under a header of its own (--json: the first as summary, "
                f"the others in other_runs; --adaptive-config, --plot and --html: the first)")


def summarize(windows) -> dict:
    m = Merge()
    for w in windows:
        m.add(w)
    return m.result()


def merge_buckets(windows) -> dict:
    return summarize(windows)["buckets"]


def verify_points(windows: list[dict]) -> list[list]:
    """[requests per cycle, context tokens per cycle or None, verify GPU ms, cycles, step count
    or None] for each window's buckets: what the advisor fits the growth of verify with tokens
    on (the step count: a bucket of an adaptive profile's, else the profile's)."""
    pts = []
    for w in windows:
        for key, b in w["buckets"].items():
            v = (b["phases"].get(VERIFY) or {}).get("gpu_ms", {}).get("mean")
            reqs = b["accept"].get("verified_requests")
            if v is None or not b["cycles"] or not reqs:
                continue
            ctx = (b.get("context_tokens") or {}).get("mean")
            pts.append([round(reqs / b["cycles"], 4), ctx, v, b["cycles"], window.bucket_steps(key)])
    return pts


TOKEN_CLASSES = ("gemm", "sampling", "copy", "other", "communication")  # kernel time that follows the tokens


def kernel_points(block: dict | None) -> list[list]:
    """[requests per cycle, verify kernel ms per cycle that follows the tokens (GEMMs, sampling,
    copies, the rest), verify attention ms per cycle, cycles, step count or None] from one
    window's kernel sample, one point per step count it holds; what `fit.TokenCurve` fits the
    growth of verify with the tokens on, apart from attention (which follows the requests and
    their context)."""
    if not isinstance(block, dict) or "error" in block:
        return []
    p = (block.get("phases") or {}).get(VERIFY)
    bss = block.get("bs") or []
    steps = block.get("steps") or [None] * len(bss)
    if not isinstance(p, dict) or not p.get("cycles") or not bss or len(steps) != len(bss):
        return []
    if len(set(steps)) != 1 or any(b is None for b in bss):
        return []  # a sample across a change of step count: its kernels are not one setting's
    busy = p.get("busy_ms") or {}
    per = max(p["cycles"], 1)
    token_ms = sum(busy.get(c) or 0.0 for c in TOKEN_CLASSES) / per
    attention_ms = (busy.get("attention") or 0.0) / per
    return [[round(sum(bss) / len(bss), 3), round(token_ms, 4), round(attention_ms, 4), len(bss), steps[0]]]


def by_steps(summary: dict) -> dict:
    """An adaptive profile (buckets "5-8@2", ...): for each batch-size bucket run at more than
    one step count, the tokens/s measured at each (its decode cycles' GPU time), and the best."""
    out = {}
    for key, b in summary["buckets"].items():
        steps = window.bucket_steps(key)
        if steps is None or not b["cycles"] or b["tokens_per_s"] is None:
            continue
        row = out.setdefault(key.partition("@")[0], {"tokens_per_s": {}, "cycles": {}})
        row["tokens_per_s"][steps] = b["tokens_per_s"]
        row["cycles"][steps] = b["cycles"]
    out = {k: v for k, v in out.items() if len(v["tokens_per_s"]) > 1}
    for v in out.values():
        v["best"] = max(v["tokens_per_s"], key=v["tokens_per_s"].get)
    return out

