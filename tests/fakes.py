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

    def stream_id(self):
        return None  # one stream: refresh() returns its handle, None

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


class _KEvent:
    """One of kineto's events, as `prof.profiler.kineto_results.events()` gives them."""

    def __init__(self, name, gpu, start, dur, corr, annotation=False):
        self._v = (name, gpu, start, dur, corr, annotation)

    def name(self):
        return self._v[0]

    def device_type(self):
        return "DeviceType.CUDA" if self._v[1] else "DeviceType.CPU"

    def start_ns(self):
        return self._v[2]

    def duration_ns(self):
        return self._v[3]

    def correlation_id(self):
        return self._v[4]

    def is_user_annotation(self):
        return self._v[5]


class _Results:
    """kineto's results of one profile: its events (a class of its own, not one made at each
    stop: a class is in a reference cycle of its own, which a test of cyclic garbage would see)."""

    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


class FakeTorch:
    """The part of torch the kernel sampler uses, over a FakeBackend's clocks: `launch` puts a
    kernel on the fake device (and its launch on the host) as CUPTI would report them."""

    def __init__(self, backend):
        self.b = backend
        self.active = None
        self.other_on = False
        self.tick = 0
        self.starts = 0
        self.synced = 0
        fake = self

        class _Inner:
            def __init__(self):
                self.use_device = "cuda"
                self.kineto_results = None

        class _Profile:
            def __init__(self, **kw):
                self.kw = kw
                self.profiler = _Inner()
                self.events = []
                # as torch's profile object: its action map holds its own bound methods, a
                # reference cycle that only the cyclic garbage collector frees
                self.action_map = {("none", "record"): [self.start], ("record", "none"): [self.stop]}

            def start(self):
                assert fake.active is None, "a second torch profiler on one thread"
                fake.active = self
                fake.starts += 1

            def stop(self):
                if self.profiler.use_device is not None:
                    fake.synced += 1
                fake.active = None
                self.profiler.kineto_results = _Results(list(self.events))

        class _RecordFunction:
            def __init__(self, name):
                self.name = name

            def __enter__(self):
                if fake.active is not None:
                    fake.active.events.append(_KEvent(self.name, False, fake.host_ns(), 0, 0))
                return self

            def __exit__(self, *a):
                return False

        class _Activity:
            CPU, CUDA = "cpu", "cuda"

        class _ProfilerNS:
            ProfilerActivity = _Activity
            profile = _Profile
            record_function = _RecordFunction

        class _Autograd:
            @staticmethod
            def _profiler_enabled():
                return fake.other_on or fake.active is not None

        class _C:
            _autograd = _Autograd

        self.profiler = _ProfilerNS
        self._C = _C
        self.corr = 0

    def host_ns(self):
        self.tick += 1
        return int(round(self.b.host * 1e9)) + self.tick

    def launch(self, name, ms, via="cudaLaunchKernel"):
        """A kernel of `ms` on the device, launched now (the device runs it at once)."""
        self.corr += 1
        start = int(round(self.b.gpu * 1e6))
        if self.active is not None:
            self.active.events.append(_KEvent(via, False, self.host_ns(), 1000, self.corr))
            self.active.events.append(_KEvent(name, True, start, int(round(ms * 1e6)), self.corr))
        self.b.advance(ms)
