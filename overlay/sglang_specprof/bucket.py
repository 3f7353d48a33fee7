"""One batch-size bucket of a summary window: its cycles' phases and acceptance folded into
bounded series (`series.py`), and its summary. Plain Python; runs on the scheduler's thread.
"""

from __future__ import annotations

from operator import sub

from .series import Series, per_position, percentile, rounded as _r


# A phase whose host time is near its GPU time held the device waiting on the host; when it
# also took far longer than the phase usually does (a kernel compiled for a new shape, a
# pause), its cycle is a stall: left out of the phase figures, reported apart.
STALL_HOST_SHARE = 0.8  # host time at least this share of the span
STALL_MIN_MS = 1.0
STALL_TIMES_P50 = 4.0  # and longer than 4 x the phase's p50 + 0.5 ms
STALL_CANDIDATES = 16  # cycles kept per bucket and window to judge at its close
WHOLE = "(cycle)"  # a stall candidate timed without its phases: the whole cycle in one row

GRAPH_KINDS = ("draft", "verify", "draft_extend")  # the forwards that replay a CUDA graph or run eager


def keep_candidate(cand: list, worst: float, rows) -> None:
    """A possible stall (its longest host-bound phase, its rows): kept among the
    STALL_CANDIDATES longest of its bucket and window, judged at the close."""
    if len(cand) < STALL_CANDIDATES:
        cand.append((worst, rows))
    else:
        i = min(range(len(cand)), key=lambda j: cand[j][0])
        if worst > cand[i][0]:
            cand[i] = (worst, rows)


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

    def settle(self) -> None:
        """Every series brought up to date (Series.settle): the values appended since go into
        its count, sum and reservoir."""
        for v in vars(self).values():
            for x in v.values() if isinstance(v, dict) else v if isinstance(v, list) else (v,):
                if isinstance(x, Series):
                    x.settle()

    def add_cycle(self, c) -> None:
        """`c`: a `window.Cycle`."""
        if c.kind == "prefill":
            self.prefill_cycles += 1
            for name, g, _ in c.phases:
                sp = self.prefill_gpu.get(name)
                if sp is None:
                    sp = self.prefill_gpu[name] = Series()
                sp.add(g)
            return
        if c.whole is not None:  # its start and end only: the cycle's time, no phases
            total, host_ms = c.whole
        else:  # its stalls are judged phase by phase, here (host 0.0: not as a whole)
            total, host_ms, worst = 0.0, 0.0, 0.0
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
                if g > STALL_MIN_MS and h >= STALL_HOST_SHARE * g and g > worst:
                    worst = g
            self.phase_cycle_gpu.add(total)
            if worst:
                keep_candidate(self.candidates, worst, c.phases)
        self.add_whole(total, host_ms, c.gap_gpu_ms, c.period_host_ms, c.period_gpu_ms, c.graph, c.bs,
                       c.host_pause_ms, c.drained)
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

    def add_whole(self, total, host_ms, gap, period, period_gpu, graph, bs, pause_ms=0.0, drained=False) -> None:
        """A decode cycle's GPU time `total` and host time `host_ms` (timed whole: a stall
        candidate as a whole), then the time around it as in `Cycle`. The reader calls it
        directly for most cycles timed whole (no `Cycle` made: Reader.read_whole)."""
        self.cycles += 1
        self.cycle_gpu.add(total)
        if drained:
            self.drain_cycles += 1
        else:
            self.decode_ms += total + (gap or 0.0)
        if total > STALL_MIN_MS and host_ms >= STALL_HOST_SHARE * total:
            keep_candidate(self.candidates, total, [(WHOLE, total, host_ms)])
        if pause_ms:
            self.pauses.add(pause_ms)
        if gap is not None and period is not None:
            self.gap.add(gap)
            self.period.add(period)
            if period_gpu is not None:
                self.period_gpu.add(period_gpu)
        if graph:
            for k in self.graph_replays:
                if graph.get(k):
                    self.graph_replays[k] += 1
            if graph.get("padded_bs"):
                self.padding.add(graph["padded_bs"] - bs)

    def add_accept(self, correct_per_req: list[int], committed: list[int] | None = None, skipped: int = 0) -> None:
        """`correct_per_req`: correct drafts of each request that took the cycle's tokens;
        `committed`: the tokens each took (correct + 1, less where a stop cut the run)."""
        self.accept_cycles += 1
        self.skipped_reqs += skipped
        hist, dh = self.accept_hist, self.drafts_hist
        n_req = len(correct_per_req)
        # Most cycles: no request cut, each took its drafts and the same number beside them (1; UNO
        # 2): counted by value, not by request. This runs for every cycle at the hand-overs, on
        # the scheduler's thread: at 48 requests 5.3 us instead of 10.8 (the 2-core CPU), at 8 the same
        beside = {1} if committed is None else set(map(sub, committed, correct_per_req))
        if n_req and len(beside) == 1 and min(correct_per_req) >= 0:
            d = beside.pop()
            if d >= 1:
                top = int(max(correct_per_req))
                if len(dh) <= top:
                    dh.extend([0] * (top + 1 - len(dh)))
                if len(hist) <= top + d:
                    hist.extend([0] * (top + d + 1 - len(hist)))
                count = correct_per_req.count  # one pass in C for each value, not a Python step for each request
                for c in range(top + 1):
                    k = count(c)
                    if k:
                        dh[c] += k
                        hist[c + d] += k
                self.committed += int(sum(correct_per_req)) + d * n_req
                self.verified_reqs += n_req
                return
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
