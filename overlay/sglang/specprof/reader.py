"""Reading a cycle's events once they completed, on the folder's reader thread.

A cycle's slot holds its events and host times (`Slot`); the scheduler's thread fills it
(profiler.py) and hands it over, the reader turns it into a `Cycle` for the window, keeps
the totals since start and gives the slot back, reset, to the free pool. Cycles and
acceptance lists come in the same order, so the k-th list settles the k-th decode cycle.
"""

from __future__ import annotations

import threading
from collections import deque

from sglang_specprof.window import Cycle

from .whole import WholeReading

FIRST_MARKS = 16  # events made per slot up front; more are made the first time a cycle needs them


class Slot:
    __slots__ = ("events", "h", "host", "names", "n", "step_events", "ns", "kind", "bs", "ctx", "graph", "steps_key",
                 "steps_replay", "steps_ms", "replay_key", "seq", "gc_ms", "span", "detail", "eager_steps", "replaying",
                 "replayed", "steps", "switched", "kv", "waiting")

    def __init__(self, backend):
        self.events = [backend.new_event() for _ in range(FIRST_MARKS)]
        handle = getattr(backend, "handle", None)  # what the backend's `crec` records, per event
        self.h = [handle(e) for e in self.events] if handle is not None else list(self.events)
        self.host = [0.0] * FIRST_MARKS
        self.names: list = ["begin"] + [None] * (FIRST_MARKS - 1)  # the first mark is always the begin
        self.step_events: list = []
        self.reset()

    def reset(self):
        """Done when the slot goes back to the pool, so that taking it costs nothing."""
        self.n = 0
        self.ns = 0
        self.kind = "decode"
        self.bs = 0
        self.ctx = None
        self.graph = None
        self.steps_key = None  # the draft graph whose replay this cycle ran (graphs.py)
        self.steps_replay = -1
        self.steps_ms = None
        self.replay_key = None  # the draft graph whose replay it launched, until draft_replay_end
        self.eager_steps = False  # its draft steps were recorded eagerly, in step_events
        self.replaying = False  # between a draft graph replay's begin and end
        self.replayed = False  # a draft graph replay closed `draft`: what follows it is draft_outputs
        self.seq = -1
        self.gc_ms = 0.0
        self.span = 0.0
        self.detail = True  # every phase timed; False: the cycle's first and last event only
        self.steps = None  # the step count it ran at (--speculative-adaptive only)
        self.switched = False  # the first decode cycle after the step count changed
        self.kv = None  # the share of the KV pool in use at its start (cycles timed by phase, v2 from 0.5.13)
        self.waiting = None  # requests waiting for a running slot at its start (cycles timed by phase)


