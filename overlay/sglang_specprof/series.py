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
    """Count, sum and a bounded reservoir of samples for percentiles."""

    __slots__ = ("n", "total", "max", "samples", "_rng", "_seed")

    def __init__(self, seed: int = 0):
        self.n = 0
        self.total = 0.0
        self.max = float("nan")
        self.samples: list[float] = []
        # made when the reservoir first fills (a window of the default 100 cycles never does):
        # a Random costs 4 us to make, and each window's buckets make dozens of series, on the
        # scheduler's thread as its cycles are folded
        self._rng = None
        self._seed = seed

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        if not x <= self.max:
            self.max = x
        if self.n <= SAMPLES_PER_SERIES:
            self.samples.append(x)
        else:
            rng = self._rng
            if rng is None:
                rng = self._rng = random.Random(self._seed)
            j = rng.randrange(self.n)
            if j < SAMPLES_PER_SERIES:
                self.samples[j] = x

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")

    def remove(self, x: float) -> None:
        """Take one value back out (a stalled cycle's, at the window's close)."""
        self.n -= 1
        self.total -= x
        try:
            self.samples.remove(x)
        except ValueError:
            pass
        self.max = max(self.samples) if self.samples else float("nan")

    def stats(self) -> dict:
        s = sorted(self.samples)
        return {"mean": _r(self.mean), "p50": _r(percentile(s, 0.5)), "p90": _r(percentile(s, 0.9)),
                "p99": _r(percentile(s, 0.99)), "max": _r(self.max), "n": self.n}


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

