"""The slot pool a cycle's events are recorded into (reader.Slot): taken by the recorder
(recorder.py) at a cycle's start, numbered there, given back, reset, by the reader once the
events completed. A decode cycle's slot is made ready at the end of the one before, where
the host is ahead of the GPU, and decided there whether it is timed phase by phase.

`SlotPool` holds the recorder's state on the scheduler's thread: the pool, the cycle in
flight, the items held for the folder and the counts of what was not timed; `Recorder`
(recorder.py) is the hooks that record into it.
"""

from __future__ import annotations

from collections import deque

from sglang_specprof.window import GRAPH_KINDS

from .batch_state import batch_state, waiting_requests
from .reader import Slot

# what the face's `mark(name)`, `draft_end()` and `draft_replay_end()` are during a cycle timed
# whole: builtins that take those arguments and do nothing with them (no Python frame)
SKIP_MARK = id
SKIP_CALL = tuple

POOL = 256  # cycles in flight at most; beyond that the oldest is dropped and counted
BEHIND = POOL // 4  # free slots below which the scheduler's thread reads cycles itself
# items held on the scheduler's thread before they go to a reader thread: about 64 cycles
# (each hand-over wakes the reader, which then wants the GIL), 8 under the cost policy (its
# figures come from the cycles read). Read on the scheduler's thread (the server's way): every
# 32 items (about 16 cycles: a cycle and its acceptance list each), what completed is read at
# once (the caches stay warm for all but the first: bench/server_hooks), at the cycle's end,
# where the GPU has the verify and the draft extend still to run; a cycle at a time under the
# cost policy, which steers by the cycles read
HAND_OVER = 128
HAND_OVER_POLICY = 16
HAND_OVER_INLINE = 32
HAND_OVER_INLINE_POLICY = 2


