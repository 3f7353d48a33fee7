"""The runtime profiler's hot path: marks at phase boundaries, handed over without waiting.

A cycle is a sequence of marks. `begin(kind, bs)` records the first event, each
`mark(name)` records one more and closes the phase `name` (from the previous mark to
this one), `end()` queues the cycle. The events are read on the folder's reader thread
once `query()` says the last one completed (reader.py), so no synchronisation is added;
acceptance comes in at `harvest()` and, on v2, the scheduler's commit, which says how many
tokens each request took; each cycle's acceptance settles in `Settlement` (settlement.py),
which alone decides where the window ends and queues its close record behind the cycles.

Draft steps inside a captured CUDA graph are timed by external events recorded during
capture (`draft_step(i)`, graphs.py); the replay's hooks (`draft_replay_begin` / `_end`)
split the draft into the inputs' preparation, the replay and its outputs.

The clock and the events come from a backend (`cuda_backend.py` on the GPU, a fake in
the tests); this module imports neither torch nor SGLang.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from sglang_specprof.window import GRAPH_KINDS

from .accept import AcceptHooks
from .folder import Folder
from .gc_pauses import GcPauses
from .graphs import DraftGraphs, GraphHooks
from .null import NullProfiler
from .reader import Reader, Slot, batch_state, waiting_requests
from .pipeline import Outputs
from .settlement import IDLE_CLOSE_S, SWITCHES_KEPT, Settlement  # noqa: F401 (the names tests and benches import)
from .sinks import Advice, LogTableSink

logger = logging.getLogger("sglang.specprof")

MAX_MARKS = 64  # phase marks a cycle may hold (a cycle records about 12); beyond, counted as lost
POOL = 256  # cycles in flight at most; beyond that the oldest is dropped and counted
BEHIND = POOL // 4  # free slots below which the scheduler's thread reads cycles itself
# items held on the scheduler's thread before they go to a reader thread: about 64 cycles
# (each hand-over wakes the reader, which then wants the GIL), 8 under the cost policy (its
# figures come from the cycles read). Read on the scheduler's thread (the server's way): every
# 16 cycles, what completed is read at once (bench/server_hooks on 0.5.12: `end`, where the
# reading runs, took 61 us a cycle so against 119 us read a cycle at a time: the caches stay
# warm for all but the first), at the cycle's end, where the GPU has the verify and the draft extend still to run;
# a cycle at a time under the cost policy, which steers by the cycles read
HAND_OVER = 128
HAND_OVER_POLICY = 16
HAND_OVER_INLINE = 32
HAND_OVER_INLINE_POLICY = 2


class Profiler(GraphHooks, AcceptHooks, NullProfiler):
    """The hooks with --speculative-profile on: the cycle's marks here, the draft graphs'
    hooks in graphs.py, the acceptance hooks in accept.py; its parts, held as attributes:
    `settlement` (where the window ends), `graphs`, `reader`, `folder`, `outputs`, `gc_pauses`."""

    enabled = True

    def __init__(self, backend, interval=100, sink=None, config=None, clock=time.perf_counter, rank=0,
                 log_table=True, exchange=None, threaded=False, on_error=None, phases_every=1, advice=None):
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
        self.config = dict(config or {})
        self.clock = clock
        self.rank = rank
        self.free = deque(Slot(backend) for _ in range(POOL))  # taken here, given back by the reader
        self.cur: Slot | None = None
        self.next_slot: Slot | None = None  # the next decode cycle's, made ready at an end (_ready_next)
        # records: one C call with the event's and the stream's handles where the backend has one
        self._crec = getattr(backend, "crec", None)
        self._rec = self._record_c if self._crec is not None else self._record_direct
        self._handle = getattr(backend, "handle", None) or (lambda ev: ev)
        # () -> the stream's handle; without one, a C callable that gives None (no Python frame)
        self._stream_id = getattr(backend, "stream_id", None) or type(None)
        self._sraw = getattr(backend, "sraw", None)  # the stream handle the records go to
        self.seq = 0
        # the Scheduler, once its idle housekeeping passed it (hooks.idle): its waiting queue is
        # read in the cycles timed by phase
        self.scheduler = None
        self.graphs = DraftGraphs(backend, clock)
        self.reader = Reader(backend, self.free, self.graphs, self.behind, pool=POOL)
        # Reading the events, folding and window closes run in `folder` (helper threads in the
        # server); this thread records the events and hands each cycle's slot over.
        self.folder = Folder(self.reader, interval, self.config.get("num_steps"), on_error=self._fail,
                             threaded=threaded)
        given = [] if sink is None else list(sink) if isinstance(sink, (list, tuple)) else [sink]
        sinks = ([LogTableSink(self.folder.pause, advice or Advice())] if log_table else []) + given
        self.outputs = Outputs(sinks, self.folder.pause, self.folder.pause_turn, exchange, rank)
        self.folder.on_close = self.outputs.publish
        self.gate = self.folder.gate
        # where the worker goes to wait for the GPU (the gate opens) and where the wait ends
        # (it shuts): v2 waits after launching a cycle, for the one before; v1 inside verify
        self.open_at_end = self.config.get("worker") != "v1"
        self.gate_open_mark = None if self.open_at_end else "verify"
        self.gate_shut_mark = None if self.open_at_end else "accept"
        adaptive = self.config.get("adaptive")
        # no reader thread: a replay's slot can be registered after the launch (graphs.py)
        self.defer_replay = not self.folder.reading_thread
        self.hand_over = (HAND_OVER_POLICY if adaptive else HAND_OVER) if self.folder.reading_thread else (
            HAND_OVER_INLINE_POLICY if adaptive else HAND_OVER_INLINE)
        self.items: list = []
        self.dropped = 0  # cycles not timed: no free slot (events that do not complete)
        self.marks_lost = 0  # phase or step marks past a cycle's room (never expected; counted, shown)
        # v2 (and a server without speculation): acceptance is settled against the requests
        # where the scheduler commits it
        self.settle_on_commit = self.config.get("worker") in ("v2", "plain")
        self.unsettled: deque = deque()  # correct-draft lists harvested, waiting for their commit
        self.open_commit = None  # (reqs, correct, visible before) between commit_begin and commit_end
        self.uncut_cycles = 0  # v2 cycles counted without their commit (a hook not reached): counted as verified
        self.eager = dict.fromkeys(GRAPH_KINDS, 0)
        # --speculative-adaptive: each decode cycle's step count keys its bucket ("5-8@2"), and
        # each change of it between decode cycles is kept for the window (Settlement.switched)
        self.adaptive = bool(self.config.get("adaptive"))
        self.policy = None  # the cost policy (policy.py), when it chooses the step counts
        self._switch_next = False  # the next decode cycle's slot is the first after a switch
        self.gc_pauses = GcPauses(self)  # the collector's pauses inside each cycle, once followed
        # where the open window ends (settlement.py); each decode cycle's acceptance settles
        # there, through the bound method the acceptance hooks call
        self.settlement = st = Settlement(self, interval, self.adaptive)
        self._add_accept = st.settle
        self.tokens = st.tokens

    # the parts' figures, under the names the tests, the hooks and the sampler read;
    # kernels: --speculative-profile-kernels' sampler (kernel_sampler.KernelSampler), or None
    kernels = property(lambda self: self.reader.kernels, lambda self, k: setattr(self.reader, "kernels", k))
    sinks = property(lambda self: self.outputs.sinks)
    read_dropped = property(lambda self: self.reader.dropped)
    steps_lost = property(lambda self: self.graphs.lost)
    capture_s = property(lambda self: self.graphs.capture_s)
    window_index = property(lambda self: self.settlement.window_index)
    window_decode = property(lambda self: self.settlement.window_decode)
    last_steps = property(lambda self: self.settlement.last_steps)
    switches = property(lambda self: self.settlement.switches)
    _gc_cb = property(lambda self: self.gc_pauses.cb)
    _on_gc = property(lambda self: self.gc_pauses.on_gc)

    def follow_gc(self):
        """Time the garbage collector's pauses of the host inside each cycle (the server's
        profiler does; they are where the device can sit waiting on the host)."""
        self.gc_pauses.follow()

    def resume(self):
        """After a pause (hooks.PAUSE_SIGNAL_ENV): what was open when it began is dropped, the
        cycle in flight and the acceptance waiting for its commit, so nothing is half counted."""
        if self.cur is not None:
            self.reader.recycle(self.cur)
            self.cur = None
        self.unsettled.clear()
        self.open_commit = None
        self.items.append(("resync",))  # the reader lines cycles and acceptance up again

    def every_phase(self, on: bool) -> None:
        """The kernel sampler's (kernel_sampler.py): from the next cycle, every cycle timed
        phase by phase (`on`: its sample's, the one made ready at the last end too), or again
        one in `phases_every`."""
        self.detail_all = on or self.phases_every == 1
        if on:
            self._decide_next(count=False)

    def add_kernel_sample(self, smp: dict) -> None:
        """A kernel sample the torch profiler recorded, to the folder in order with the cycles."""
        self.items.append(("kernels", smp))

    def close(self):
        """Stop following the garbage collector (the profiler is being replaced)."""
        self.gc_pauses.stop()

    def behind(self) -> bool:
        """Few free slots left: the reader must catch up whatever the scheduler does."""
        return len(self.free) < BEHIND

    # -- hot path: the hooks, each a few attribute writes and at most one event ----------
    def begin(self, kind, bs, ctx=None, steps=None):
        """A cycle of `bs` requests starts; `ctx`: the sum of their sequence lengths (KV tokens);
        `steps`: the step count it runs at (read under --speculative-adaptive only).

        On 0.5.12 the GPU waits for the host from the cycle's start to its draft replay (it
        synchronises there): a decode cycle after a decode cycle of the same batch size takes
        the slot the last `end` made ready (numbered, and decided whether it is timed by phase)
        and records one event, with one C call, on the stream the cycles before ran on (`end`
        checks it); anything else (the first cycle, a prefill, another batch size, a changed
        stream, an adaptive step count, a cycle that never ended) goes the long way (`_begin`)."""
        s = self.next_slot
        if s is None or bs != s.bs or kind != "decode":
            return self._begin(kind, bs, ctx, steps)
        self.next_slot = None
        try:
            g = self.gate  # shut: the scheduler's thread has work of its own (Gate.shut, inline)
            g.is_open = False
            g.busy = True
            crec = self._crec  # _record_c, inline
            if crec is None:
                self.backend.record(s.events[0])
            elif crec(s.h[0], self._sraw):
                raise RuntimeError("cuEventRecord failed (a cycle's first event)")
            s.host[0] = self.clock()
            if s.detail and ctx is not None:  # a tensor's sum costs microseconds: the cycles timed by phase only
                s.ctx, s.kv = (ctx, None) if ctx.__class__ is int else batch_state(ctx)  # _batch_state, inline
                if self.scheduler is not None:
                    s.waiting = waiting_requests(self.scheduler)
            self.cur = s
        except Exception as e:  # never take the server down
            self._fail(e)

    def _batch_state(self, s, ctx):
        """What a cycle timed by phase records of its batch at its start: the context tokens and
        the KV pool's share (a number is taken as the context), and the scheduler's waiting queue."""
        s.ctx, s.kv = (ctx, None) if ctx.__class__ is int else batch_state(ctx)
        if self.scheduler is not None:
            s.waiting = waiting_requests(self.scheduler)

    def _decide_next(self, count=True):
        """Whether the slot made ready is timed by phase, for the batch size it is ready for;
        again after the window's counts were cleared (`count`) or the kernel sampler asked for
        every phase."""
        s = self.next_slot
        if s is not None:
            if count:
                seen = self._detail_seen
                k = seen.get(s.bs, 0)
                seen[s.bs] = k + 1
                s.detail = not k % self.phases_every or self.detail_all
            elif self.detail_all:
                s.detail = True

    def _take_ready(self):
        """The slot the last `end` made ready, taken back from there with the count `end` gave
        its batch size (the cycle that takes it is counted as it is), or None."""
        s = self.next_slot
        if s is not None:
            self.next_slot = None
            seen = self._detail_seen
            if seen.get(s.bs, 0) > 0:
                seen[s.bs] -= 1
        return s

    def _record_direct(self, s, n):
        self.backend.record(s.events[n])

    def _record_c(self, s, n):
        if self._crec(s.h[n], self._sraw):
            raise RuntimeError(f"cuEventRecord failed (event {n} of a cycle)")

    def _begin(self, kind, bs, ctx=None, steps=None):
        if self.broken:
            return
        try:
            g = self.gate  # shut: the scheduler's thread has work of its own (Gate.shut, inline)
            g.is_open = False
            g.busy = True
            if self.graphs.capturing is not None:
                self.graphs.capture_done()
            if self.cur is not None:  # a cycle that never ended (an exception upstream): discard it
                self.reader.recycle(self.cur)
                self.cur = None
            if not self.adaptive:
                steps = None
            elif kind == "decode":
                st = self.settlement
                if steps != st.last_steps:
                    self._switch_next = st.switched(bs, steps)
            s = self._take_ready()
            if s is not None:  # made ready for a decode cycle; this one takes it, and its number
                s.detail = True
            else:
                free = self.free
                if len(free) < BEHIND:  # the reader got no turn (or events do not complete)
                    self._hand_over()
                    if self.folder.reading_thread:
                        self.folder.help()
                    if not free:  # every slot waits for its events: this cycle is not timed
                        self.dropped += 1
                        self.items.append(("lost", kind, steps))
                        return
                s = free.popleft()  # reset when it was given back
                s.seq = seq = self.seq
                self.seq = seq + 1
            s.kind = kind
            s.bs = bs
            s.steps = steps
            if self._switch_next:  # the first cycle after a switch (a slot is reset unswitched)
                s.switched, self._switch_next = True, False
            if kind != "decode" or self.detail_all:
                if ctx is not None:
                    self._batch_state(s, ctx)
            else:
                seen = self._detail_seen
                k = seen.get(bs, 0)
                seen[bs] = k + 1
                if k % self.phases_every:
                    s.detail = False
                elif ctx is not None:
                    self._batch_state(s, ctx)
            self.cur = s
            b = self.backend
            self._sraw = b.refresh()  # the stream's handle (each cycle's `end` checks it)
            self._rec(s, 0)
            s.host[0] = self.clock()
            s.n = 1
        except Exception as e:  # never take the server down
            self._fail(e)

    def mark(self, name):
        s = self.cur
        if s is not None and s.detail:
            try:
                n = s.n
                if n == len(s.events):
                    self._record(s, name)  # grows the slot, or counts the mark as lost
                else:
                    crec = self._crec  # _record, inline: the hot path's most frequent call
                    if crec is None:
                        self.backend.record(s.events[n])
                    elif crec(s.h[n], self._sraw):
                        raise RuntimeError("cuEventRecord failed")
                    s.host[n] = self.clock()
                    s.names[n] = name
                    s.n = n + 1
            except Exception as e:
                self._fail(e)
        if name is self.gate_open_mark:  # v1: the wait for the verify's result starts, and ends
            self.gate.open()
        elif name is self.gate_shut_mark:
            self.gate.shut()

    def draft_end(self):
        """The draft's outputs are ready: closes `draft` (eager), or `draft_outputs` (after a
        graph replay, whose own hooks closed `draft`)."""
        s = self.cur
        if s is not None and s.detail:
            self.mark("draft_outputs" if s.replayed else "draft")

    def end(self):
        s = self.cur
        if s is None:
            return
        self.cur = None
        try:
            moved = self._stream_id() != self._sraw  # the worker's stream is not the one its events went to
        except Exception as e:
            self._fail(e)
            return
        if moved:
            self._stream_changed(s)
            return
        if not s.detail:  # the cycle's end: its last mark came just before (_record, inline)
            try:
                n = s.n  # 1: no mark recorded (the slot holds FIRST_MARKS events)
                crec = self._crec  # _record_c, inline
                if crec is None:
                    self.backend.record(s.events[n])
                elif crec(s.h[n], self._sraw):
                    raise RuntimeError("cuEventRecord failed (a cycle's last event)")
                s.host[n] = self.clock()
                s.names[n] = "end"
                s.n = n + 1
            except Exception as e:
                self._fail(e)
                return
        if s.steps_key is not None:  # its draft graph's step times, if they are done (graphs.py)
            try:
                self.graphs.read_done(s)
            except Exception as e:
                self._fail(e)
                return
        items = self.items
        items.append(("slot", s))
        if len(items) >= self.hand_over:
            self._hand_over()
        # The next decode cycle's slot, taken from the pool here, where the host is ahead of the
        # GPU, so that `begin` only records (when nothing odd is pending: else `_begin`)
        if s.kind == "decode" and not (self.broken or self.adaptive or self.graphs.capturing is not None):
            free = self.free
            if len(free) >= BEHIND:
                nxt = free.popleft()
                nxt.seq = seq = self.seq
                self.seq = seq + 1
                nxt.n = 1  # names[0] is "begin" in every slot
                # ready for a cycle of this one's batch size (another takes the long way), and
                # counted for it now: whether it is timed by phase (_decide_next, inline)
                nxt.bs = bs = s.bs
                seen = self._detail_seen
                k = seen.get(bs, 0)
                seen[bs] = k + 1
                if k % self.phases_every and not self.detail_all:
                    nxt.detail = False
                self.next_slot = nxt
        if self.open_at_end:  # Gate.open, inline
            g = self.gate
            g.is_open = True
            if g.waiting:
                g.waiting = False
                g._ev.set()

    def _stream_changed(self, s):
        """At a cycle's end the worker runs on another stream than the one its events were
        recorded on (`begin` took the stream of the cycles before: the check is here, off
        0.5.12's critical path, since `begin` and `end` run on one stream): the cycle is not
        timed, and the next one starts the long way, on the stream there is now."""
        try:
            self.dropped += 1
            self.items.append(("lost", s.kind, s.steps))
            self.reader.recycle(s)
            self._sraw = self.backend.refresh()
            n = self._take_ready()
            if n is not None:  # made ready for the stream before: back to the pool
                self.reader.recycle(n)
        except Exception as e:
            self._fail(e)
        if self.open_at_end:
            self.gate.open()

    def _record(self, s, name):
        n = s.n
        if n == len(s.events):
            if n >= MAX_MARKS:
                self.marks_lost += 1
                return
            ev = self.backend.new_event()
            s.events.append(ev)
            s.h.append(self._handle(ev))
            s.host.append(0.0)
            s.names.append(None)
        self._rec(s, n)
        s.host[n] = self.clock()
        s.names[n] = name
        s.n = n + 1

    def window_closed(self, index):
        """The settlement queued window `index`'s close: the items go to the folder, and the
        next window times each batch size's first cycle by phase; the kernel sampler hears it."""
        self._hand_over()
        self._detail_seen.clear()
        self._decide_next()  # the slot made ready at the last end, for the next window
        k = self.reader.kernels
        if k is not None:
            k.window_closed(index)

    def idle(self):
        """Upstream's idle housekeeping (the scheduler has no batch to run; called before
        upstream's own guard, about once a second with --sleep-on-idle, or on every loop
        without): the settlement closes the open window once it sat idle long enough, so that
        what ran before a pause (or before a shutdown: the scheduler is killed, nothing flushes
        then) is in the outputs and the JSONL instead of waiting for the traffic."""
        self.settlement.idle()

    def _hand_over(self):
        """The items held on this thread go to the folder as one batch."""
        if self.items:
            self.folder.submit(self.items)
            self.items = []

    # -- reads ------------------------------------------------------------------------
    @property
    def window(self):
        """The open window (inline: with every item held; threaded: up to the last batch
        folded, see `flush`)."""
        if not self.folder.reading_thread:
            self._hand_over()
        return self.folder.window

    def flush(self, timeout: float = 10.0, outputs: bool = True) -> bool:
        """Hand over what is held and wait until what completed is read and folded and
        (`outputs`) the outputs ran (tests, benchmarks, /server_info)."""
        self._hand_over()
        return self.folder.flush(timeout, outputs)

    def latest(self):
        return self.outputs.latest

    def catch_up(self, timeout: float = 0.05) -> None:
        """Before a read of the totals (/server_info): the cycles whose events completed are
        read first, waiting `timeout` at most (the reader works while the scheduler waits)."""
        if not self.broken:
            self.flush(timeout, outputs=False)

    def totals_now(self) -> dict:
        return self.reader.totals(self.tokens)

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
        self.next_slot = None
        k = self.reader.kernels
        if k is not None:
            k.shutdown()
        if self.on_error is not None:
            self.on_error(reason)
        else:
            logger.warning("speculative profile disabled after an internal error (%s).", reason)
