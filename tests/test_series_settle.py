"""A series appends its values in C and brings its count, sum, maximum and reservoir up to date
where they are read (Series.settle): the figures are those of adding one value at a time, for any
values, any reads in between and past the reservoir's size; and a window settles its series often
enough that none holds more than twice its reservoir."""
import random

from hypothesis import given, settings, strategies as st

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import series
from sglang_specprof.window import Cycle, Window


class OneAtATime:
    """The series as it was: every figure updated at each value."""

    def __init__(self, seed=0):
        self.n, self.total, self.max, self.samples, self.rng, self.seed = 0, 0.0, float("nan"), [], None, seed

    def add(self, x):
        self.n += 1
        self.total += x
        if not x <= self.max:
            self.max = x
        if self.n <= series.SAMPLES_PER_SERIES:
            self.samples.append(x)
        else:
            if self.rng is None:
                self.rng = random.Random(self.seed)
            j = self.rng.randrange(self.n)
            if j < series.SAMPLES_PER_SERIES:
                self.samples[j] = x

    def remove(self, x):
        self.n -= 1
        self.total -= x
        if x in self.samples:
            self.samples.remove(x)
        self.max = max(self.samples) if self.samples else float("nan")


def same(a, b):
    assert b.n == a.n and b.total == a.total and b.samples == a.samples
    assert b.max == a.max or (a.max != a.max and b.max != b.max)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.floats(min_value=0, max_value=1e4, allow_nan=False),
                              st.sampled_from(["read", "settle", "remove"])), max_size=300),
       seed=st.integers(min_value=0, max_value=5))
def test_settled_late_is_added_one_at_a_time(ops, seed):
    a, b = OneAtATime(seed), series.Series(seed)
    for op in ops:
        if op == "read":
            same(a, b)
        elif op == "settle":
            b.settle()
        elif op == "remove":  # taken out at a window's close, before the reservoir fills
            if a.samples and a.n < series.SAMPLES_PER_SERIES:
                x = a.samples[len(a.samples) // 2]
                a.remove(x)
                b.remove(x)
        else:
            a.add(op)
            b.add(op)
    same(a, b)
    assert b.stats()["n"] == a.n


def test_past_the_reservoir_and_back(monkeypatch):
    monkeypatch.setattr(series, "SAMPLES_PER_SERIES", 50)
    r = random.Random(3)
    a, b = OneAtATime(9), series.Series(9)
    for i in range(400):
        x = r.random()
        a.add(x)
        b.add(x)
        if i % 37 == 0:
            same(a, b)
    same(a, b)
    assert len(b.samples) == 50
    for x in list(a.samples[:5]):  # a window's close takes its stalled cycles out, after the last value
        a.remove(x)
        b.remove(x)
    same(a, b)


def test_a_long_window_keeps_its_series_bounded(monkeypatch):
    """A window of many cycles (the interval may be a million): its series are settled every
    SAMPLES_PER_SERIES cycles, so none holds more than twice its reservoir unsettled."""
    import sglang_specprof.window as window

    monkeypatch.setattr(window, "SAMPLES_PER_SERIES", 64)
    monkeypatch.setattr(series, "SAMPLES_PER_SERIES", 64)
    w = Window(0)
    most = 0
    for i in range(1000):
        w.add_cycle(Cycle(kind="decode", bs=4, phases=[("draft", 1.0 + i % 7, 0.1), ("verify", 2.0, 0.2)],
                          gap_gpu_ms=0.1, period_host_ms=3.0, period_gpu_ms=3.3, host_start_s=float(i)))
        b = w.buckets["3-4"]
        most = max(most, len(b.gpu["draft"]._new), len(b.cycle_gpu._new), len(b.gap._new))
    assert most <= 64
    b = w.buckets["3-4"]
    assert b.cycle_gpu.n == 1000 and len(b.cycle_gpu.samples) == 64
    assert b.gpu["draft"].max == 7.0 and abs(b.gpu["verify"].mean - 2.0) < 1e-12


def test_a_copy_of_a_series_is_a_series_of_its_own():
    """`add` is a bound `append`: a deep copy (deepcopy, pickle) appends to its own list, not to
    the original's (a deepcopy keeps a builtin method as it is)."""
    import copy
    import pickle

    s = series.Series(4)
    for x in (1.0, 5.0, 3.0):
        s.add(x)
    for c in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        c.add(10.0)
        assert c.n == 4 and c.max == 10.0 and c.samples == [1.0, 5.0, 3.0, 10.0]
    assert s.n == 3 and s.max == 5.0 and s.samples == [1.0, 5.0, 3.0]