class SlotPool:
    """The recorder's state: the slots, the cycle in flight, the one made ready, the items
    held for the folder. `fail`: the profiler's `_fail`."""

    def __init__(self, backend, clock, graphs, config, phases_every, fail):
        self.backend = backend
        self.clock = clock
        self.graphs = graphs
        self._fail = fail
        self.broken = False  # set by `fail`: the hooks stop recording
        # Each batch size's cycles are timed phase by phase one in `phases_every` (in each
        # window the first, then every phases_every-th); the others record two events (their
        # start and end) and skip the marks: every cycle's GPU time, a sample of its phases, at
        # about half the host time. `detail_all`: every cycle in detail (prefills always; the
        # cycles of a kernel sample).
        self.phases_every = max(1, int(phases_every))
        self.detail_all = self.phases_every == 1
        self._detail_seen: dict = {}  # batch size -> decode cycles begun
        self.free = deque(Slot(backend) for _ in range(POOL))  # taken here, given back by the reader
        self.cur: Slot | None = None
        self.next_slot: Slot | None = None  # the next decode cycle's, made ready at an end
        # records: one C call with the event's and the stream's handles where the backend has one
        self._crec = getattr(backend, "crec", None)
        self._rec = self._record_c if self._crec is not None else self._record_direct
        self._handle = getattr(backend, "handle", None) or (lambda ev: ev)
        # () -> the stream's handle; without one, a C callable that gives None (no Python frame)
        self._stream_id = getattr(backend, "stream_id", None) or type(None)
        self._sraw = getattr(backend, "sptr", None)  # the stream the records go to, as `crec` takes it
        self._sid = getattr(backend, "sraw", None)  # and its handle, a number (`end` checks it)
        self.seq = 0
        # the Scheduler, once its idle housekeeping passed it (hooks.idle): its waiting queue is
        # read in the cycles timed by phase
        self.scheduler = None
        # where the worker goes to wait for the GPU (the gate opens) and where the wait ends
        # (it shuts): v2 waits after launching a cycle, for the one before; v1 inside verify
        self.open_at_end = config.get("worker") != "v1"
        self.gate_open_mark = None if self.open_at_end else "verify"
        self.gate_shut_mark = None if self.open_at_end else "accept"
        self.items: list = []
        self.dropped = 0  # cycles not timed: no free slot (events that do not complete)
        self.marks_lost = 0  # phase or step marks past a cycle's room (never expected; counted, shown)
        self.eager = dict.fromkeys(GRAPH_KINDS, 0)  # forwards run without their graph, by kind
        # --speculative-adaptive: each decode cycle's step count keys its bucket ("5-8@2"), and
        # each change of it between decode cycles is kept for the window (Settlement.switched)
        self.adaptive = bool(config.get("adaptive"))
        self._switch_next = False  # the next decode cycle's slot is the first after a switch
        # The hooks' face (the profiler, `show_marks`): while a cycle timed whole runs, its `mark`
        # and `draft_end` are C callables that do nothing with what they are given, so the ten or
        # so marks of such a cycle cost no Python frame. Not on v1, whose marks open the gate.
        self.face = None
        self.marks_shown = True  # the face's marks are this recorder's (a cycle timed by phase)

    def connect(self, reader, folder, settlement):
        """The parts the cycles go to: the reader gives slots back, the folder takes the items
        (and its gate is where the worker waits), the settlement keeps the step-count switches."""
        self.reader = reader
        self.folder = folder
        self.gate = folder.gate
        self.settlement = settlement
        # no reader thread: a replay's slot can be registered after the launch (graphs.py)
        self.defer_replay = not folder.reading_thread
        adaptive = self.adaptive
        self.hand_over = (HAND_OVER_POLICY if adaptive else HAND_OVER) if folder.reading_thread else (
            HAND_OVER_INLINE_POLICY if adaptive else HAND_OVER_INLINE)

    def show_marks(self, detail: bool) -> None:
        """The face's marks for the next cycle, timed by phase (`detail`: this recorder's own) or
        whole (C callables that ignore their arguments); called (v2 only) where a slot's detail is
        decided and differs from what is shown: at the `end` that makes the next slot ready, in
        `_decide_next`, and in the long way of `begin` (`_begin`), not in its fast way."""
        f = self.face
        if f is None:
            return
        self.marks_shown = detail
        if detail:
            f.mark, f.draft_end, f.draft_replay_end = self.mark, self.draft_end, self.draft_replay_end
        else:
            f.mark, f.draft_end, f.draft_replay_end = SKIP_MARK, SKIP_CALL, SKIP_CALL

    def behind(self) -> bool:
        """Few free slots left: the reader must catch up whatever the scheduler does."""
        return len(self.free) < BEHIND

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
            if self.open_at_end and s.detail is not self.marks_shown:
                self.show_marks(s.detail)

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

    def _stream_changed(self, s):
        """At a cycle's end the worker runs on another stream than the one its events were
        recorded on (`begin` took the stream of the cycles before: the check is here, off
        0.5.12's critical path, since `begin` and `end` run on one stream): the cycle is not
        timed, and the next one starts the long way, on the stream there is now."""
        try:
            self.dropped += 1
            self.items.append(("lost", s.kind, s.steps))
            self.reader.recycle(s)
            self._refresh_stream()
            n = self._take_ready()
            if n is not None:  # made ready for the stream before: back to the pool
                self.reader.recycle(n)
        except Exception as e:
            self._fail(e)
        if self.open_at_end:
            self.gate.open()

    def _refresh_stream(self):
        """The stream the worker runs on now (the long way of `begin`, a changed stream): its
        handle as a number (`end` checks it) and as `crec` takes it."""
        b = self.backend
        self._sid = b.refresh()
        self._sraw = getattr(b, "sptr", None)

    def next_window(self):
        """The settlement queued a window's close: the items go to the folder, and the next
        window times each batch size's first cycle by phase (the slot made ready at the last
        end too)."""
        self._hand_over()
        self._detail_seen.clear()
        self._decide_next()

    def _hand_over(self):
        """The items held on this thread go to the folder as one batch."""
        if self.items:
            self.folder.submit(self.items)
            self.items = []
