"""One batch-size bucket of a profile, its windows' buckets merged one at a time (`merge.Merge`
holds one for each bucket), and the figure of what timing by phase adds."""

from __future__ import annotations

import math
import statistics
from array import array

from . import window
from .window import rounded as _r


def _wmean(pairs):
    pairs = [(v, n) for v, n in pairs if v is not None and n]
    tot = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / tot if tot else None


def _wmedian(pairs):
    pairs = sorted((v, n) for v, n in pairs if v is not None and n)
    tot = sum(n for _, n in pairs)
    acc = 0
    for v, n in pairs:
        acc += n
        if acc >= tot / 2:
            return v
    return None


class MergedStats:
    """Stats objects merged one at a time: a count-weighted mean, and each percentile the
    count-weighted median of the windows' ones (their values and counts kept in arrays, 16
    bytes a window, so that a long profile is never held whole)."""

    __slots__ = ("n", "wsum", "wtot", "q", "max")
    QUANTILES = ("p50", "p90", "p99")

    def __init__(self):
        self.n = 0
        self.wsum = 0.0
        self.wtot = 0
        self.q = tuple((array("d"), array("d")) for _ in self.QUANTILES)
        self.max = None

    def add(self, s: dict) -> tuple | None:
        """Adds one window's stats; returns what `take_back` needs to take them out again."""
        n = s.get("n") or 0
        self.n += n
        if not n:
            return None
        m = s["mean"]
        if m is not None:
            self.wsum += m * n
            self.wtot += n
        at = []
        for (vs, ns), key in zip(self.q, self.QUANTILES):
            v = s[key]
            if v is not None:
                at.append(len(vs))
                vs.append(v)
                ns.append(n)
            else:
                at.append(None)
        mx = s.get("max")
        if mx is not None and (self.max is None or mx > self.max):
            self.max = mx
        return n, m, at

    def take_back(self, token: tuple | None) -> None:
        """One window's stats out again (its percentiles weigh nothing; the max stays what it was)."""
        if token is None:
            return
        n, m, at = token
        self.n -= n
        if m is not None:
            self.wsum -= m * n
            self.wtot -= n
        for (_, ns), i in zip(self.q, at):
            if i is not None:
                ns[i] = 0

    def result(self) -> dict:
        out = {"n": self.n, "mean": _r(self.wsum / self.wtot) if self.wtot else None}
        for (vs, ns), key in zip(self.q, self.QUANTILES):
            out[key] = _r(_wmedian(zip(vs, ns)))
        out["max"] = self.max
        return out


def marks_added(b: dict):
    """In one window's bucket, what its cycles timed by phase took on the GPU beyond those
    timed whole (ms): about ten more events each, and the marks' host time where the GPU
    waits for the host. None unless the bucket holds both kinds (phases in one cycle of K)."""
    every, detail = b.get("cycle_gpu_ms") or {}, b.get("phase_cycle_gpu_ms") or {}
    n, nd = every.get("n") or 0, detail.get("n") or 0
    if not (0 < nd < n) or every.get("mean") is None or detail.get("mean") is None:
        return None
    whole = (every["mean"] * n - detail["mean"] * nd) / (n - nd)
    return detail["mean"] - whole


MARKS_MIN_CYCLES = 20  # cycles of each kind (timed by phase, timed whole) the figure of what timing adds needs
MARKS_MIN_WINDOWS = 3  # windows whose differences give the noise it is judged against


def _marks_judged(diffs, cycles, added: float) -> dict:
    """Whether the median of the windows' differences (`added`) says what timing by phase adds:
    "too few cycles" (a warm-up bucket of a few cycles), "too few windows" to judge the noise,
    "within noise" (no more than twice the median's standard error from the windows' spread:
    below zero too), else "measured"."""
    k = len(diffs)
    if min(cycles) < MARKS_MIN_CYCLES:
        return {"noise_gpu_ms": None, "judged": "too few cycles"}
    if k < MARKS_MIN_WINDOWS:
        return {"noise_gpu_ms": None, "judged": "too few windows"}
    # the median's standard error from the windows' spread, robustly (a window with a stall in it
    # must not widen it): 1.4826 x the median absolute deviation for the deviation, 1.2533 / sqrt(k)
    # for a median of k
    mad = statistics.median(abs(d - added) for d in diffs)
    noise = 2 * 1.2533 * 1.4826 * mad / math.sqrt(k)
    return {"noise_gpu_ms": _r(noise), "judged": "within noise" if added <= noise else "measured"}


def _sum_into(out: list, xs) -> None:
    for i, c in enumerate(xs):
        while len(out) <= i:
            out.append(0)
        out[i] += c


# A window's bucket with fewer cycles timed by phase than this cannot judge its own stalls (the
# p50 it judges them against is theirs: a server's first cycles, compiling kernels for each new
# shape); it is added, then judged once the profile is read against the other windows' p50.
FEW_TIMED = 20
PENDING_MAX = 256  # such windows held at once; past it they are judged on what is known so far


