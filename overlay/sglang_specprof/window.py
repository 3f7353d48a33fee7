"""Summary windows: per batch-size bucket statistics of timed cycles. Plain Python.

A cycle arrives as a `Cycle` (phase names, GPU and host milliseconds, draft-step GPU
milliseconds, the gap before it on the GPU, its host period); acceptance arrives as the
number of correct drafts per request. `Window` folds them into bounded per-bucket
accumulators (`bucket.Bucket`, of `series.Series`) and `summary()` turns them into one
JSON-ready dict (the schema in `schema.py`).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from .bucket import GRAPH_KINDS, Bucket  # noqa: F401  (GRAPH_KINDS: part of window's interface)
from .series import SAMPLES_PER_SERIES, Series, per_position, percentile, rounded  # noqa: F401  (the same)

_r = rounded
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
        self._settle_in = SAMPLES_PER_SERIES  # cycles until the series are settled (Series.settle): bounded memory
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
        self._tick()
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

    def add_whole(self, bs, steps, total, host_ms, gap, period, period_gpu, graph, pause_ms, start_s, end_s) -> None:
        """A decode cycle timed whole, neither drained nor the first after a switch or after
        prefills, as `add_cycle` takes it (Bucket.add_whole), without a `Cycle` (Reader.read_whole)."""
        self.bucket(bs, steps).add_whole(total, host_ms, gap, period, period_gpu, graph, bs, pause_ms)
        self._tick()
        self.decode_cycles += 1
        if self.first_host_s is None:
            self.first_host_s = start_s
        self.last_host_s = end_s

    def _tick(self) -> None:
        """A series takes one value a cycle at most: settled every SAMPLES_PER_SERIES cycles,
        none outgrows twice its reservoir."""
        n = self._settle_in - 1
        if n:
            self._settle_in = n
        else:
            self._settle_in = SAMPLES_PER_SERIES
            for b in self.buckets.values():
                b.settle()

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
