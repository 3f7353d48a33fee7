"""Summary windows: per batch-size bucket statistics of timed cycles. Plain Python.

A cycle arrives as a `Cycle` (phase names, GPU and host milliseconds, draft-step GPU
milliseconds, the gap before it on the GPU, its host period); acceptance arrives as the
number of correct drafts per request. `Window` folds them into bounded per-bucket
accumulators and `summary()` turns them into one JSON-ready dict (the schema in
`schema.py`).
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from dataclasses import dataclass, field

# A phase whose host time is near its GPU time held the device waiting on the host; when it
# also took far longer than the phase usually does (a kernel compiled for a new shape, a
# pause), its cycle is a stall: left out of the phase figures, reported apart.
STALL_HOST_SHARE = 0.8  # host time at least this share of the span
STALL_MIN_MS = 1.0
STALL_TIMES_P50 = 4.0  # and longer than 4 x the phase's p50 + 0.5 ms
STALL_CANDIDATES = 16  # cycles kept per bucket and window to judge at its close
WHOLE = "(cycle)"  # a stall candidate timed without its phases: the whole cycle in one row
SAMPLES_PER_SERIES = 2048  # reservoir size: memory stays bounded whatever the window length
CYCLE_SAMPLES = 8  # whole cycles kept per window, for timelines (the report's --trace)


@dataclass
class Cycle:
    kind: str  # "decode" or "prefill"
    bs: int
    phases: list[tuple[str, float, float]]  # (name, gpu_ms, host_ms), in order
    steps_gpu_ms: list[float] = field(default_factory=list)
    gap_gpu_ms: float | None = None  # GPU time from the previous cycle's end to this one's start
    period_host_ms: float | None = None  # host time from the previous cycle's start to this one's
    graph: dict | None = None  # {"draft": bool, "verify": bool, "draft_extend": bool, "padded_bs": int}
    host_start_s: float | None = None  # host clock at the cycle's first mark
    host_offsets_ms: list[float] = field(default_factory=list)  # each phase's host start, from the first mark
    context_tokens: int | None = None  # sum of the batch's sequence lengths at the cycle's start
    period_gpu_ms: float | None = None  # GPU time from the previous cycle's start to this one's
    host_pause_ms: float = 0.0  # host time the garbage collector stopped the process inside the cycle
    drained: bool = False  # every request had finished before it: no decode time
    whole: tuple[float, float] | None = None  # (GPU ms, host ms) of a cycle timed without its phases
    # the first decode cycle after prefills: the GPU time between them and beside them (host
    # work admitting the requests: neither decode nor prefill time)
    beside_prefill_ms: float | None = None
    steps: int | None = None  # the step count it ran at, under --speculative-adaptive (else None)
    # the first decode cycle after the step count changed: its GPU time holds the worker's swap of
    # graphs (and what a first replay compiles), the switch's cost, not the setting's
    switched: bool = False
    kv_used: float | None = None  # the share of the KV pool in use at its start (v2 from 0.5.13, timed by phase)
    waiting: int | None = None  # requests waiting for a running slot at its start (timed by phase)


GRAPH_KINDS = ("draft", "verify", "draft_extend")  # the forwards that replay a CUDA graph or run eager


_BUCKET_KEY = re.compile(r"(\d+)(?:-\d+)?(?:@(\d+))?")


def bucket_order(key: str) -> tuple[int, int]:
    """The sort key of a bucket's name: its smallest batch size, then its step count. A name
    that is no bucket's ("1-2", "5-8@3" are) raises ValueError."""
    m = _BUCKET_KEY.fullmatch(key) if isinstance(key, str) and key.isascii() else None
    if m is None:
        raise ValueError(f"{key!r} is not a batch-size bucket")
    return int(m[1]), int(m[2]) if m[2] is not None else -1


def bucket_bs(key: str) -> int:
    """A bucket's smallest batch size ("5-8@2" -> 5)."""
    return bucket_order(key)[0]


