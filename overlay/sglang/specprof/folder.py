"""Reading cycles, folding them into summary windows, and handing the closed ones to the outputs.

The profiler's hot path records the events and hands each cycle's slot here (`submit`);
each slot is read once its events completed, its numbers folded into the open window, and
windows closed (the summary, the advisor); an outputs thread runs the output pipeline
(pipeline.py: the rank exchange, then the log table, the JSONL, Prometheus), so an output
that blocks stops nothing else.

Where the reading runs (`reading`, hooks.READING):
- AT_HAND_OVER (v2 and a server without speculation): on the scheduler's thread, at each
  hand-over; only the closed windows go to the outputs thread. A reader thread would take
  the GIL wherever the scheduler's thread lets it go (each torch call does), and where the
  host is the bottleneck those hand-overs cost the scheduler more than the reading itself
  (bench/hook_cost.py, docs/benchmarks.md).
- READER_THREAD (v1): on a reader thread, which works while the scheduler's thread waits for the
  verify's result (the `Gate`: the profiler opens it where the worker goes to wait, and
  shuts it where the wait ends), regardless when it falls behind (few free slots left) or
  when nothing opened the gate for IDLE_S (an idle server), giving the GIL back between
  steps (`time.sleep(0)`).
- INLINE (the tests' default): everything at once on the caller's thread, with the same code.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from sglang_specprof.window import Window

logger = logging.getLogger("sglang.specprof")

BACKLOG = 256  # windows waiting for the outputs at most; beyond, a window's outputs are dropped and counted
IDLE_S = 0.02  # with the gate shut this long, the server is idle (or busy on the host alone): work anyway


class Gate:
    """Open while the scheduler's thread waits for the GPU with the GIL released.

    `open` and `shut` run on the scheduler's thread every cycle: attribute writes only, and
    the event is set only when a helper said it waits for it (`waiting`). A helper clears
    the event before it says so, so no opening after that is missed."""

    def __init__(self):
        self.is_open = False
        self.busy = False  # the scheduler's thread shut the gate since the helpers last found it idle
        self.waiting = False  # a helper waits on the event: the next opening sets it
        self._ev = threading.Event()

    def open(self):
        self.is_open = True
        if self.waiting:
            self.waiting = False
            self._ev.set()

    def shut(self):  # the hot path writes these two inline (profiler.py)
        self.is_open = False
        self.busy = True

    def wait(self, timeout=None) -> bool:
        """On a helper: until the gate opens (True) or `timeout` (IDLE_S) passes (False)."""
        timeout = IDLE_S if timeout is None else timeout
        if self.is_open or not self.busy:
            return True
        self._ev.clear()
        self.waiting = True
        if self.is_open:
            return True
        if self._ev.wait(timeout):
            return True
        self.busy = False  # no hook ran for IDLE_S: idle until the next one
        return False


# where the cycles are read (the module's docstring)
INLINE = "inline"
AT_HAND_OVER = "at hand-over"
READER_THREAD = "reader thread"
READINGS = (INLINE, AT_HAND_OVER, READER_THREAD)


class Folder:
    def __init__(self, reader, interval, num_steps=None, on_close=None, on_error=None, reading=INLINE):
        if reading not in READINGS:
            raise ValueError(f"reading is one of {', '.join(READINGS)}, not {reading!r}")
        self.reader = reader  # reads a slot's events (the profiler)
        # the open window holds the decode cycles from the one the last close left off at to
        # `window_end` - 1: the profiler closes it after `interval` acceptance lists, which
        # come after their cycles (or sooner, idle, when every cycle read has its list)
        self.interval = interval
        self.window_end = interval
        self.early: list = []  # cycles read before their window opened, added when it does
        self.num_steps = num_steps
        self.window = Window(0)
        self.on_close = on_close  # called with each closed window's summary and its kernel sample (outputs thread)
        self.on_error = on_error  # called with an exception the reading or folding raised
        self.observer = None  # told of each cycle read and each list settled (the cost policy), on this thread
        self.dropped_batches = 0  # windows whose outputs were dropped: the outputs were stuck
        self.threaded = threaded = reading != INLINE  # helper threads: the outputs one at least
        self.reading_thread = reading == READER_THREAD  # and a reader thread (else this thread reads at each hand-over)
        self.gate = Gate()
        self._items: deque = deque()  # handed over, not yet folded
        self._urgent = 0  # flushes waiting: work regardless of the gate
        self.pause = (lambda: time.sleep(0)) if threaded else (lambda: None)
        self.pause_turn = self._pause_turn if threaded else (lambda: None)
        self._wake = threading.Event()
        self._lock = threading.Lock()  # held by whoever folds an item: the reader, or the scheduler helping
        self._out: queue.Queue | None = None
        if threaded:
            self._out = queue.Queue()
            if self.reading_thread:
                self._thread = threading.Thread(target=self._run, name="specprof-reader", daemon=True)
                self._thread.start()
            self._out_thread = threading.Thread(target=self._run_outputs, name="specprof-outputs", daemon=True)
            self._out_thread.start()

    def submit(self, items: list) -> None:
        """A batch of ("slot", slot) / ("accept", correct, committed, skipped) / ("lost", kind)
        / ("close", extra fields) / ("kernels", a kernel sample) items, in order."""
        self._items.extend(items)
        if not self.reading_thread:
            self._fold(yield_gil=False)
        elif not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout: float = 10.0, outputs: bool = True) -> bool:
        """Wait until every submitted item whose events completed is folded and (`outputs`)
        every closed window's outputs ran (tests, /server_info, shutdown). True when they were."""
        if not self.reading_thread:
            self._fold(yield_gil=False)
            if not (outputs and self.threaded):
                return True
        done = threading.Event()
        self._urgent += 1
        try:
            if self.reading_thread:
                self._items.append(("flush", done, outputs))
                self._wake.set()
                self.gate.open()
            else:  # set once the outputs before it ran
                self._out.put(done)
            return done.wait(timeout)
        finally:
            self._urgent -= 1

    def help(self, most: int = 16) -> None:
        """On the scheduler's thread, when the reader falls behind (it got no turn: a host
        that never waits for the GPU): fold up to `most` items here, so no cycle is lost."""
        if self._lock.acquire(timeout=0.002):  # the reader finishes its item (the GIL is released here)
            try:
                self._fold(yield_gil=False, most=most)
            finally:
                self._lock.release()

    # -- the reader thread ------------------------------------------------------------
    def _run(self):
        try:
            self.reader.attach()
        except Exception as e:
            if self.on_error is not None:
                self.on_error(e)
            return
        while True:
            self._wake.wait(IDLE_S if self._items else None)
            self._wake.clear()
            if self._items:
                self._fold(yield_gil=True)

    def _wait_turn(self) -> None:
        """Until the reader may take the GIL: the gate is open, a flush waits, the reader is
        behind, or the gate stayed shut for IDLE_S (nothing waits on the GPU)."""
        if not (self.gate.is_open or self._urgent or self.reader.behind()):
            self.gate.wait()

    def _fold(self, yield_gil, most=None):
        if yield_gil:  # the reader: the lock is taken for each item
            while self._items:
                self._wait_turn()
                with self._lock:
                    if not self._fold_one(True):
                        return
                time.sleep(0)
        else:
            n = 0
            while self._items and (most is None or n < most):
                if not self._fold_one(False):
                    return
                n += 1

    def _fold_one(self, yield_gil) -> bool:
        """The next item; False when there is none, or it waits for its events."""
        items = self._items
        r = self.reader
        try:
            while items:
                it = items[0]
                kind = it[0]
                if kind == "slot":
                    s = it[1]
                    if not r.slot_ready(s):
                        if r.slot_stuck():
                            r.slot_drop(s)
                            items.popleft()
                            continue
                        if yield_gil and self._urgent:  # the events will complete: wait a little
                            time.sleep(0.0005)
                            continue
                        return False  # read at the next hand-over
                    w = self.window
                    obs = self.observer
                    if s.kind == "decode" and r.decode_read >= self.window_end:
                        read = r.slot_read(s, w.index + 1)
                        self.early.append(read)
                    elif obs is None and not s.detail and r.read_whole(s, w):  # most cycles timed whole: no Cycle made
                        items.popleft()
                        return True
                    else:
                        read = r.slot_read(s, w.index)
                        w.add_cycle(*read)
                    if obs is not None:
                        obs.cycle(read[0])
                elif kind == "accept":
                    un, steps, switched = r.settle(it[1], it[3], self.window.index)
                    if un is not None:
                        self.window.uncharge(*un)
                    self.window.add_accept(it[1], it[2], it[3], steps, switched)
                    obs = self.observer
                    if obs is not None:  # the cost policy's live figures (policy.py)
                        obs.accept(it[1], it[2], it[3], steps)
                elif kind == "lost":
                    r.lost(*it[1:])
                elif kind == "resync":  # the lists of the cycles read and not settled are lost: the
                    # open window holds those cycles and closes `interval` lists on, so it ends later
                    self.window_end += max(r.decode_read - r.decode_settled, 0)
                    r.resync()
                elif kind == "kernels":
                    r.kernel_sample(it[1])
                elif kind == "close":
                    self._close(it[1])
                elif kind == "flush":
                    items.popleft()
                    if self._out is not None and it[2]:
                        self._out.put(it[1])  # set once the outputs before it ran
                    else:
                        it[1].set()
                    continue
                items.popleft()
                return True
            return False
        except Exception as e:  # never take the server down
            items.clear()
            if self.on_error is not None:
                self.on_error(e)
            return False

    def _close(self, extra: dict) -> None:
        """The open window closes: the fields counted up to here join it, and its summary is
        made where the outputs run (the outputs thread: a window is not touched after its
        close, the folding goes on into the next one)."""
        self.reader.close_fields(extra)
        extra["backlog_dropped"] = self.dropped_batches
        pending = self.reader.kernel_pending  # the oldest sample read rides beside the window (pipeline.py)
        sample = pending.popleft() if pending else None
        # the next window starts after the last cycle settled here: `interval` lists after the
        # last close, or fewer when it closed idle
        self.window_end = self.reader.decode_settled + self.interval
        closed = self.window
        self.window = Window(closed.index + 1)
        for c, end in self.early:
            self.window.add_cycle(c, end)
        self.early.clear()
        if self._out is None:
            if self.on_close is not None:
                self.on_close(self._summary(closed, extra), sample)
        elif self._out.qsize() >= BACKLOG:  # the outputs are stuck (a blocked file): never grow
            self.dropped_batches += 1
        else:
            self._out.put((closed, extra, sample))

    def _summary(self, window, extra: dict) -> dict:
        summary = window.summary(self.num_steps, self.pause)
        summary.update(extra)
        return summary

    def _pause_turn(self) -> None:
        """Inside a long step on a helper (a kernel sample's events): the GIL goes back, and
        the step goes on once the scheduler waits for the GPU again (or IDLE_S passed)."""
        time.sleep(0)
        if not (self.gate.is_open or self._urgent):
            self.gate.wait()

    # -- the outputs thread -----------------------------------------------------------
    def _run_outputs(self):
        while True:
            item = self._out.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if not self._urgent:
                self.gate.wait()
            try:
                closed, extra, sample = item
                summary = self._summary(closed, extra)
                if self.on_close is not None:
                    self.on_close(summary, sample)
            except Exception as e:
                if self.on_error is not None:
                    self.on_error(e)
