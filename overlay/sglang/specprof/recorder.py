"""The profiler's hot path on the scheduler's thread: marks at phase boundaries, handed over
without waiting.

A cycle is a sequence of marks. `begin(kind, bs)` records the first event, each
`mark(name)` records one more and closes the phase `name` (from the previous mark to
this one), `end()` queues the cycle. The events are read by the folder once the last one
completed (Reader.slot_ready: asked as the cycle's span, or `query()`), so no synchronisation
is added.
Each cycle's events go into a slot of the pool (slots.py); draft steps inside a captured
CUDA graph are timed by the draft graphs' hooks (graphs.py), which record into the same slots.

A part of `Profiler` (profiler.py), which hands the hooks these bound methods as its own:
no Python frame between a hook's call and its code.
"""

from __future__ import annotations

from .graphs import GraphHooks
from .batch_state import batch_state, waiting_requests
from .slots import BEHIND, SlotPool

MAX_MARKS = 64  # phase marks a cycle may hold (a cycle records about 12); beyond, counted as lost


class Recorder(GraphHooks, SlotPool):
    """The hooks of a cycle's marks, recording into the slot pool (slots.py); the draft
    graphs' hooks (GraphHooks, graphs.py) record into the same slots."""

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
            self._refresh_stream()
            self._rec(s, 0)
            s.host[0] = self.clock()
            s.n = 1
            if self.open_at_end and s.detail is not self.marks_shown:  # the face's marks for it (show_marks)
                self.show_marks(s.detail)
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
        if name == self.gate_open_mark:  # v1: the wait for the verify's result starts, and ends
            self.gate.open()
        elif name == self.gate_shut_mark:
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
            moved = self._stream_id() != self._sid  # the worker's stream is not the one its events went to
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
                if self.open_at_end and nxt.detail is not self.marks_shown:  # the face's marks for it, here
                    self.show_marks(nxt.detail)  # where the host leads (show_marks), not in `begin`
        if self.open_at_end:  # Gate.open, inline
            g = self.gate
            g.is_open = True
            if g.waiting:
                g.waiting = False
                g._ev.set()

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