def bucket_steps(key: str) -> int | None:
    """The step count a bucket's cycles ran at, when its name says ("5-8@2" -> 2): under
    --speculative-adaptive a bucket is a batch-size bucket at one step count."""
    steps = bucket_order(key)[1]
    return None if steps < 0 else steps


def with_steps(key: str, summary: dict) -> dict:
    """A bucket's summary, with the step count its name says (an adaptive profile's) as `steps`."""
    steps = bucket_steps(key)
    if steps is not None:
        summary["steps"] = steps
    return summary


def bucket_key(bs: int, steps: int | None = None) -> str:
    """The bucket of a batch size ("5-8"), at a step count when there is one ("5-8@2")."""
    key = bucket_of(bs)
    return key if steps is None else f"{key}@{steps}"


def bucket_of(bs: int) -> str:
    """1, 2, 3-4, 5-8, 9-16, ...: powers of two, so a bucket's cycles cost about the same."""
    if bs <= 2:
        return str(max(bs, 0))
    hi = 1 << (bs - 1).bit_length()
    lo = hi // 2 + 1
    return f"{lo}-{hi}"


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Series:
    """Count, sum and a bounded reservoir of samples for percentiles."""

    __slots__ = ("n", "total", "max", "samples", "_rng", "_seed")

    def __init__(self, seed: int = 0):
        self.n = 0
        self.total = 0.0
        self.max = float("nan")
        self.samples: list[float] = []
        # made when the reservoir first fills (a window of the default 100 cycles never does):
        # a Random costs 4 us to make, and each window's buckets make dozens of series, on the
        # scheduler's thread as its cycles are folded
        self._rng = None
        self._seed = seed

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        if not x <= self.max:
            self.max = x
        if self.n <= SAMPLES_PER_SERIES:
            self.samples.append(x)
        else:
            rng = self._rng
            if rng is None:
                rng = self._rng = random.Random(self._seed)
            j = rng.randrange(self.n)
            if j < SAMPLES_PER_SERIES:
                self.samples[j] = x

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")

    def remove(self, x: float) -> None:
        """Take one value back out (a stalled cycle's, at the window's close)."""
        self.n -= 1
        self.total -= x
        try:
            self.samples.remove(x)
        except ValueError:
            pass
        self.max = max(self.samples) if self.samples else float("nan")

    def stats(self) -> dict:
        s = sorted(self.samples)
        return {"mean": _r(self.mean), "p50": _r(percentile(s, 0.5)), "p90": _r(percentile(s, 0.9)),
                "p99": _r(percentile(s, 0.99)), "max": _r(self.max), "n": self.n}


def rounded(x: float | None) -> float | None:
    """4 decimals; None for None and NaN (an empty series): what every summary writes."""
    return None if x is None or x != x else round(x, 4)


_r = rounded


def per_position(hist: list[int], positions: int) -> list[float | None]:
    """a_p = P(draft p correct | drafts 1..p-1 correct), p = 1..positions, from the histogram
    of accept lengths: reached(p), the requests whose first p drafts were all correct, is the
    count of accept lengths >= p + 1."""
    reached = [sum(hist[p + 1:]) for p in range(positions + 1)]
    return [_r(reached[p] / reached[p - 1]) if reached[p - 1] else None for p in range(1, positions + 1)]


