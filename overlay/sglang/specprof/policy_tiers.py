"""The cost policy's figures of one batch-size tier (policy.py): what a candidate step count
costs and what it commits, fed on the folder's reader thread and read by the decision on the
scheduler's.

- `Period`: a candidate's GPU period per cycle over its last RING cycles, with the sums its
  batch-size fit reads;
- `Acceptance`: per-position acceptance pooled over the step counts a tier ran, and the
  tokens a request commits per cycle from it (`sglang_specprof.model.expected_tokens`, the
  advisor's own formula);
- `Tier`: one of upstream's tiers, its candidates and their periods, and the tokens per GPU ms
  of each, measured or predicted (`Tier.rate`).
"""

from __future__ import annotations

import math
from collections import deque

from sglang_specprof.model import expected_tokens

UPDATE_CYCLES = 16  # a tier's decode cycles between two decisions
MIN_CYCLES = 16  # cycles a period needs to count as measured: a probe runs that long
STALE_CYCLES = 1000  # a tier's cycles after which a candidate's period is stale (explored again)
STALE_REQUESTS = 4000  # ... or its requests, whichever is longer
DECAY = 0.98  # weight each acceptance list leaves to the ones before (about the last 50)
RING = 64  # cycle periods kept per candidate
TRIM = 0.1  # share of them left out at each end (stalls; a switch's first cycle is left out anyway)
SHARED_UNTIL = 32  # requests (decayed: about 50 a request of batch at most) a tier's own first position needs before its acceptance replaces the pooled one



class Period:
    """A candidate's GPU period per cycle in one tier, over its last RING cycles: the mean of
    the middle of them (the longest and shortest TRIM left out: a stall, a kernel compiled
    for a new shape, is not the setting's cost). The sums over the ring of the batch size,
    the period and their products are kept as cycles come and go (the batch-size fit)."""

    __slots__ = ("ms", "bs", "step_ms", "seen_at", "cycles", "_mean", "sums")

    def __init__(self):
        self.ms: deque = deque(maxlen=RING)
        self.bs: deque = deque(maxlen=RING)
        self.step_ms: deque = deque(maxlen=RING)  # the draft model's step time, where its events were read
        self.seen_at = -1  # the tier's cycle count when it last ran
        self.cycles = 0  # cycles since it was (re)started
        self._mean = None
        self.sums = [0.0, 0.0, 0.0, 0.0]  # over the ring: bs, ms, bs * bs, bs * ms

    def add(self, ms, bs, step_ms):
        s = self.sums
        if len(self.ms) == RING:  # the oldest leaves the ring
            b0, m0 = self.bs[0], self.ms[0]
            s[0] -= b0
            s[1] -= m0
            s[2] -= b0 * b0
            s[3] -= b0 * m0
        self.ms.append(ms)
        self.bs.append(bs)
        s[0] += bs
        s[1] += ms
        s[2] += bs * bs
        s[3] += bs * ms
        if step_ms:
            self.step_ms.append(step_ms)
        self.cycles += 1
        self._mean = None
        if self.cycles % RING == 0:  # afresh now and then: no rounding piles up
            self.sums = [sum(self.bs), sum(self.ms), sum(b * b for b in self.bs),
                         sum(b * m for b, m in zip(self.bs, self.ms))]

    def measured(self) -> bool:
        return self.cycles >= MIN_CYCLES

    def mean(self, at_bs=None, slope=0.0):
        """The trimmed mean; with `at_bs`, moved to that batch size from the ring's mean batch
        size by `slope` ms a request (Tier.batch_slope)."""
        if self._mean is None:
            xs = sorted(self.ms)
            k = int(len(xs) * TRIM)
            mid = xs[k:len(xs) - k] or xs
            self._mean = sum(mid) / len(mid)
        if at_bs is not None and slope:
            return self._mean + slope * (at_bs - self.mean_bs())
        return self._mean

    def mean_bs(self):
        return self.sums[0] / len(self.bs) if self.bs else 0.0

    def mean_step(self):
        return sum(self.step_ms) / len(self.step_ms) if self.step_ms else None


class Acceptance:
    """Per-position acceptance of one tier, pooled over the step counts it ran at: at position
    p, the requests that reached it (p - 1 drafts right, run at p steps or more) and those that
    got it right too; each list decays what came before it by DECAY at the positions it saw."""

    def __init__(self):
        self.reached: list[float] = []  # index p - 1
        self.passed: list[float] = []

    def add(self, correct, steps):
        if steps <= 0:
            return
        r, ps = self.reached, self.passed
        while len(r) < steps:
            r.append(0.0)
            ps.append(0.0)
        for i in range(steps):  # positions past `steps` keep what the last runs there said
            r[i] *= DECAY
            ps[i] *= DECAY
        counts = [0] * (steps + 1)  # requests by correct drafts
        for c in correct:
            counts[min(max(int(c), 0), steps)] += 1
        at = len(correct)  # requests that reached position p
        for p in range(1, steps + 1):
            r[p - 1] += at
            at -= counts[p - 1]
            ps[p - 1] += at

    def rates(self) -> list[float]:
        return [ps / r if r > 0 else 0.0 for ps, r in zip(self.passed, self.reached)]

    def tokens(self, steps: int, z: float = 0.0) -> float | None:
        """Tokens a request commits per cycle at `steps`: 1 + sum over p of a_1 ... a_p (the
        advisor's `expected_tokens`); past the positions measured, the last one is held (the
        optimistic side; a probe measures it).
        With `z`, each a_p is taken z standard errors higher (at most 1): how much a position
        seen by few requests might still give."""
        if steps <= 0:
            return 1.0
        a = self.rates()
        if not a:
            return None
        if z:
            a = [min(1.0, x + z * math.sqrt(max(x * (1.0 - x), 0.05) / r)) if r > 0 else 1.0
                 for x, r in zip(a, self.reached)]
        return expected_tokens(a, steps)


