"""Folding cycles into summary windows, and closing windows, off the scheduler's thread.

The profiler's hot path only reads a cycle's events and hands the numbers here in small
batches (`submit`); folding them into the window's statistics, closing the window (the
summary, the advisor, the log table, the JSONL and Prometheus sinks, the rank exchange)
runs on a helper thread. The helper gives the GIL back between every few items
(`time.sleep(0)`), so the scheduler's thread waits at most one item's work for it, and
most of the helper's work falls where the scheduler waits on the GPU with the GIL released.

Inline (`threaded=False`, the tests' default) runs each batch at once on the caller's
thread, with the same code.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from sglang_specprof.window import Window

logger = logging.getLogger("sglang.specprof")

YIELD_EVERY = 2  # items folded between two hand-backs of the GIL (each item is tens of microseconds)
BACKLOG = 256  # batches waiting at most; beyond, a batch is dropped and counted


class Folder:
    def __init__(self, num_steps=None, on_close=None, on_error=None, threaded=False):
        self.num_steps = num_steps
        self.window = Window(0)
        self.on_close = on_close  # called with each closed window's summary (on the helper)
        self.on_error = on_error  # called with an exception the folding raised
        self.dropped_batches = 0
        self.threaded = threaded
        # between steps of a window close: hand the GIL back to the scheduler's thread
        self.pause = (lambda: time.sleep(0)) if threaded else (lambda: None)
        self._q: queue.Queue | None = None
        if threaded:
            self._q = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="specprof-folder", daemon=True)
            self._thread.start()

    def submit(self, items: list) -> None:
        """A batch of ("cycle", Cycle, end_host_s) / ("accept", correct, committed, skipped) /
        ("uncharge", bs, ms) / ("close", extra fields) items, in order."""
        if self._q is None:
            self._fold(items, yield_gil=False)
        elif self._q.qsize() >= BACKLOG:  # the helper is stuck (a blocked output): never grow
            self.dropped_batches += 1
        else:
            self._q.put(items)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted batch is folded (tests, shutdown). True when it was."""
        if self._q is None:
            return True
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout)

    def _run(self):
        while True:
            items = self._q.get()
            if isinstance(items, threading.Event):
                items.set()
                continue
            self._fold(items, yield_gil=True)

    def _fold(self, items, yield_gil):
        try:
            w = self.window
            for i, it in enumerate(items):
                kind = it[0]
                if kind == "cycle":
                    w.add_cycle(it[1], it[2])
                elif kind == "accept":
                    w.add_accept(it[1], it[2], it[3])
                elif kind == "uncharge":
                    w.uncharge(it[1], it[2])
                elif kind == "close":
                    self._close(it[1])
                    w = self.window
                if yield_gil and i % YIELD_EVERY == YIELD_EVERY - 1:
                    time.sleep(0)
        except Exception as e:  # never take the server down
            if self.on_error is not None:
                self.on_error(e)

    def _close(self, extra: dict) -> None:
        summary = self.window.summary(self.num_steps, self.pause)
        summary.update(extra)
        summary["backlog_dropped"] = self.dropped_batches
        self.window = Window(self.window.index + 1)
        if self.on_close is not None:
            self.on_close(summary)
