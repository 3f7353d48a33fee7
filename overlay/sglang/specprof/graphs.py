"""The draft CUDA graphs' step times: events recorded during capture, read around replays.

`draft_step(i)` under capture records an external event, which becomes an event node of
the graph: every replay rewrites it. So a replay's step times must be read before the next
replay of the same graph is launched (`replay`), or by the reader once the cycle's events
completed (`read`), whichever comes first; `lock` keeps the two from reading one slot at
once. A graph is named by its runner, its batch size and the runner's variant (the series
pass them; the key is built here).
"""

from __future__ import annotations

import os
import threading

MAX_STEP_MARKS = 64  # eager draft-step marks a cycle may hold (steps + 1), apart from the phase marks
# "0" in the server's environment: no draft-step events, so no event node inside the draft graphs
# (each costs the GPU about 2 us a replay, in every cycle); the draft is then timed as one phase
DRAFT_STEPS_ENV = "SGLANG_SPECPROF_DRAFT_STEPS"


def draft_steps_timed(environ=os.environ) -> bool:
    """Whether the draft's steps are timed (the default), from DRAFT_STEPS_ENV."""
    return environ.get(DRAFT_STEPS_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


class DraftGraphs:
    def __init__(self, backend, clock):
        self.backend = backend
        self.timed = draft_steps_timed()  # False: no step events, under capture or eager
        # the reads keep the GIL where the backend can (cuda_backend.DriverEvents._hold_gil)
        self.query_held = getattr(backend, "query_captured_held", None)
        self.elapsed_held = getattr(backend, "elapsed_captured_held", None)
        self.clock = clock
        self.step_events: dict = {}  # graph key -> [external events recorded during capture]
        self.capturing = None  # the key of the graph being captured
        self._t0 = 0.0
        self.replays: dict = {}  # graph key -> replay count, while a slot waits for its step times
        # slots that took a replay and have not read its step times: while none does, a replay
        # is only counted (`quiet`), not keyed (the hot path of the cycles timed whole)
        self.watched = 0
        self.quiet = 0
        self.last_replay: dict = {}  # graph key -> the slot of its last replay
        self.lock = threading.Lock()
        self.lost = 0  # replays whose step times were rewritten before they were read
        self.read_late = 0  # replays whose step times were read just before the next one (not at their cycle's end)
        self.capture_s: dict = {}  # "draft" -> {batch size: seconds}

    @staticmethod
    def key(runner, bs, variant=None):
        return (id(runner), bs, variant)

    def capture_begin(self, runner, bs, variant=None):
        self.capture_done()
        self.capturing = self.key(runner, bs, variant)
        self._t0 = self.clock()

    def capture_done(self):
        k = self.capturing
        if k is not None:
            self.capturing = None
            self.capture_s.setdefault("draft", {})[str(k[1])] = round(self.clock() - self._t0, 4)

    def captured_step(self, i):
        """Inside draft_forward during capture: one event node per step boundary."""
        key = self.capturing
        if key is None or not self.timed:
            return
        evs = self.step_events.setdefault(key, [])
        if i == 0:
            evs.clear()
        ev = self.backend.new_event(external=True)
        self.backend.record_captured(ev)
        evs.append(ev)

    def replay(self, key, s):
        """Just before a replay of `key`: the previous replay's step times are read now, before
        this one rewrites them; `s` (the cycle's slot, or None when its steps are not kept)
        takes this replay. Its two halves (`before_replay`, `took`) run on either side of the
        launch where no other thread reads step times."""
        if key not in self.step_events:
            return
        self.before_replay(key)
        if s is not None:
            self.took(key, s)
        else:
            with self.lock:
                self.replays[key] = self.replays.get(key, 0) + 1

    def before_replay(self, key) -> None:
        """`replay`'s first half, where the cycle's own slot is registered after the launch
        (`took`): the previous replay's step times, read now if they still wait."""
        if key not in self.step_events:
            return
        with self.lock:
            prev = self.last_replay.get(key)
            if prev is not None and prev.steps_key == key and prev.steps_replay == self.replays.get(key, 0) \
                    and prev.steps_ms is None:
                self.read_late += 1
                self._read(prev)

    def took(self, key, s) -> None:
        """`replay`'s second half (just after the launch where it is deferred): the replay of
        `key` is counted and `s` takes it (nothing else replays between the two halves)."""
        if key not in self.step_events:
            return
        with self.lock:
            n = self.replays.get(key, 0) + 1
            self.replays[key] = n
            if s.steps_key is not None and s.steps_ms is None:  # a second replay in one cycle
                self.watched -= 1
            s.steps_key = key
            s.steps_replay = n
            s.steps_ms = None
            self.watched += 1
            self.last_replay[key] = s

    def read_done(self, s) -> None:
        """At the end of the cycle `s`: its replay's step times, if the GPU has run that
        replay already (one query, no wait). The next replay then finds nothing to read, and it
        is launched where the GPU may be waiting for the host (0.5.12 syncs at each cycle's
        start, so a cycle's first hooks and its draft replay are on the critical path)."""
        key = s.steps_key
        with self.lock:
            if s.steps_ms is None and s.steps_replay == self.replays.get(key, 0):
                evs = self.step_events[key]
                if (self.query_held or self.backend.query_captured)(evs[-1]):
                    el = self.elapsed_held or self.backend.elapsed_captured
                    s.steps_ms = [el(x, y) for x, y in zip(evs, evs[1:])]
                    self.watched -= 1

    def read(self, s) -> list:
        """Reader: the step times of the replay `s` ran ([] if a later replay came first)."""
        with self.lock:
            if s.steps_ms is None and s.steps_replay == self.replays.get(s.steps_key, 0):
                self._read(s)
            return s.steps_ms or []

    def _read(self, s):
        evs = self.step_events[s.steps_key]
        b = self.backend
        el = self.elapsed_held or b.elapsed_captured
        if (self.query_held or b.query_captured)(evs[-1]):
            s.steps_ms = [el(x, y) for x, y in zip(evs, evs[1:])]
        else:
            s.steps_ms = []
            self.lost += 1
        self.watched -= 1

    def forget(self, s) -> None:
        """`s` goes back to the pool (under `lock`): it no longer waits for step times."""
        if s.steps_key is not None and s.steps_ms is None:
            self.watched -= 1

    def total_replays(self) -> int:
        return sum(self.replays.values()) + self.quiet


class GraphHooks:
    """The profiler's hooks around the draft graphs and the forwards' graph use (a part of
    the profiler's `Recorder`, recorder.py: they use its current slot, its `_record` and its
    `graphs`)."""

    def draft_step(self, i):
        """Inside draft_forward: under capture, an external event node; eager, a plain event."""
        try:
            if self.backend.capturing():
                self.graphs.captured_step(i)
                return
            s = self.cur
            if s is None or not s.detail or not self.graphs.timed:
                return
            if i == 0:
                s.ns = 0  # a draft that ran again in the same cycle: its steps replace the first's
            s.eager_steps = True
            n = s.ns
            if n == len(s.step_events):
                if n >= MAX_STEP_MARKS:
                    self.marks_lost += 1
                    return
                s.step_events.append(self.backend.new_event())
            self.backend.record(s.step_events[n])
            s.ns = n + 1
        except Exception as e:
            self._fail(e)

    def capture_begin(self, runner, bs, variant=None):
        """The draft graph runner starts capturing its graph for `bs` (and `variant`)."""
        try:
            self.graphs.capture_begin(runner, bs, variant)
        except Exception as e:
            self._fail(e)

    def capture_end(self):
        """The draft graph runner captured its last graph."""
        try:
            self.graphs.capture_done()
        except Exception as e:
            self._fail(e)

    def graph(self, which, used, runner=None):
        """After a forward: did `which` replay a CUDA graph, and at what padded batch size."""
        s = self.cur
        if s is None:
            return
        try:
            if used:
                g = s.graph
                if g is None:
                    g = s.graph = {}
                g[which] = True
                padded = getattr(runner, "bs", 0) or 0
                if padded > g.get("padded_bs", 0):
                    g["padded_bs"] = padded
            else:
                self.eager[which] = self.eager.get(which, 0) + 1
        except Exception as e:
            self._fail(e)

    def draft_replay_begin(self, runner, bs, variant=None):
        """Just before a draft graph replay, its inputs copied and its attention metadata set:
        closes `draft_inputs` (that preparation), so that `draft` holds the replay alone, and
        reads the step times of this graph's previous replay if they still wait. Where no
        other thread reads the step times (`defer_replay`: the server's v2), the cycle's slot
        takes the replay just after its launch, in draft_replay_end, off 0.5.12's critical path."""
        s = self.cur
        if s is None or not s.detail:  # its steps are not read: the replay is counted, nothing kept
            g = self.graphs
            if not g.watched:  # and no earlier replay's step times wait to be read: nothing to key
                g.quiet += 1
                return
        try:
            if s is not None:
                if s.detail:
                    n = s.n  # _record, inline: on 0.5.12 the GPU waits for the host here
                    if n < len(s.events):
                        crec = self._crec
                        if crec is None:
                            self.backend.record(s.events[n])
                        elif crec(s.h[n], self._sraw):
                            raise RuntimeError("cuEventRecord failed (the draft's inputs)")
                        s.host[n] = self.clock()
                        s.names[n] = "draft_inputs"
                        s.n = n + 1
                    else:
                        self._record(s, "draft_inputs")
                    s.replaying = True
                    if self.defer_replay:  # the slot takes the replay after its launch (draft_replay_end)
                        key = s.replay_key = (id(runner), bs, variant)  # DraftGraphs.key, inline
                        g = self.graphs
                        if g.watched:
                            g.before_replay(key)
                        return
                else:  # its steps are not read: the replay is counted, nothing kept
                    s = None
            self.graphs.replay((id(runner), bs, variant), s)  # DraftGraphs.key, inline
        except Exception as e:
            self._fail(e)

    def draft_replay_end(self):
        """Just after a draft graph replay: closes `draft`, the replay alone."""
        s = self.cur
        if s is None or not s.replaying:
            return
        try:
            s.replaying = False
            s.replayed = True
            self._record(s, "draft")
            key = s.replay_key
            if key is not None:
                s.replay_key = None
                self.graphs.took(key, s)
        except Exception as e:
            self._fail(e)