class Tier:
    """One of upstream's batch-size tiers: its candidates, the step count it runs, its figures."""

    def __init__(self, key, candidates, steps, shared=None):
        self.key = key
        self.candidates = candidates  # sorted, and holding `steps`
        self.steps = steps
        self.periods = {c: Period() for c in self.candidates}
        self.accept = Acceptance()
        self.shared = shared  # every tier's acceptance pooled: for a tier that has measured too little of its own
        self.cycles = 0  # decode cycles of this tier (the scheduler's count)
        self.next_decision = UPDATE_CYCLES
        self.probing = None  # the candidate being measured, while a probe runs
        self.seen_steps = None  # the step count of the last cycle read (the reader thread)
        self.probed_at: dict = {}  # candidate -> this tier's cycle count when its last probe began
        self.last = {}  # the figures of the last decision, for /server_info and the profile

    def fresh(self, c) -> bool:
        """Measured, and lately: within STALE_CYCLES of this tier's cycles, or STALE_REQUESTS of
        its requests where batches are small (a probe there takes more cycles)."""
        f = self.periods[c]
        if not f.measured():
            return False
        stale = max(STALE_CYCLES, STALE_REQUESTS / max(f.mean_bs(), 1.0))
        return self.cycles - f.seen_at <= stale

    def batch_slope(self) -> float:
        """GPU ms a cycle grows by per request of batch, within this tier: the covariance of each
        candidate's periods with its batch sizes about its own means, pooled (so the step counts'
        own costs do not enter), at least 0 and at most the period in proportion to the batch."""
        sxx = sxy = 0.0
        most = None
        for f in self.periods.values():
            n = len(f.ms)
            if n < MIN_CYCLES:
                continue
            sb, sm, sbb, sbm = f.sums
            sxx += sbb - sb * sb / n
            sxy += sbm - sb * sm / n
            if sb > 0:
                most = sm / sb if most is None else min(most, sm / sb)
        if sxx <= 1e-9 or most is None:
            return 0.0
        return min(max(sxy / sxx, 0.0), most)

    def at_batch(self):
        """Where candidates are compared: (batch size, slope): the batch the tier runs now (the
        mean over the current step count's periods) and Tier.batch_slope. A candidate measured
        while the batches were smaller (the tail of a load) would otherwise look faster."""
        return self.periods[self.steps].mean_bs() or None, self.batch_slope()

    def period(self, c, at=(None, 0.0)):
        """(GPU ms per cycle at `c`, "measured" or "predicted"), or (None, "unknown"); `at`:
        (batch size, slope) to compare at (at_batch).

        0 steps is another path (no draft, no tree, a verify of one token a request, which runs
        the decode kernel: zero_step.py): it is never predicted from the step counts that
        draft, nor they from it; a stale figure of its own is its prediction, and one never
        measured is unknown (`decide` probes it once)."""
        if self.fresh(c):
            return self.periods[c].mean(*at), "measured"
        own = self.periods[c]
        drafting = [k for k in self.candidates if k > 0 and self.fresh(k)]
        ref = self.steps if self.steps > 0 else min(drafting, key=lambda k: abs(k - c), default=None)
        if c == 0 or ref is None:
            return (own.mean(*at), "predicted") if own.measured() else (None, "unknown")
        cur = self.periods[ref]
        if not cur.measured():
            return None, "unknown"
        pts = [(k, self.periods[k].mean(*at)) for k in drafting]
        slope = 0.0
        if len(pts) >= 2:
            n = len(pts)
            mx = sum(k for k, _ in pts) / n
            my = sum(t for _, t in pts) / n
            sxx = sum((k - mx) ** 2 for k, _ in pts)
            slope = max(sum((k - mx) * (t - my) for k, t in pts) / sxx if sxx > 0 else 0.0, 0.0)
        step = cur.mean_step()
        if step is not None and step > slope:
            slope = step
        # at most the whole cycle in proportion to its tokens (steps + 1): a noisy line through
        # close points must not predict a cycle for nothing
        t = cur.mean(*at)
        slope = min(slope, t / (ref + 1))
        return t + slope * (c - ref), "predicted"

    def settled(self) -> bool:
        """It decided with a figure for the step count it runs."""
        fig = self.last.get(self.steps)
        return fig is not None and fig[0] is not None

    def acceptance(self) -> Acceptance:
        """This tier's acceptance once SHARED_UNTIL requests reached its first position, else every
        tier's pooled (a tier that has run only at 0 steps, or just began, measured none): what a
        request accepts depends on the request, not on how many ran beside it."""
        own = self.accept
        if self.shared is None or (own.reached and own.reached[0] >= SHARED_UNTIL):
            return own
        return self.shared

    def rate(self, c, z=0.0, at=(None, 0.0)):
        """(tokens a request gets per GPU ms at `c`, how its period is known); with `z`, the
        acceptance at its upper bound (`Acceptance.tokens`); `at`: see `period`."""
        t, how = self.period(c, at)
        e = self.acceptance().tokens(c, z)
        if t is None or e is None:
            return None, "unknown"
        return e / t, how