class Reader(WholeReading):
    """What the folder calls to read slots and settle acceptance; the totals since start."""

    def __init__(self, backend, free: deque, graphs, behind, pool: int = 64):
        self.backend = backend
        # the reads keep the GIL where the backend can (cuda_backend.DriverEvents._hold_gil)
        self.query_held = getattr(backend, "query_held", None)
        self.elapsed_held = getattr(backend, "elapsed_held", None)
        # a cycle's readiness as its first-to-last elapsed time (None: not complete), where the backend has it
        self.span_held = getattr(backend, "span_held", None)
        self.handle = getattr(backend, "handle", None) or (lambda ev: ev)  # an event as the reads take it
        self.free = free  # the profiler's pool: read slots go back there
        self.graphs = graphs
        self.behind = behind  # () -> True when few free slots are left
        self.kernels = None  # the kernel sampler, where there is one (set by the profiler)
        self.kernel_pending: deque = deque()  # kernel samples read, waiting for a window to carry them
        self.lock = threading.Lock()  # the totals: read by /server_info on the scheduler's thread
        self.timing = {"decode_cycles": 0, "prefill_cycles": 0, "phase_gpu_ms": {}, "decode_gpu_ms": 0.0,
                       "drain_cycles": 0, "phase_cycles": 0,  # phase_gpu_ms: the sums over phase_cycles
                       "prefill_gpu_ms": 0.0, "beside_prefill_gpu_ms": 0.0, "admissions": 0, "drain_gpu_ms": 0.0}
        # the GPU time next to the prefills since the last decode cycle, (ms, after a decode
        # cycle), and the prefills' requests; the decode cycle after them says whether the
        # first gap was the server at work (its batch went on) or idle (only new requests)
        self.prefill_chain: list = []
        self.prefill_chain_bs = 0
        self.prev_done: Slot | None = None  # kept until the next cycle is read, for the gap
        self.dropped = 0  # cycles whose events never completed, dropped
        self.decode_read = 0
        self.decode_settled = 0
        self.drain_pending: set = set()  # cycles found drained before they were read
        self.charged: deque = deque(maxlen=2 * pool)  # (cycle index, window, bs, ms, steps) of recent reads
        # (cycle index, step count, first after a switch) of the decode cycles read and not yet settled, under
        # --speculative-adaptive: the k-th list takes the k-th cycle's step count
        self.unsettled_steps: deque = deque(maxlen=4 * pool)

    def attach(self):
        """The reader thread starts: the device's context there (the GPU backend)."""
        attach = getattr(self.backend, "attach", None)
        if attach is not None:
            attach()

    def recycle(self, s):
        with self.graphs.lock:  # a replay may be reading the step times into it
            self.graphs.forget(s)
            s.reset()
        self.free.append(s)

    def slot_ready(self, s) -> bool:
        """Whether the cycle's last event completed. Where the backend has `span_held`, asked as
        the elapsed time from its first event to its last, kept in `s.span`: for a cycle timed
        whole that is its span, so one driver call reads what a query and an elapsed time did
        (1-4 us a call on an H100 machine, bench/hand_overs.py)."""
        n = s.n
        sp = self.span_held
        if sp is not None and n > 1:
            h = s.h
            ms = sp(h[0], h[n - 1])
            if ms is None:
                return False
            s.span = ms
            return True
        q = self.query_held
        ev = s.h[n - 1]
        return q(ev) if q is not None else self.backend.query(ev)

    def slot_stuck(self) -> bool:
        """No free slot and the oldest cycle still incomplete: its events will not complete
        (a GPU error, a lost event); dropping it lets the others be timed."""
        return not self.free

    def slot_drop(self, s):
        self.dropped += 1
        self.lost(s.kind, s.steps)
        self.recycle(s)

    def lost(self, kind, steps=None):
        """A cycle that was not timed: it still takes its place in the order of settling."""
        if kind == "decode":
            if steps is not None:
                self.unsettled_steps.append((self.decode_read, steps, False))
            self.decode_read += 1

    def resync(self):
        """After a pause: cycles read before it may have lost their acceptance lists; the next
        list settles the next cycle read."""
        self.decode_settled = self.decode_read
        self.unsettled_steps.clear()
        self.drain_pending.clear()
        self.prefill_chain = []
        self.prefill_chain_bs = 0

    def settle(self, correct, skipped, window):
        """The k-th acceptance list settles the k-th decode cycle: one whose requests had all
        finished is a drain cycle. Returns ((bs, ms, steps, switched) to take out of the open
        window, or None; the step count the k-th cycle ran at, or None; whether a switch came
        before it)."""
        k = self.decode_settled
        self.decode_settled = k + 1
        steps = None
        switched = False
        us = self.unsettled_steps
        while us and us[0][0] <= k:
            idx, st, sw = us.popleft()
            if idx == k:
                steps, switched = st, sw
        if not (skipped and not correct):
            return None, steps, switched
        with self.lock:
            t = self.timing
            t["drain_cycles"] += 1
            for i, (idx, win, bs, ms, st) in enumerate(self.charged):
                if idx == k:
                    t["decode_gpu_ms"] -= ms
                    t["drain_gpu_ms"] += ms
                    del self.charged[i]
                    return ((bs, ms, st, switched) if win == window else None), steps, switched
        if k >= self.decode_read:
            self.drain_pending.add(k)
        return None, steps, switched

    def slot_read(self, s, window):
        """A completed cycle's events: (Cycle, host time of its last mark) for the window."""
        el = self.elapsed_held or self.backend.elapsed
        ev = s.h  # the handles the reads take (cuda_backend: `handle`)
        phases = []
        offsets = []  # host start of each phase, from the cycle's first mark
        names, host = s.names, s.host
        h0 = host[0]
        span = 0.0
        whole = None
        if not s.detail:  # two events: the cycle's start and end (read by slot_ready with span_held)
            span = s.span if self.span_held is not None else el(ev[0], ev[1]) if s.n > 1 else 0.0
            whole = (span, (host[s.n - 1] - h0) * 1000.0)
        else:
            for i in range(1, s.n):
                hb = host[i - 1]
                g = el(ev[i - 1], ev[i])
                span += g
                phases.append((names[i], g, (host[i] - hb) * 1000.0))
                offsets.append((hb - h0) * 1000.0)
        s.span = span  # first mark to last, as the sum of the phases
        if s.eager_steps:
            se = s.step_events  # events, not handles (rare: a draft run without its graph)
            h = self.handle
            steps = [el(h(se[i - 1]), h(se[i])) for i in range(1, s.ns)]
        elif s.steps_key is not None:
            steps = self.graphs.read(s)
        else:
            steps = []
        gap = period = gpu_period = None
        p = self.prev_done
        # The period of a decode cycle runs from the start of the decode cycle just before it;
        # after a prefill, or after the server sat idle, there is none to measure. On the GPU
        # it is the previous cycle's work and the GPU time between the two; on the host it
        # also holds whatever the scheduler waited for meanwhile (a prefill's results).
        # GPU time from the cycle just before (read once; None when that one was not timed)
        since = el(p.h[p.n - 1], ev[0]) if p is not None and p.seq == s.seq - 1 else None
        beside = None
        if since is not None and p.kind == "decode" and s.kind == "decode":
            gap = since
            gpu_period = p.span + gap
            period = (h0 - p.host[0]) * 1000.0
        elif s.kind == "prefill":
            if since is not None:
                self.prefill_chain.append((since, p.kind == "decode"))
            self.prefill_chain_bs += s.bs
        elif self.prefill_chain_bs:  # the first decode cycle after prefills
            chain = self.prefill_chain
            if since is not None:
                chain.append((since, False))
            busy = s.bs > self.prefill_chain_bs  # requests from before the prefills still run
            beside = sum(g for g, after_decode in chain if busy or not after_decode)
            self.prefill_chain = []
            self.prefill_chain_bs = 0
        c = Cycle(kind=s.kind, bs=s.bs, context_tokens=s.ctx, phases=phases, steps_gpu_ms=steps, gap_gpu_ms=gap,
                  period_host_ms=period, graph=s.graph, host_start_s=h0, host_offsets_ms=offsets,
                  period_gpu_ms=gpu_period, host_pause_ms=s.gc_ms, whole=whole, beside_prefill_ms=beside,
                  steps=s.steps)  # 15 keywords: a 16th makes CPython build a dict for the call
        if s.switched:
            c.switched = True
        if s.kv is not None:
            c.kv_used = s.kv
        if s.waiting is not None:
            c.waiting = s.waiting
        with self.lock:
            t = self.timing
            t[s.kind + "_cycles"] = t.get(s.kind + "_cycles", 0) + 1
            if s.kind == "prefill":
                t["prefill_gpu_ms"] += span
            if beside is not None:
                t["beside_prefill_gpu_ms"] += beside
                t["admissions"] += 1
            if s.kind == "decode":
                if s.detail:
                    t["phase_cycles"] += 1
                    sums = t["phase_gpu_ms"]
                    for name, g, _ in phases:
                        sums[name] = sums.get(name, 0.0) + g
                # decode time: each cycle's own span, and the GPU time after a decode cycle
                # until this one (not after a prefill or an idle server)
                ms = span + (gap or 0.0)
                k = self.decode_read
                self.decode_read = k + 1
                if s.steps is not None:
                    self.unsettled_steps.append((k, s.steps, s.switched))
                if k in self.drain_pending:
                    self.drain_pending.discard(k)
                    c.drained = True
                    t["drain_gpu_ms"] += ms
                else:
                    t["decode_gpu_ms"] += ms
                    self.charged.append((k, window, s.bs, ms, s.steps))
        k = self.kernels
        if k is not None and s.seq in k.seqs:  # a kernel sample's cycle: its event times, to compare
            k.event_ms[s.seq] = [[name, g] for name, g, _ in phases]
        end = host[s.n - 1]
        if p is not None:
            self.recycle(p)
        self.prev_done = s
        return c, end

    def kernel_sample(self, smp):
        """A kernel sample stopped (its cycles are read before it): their event times join it,
        and the next window to close carries it."""
        k = self.kernels
        ev = k.event_ms if k is not None else {}
        smp["event_ms"] = {q: ev.pop(q) for q in smp.get("seqs", []) if q in ev}
        ev.clear()
        self.kernel_pending.append(smp)

    def close_fields(self, extra):
        """At a window's close: the fields counted here (the hot path's own came in `extra`)."""
        extra["dropped_cycles"] = extra.pop("dropped") + self.dropped
        extra["steps_lost"] = self.graphs.lost
        extra["totals"] = self.totals(extra.pop("tokens"))
        if self.kernels is not None:
            k = self.kernels
            extra["kernel_samples"] = {"taken": k.samples, "skipped": k.skipped, "max": k.max_samples}

    def totals(self, tokens) -> dict:
        with self.lock:
            t = self.timing
            out = {"decode_cycles": t["decode_cycles"], "prefill_cycles": t["prefill_cycles"]}
            out.update(tokens)
            out.update(decode_gpu_ms=round(t["decode_gpu_ms"], 4), drain_cycles=t["drain_cycles"],
                       drain_gpu_ms=round(t["drain_gpu_ms"], 4), prefill_gpu_ms=round(t["prefill_gpu_ms"], 4),
                       beside_prefill_gpu_ms=round(t["beside_prefill_gpu_ms"], 4), admissions=t["admissions"],
                       phase_cycles=t["phase_cycles"],
                       phase_gpu_ms={k: round(v, 4) for k, v in t["phase_gpu_ms"].items()})
        return out
