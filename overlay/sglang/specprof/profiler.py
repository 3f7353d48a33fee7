"""The runtime profiler: marks at phase boundaries, harvested without waiting.

A cycle is a sequence of marks. `begin(kind, bs)` records the first event, each
`mark(name)` records one more and closes the phase `name` (from the previous mark to
this one), `end()` queues the cycle. Events are read only once `query()` says the last
one completed: at `harvest()`, which the worker calls where the accepted lengths have
reached the CPU (the scheduler already waited there), so no synchronisation is added.

Draft steps inside a captured CUDA graph are timed by external events recorded during
capture (`draft_step(i)`): they become event nodes of the graph and are rewritten by
every replay, so a replay's step times are read before the next replay of that graph.

The clock and the events come from a backend (`cuda_backend.py` on the GPU, a fake in
the tests); this module imports neither torch nor SGLang.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque

from sglang_specprof.kernels import against_window
from sglang_specprof.schema import SCHEMA
from sglang_specprof.table import format_summary
from sglang_specprof.window import Cycle

from .folder import Folder

logger = logging.getLogger("sglang.specprof")

MAX_MARKS = 64  # phase marks a cycle may hold (a cycle records about 12); beyond, counted as lost
MAX_STEP_MARKS = 64  # eager draft-step marks a cycle may hold (steps + 1), apart from the phase marks
POOL = 64  # cycles in flight at most; beyond that the oldest is dropped and counted
FIRST_MARKS = 16  # events made per slot up front; more are made the first time a cycle needs them


def _context(ctx):
    """KV tokens of a cycle: a number, or the sum of a CPU tensor of sequence lengths (0.5.16
    on keeps only that one up to date). A device tensor is never read: that would wait."""
    if ctx is None or isinstance(ctx, (int, float)):
        return ctx
    if getattr(getattr(ctx, "device", None), "type", None) == "cpu":
        return int(ctx.sum())
    return None


class _Slot:
    __slots__ = ("events", "host", "names", "n", "step_events", "ns", "kind", "bs", "ctx", "graph", "steps_key",
                 "steps_replay", "steps_ms", "seq", "gc_ms", "span", "detail")

    def __init__(self, backend):
        self.events = [backend.new_event() for _ in range(FIRST_MARKS)]
        self.host = [0.0] * FIRST_MARKS
        self.names: list = [None] * FIRST_MARKS
        self.step_events: list = []
        self.reset()

    def reset(self):
        self.n = 0
        self.ns = 0
        self.kind = "decode"
        self.bs = 0
        self.ctx = None
        self.graph = None
        self.steps_key = None
        self.steps_replay = -1
        self.steps_ms = None
        self.seq = -1
        self.gc_ms = 0.0
        self.span = 0.0
        self.detail = True  # every phase timed; False: the cycle's first and last event only


class RankSpreadSink:
    """tp > 1: publish this rank's window; on rank 0, add the spread across ranks (`ranks`)."""

    def __init__(self, exchange, rank):
        self.exchange, self.rank = exchange, rank

    def __call__(self, summary):
        try:
            self.exchange.publish(summary)
            if self.rank == 0:
                summary["ranks"] = self.exchange.collect(summary)
        except OSError as e:
            raise OSError(f"the rank exchange in {self.exchange.folder} ({e.strerror}); no spread across "
                          f"ranks") from None


class LogTableSink:
    """The window's table in the server log (TP rank 0)."""

    def __init__(self, profiler):
        self.profiler = profiler

    def __call__(self, summary):
        logger.info("speculative profile\n%s", format_summary(summary, self.profiler.folder.pause))


