"""The garbage collector's pauses of the host inside each cycle: a part of `Profiler`
(profiler.py). Once `follow` registered it in `gc.callbacks`, each collection's host time
is added to the slot of the cycle in flight (`Slot.gc_ms`); such pauses are where the
device can sit waiting on the host."""

from __future__ import annotations

import gc


class GcPauses:
    def __init__(self, profiler):
        self.p = profiler
        self.t0 = None  # the host time the collection in progress started
        self.cb = None  # the callback while registered

    def follow(self):
        """Register in `gc.callbacks` (once)."""
        if self.cb is None:
            self.cb = self.on_gc
            gc.callbacks.append(self.cb)

    def on_gc(self, phase, info):
        try:
            p = self.p
            if phase == "start":
                self.t0 = p.clock()
            elif self.t0 is not None:
                s = p.cur
                if s is not None:
                    s.gc_ms += (p.clock() - self.t0) * 1000.0
                self.t0 = None
        except Exception:
            pass

    def stop(self):
        """Leave `gc.callbacks` (the profiler is being replaced)."""
        if self.cb is not None:
            try:
                gc.callbacks.remove(self.cb)
            except ValueError:
                pass
            self.cb = None