class Bucket:
    def __init__(self):
        self.cycles = 0
        self.prefill_cycles = 0
        self.order: list[str] = []
        self.gpu: dict[str, Series] = {}
        self.host: dict[str, Series] = {}
        self.steps: list[Series] = []
        self.gap = Series()
        self.cycle_gpu = Series()
        self.phase_cycle_gpu = Series()  # the cycles timed phase by phase (all, or one in --speculative-profile-phases-every)
        self.context = Series()
        self.kv_used = Series()  # the KV pool's share in use at the cycles' start
        self.waiting = Series()  # the requests waiting for a running slot at the cycles' start
        self.period = Series()
        self.period_gpu = Series()
        self.decode_ms = 0.0  # GPU time of decode: the cycles' spans and the gaps between consecutive ones
        self.drain_cycles = 0  # cycles run after all their requests had finished: not decode time
        self.pauses = Series()  # cycles the garbage collector paused, and for how long
        self.candidates: list[tuple[float, list]] = []  # (longest host-bound phase, phases) of possible stalls
        self.graph_replays = dict.fromkeys(GRAPH_KINDS, 0)
        self.padding = Series()
        self.prefill_gpu: dict[str, Series] = {}
        self.beside_prefill = Series()  # GPU time around the prefills before one of this bucket's cycles
        # acceptance
        self.verified_reqs = 0
        self.skipped_reqs = 0  # in the batch but finished or retracted: took none of the cycle's tokens
        self.accept_hist: list[int] = []  # tokens each request took (index = accept length), cut at stops
        self.drafts_hist: list[int] = []  # correct drafts each request's verify found (index = count), uncut
        self.committed = 0
        self.cut_reqs = 0
        self.cut_tokens = 0
        self.accept_cycles = 0

    def add_cycle(self, c: Cycle) -> None:
        if c.kind == "prefill":
            self.prefill_cycles += 1
            for name, g, _ in c.phases:
                sp = self.prefill_gpu.get(name)
                if sp is None:
                    sp = self.prefill_gpu[name] = Series()
                sp.add(g)
            return
        self.cycles += 1
        total = 0.0
        if c.whole is not None:  # its start and end only: the cycle's time, no phases
            total, host_ms = c.whole
            rows = [(WHOLE, total, host_ms)]
        else:
            gpu, host = self.gpu, self.host
            for name, g, h in c.phases:
                sg = gpu.get(name)
                if sg is None:
                    self.order.append(name)
                    sg = gpu[name] = Series()
                    host[name] = Series()
                sg.add(g)
                host[name].add(h)
                total += g
            self.phase_cycle_gpu.add(total)
            rows = c.phases
        self.cycle_gpu.add(total)
        if c.drained:
            self.drain_cycles += 1
        else:
            self.decode_ms += total + (c.gap_gpu_ms or 0.0)
        worst = 0.0  # a loop, not max() over a generator: this runs for every cycle, on the scheduler's thread
        for _, g, h in rows:
            if g > STALL_MIN_MS and h >= STALL_HOST_SHARE * g and g > worst:
                worst = g
        if worst:
            cand = self.candidates
            if len(cand) < STALL_CANDIDATES:
                cand.append((worst, rows))
            else:
                i = min(range(len(cand)), key=lambda j: cand[j][0])
                if worst > cand[i][0]:
                    cand[i] = (worst, rows)
        if c.host_pause_ms:
            self.pauses.add(c.host_pause_ms)
        if c.beside_prefill_ms is not None:
            self.beside_prefill.add(c.beside_prefill_ms)
        if c.context_tokens is not None:
            self.context.add(c.context_tokens)
        if c.kv_used is not None:
            self.kv_used.add(c.kv_used)
        if c.waiting is not None:
            self.waiting.add(c.waiting)
        for i, s in enumerate(c.steps_gpu_ms):
            while len(self.steps) <= i:
                self.steps.append(Series())
            self.steps[i].add(s)
        if c.gap_gpu_ms is not None and c.period_host_ms is not None:
            self.gap.add(c.gap_gpu_ms)
            self.period.add(c.period_host_ms)
            if c.period_gpu_ms is not None:
                self.period_gpu.add(c.period_gpu_ms)
        if c.graph:
            for k in self.graph_replays:
                if c.graph.get(k):
                    self.graph_replays[k] += 1
            if c.graph.get("padded_bs"):
                self.padding.add(c.graph["padded_bs"] - c.bs)

    def add_accept(self, correct_per_req: list[int], committed: list[int] | None = None, skipped: int = 0) -> None:
        """`correct_per_req`: correct drafts of each request that took the cycle's tokens;
        `committed`: the tokens each took (correct + 1, less where a stop cut the run)."""
        self.accept_cycles += 1
        self.skipped_reqs += skipped
        hist, dh = self.accept_hist, self.drafts_hist
        for i, c in enumerate(correct_per_req):
            c = int(c) if c > 0 else 0
            if len(dh) <= c:
                dh.extend([0] * (c + 1 - len(dh)))
            dh[c] += 1
            n = c + 1 if committed is None else int(committed[i])  # the bonus token and the correct drafts
            if n < c + 1:
                self.cut_reqs += 1
                self.cut_tokens += c + 1 - n
            if len(hist) <= n:
                hist.extend([0] * (n + 1 - len(hist)))
            hist[n] += 1
            self.committed += n
        self.verified_reqs += len(correct_per_req)

    def _take_out_stalls(self) -> dict:
        """Judge the candidate cycles against each phase's p50; take the stalled ones out of
        the phase and cycle statistics. Returns what they held."""
        p50 = {}
        out = {"cycles": 0, "gpu_ms": 0.0, "phases": {}}
        for _, phases in self.candidates:
            waited = []
            for name, g, h in phases:
                if name not in p50:  # a cycle timed whole is judged against the cycles' p50
                    series = self.cycle_gpu if name == WHOLE else self.gpu[name]
                    p50[name] = percentile(sorted(series.samples), 0.5)
                if g > STALL_MIN_MS and h >= STALL_HOST_SHARE * g and g > STALL_TIMES_P50 * p50[name] + 0.5:
                    waited.append((name, g, h))
            if not waited or self.cycle_gpu.n <= 1:
                continue
            total = 0.0
            for name, g, h in phases:
                if name != WHOLE:
                    self.gpu[name].remove(g)
                    self.host[name].remove(h)
                total += g
            if phases[0][0] != WHOLE:
                self.phase_cycle_gpu.remove(total)
            self.cycle_gpu.remove(total)
            out["cycles"] += 1
            out["gpu_ms"] += total
            for name, g, h in waited:
                e = out["phases"].setdefault(name, {"n": 0, "gpu_ms": 0.0, "host_ms": 0.0})
                e["n"] += 1
                e["gpu_ms"] += g
                e["host_ms"] += h
        out["gpu_ms"] = _r(out["gpu_ms"])
        for e in out["phases"].values():
            e["gpu_ms"], e["host_ms"] = _r(e["gpu_ms"]), _r(e["host_ms"])
        self.candidates = []
        return out

    def summary(self, num_steps: int | None) -> dict:
        phases = {}
        stalled = self._take_out_stalls()
        mean_cycle = self.phase_cycle_gpu.mean  # shares: of the cycles the phases were timed in
        for name in self.order:
            g = self.gpu[name]
            phases[name] = {"gpu_ms": g.stats(), "host_ms": self.host[name].stats(),
                            "share": _r(g.mean / mean_cycle) if mean_cycle == mean_cycle and mean_cycle > 0 else None}
        positions = max(len(self.drafts_hist) - 1, num_steps or 0)
        n = self.verified_reqs
        mean_len = self.committed / n if n else float("nan")
        gpu_period = self.period_gpu.mean
        return {
            "cycles": self.cycles,
            "prefill_cycles": self.prefill_cycles,
            "phases": phases,
            "draft_steps_gpu_ms": [s.stats() for s in self.steps],
            "cycle_gpu_ms": self.cycle_gpu.stats(),
            "phase_cycle_gpu_ms": self.phase_cycle_gpu.stats(),
            "context_tokens": self.context.stats(),
            "kv_used_share": self.kv_used.stats(),
            "waiting_requests": self.waiting.stats(),
            "between_cycles_gpu_ms": self.gap.stats(),
            "cycle_period_gpu_ms": self.period_gpu.stats(),
            "cycle_wall_ms": self.period.stats(),
            "host_pause_ms": self.pauses.stats(),
            "stalled": stalled,
            "between_cycles_share": _r(self.gap.mean / gpu_period) if self.period_gpu.n and gpu_period > 0 else None,
            "prefill_phases_gpu_ms": {k: v.stats() for k, v in self.prefill_gpu.items()},
            "beside_prefill_gpu_ms": self.beside_prefill.stats(),
            "graph": {"replays": dict(self.graph_replays), "eager": {k: self.cycles - v for k, v in self.graph_replays.items()},
                      "padding_mean": _r(self.padding.mean)},
            "accept": {
                "verified_requests": n,
                "skipped_requests": self.skipped_reqs,
                "mean_length": _r(mean_len),
                "histogram": list(self.accept_hist),
                "drafts_histogram": list(self.drafts_hist),
                "per_position": per_position([0] + self.drafts_hist, positions),
                "committed_tokens": self.committed,
                "cut_requests": self.cut_reqs,
                "cut_tokens": self.cut_tokens,
                "tokens_per_cycle": _r(self.committed / self.accept_cycles) if self.accept_cycles else None,
            },
            "decode_gpu_ms": _r(self.decode_ms),
            "drain_cycles": self.drain_cycles,
            "tokens_per_s": _r(self.tokens_per_s()),
        }

    def busy_seconds(self) -> float:
        """GPU seconds of this bucket's decode cycles: their phases and the time between one
        decode cycle and the next; prefills and idle time excluded."""
        return self.decode_ms / 1000.0 if self.accept_cycles else 0.0

    def tokens_per_s(self) -> float:
        busy = self.busy_seconds()
        return self.committed / busy if busy > 0 else float("nan")


