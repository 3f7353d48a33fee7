"""Count, sum and a bounded reservoir of samples: what each figure of a window is kept as. Plain Python."""

from __future__ import annotations

import math
import random

SAMPLES_PER_SERIES = 2048  # reservoir size: memory stays bounded whatever the window length


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Series:
    """Count, sum and a bounded reservoir of samples for percentiles.

    `add` is the list's own `append` (one C call: the cycles are folded on the scheduler's
    thread, about ten values a cycle); the count, the sum, the maximum and the reservoir are
    brought up to date from the values appended (`settle`) where they are read, and by the
    window every SAMPLES_PER_SERIES cycles (`Window.add_cycle`), which bounds the memory.
    Settled in the order added, with the same generator, the figures are those of adding one
    value at a time."""

    __slots__ = ("_n", "_total", "_max", "_kept", "_new", "add", "_rng", "_seed")

    def __init__(self, seed: int = 0):
        self._n = 0
        self._total = 0.0
        self._max = float("nan")
        self._kept: list[float] = []  # the reservoir (every value, up to SAMPLES_PER_SERIES)
        self._new: list[float] = []  # appended since the last settle, in order
        self.add = self._new.append
        # made when the reservoir first fills (a window of the default 100 cycles never does):
        # a Random costs 4 us to make, and each window's buckets make dozens of series
        self._rng = None
        self._seed = seed

    def __getstate__(self):  # a copy (copy, deepcopy, pickle) appends to a list of its own
        self.settle()
        return {k: getattr(self, k) for k in self.__slots__ if k != "add"}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)
        self.add = self._new.append

    def settle(self) -> None:
        new = self._new
        if not new:
            return
        n, total, mx, kept = self._n, self._total, self._max, self._kept
        for x in new:
            n += 1
            total += x
            if not x <= mx:
                mx = x
            if n <= SAMPLES_PER_SERIES:
                kept.append(x)
            else:
                rng = self._rng
                if rng is None:
                    rng = self._rng = random.Random(self._seed)
                j = rng.randrange(n)
                if j < SAMPLES_PER_SERIES:
                    kept[j] = x
        new.clear()
        self._n, self._total, self._max = n, total, mx

    @property
    def n(self) -> int:
        return self._n + len(self._new)

    @property
    def total(self) -> float:
        self.settle()
        return self._total

    @property
    def max(self) -> float:
        self.settle()
        return self._max

    @property
    def samples(self) -> list[float]:
        self.settle()
        return self._kept

    @property
    def mean(self) -> float:
        self.settle()
        return self._total / self._n if self._n else float("nan")

    def remove(self, x: float) -> None:
        """Take one value back out (a stalled cycle's, at the window's close)."""
        self.settle()
        self._n -= 1
        self._total -= x
        try:
            self._kept.remove(x)
        except ValueError:
            pass
        self._max = max(self._kept) if self._kept else float("nan")

    def stats(self) -> dict:
        s = sorted(self.samples)
        return {"mean": _r(self.mean), "p50": _r(percentile(s, 0.5)), "p90": _r(percentile(s, 0.9)),
                "p99": _r(percentile(s, 0.99)), "max": _r(self._max), "n": self._n}


def rounded(x: float | None) -> float | None:
    """4 decimals; None for None and NaN (an empty series): what every summary writes."""
    return None if x is None or x != x else round(x, 4)


_r = rounded


def per_position(hist: list[int], positions: int) -> list[float | None]:
    """a_p = P(draft p correct | drafts 1..p-1 correct), p = 1..positions, from the histogram
    of accept lengths: reached(p), the requests whose first p drafts were all correct, is the
    count of accept lengths >= p + 1."""
    reached = [sum(hist[p + 1:]) for p in range(positions + 1)]
    return [_r(reached[p] / reached[p - 1]) if reached[p - 1] else None for p in range(1, positions + 1)]