def _stalled_phases(b: dict, reference: dict) -> list:
    """The phases of window bucket `b` that stalled by the server's own rule (bucket.py: host-bound,
    over STALL_MIN_MS and STALL_TIMES_P50 x the phase's p50 + 0.5 ms), judged on their p50 against
    `reference` ({phase: p50 of the other windows}) rather than their own."""
    from .bucket import STALL_HOST_SHARE, STALL_MIN_MS, STALL_TIMES_P50

    out = []
    for n, p in b["phases"].items():
        g, h, ref = p["gpu_ms"].get("p50"), p["host_ms"].get("p50"), reference.get(n)
        if None in (g, h, ref):
            continue
        if g > STALL_MIN_MS and h >= STALL_HOST_SHARE * g and g > STALL_TIMES_P50 * ref + 0.5:
            out.append(n)
    return out


class MergedBucket:
    """One batch-size bucket of a profile, its windows' buckets added one at a time. A window's
    bucket of a few cycles timed by phase is judged for stalls against the others (`FEW_TIMED`)."""

    GRAPHS = window.GRAPH_KINDS

    def __init__(self):
        self.cycles = self.prefill_cycles = 0
        self.phases: dict = {}  # name -> (gpu _Stats, host _Stats), in first-seen order
        self.steps: list = []
        self.cyc, self.timed, self.wall, self.gap, self.period = (MergedStats() for _ in range(5))
        self.ctx = None
        self.kv = None
        self.waiting = None
        self.hist: list = []
        self.drafts: list = []
        self.positions = 0
        self.committed = self.skipped = self.cut_requests = self.cut_tokens = 0
        self.busy = self.counted = self.accept_cycles = 0.0
        self.stalled = {"cycles": 0, "gpu_ms": 0.0, "phases": {}}
        self.replays = dict.fromkeys(self.GRAPHS, 0)
        self.eager = dict.fromkeys(self.GRAPHS, 0)
        self.padding: list = []  # (padding_mean, cycles) of each window
        # each window's cycles timed by phase against those timed whole (ms of GPU span)
        self.marks = array("d")
        self.marks_cycles = [0, 0]  # the cycles timed by phase, and whole, of the windows in `marks`
        self.pending: list = []  # (window bucket, what to take back) of few cycles timed by phase, not yet judged

    def add(self, b: dict) -> None:
        timed = (b.get("phase_cycle_gpu_ms") or b.get("cycle_gpu_ms") or {}).get("n") or 0
        tokens = self._add(b)
        if 0 < timed < FEW_TIMED and b.get("phases"):
            if len(self.pending) >= PENDING_MAX:
                self._judge_pending()
            self.pending.append((b, tokens))

    def _judge_pending(self) -> None:
        """The held window buckets judged against each phase's p50 over the windows that timed it
        in FEW_TIMED cycles or more: a stalled one keeps its cycles and tokens, and its times go
        from the phase and cycle figures to `stalled`."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        reference = {}
        for n, (g, _) in self.phases.items():
            vs, ns = g.q[0]
            long = [(v, c) for v, c in zip(vs, ns) if c >= FEW_TIMED]
            if long:
                reference[n] = _wmedian(long)
        for b, tokens in pending:
            waited = _stalled_phases(b, reference)
            if not waited:
                continue
            for stats, token in tokens:
                stats.take_back(token)
            timed = b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"]
            st = self.stalled
            st["cycles"] += timed["n"]
            st["gpu_ms"] += (timed["mean"] or 0.0) * timed["n"]
            for n in waited:
                p = b["phases"][n]
                m = st["phases"].setdefault(n, {"n": 0, "gpu_ms": 0.0, "host_ms": 0.0})
                m["n"] += p["gpu_ms"]["n"]
                m["gpu_ms"] += (p["gpu_ms"]["mean"] or 0.0) * p["gpu_ms"]["n"]
                m["host_ms"] += (p["host_ms"]["mean"] or 0.0) * p["host_ms"]["n"]

    def _add(self, b: dict) -> list:
        """Adds one window's bucket; returns the (stats, token) pairs of its times, to take back
        if it turns out to have stalled."""
        times = []
        self.cycles += b["cycles"]
        self.prefill_cycles += b["prefill_cycles"]
        for n, p in b["phases"].items():
            st = self.phases.get(n)
            if st is None:
                st = self.phases[n] = (MergedStats(), MergedStats())
            times.append((st[0], st[0].add(p["gpu_ms"])))
            times.append((st[1], st[1].add(p["host_ms"])))
        times.append((self.cyc, self.cyc.add(b["cycle_gpu_ms"])))
        # the cycles the phases were timed in (all of them before --speculative-profile-phases-every)
        times.append((self.timed, self.timed.add(b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"])))
        diff = marks_added(b)
        if diff is not None:
            self.marks.append(diff)
            nd = b["phase_cycle_gpu_ms"]["n"]
            self.marks_cycles[0] += nd
            self.marks_cycles[1] += b["cycle_gpu_ms"]["n"] - nd
        for i, s in enumerate(b["draft_steps_gpu_ms"]):
            if len(self.steps) <= i:
                self.steps.append(MergedStats())
            times.append((self.steps[i], self.steps[i].add(s)))
        acc = b["accept"]
        _sum_into(self.hist, acc["histogram"])
        # correct drafts per request, uncut (schema 2); schema 1 had the accept lengths only
        drafts = acc["drafts_histogram"] if "drafts_histogram" in acc else acc["histogram"][1:]
        _sum_into(self.drafts, drafts)
        self.positions = max(self.positions, len(acc["per_position"]))
        self.committed += acc["committed_tokens"]
        if b.get("tokens_per_s"):
            self.busy += acc["committed_tokens"] / b["tokens_per_s"]
            self.counted += acc["committed_tokens"]
        if acc.get("tokens_per_cycle"):
            self.accept_cycles += acc["committed_tokens"] / acc["tokens_per_cycle"]
        self.skipped += acc.get("skipped_requests") or 0
        self.cut_requests += acc.get("cut_requests") or 0
        self.cut_tokens += acc.get("cut_tokens") or 0
        times.append((self.wall, self.wall.add(b["cycle_wall_ms"])))
        times.append((self.gap, self.gap.add(b["between_cycles_gpu_ms"])))
        if b.get("cycle_period_gpu_ms"):
            times.append((self.period, self.period.add(b["cycle_period_gpu_ms"])))
        if (b.get("context_tokens") or {}).get("n"):
            if self.ctx is None:
                self.ctx = MergedStats()
            self.ctx.add(b["context_tokens"])
        if (b.get("kv_used_share") or {}).get("n"):
            if self.kv is None:
                self.kv = MergedStats()
            self.kv.add(b["kv_used_share"])
        if (b.get("waiting_requests") or {}).get("n"):
            if self.waiting is None:
                self.waiting = MergedStats()
            self.waiting.add(b["waiting_requests"])
        st = b.get("stalled") or {}
        stalled = self.stalled
        stalled["cycles"] += st.get("cycles") or 0
        stalled["gpu_ms"] += st.get("gpu_ms") or 0.0
        for n, e in (st.get("phases") or {}).items():
            m = stalled["phases"].setdefault(n, {"n": 0, "gpu_ms": 0.0, "host_ms": 0.0})
            for f in m:
                m[f] += e.get(f) or 0
        for g in self.GRAPHS:
            self.replays[g] += b["graph"]["replays"].get(g, 0)
            self.eager[g] += b["graph"]["eager"].get(g, 0)
        self.padding.append((b["graph"]["padding_mean"], b["cycles"]))
        return times

    def result(self) -> dict:
        self._judge_pending()
        phases = {n: {"gpu_ms": g.result(), "host_ms": h.result()} for n, (g, h) in self.phases.items()}
        cyc, timed = self.cyc.result(), self.timed.result()
        for p in phases.values():
            p["share"] = _r(p["gpu_ms"]["mean"] / timed["mean"]) if timed["mean"] and p["gpu_ms"]["mean"] is not None else None
        gap, period = self.gap.result(), self.period.result()
        verified = sum(self.hist)
        positions = max(len(self.drafts) - 1, self.positions)
        stalled = dict(self.stalled, gpu_ms=_r(self.stalled["gpu_ms"]))
        marks = None
        if self.marks and cyc["n"] and timed["n"] and cyc["mean"]:
            added = statistics.median(self.marks)
            marks = {"gpu_ms": _r(added), "windows": len(self.marks),
                     "share_of_all": _r(added * timed["n"] / cyc["n"] / cyc["mean"]),
                     "cycles": list(self.marks_cycles), **_marks_judged(self.marks, self.marks_cycles, added)}
        return {
            "cycles": self.cycles,
            "prefill_cycles": self.prefill_cycles,
            "phases": phases,
            "draft_steps_gpu_ms": [s.result() for s in self.steps],
            "cycle_gpu_ms": cyc,
            "phase_cycle_gpu_ms": timed,
            "phase_marks_added": marks,
            "context_tokens": self.ctx.result() if self.ctx is not None else None,
            "kv_used_share": self.kv.result() if self.kv is not None else None,
            "waiting_requests": self.waiting.result() if self.waiting is not None else None,
            "between_cycles_gpu_ms": gap,
            "cycle_period_gpu_ms": period,
            "stalled": stalled,
            "cycle_wall_ms": self.wall.result(),
            "between_cycles_share": _r(gap["mean"] / period["mean"]) if period["mean"] and gap["mean"] is not None
            else None,
            "graph": {"replays": self.replays, "eager": self.eager, "padding_mean": _r(_wmean(self.padding))},
            "accept": {"verified_requests": verified, "mean_length": _r(self.committed / verified) if verified else None,
                       "skipped_requests": self.skipped,
                       "histogram": self.hist, "drafts_histogram": self.drafts,
                       "per_position": window.per_position([0] + self.drafts, positions),
                       "committed_tokens": self.committed,
                       "cut_requests": self.cut_requests,
                       "cut_tokens": self.cut_tokens,
                       "tokens_per_cycle": _r(self.committed / self.accept_cycles) if self.accept_cycles else None},
            "tokens_per_s": _r(self.counted / self.busy) if self.busy else None,
        }