class Switches:
    """The first decode cycle at a step count after each change (--speculative-adaptive): its
    GPU time (its span and the GPU time before it, where the host swapped the worker's graphs)
    and tokens, kept out of the buckets and shown as what the switches cost."""

    def __init__(self):
        self.cycles = 0
        self.gpu_ms = 0.0
        self.gap_ms = 0.0
        self.committed = 0
        self.drain_cycles = 0

    def add_cycle(self, c: Cycle) -> None:
        self.cycles += 1
        if c.drained:
            self.drain_cycles += 1
            return
        whole = c.whole[0] if c.whole is not None else sum(g for _, g, _ in c.phases)
        self.gpu_ms += whole + (c.gap_gpu_ms or 0.0)
        self.gap_ms += c.gap_gpu_ms or 0.0

    def add_accept(self, correct_per_req: list[int], committed: list[int] | None = None, skipped: int = 0) -> None:
        self.committed += sum(int(c) + 1 for c in correct_per_req) if committed is None else sum(map(int, committed))

    def uncharge(self, ms: float) -> None:
        self.gpu_ms -= ms
        self.drain_cycles += 1

    def summary(self) -> dict:
        n = self.cycles - self.drain_cycles
        return {"cycles": self.cycles, "gpu_ms": _r(self.gpu_ms), "gap_gpu_ms": _r(self.gap_ms),
                "mean_gpu_ms": _r(self.gpu_ms / n) if n > 0 else None, "committed_tokens": self.committed}


