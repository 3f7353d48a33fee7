"""A fake GPU for driving the profiler on the CPU: events take the fake device clock's time."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "overlay"))


class FakeEvent:
    __slots__ = ("t", "done", "external")

    def __init__(self, external=False):
        self.t = None
        self.done = False
        self.external = external


class FakeBackend:
    """`gpu` is the device clock (ms) an event completes at when recorded; `host` the host clock (s)."""

    def __init__(self):
        self.gpu = 0.0
        self.host = 0.0
        self.capture = False
        self.hold = False  # recorded events stay incomplete while True
        self.records = 0
        self.held = []

    def clock(self):
        return self.host

    def advance(self, gpu_ms, host_ms=None):
        self.gpu += gpu_ms
        self.host += (gpu_ms if host_ms is None else host_ms) / 1000.0

    def new_event(self, external=False):
        return FakeEvent(external)

    def refresh(self):
        pass

    def record(self, ev):
        self.records += 1
        ev.t = self.gpu
        ev.done = not self.hold
        if self.hold:
            self.held.append(ev)

    def record_captured(self, ev):
        assert self.capture, "record_captured outside a capture"
        self.record(ev)

    def release(self):
        for ev in self.held:
            ev.done = True
        self.held.clear()

    def query(self, ev):
        return ev.done

    def elapsed(self, a, b):
        assert a.done and b.done, "elapsed_time on an incomplete event would raise on a GPU"
        return b.t - a.t

    def query_captured(self, ev):
        return self.query(ev)

    def elapsed_captured(self, a, b):
        return self.elapsed(a, b)

    def capturing(self):
        return self.capture