class NullProfiler:
    """What the hooks call when --speculative-profile is off: each method does nothing."""

    enabled = False

    def begin(self, kind, bs, ctx=None):
        pass

    def mark(self, name):
        pass

    def end(self):
        pass

    def draft_step(self, i):
        pass

    def graph(self, which, used, runner=None):
        pass

    def graph_replay(self, key):
        pass

    def graph_replayed(self):
        pass

    def capture_begin(self, key):
        pass

    def capture_end(self):
        pass

    def harvest(self, correct_per_req=None):
        pass

    def commit_begin(self, reqs):
        pass

    def commit_end(self):
        pass

    def latest(self):
        return None

    def catch_up(self, timeout=0.05):
        pass

    def totals_now(self):
        return None


class Profiler(NullProfiler):
    enabled = True

    def __init__(self, backend, interval=100, sink=None, config=None, clock=time.perf_counter, rank=0,
                 log_table=True, exchange=None, threaded=False, on_error=None, phases_every=1):
        self.backend = backend
        self.interval = interval
        # Each batch size's cycles are timed phase by phase one in `phases_every` (in each
        # window the first, then every phases_every-th); the others record two events (their
        # start and end) and skip the marks: every cycle's GPU time, a sample of its phases, at
        # about half the host time. `detail_all`: every cycle in detail (prefills always; the
        # cycles of a kernel sample).
        self.phases_every = max(1, int(phases_every))
        self.detail_all = self.phases_every == 1
        self._detail_seen: dict = {}  # batch size -> decode cycles begun
        self.on_error = on_error
        self.broken = False
        # callables given each window's summary, in order: the rank spread (it adds `ranks`),
        # the log table, then the given ones (the JSONL writer, the Prometheus gauges)
        given = [] if sink is None else list(sink) if isinstance(sink, (list, tuple)) else [sink]
        self.sinks = ([RankSpreadSink(exchange, rank)] if exchange is not None else []) + (
            [LogTableSink(self)] if log_table else []) + given
        self.config = dict(config or {})
        self.clock = clock
        self.rank = rank
        self.free = deque(_Slot(backend) for _ in range(POOL))  # taken here, given back by the reader
        self.cur: _Slot | None = None
        self.seq = 0
        # Reading the events, folding and window closes run in `folder` (helper threads in the
        # server); this thread records the events and hands each cycle's slot over.
        self.folder = Folder(self, interval, self.config.get("num_steps"), on_close=self._publish,
                             on_error=self._fail, threaded=threaded)
        self.gate = self.folder.gate
        # where the worker goes to wait for the GPU (the gate opens) and where the wait ends
        # (it shuts): v2 waits after launching a cycle, for the one before; v1 inside verify
        self.open_at_end = self.config.get("worker") != "v1"
        self.gate_open_mark = None if self.open_at_end else "verify"
        self.gate_shut_mark = None if self.open_at_end else "accept"
        self.items: list = []
        self.window_index = 0  # windows handed to the folder to close
        self.window_decode = 0  # decode cycles settled into the open window
        self.dropped = 0  # cycles not timed: no free slot (events that do not complete)
        self.marks_lost = 0  # phase or step marks past a cycle's room (never expected; counted, shown)
        # v2: acceptance is settled against the requests where the scheduler commits it
        self.settle_on_commit = self.config.get("worker") == "v2"
        self.unsettled: deque = deque()  # correct-draft lists harvested, waiting for their commit
        self.open_commit = None  # (reqs, correct, visible before) between commit_begin and commit_end
        self.uncut_cycles = 0  # v2 cycles counted without their commit (a hook not reached): counted as verified
        # Draft steps inside CUDA graphs: their events belong to the graph, rewritten by each
        # replay, so the previous replay's are read before the next is launched (under
        # steps_lock: the reader may be reading the same slot).
        self.step_events: dict = {}  # graph key -> [external events recorded during capture]
        self.capturing_key = None
        self.replays: dict = {}  # graph key -> replay count
        self.last_replay: dict = {}  # graph key -> the slot of its last replay
        self.steps_lock = threading.Lock()
        self.steps_lost = 0
        self.eager = {"draft": 0, "verify": 0, "draft_extend": 0}
        self.capture_s: dict = {}
        self._latest = None
        self._gc_t0 = None
        self._gc_cb = None
        # Since start, so that any two reads of /server_info give the exact totals between
        # them: the tokens, counted on this thread where they are committed ...
        self.tokens = {"committed_tokens": 0, "verified_requests": 0, "skipped_requests": 0, "cut_tokens": 0}
        # ... and the cycles and their GPU time, counted by the reader (under timing_lock).
        # A cycle whose requests had all finished before it (the overlap scheduler runs one
        # more as a batch drains) gives clients nothing: its time is not decode time. Cycles
        # and acceptance lists come in the same order, so the k-th list settles the k-th cycle.
        self.timing_lock = threading.Lock()
        self.timing = {"decode_cycles": 0, "prefill_cycles": 0, "phase_gpu_ms": {}, "decode_gpu_ms": 0.0,
                       "drain_cycles": 0, "phase_cycles": 0,  # phase_gpu_ms: the sums over phase_cycles
                       "prefill_gpu_ms": 0.0, "beside_prefill_gpu_ms": 0.0, "admissions": 0, "drain_gpu_ms": 0.0}
        # reader: the GPU time next to the prefills since the last decode cycle, (ms, after a
        # decode cycle), and the prefills' requests; the decode cycle after them says whether
        # the first gap was the server at work (its batch went on) or idle (only new requests)
        self.prefill_chain: list = []
        self.prefill_chain_bs = 0
        self.prev_done: _Slot | None = None  # reader: kept until the next cycle is read, for the gap
        self.read_dropped = 0  # reader: cycles whose events never completed, dropped
        self.decode_read = 0
        self.decode_settled = 0
        self.drain_pending: set = set()  # cycles found drained before they were read
        self.charged: deque = deque(maxlen=2 * POOL)  # (cycle index, window, bs, ms) of recent reads
        # --speculative-profile-kernels: the sampler (kernel_sampler.KernelSampler), and the
        # samples read, waiting for a window to carry them (reader)
        self.kernels = None
        self.kernel_pending: deque = deque()
        self._recent: dict = {}  # outputs: the last windows' summaries, for a sample's comparison

    def follow_gc(self):
        """Time the garbage collector's pauses of the host inside each cycle (the server's
        profiler does; they are where the device can sit waiting on the host)."""
        if self._gc_cb is None:
            self._gc_cb = self._on_gc
            gc.callbacks.append(self._gc_cb)

    def _on_gc(self, phase, info):
        try:
            if phase == "start":
                self._gc_t0 = self.clock()
            elif self._gc_t0 is not None:
                s = self.cur
                if s is not None:
                    s.gc_ms += (self.clock() - self._gc_t0) * 1000.0
                self._gc_t0 = None
        except Exception:
            pass

    def resume(self):
        """After a pause (hooks.PAUSE_SIGNAL_ENV): what was open when it began is dropped, the
        cycle in flight and the acceptance waiting for its commit, so nothing is half counted."""
        if self.cur is not None:
            self._recycle(self.cur)
            self.cur = None
        self.unsettled.clear()
        self.open_commit = None
        self.items.append(("resync",))  # the reader lines cycles and acceptance up again

    def resync(self):
        """Reader: cycles read before a pause may have lost their acceptance lists; the next
        list settles the next cycle read."""
        self.decode_settled = self.decode_read
        self.drain_pending.clear()
        self.prefill_chain = []
        self.prefill_chain_bs = 0

    def close(self):
        """Stop following the garbage collector (the profiler is being replaced)."""
        if self._gc_cb is not None:
            try:
                gc.callbacks.remove(self._gc_cb)
            except ValueError:
                pass
            self._gc_cb = None

    # -- hot path -------------------------------------------------------------------
    def begin(self, kind, bs, ctx=None):
        """A cycle of `bs` requests starts; `ctx`: the sum of their sequence lengths (KV tokens)."""
        if self.broken:
            return
        try:
            self.gate.shut()
            if self.capturing_key is not None:
                self._capture_done()
            if self.cur is not None:  # a cycle that never ended (an exception upstream): discard it
                self._recycle(self.cur)
                self.cur = None
            if self.behind():  # the reader got no turn (or events do not complete)
                self._hand_over()
                if self.folder.threaded:
                    self.folder.help()
            if not self.free:  # every slot waits for its events: this cycle is not timed
                self.dropped += 1
                self.items.append(("lost", kind))
                return
            s = self.free.popleft()
            s.reset()
            s.kind = kind
            s.bs = bs
            s.seq = self.seq
            self.seq += 1
            if not self.detail_all and kind == "decode":
                seen = self._detail_seen
                k = seen.get(bs, 0)
                seen[bs] = k + 1
                s.detail = k % self.phases_every == 0
            if s.detail and ctx is not None:  # a tensor's sum costs microseconds: the cycles timed by phase only
                s.ctx = _context(ctx)
            self.cur = s
            self.backend.refresh()
            self._record(s, "begin")
        except Exception as e:  # never take the server down
            self._fail(e)

    def mark(self, name):
        s = self.cur
        if s is None or not s.detail:
            if name is self.gate_open_mark:
                self.gate.open()
            elif name is self.gate_shut_mark:
                self.gate.shut()
            return
        try:
            n = s.n
            if name == "draft" and s.names[n - 1] == "draft":
                name = "draft_outputs"  # the graph replay closed `draft`: what follows it until here
            if n == len(s.events):
                self._record(s, name)  # grows the slot, or counts the mark as lost
            else:
                self.backend.record(s.events[n])  # _record, inline: the hot path's most frequent call
                s.host[n] = self.clock()
                s.names[n] = name
                s.n = n + 1
            if name is self.gate_open_mark:
                self.gate.open()
            elif name is self.gate_shut_mark:
                self.gate.shut()
        except Exception as e:
            self._fail(e)

    def end(self):
        s = self.cur
        if s is None:
            return
        self.cur = None
        if not s.detail:  # the cycle's end: its last mark came just before
            try:
                self._record(s, "end")
            except Exception as e:
                self._fail(e)
                return
        self.items.append(("slot", s))
        if len(self.items) >= 8:
            self._hand_over()
        if self.open_at_end:
            self.gate.open()

    def _record(self, s, name):
        n = s.n
        if n == len(s.events):
            if n >= MAX_MARKS:
                self.marks_lost += 1
                return
            s.events.append(self.backend.new_event())
            s.host.append(0.0)
            s.names.append(None)
        self.backend.record(s.events[n])
        s.host[n] = self.clock()
        s.names[n] = name
        s.n = n + 1

    def _record_step(self, s):
        """An eager draft-step boundary: its own events, apart from the phase marks."""
        n = s.ns
        if n == len(s.step_events):
            if n >= MAX_STEP_MARKS:
                self.marks_lost += 1
                return
            s.step_events.append(self.backend.new_event())
        self.backend.record(s.step_events[n])
        s.ns = n + 1

    def draft_step(self, i):
        """Inside draft_forward: under capture, an external event node; eager, a plain event."""
        try:
            if self.backend.capturing():
                key = self.capturing_key
                if key is None:
                    return
                evs = self.step_events.setdefault(key, [])
                if i == 0:
                    evs.clear()
                ev = self.backend.new_event(external=True)
                self.backend.record_captured(ev)
                evs.append(ev)
            else:
                s = self.cur
                if s is None or not s.detail:
                    return
                if i == 0:
                    s.ns = 0  # a draft that ran again in the same cycle: its steps replace the first's
                s.steps_key = "eager"
                self._record_step(s)
        except Exception as e:
            self._fail(e)

    def capture_begin(self, key):
        """The draft graph runner starts capturing the graph `key` (its id and batch size)."""
        self._capture_done()
        self.capturing_key = key
        self._capture_t0 = self.clock()

    def capture_end(self):
        """The draft graph runner captured its last graph."""
        try:
            self._capture_done()
        except Exception as e:
            self._fail(e)

    def _capture_done(self):
        if self.capturing_key is not None:
            bs = self.capturing_key[1] if isinstance(self.capturing_key, tuple) else self.capturing_key
            self.capture_time("draft", bs, self.clock() - self._capture_t0)
            self.capturing_key = None

    def graph(self, which, used, runner=None):
        """After a forward: did `which` replay a CUDA graph, and at what padded batch size."""
        s = self.cur
        if s is None:
            return
        try:
            if used:
                g = s.graph if s.graph is not None else {}
                g[which] = True
                padded = getattr(runner, "bs", 0) or 0
                g["padded_bs"] = max(g.get("padded_bs", 0), padded)
                s.graph = g
            else:
                self.eager[which] = self.eager.get(which, 0) + 1
        except Exception as e:
            self._fail(e)

    def graph_replay(self, key):
        """Just before a draft graph replay, its inputs copied and its attention metadata set.

        Closes the phase `draft_inputs` (that preparation), so that `draft` holds the
        replay alone, and reads the step times of this graph's previous replay.
        """
        try:
            s = self.cur
            if s is not None:
                if not s.detail:  # its steps are not read: the replay is counted, nothing kept
                    s = None
                else:
                    self._record(s, "draft_inputs")
            if key not in self.step_events:
                return
            with self.steps_lock:
                prev = self.last_replay.get(key)
                n = self.replays.get(key, 0)
                if prev is not None and prev.steps_key == key and prev.steps_replay == n and prev.steps_ms is None:
                    self._read_steps(prev)  # before this replay rewrites the graph's events
                self.replays[key] = n + 1
                if s is not None:
                    s.steps_key = key
                    s.steps_replay = n + 1
                    s.steps_ms = None
                    self.last_replay[key] = s
        except Exception as e:
            self._fail(e)

    def graph_replayed(self):
        """Just after a draft graph replay: closes `draft`, the replay alone."""
        s = self.cur
        if s is None or s.names[s.n - 1] != "draft_inputs":
            return
        try:
            self._record(s, "draft")
        except Exception as e:
            self._fail(e)

    def capture_time(self, which, bs, seconds):
        self.capture_s.setdefault(which, {})[str(bs)] = round(seconds, 4)

    # -- reading, one iteration behind ------------------------------------------------
    def harvest(self, correct_per_req=None):
        """Where the cycle's correct drafts per request reach the CPU.

        v1 counts them here: its verify has already cut each request at its stop and skipped
        finished ones. v2 hands every request of the batch, so its list waits for the
        scheduler's commit (`commit_begin` / `commit_end`), which says what reached each
        request; a list whose commit never came is counted whole when the next one arrives."""
        if self.open_at_end:
            self.gate.shut()  # the wait for the GPU is over
        if correct_per_req is None:
            return
        try:
            correct = list(correct_per_req)
            if self.settle_on_commit:
                while self.unsettled:
                    self.uncut_cycles += 1
                    self._add_accept(self.unsettled.popleft())
                self.unsettled.append(correct)
            else:
                self._add_accept(correct)
        except Exception as e:
            self._fail(e)

    def _add_accept(self, correct, committed=None, skipped=0):
        """`correct`: correct drafts of each request that took the cycle's tokens; `committed`:
        the tokens each of them got (correct + 1 unless cut at a stop)."""
        if committed is None:
            committed = [c + 1 for c in correct]
        t = self.tokens
        got = sum(committed)
        t["committed_tokens"] += got
        t["verified_requests"] += len(correct)
        t["skipped_requests"] += skipped
        t["cut_tokens"] += sum(correct) + len(correct) - got
        self.items.append(("accept", correct, committed, skipped))
        # each list settles one decode cycle: a window closes after its `interval`-th
        self.window_decode += 1
        if self.window_decode >= self.interval:
            self._close_window()

    def commit_begin(self, reqs):
        """v2, in the scheduler, before it appends the cycle's tokens to each request: which
        requests will take them (upstream skips finished and retracted ones) and what each
        request's client has so far."""
        try:
            if not self.unsettled:
                return
            correct = self.unsettled.popleft()
            if len(correct) != len(reqs):  # not this batch's list: count it whole, as before
                self.uncut_cycles += 1
                self._add_accept(correct)
                return
            # what each request's client has: its output up to the stop, as upstream sends it
            # (a finished or retracted request is skipped by upstream: it gets nothing)
            self.open_commit = (reqs, correct, [len(r.output_ids) if r.finished_len is None else r.finished_len
                                                for r in reqs])
        except Exception as e:
            self._fail(e)

    def commit_end(self):
        """v2, after the scheduler committed the cycle's tokens and checked each stop."""
        c = self.open_commit
        if c is None:
            return
        self.open_commit = None
        try:
            reqs, correct, before = c
            took, got = [], []
            for r, k, b in zip(reqs, correct, before):
                n = r.finished_len
                n = (len(r.output_ids) if n is None else n) - b
                if n > 0:  # a request upstream commits to takes one token at least (the bonus)
                    took.append(k)
                    got.append(n)
            self._add_accept(took, got, len(reqs) - len(took))
        except Exception as e:
            self._fail(e)

    def _close_window(self):
        """O(1) here: the window's fields that live on this thread go with the last items to
        the folder, which closes the window and hands it to the outputs (`_publish`)."""
        self.items.append(("close", {
            "schema": SCHEMA,
            "rank": self.rank,
            "time": round(time.time(), 3),
            "config": self.config,
            "graphs": {"draft_replays": sum(self.replays.values()), "eager": dict(self.eager),
                       "capture_s": {k: dict(v) for k, v in self.capture_s.items()}},
            "marks_lost": self.marks_lost,
            "uncut_cycles": self.uncut_cycles,
            "tokens": dict(self.tokens),
        }))
        self._hand_over()
        self._detail_seen.clear()  # each batch size's first cycle in the next window: timed by phase
        if self.kernels is not None:
            self.kernels.window_closed(self.window_index)
        self.window_index += 1
        self.window_decode = 0

    def _hand_over(self):
        """The items held on this thread go to the folder as one batch."""
        if self.items:
            self.folder.submit(self.items)
            self.items = []

    # -- reading, on the folder's reader thread ------------------------------------------
    def attach(self):
        """The reader thread starts: the device's context there (the GPU backend)."""
        attach = getattr(self.backend, "attach", None)
        if attach is not None:
            attach()

    def behind(self) -> bool:
        """Few free slots left: the reader must catch up whatever the scheduler does."""
        return len(self.free) < POOL // 4

    def slot_ready(self, s) -> bool:
        return self.backend.query(s.events[s.n - 1])

    def slot_stuck(self) -> bool:
        """No free slot and the oldest cycle still incomplete: its events will not complete
        (a GPU error, a lost event); dropping it lets the others be timed."""
        return not self.free

    def slot_drop(self, s):
        self.read_dropped += 1
        self.lost(s.kind)
        self._recycle(s)

    def lost(self, kind):
        """A cycle that was not timed: it still takes its place in the order of settling."""
        if kind == "decode":
            self.decode_read += 1

    def settle(self, correct, skipped, window):
        """The k-th acceptance list settles the k-th decode cycle: one whose requests had all
        finished is a drain cycle. Returns (bs, ms) to take out of the open window, if any."""
        k = self.decode_settled
        self.decode_settled = k + 1
        if not (skipped and not correct):
            return None
        with self.timing_lock:
            t = self.timing
            t["drain_cycles"] += 1
            for i, (idx, win, bs, ms) in enumerate(self.charged):
                if idx == k:
                    t["decode_gpu_ms"] -= ms
                    t["drain_gpu_ms"] += ms
                    del self.charged[i]
                    return (bs, ms) if win == window else None
        if k >= self.decode_read:
            self.drain_pending.add(k)
        return None

    def _read_steps(self, s):
        evs = self.step_events[s.steps_key]
        b = self.backend
        if b.query_captured(evs[-1]):
            s.steps_ms = [b.elapsed_captured(x, y) for x, y in zip(evs, evs[1:])]
        else:
            s.steps_ms = []
            self.steps_lost += 1

    def slot_read(self, s, window):
        """A completed cycle's events: (Cycle, host time of its last mark) for the window."""
        el = self.backend.elapsed
        ev = s.events
        phases = []
        offsets = []  # host start of each phase, from the cycle's first mark
        names, host = s.names, s.host
        h0 = host[0]
        span = 0.0
        whole = None
        if not s.detail:  # two events: the cycle's start and end
            span = el(ev[0], ev[1]) if s.n > 1 else 0.0
            whole = (span, (host[s.n - 1] - h0) * 1000.0)
        else:
            for i in range(1, s.n):
                hb = host[i - 1]
                g = el(ev[i - 1], ev[i])
                span += g
                phases.append((names[i], g, (host[i] - hb) * 1000.0))
                offsets.append((hb - h0) * 1000.0)
        s.span = span  # first mark to last, as the sum of the phases
        if s.steps_key == "eager":
            se = s.step_events
            steps = [el(se[i - 1], se[i]) for i in range(1, s.ns)]
        elif s.steps_key is not None:
            with self.steps_lock:
                if s.steps_ms is None and s.steps_replay == self.replays.get(s.steps_key, 0):
                    self._read_steps(s)
                steps = s.steps_ms or []
        else:
            steps = []
        gap = period = gpu_period = None
        p = self.prev_done
        # The period of a decode cycle runs from the start of the decode cycle just before it;
        # after a prefill, or after the server sat idle, there is none to measure. On the GPU
        # it is the previous cycle's work and the GPU time between the two; on the host it
        # also holds whatever the scheduler waited for meanwhile (a prefill's results).
        # GPU time from the cycle just before (read once; None when that one was not timed)
        since = el(p.events[p.n - 1], ev[0]) if p is not None and p.seq == s.seq - 1 else None
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
                  period_gpu_ms=gpu_period, host_pause_ms=s.gc_ms, whole=whole, beside_prefill_ms=beside)
        with self.timing_lock:
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
                if k in self.drain_pending:
                    self.drain_pending.discard(k)
                    c.drained = True
                    t["drain_gpu_ms"] += ms
                else:
                    t["decode_gpu_ms"] += ms
                    self.charged.append((k, window, s.bs, ms))
        k = self.kernels
        if k is not None and s.seq in k.seqs:  # a kernel sample's cycle: its event times, to compare
            k.event_ms[s.seq] = [[name, g] for name, g, _ in phases]
        end = host[s.n - 1]
        if p is not None:
            self._recycle(p)
        self.prev_done = s
        return c, end

    def _recycle(self, s):
        with self.steps_lock:  # graph_replay may be reading the step times into it
            s.reset()
        self.free.append(s)

    def kernel_sample(self, smp):
        """A kernel sample stopped (its cycles are read before it): their event times join it,
        and the next window to close carries it."""
        k = self.kernels
        ev = k.event_ms if k is not None else {}
        smp["event_ms"] = {q: ev.pop(q) for q in smp.get("seqs", []) if q in ev}
        ev.clear()
        self.kernel_pending.append(smp)

    def close_fields(self, extra):
        """At a window's close, on the reader: the fields counted there."""
        extra["dropped_cycles"] = self.dropped + self.read_dropped
        extra["steps_lost"] = self.steps_lost
        extra["totals"] = self._totals(extra.pop("tokens"))
        if self.kernel_pending:
            extra["_kernel_sample"] = self.kernel_pending.popleft()
        if self.kernels is not None:
            extra["kernel_samples"] = {"taken": self.kernels.samples, "skipped": self.kernels.skipped}

    def _publish(self, summary):
        """A closed window (on the folder's thread): each sink in turn; one that fails is
        dropped with a warning and the others go on."""
        pause = self.folder.pause
        smp = summary.pop("_kernel_sample", None)
        if smp is not None:
            summary["kernels"] = self._kernel_block(smp)
        self._recent[summary.get("window")] = summary
        while len(self._recent) > 3:
            self._recent.pop(next(iter(self._recent)))
        k = summary.get("kernels")
        if k and "error" not in k and k.get("window") in self._recent:
            try:
                against_window(k, self._recent[k["window"]])
            except Exception:
                pass
        self._latest = summary
        for sink in list(self.sinks):
            pause()
            try:
                sink(summary)
            except Exception as e:  # a broken output must not stop the profiler
                self.sinks.remove(sink)
                logger.warning("speculative profile: %s failed (%s: %s) and is switched off.",
                               type(sink).__name__, type(e).__name__, e)

    def _kernel_block(self, smp):
        """A kernel sample as the window's `kernels` block (outputs thread, giving the GIL back
        every few hundred events); one that cannot be read is an error line, nothing more."""
        try:
            from .kernel_sampler import analyse_sample

            return analyse_sample(smp, self.folder.pause_turn)
        except Exception as e:
            smp.pop("prof", None)
            first = (str(e).strip().splitlines() or [""])[0]
            return {"window": smp.get("window"), "error": f"{type(e).__name__}: {first}"}

    @property
    def window(self):
        """The open window (inline: with every item held; threaded: up to the last batch
        folded, see `flush`)."""
        if not self.folder.threaded:
            self._hand_over()
        return self.folder.window

    def flush(self, timeout: float = 10.0, outputs: bool = True) -> bool:
        """Hand over what is held and wait until what completed is read and folded and
        (`outputs`) the outputs ran (tests, benchmarks, /server_info)."""
        self._hand_over()
        return self.folder.flush(timeout, outputs)

    def latest(self):
        return self._latest

    def catch_up(self, timeout: float = 0.05) -> None:
        """Before a read of the totals (/server_info): the cycles whose events completed are
        read first, waiting `timeout` at most (the reader works while the scheduler waits)."""
        if not self.broken:
            self.flush(timeout, outputs=False)

    def totals_now(self) -> dict:
        return self._totals(self.tokens)

    def _totals(self, tokens) -> dict:
        with self.timing_lock:
            t = self.timing
            out = {"decode_cycles": t["decode_cycles"], "prefill_cycles": t["prefill_cycles"]}
            out.update(tokens)
            out.update(decode_gpu_ms=round(t["decode_gpu_ms"], 4), drain_cycles=t["drain_cycles"],
                       drain_gpu_ms=round(t["drain_gpu_ms"], 4), prefill_gpu_ms=round(t["prefill_gpu_ms"], 4),
                       beside_prefill_gpu_ms=round(t["beside_prefill_gpu_ms"], 4), admissions=t["admissions"],
                       phase_cycles=t["phase_cycles"],
                       phase_gpu_ms={k: round(v, 4) for k, v in t["phase_gpu_ms"].items()})
        return out

    # -- failure ----------------------------------------------------------------------
    def _fail(self, e):
        """Any internal error: this profiler stops, and `on_error` (the hooks' `disable`,
        which puts the null profiler in its place) hears why; without one, a warning."""
        first = (str(e).strip().splitlines() or [""])[0]
        reason = f"{type(e).__name__}: {first}"
        if self.broken:
            return
        self.broken = True
        self.cur = None
        if self.kernels is not None:
            self.kernels.shutdown()
        if self.on_error is not None:
            self.on_error(reason)
        else:
            logger.warning("speculative profile disabled after an internal error (%s).", reason)