class Window:
    """One summary window: cycles and acceptance per batch-size bucket."""

    def __init__(self, index: int = 0):
        self.index = index
        self.buckets: dict[str, Bucket] = {}
        self.decode_cycles = 0
        self.first_host_s: float | None = None
        self.last_host_s: float | None = None
        self.samples: deque = deque(maxlen=CYCLE_SAMPLES)
        self.slowest: Cycle | None = None  # the decode cycle with the longest phases, kept whole
        self._slowest_ms = -1.0
        self._by: dict = {}  # (bs, steps) -> its bucket: each cycle and list looks its bucket up once
        self.switches = Switches()

    def bucket(self, bs: int, steps: int | None = None) -> Bucket:
        b = self._by.get((bs, steps))
        if b is None:
            key = bucket_key(bs, steps)
            b = self.buckets.get(key)
            if b is None:
                b = self.buckets[key] = Bucket()
            self._by[(bs, steps)] = b
        return b

    def add_cycle(self, c: Cycle, end_host_s: float | None = None) -> None:
        if c.switched and c.kind == "decode":
            self.switches.add_cycle(c)
        else:
            self.bucket(c.bs, c.steps).add_cycle(c)
        if c.kind == "decode":
            self.decode_cycles += 1
            if not c.switched and c.whole is None and c.host_start_s is not None and len(c.host_offsets_ms) == len(c.phases):
                self.samples.append(c)
                total = sum(g for _, g, _ in c.phases)
                if total > self._slowest_ms:
                    self._slowest_ms, self.slowest = total, c
        if c.host_start_s is not None and self.first_host_s is None:
            self.first_host_s = c.host_start_s
        if end_host_s is not None:
            self.last_host_s = end_host_s

    def uncharge(self, bs: int, ms: float, steps: int | None = None, switched: bool = False) -> None:
        """A cycle read before it was found drained: its time is not decode time."""
        if switched:
            self.switches.uncharge(ms)
            return
        b = self.bucket(bs, steps)
        b.decode_ms -= ms
        b.drain_cycles += 1

    def add_accept(self, correct_per_req: list[int], committed: list[int] | None = None, skipped: int = 0,
                   steps: int | None = None, switched: bool = False) -> None:
        """One cycle's acceptance, in the bucket of its batch size (the requests that took its
        tokens and the `skipped` ones that were in the batch but took none) and step count; a
        switch's first cycle in `switches`."""
        bs = len(correct_per_req) + skipped
        if switched:
            self.switches.add_accept(correct_per_req, committed, skipped)
        elif bs:
            self.bucket(bs, steps).add_accept(correct_per_req, committed, skipped)

    @property
    def host_seconds(self) -> float:
        if self.first_host_s is None or self.last_host_s is None:
            return 0.0
        return max(0.0, self.last_host_s - self.first_host_s)

    def summary(self, num_steps: int | None = None, pause=None) -> dict:
        """Tokens/s: committed tokens over the time the decode cycles took (idle time excluded).
        `pause`: called between buckets (the folder's thread gives the GIL back there)."""
        buckets = {}
        for key in sorted(self.buckets, key=bucket_order):
            steps = bucket_steps(key)
            buckets[key] = with_steps(key, self.buckets[key].summary(num_steps if steps is None else steps))
            if pause is not None:
                pause()
        bs = self.buckets.values()
        committed = sum(b.committed for b in bs if b.busy_seconds() > 0)
        busy = sum(b.busy_seconds() for b in bs)
        prefill = sum(x.total for b in bs for x in b.prefill_gpu.values()) / 1000.0
        beside = sum(b.beside_prefill.total for b in bs) / 1000.0
        return {"window": self.index, "decode_cycles": self.decode_cycles, "seconds": _r(busy),
                "prefill_seconds": _r(prefill), "beside_prefill_seconds": _r(beside),
                "admissions": sum(b.beside_prefill.n for b in bs),
                "wall_seconds": _r(self.host_seconds),
                "host_start_s": None if self.first_host_s is None else round(self.first_host_s, 6),
                "tokens_per_s": _r(committed / busy) if busy > 0 else None, "buckets": buckets,
                "samples": [self._sample(c) for c in self.samples],
                "slowest": None if self.slowest is None or self.first_host_s is None else self._sample(self.slowest),
                **({"switch_cycles": self.switches.summary()} if self.switches.cycles else {})}

    def _sample(self, c: Cycle) -> dict:
        """One whole cycle: each phase's GPU start and time (from the cycle's first event) and
        host start and time (from its first mark); `t_ms` places the cycle in the window."""
        rows, gpu_at = [], 0.0
        for (name, g, h), host_at in zip(c.phases, c.host_offsets_ms):
            rows.append([name, _r(gpu_at), _r(g), _r(host_at), _r(h)])
            gpu_at += g
        t = (c.host_start_s - self.first_host_s) * 1000.0 if self.first_host_s is not None else 0.0
        return {"t_ms": _r(t), "bs": c.bs, "phases": rows, "steps_gpu_ms": [_r(x) for x in c.steps_gpu_ms],
                "gap_ms": None if c.gap_gpu_ms is None else _r(c.gap_gpu_ms), "host_pause_ms": _r(c.host_pause_ms)}
