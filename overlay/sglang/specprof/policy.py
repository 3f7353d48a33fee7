"""--speculative-adaptive-policy cost: SGLang's adaptive step choice, made from the live profile.

SGLang's `--speculative-adaptive` keeps, per batch-size tier, a list of candidate step counts
with CUDA graphs for each, and picks one from an average of the accept length (one step more
than it). That rule never weighs what a step costs. `CostPolicy` takes the place of its
chooser (`AdaptiveSpeculativeParams`, the object the controller asks which step count a batch
runs at) and, per tier, runs the candidate with the highest tokens/s:

- tokens a request commits per cycle at s steps, 1 + a_1 + a_1 a_2 + ... + a_1...a_s, from
  per-position acceptance pooled over every step count the tier ran (a request run at s
  steps says nothing past position s: it is cut there, not rejected), so that the figure
  of one candidate is not the noise of its own few cycles;
- over the cycle's GPU period at s steps: measured, for a candidate run lately (the trimmed
  mean of its last RING cycles, the first cycle after each change of step count left out: its
  period holds the worker's swap of graphs, not the setting's cost); predicted for the
  others from the step count running now, by the slope of a line through the fresh
  measurements, at least the draft model's step time measured now, at most the cycle
  scaled by its tokens; every candidate's periods taken at the batch size the tier runs
  now (each cycle moved by the tier's growth per request, fitted within each candidate's
  own cycles and pooled), so that one measured while the batches were smaller (a load's
  tail) does not look faster for it;
- explored: a rival predicted faster, a neighbour not measured lately whose prediction is
  within EXPLORE_MARGIN, or a neighbour whose acceptance is known from so few requests that
  its upper bound (UPPER_Z standard errors) would beat the current figure (at most once in
  COOLDOWN probes' time), runs until PROBE_REQUESTS requests ran at it, so that candidate
  costs are measured rather than extrapolated; the next decision keeps the best;
- with hysteresis: a rival must beat the current figure by HYSTERESIS to take its place, and
  each switch is logged with both figures.

The folder's reader thread feeds `cycle` (each decode cycle read) and `accept` (each list
settled, with the step count its cycle ran at).

Decisions run every UPDATE_CYCLES of a tier's decode cycles on the scheduler's thread (a
sort of each candidate's 64 periods that changed, and some arithmetic); the figures are
folded on the reader thread.

For benchmarks, with `SGLANG_SPECPROF_POLICY_FILE` set, each read of /server_info (on the
scheduler's thread, between batches) takes the mode from that file when it changed: `cost`,
`ema` (upstream's rule) or a step count to pin every tier to; the answer's
`speculative_profile.adaptive_policy` says which is in force. So one server runs the static
settings, upstream's policy and this one round by round.
"""

from __future__ import annotations

import logging
import math
import os
import stat
from collections import deque

from sglang_specprof.table import printable

logger = logging.getLogger("sglang.specprof")

UPDATE_CYCLES = 16  # a tier's decode cycles between two decisions
MIN_CYCLES = 16  # cycles a period needs to count as measured: a probe runs that long
STALE_CYCLES = 1000  # a tier's cycles after which a candidate's period is stale (explored again)
STALE_REQUESTS = 4000  # ... or its requests, whichever is longer
EXPLORE_MARGIN = 0.08  # explore a neighbour predicted within 8% of the current figure
HYSTERESIS = 0.02  # a measured rival takes over when 2% faster
DECAY = 0.98  # weight each acceptance list leaves to the ones before (about the last 50)
RING = 64  # cycle periods kept per candidate
TRIM = 0.1  # share of them left out at each end (stalls; a switch's first cycle is left out anyway)
PROBE_REQUESTS = 32  # a probe runs until this many requests ran at its step count (MIN_CYCLES at least)
UPPER_Z = 2.0  # a neighbour is probed while its acceptance 2 standard errors up would beat the current figure
COOLDOWN = 25  # ... at most once in 25 probes' time
SHARED_UNTIL = 32  # requests (decayed: about 50 a request of batch at most) a tier's own first position needs before its acceptance replaces the pooled one
POLICY_FILE_ENV = "SGLANG_SPECPROF_POLICY_FILE"
SLOT_SETTINGS = ("ema_alpha", "update_interval", "warmup_batches", "down_hysteresis", "up_hysteresis",
                 "ceiling_coeff")  # upstream's per-tier settings, kept where `ema-all` changes the candidates


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
        """Tokens a request commits per cycle at `steps`: 1 + sum over p of a_1 ... a_p; past the
        positions measured, the last one is held (the optimistic side; a probe measures it).
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
        e, run = 1.0, 1.0
        for p in range(steps):
            run *= a[p] if p < len(a) else a[-1]
            e += run
        return e


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


class CostPolicy:
    """Stands where upstream's AdaptiveSpeculativeParams stood; keeps it for `ema` mode and
    for what the controller reads of it (candidate steps, graph batch sizes).

    `launch_steps` with `widen` (no config file given): every tier's candidates are 0 to the
    launch step count, with upstream's own for the tier beside them, and graphs are captured
    for each of them at every batch size (`cuda_graph_bs_for_step`); every tier starts at the
    launch step count. A user's config file (`widen` False) restricts them to its own."""

    def __init__(self, upstream, mode="cost", launch_steps=None, widen=False):
        self.up = upstream
        self.rule = upstream  # upstream's rule as the `ema` modes run it (`set_mode`)
        self.mode = mode
        slots = upstream._slots  # tier -> AdaptiveStepSlot (0.5.16): its candidates and first step count
        self.bs_list = sorted(slots)
        self.launch_steps = launch_steps
        self.widened = bool(widen and launch_steps is not None and launch_steps >= 0)
        self.shared = Acceptance()
        self.tiers = {}
        for bs in self.bs_list:
            cands, first = list(slots[bs].candidate_steps), slots[bs].current_steps
            if self.widened:
                cands = sorted(set(cands) | set(range(0, launch_steps + 1)))
                first = launch_steps
            self.tiers[bs] = Tier(bs, cands, first, self.shared)
        self._by_slot = {id(slots[bs]): self.tiers[bs] for bs in self.bs_list}
        self.pinned = None
        self.switches = 0
        self.mode_file = None  # benchmarks: where `reread` takes the mode from (follow_file)
        self._mode_text = None  # the bytes last read from mode_file
        self._file_problems: set = set()  # what was wrong with mode_file, each warned once
        self._rules = {}  # benchmarks: the upstream rules built for `ema-all` and `ema:PATH`

    # -- what the controller calls (upstream's interface) --------------------------------------
    @property
    def candidate_steps(self):
        """Every step count a tier may run (the controller builds a runtime state for each)."""
        return sorted(set(self.up.candidate_steps) | {c for t in self.tiers.values() for c in t.candidates})

    def set_cuda_graph_bs(self, cuda_graph_bs):
        self.up.set_cuda_graph_bs(cuda_graph_bs)
        for r in self._rules.values():
            r.set_cuda_graph_bs(cuda_graph_bs)

    def cuda_graph_bs_for_step(self, step):
        """The graph batch sizes to capture at `step`: those whose tier may run it (upstream's
        pruning, over this policy's candidates)."""
        got = self.up.cuda_graph_bs_for_step(step)
        if got is None or not self.widened:
            return got
        return [v for v in self.up._cuda_graph_bs if step in self.tiers[self.up._find_closest_bs(v)].candidates]

    def get_steps_for_batch(self, batch_size):
        if self.pinned is not None:
            return self.pinned
        if self.mode == "ema":
            return self.rule.get_steps_for_batch(batch_size)
        try:
            t = self.tier(batch_size)
            if t.cycles < MIN_CYCLES and not t.settled():
                self._start_near(t)
            return t.steps
        except Exception as e:  # never take the server down: upstream's rule takes over
            logger.warning("speculative adaptive policy: %s: %s; upstream's rule takes over.", type(e).__name__, e)
            self.mode, self.rule = "ema", self.up
            return self.up.get_steps_for_batch(batch_size)

    def on_verify_complete(self, num_correct_drafts_per_req, batch_size):
        if self.pinned is not None:
            return None
        if self.mode == "ema":
            return self.rule.on_verify_complete(num_correct_drafts_per_req, batch_size)
        try:
            t = self.tier(batch_size)
            t.cycles += 1
            if t.cycles >= t.next_decision:
                return self.decide(t)
        except Exception as e:  # never take the server down: upstream's rule takes over
            logger.warning("speculative adaptive policy: %s: %s; upstream's rule takes over.", type(e).__name__, e)
            self.mode, self.rule = "ema", self.up
        return None

    def _start_near(self, t):
        """A tier that has decided nothing yet runs what the nearest tier that has runs (on the
        H200 the tier of 8-31 requests, visited in a load's ramps only, sat at the launch step
        count of 7 while every other tier had settled on 2 or 3)."""
        near = [u for u in self.tiers.values() if u is not t and u.settled() and u.steps in t.candidates]
        if not near:
            return
        u = min(near, key=lambda u: abs(math.log(u.key / t.key)))
        if u.steps != t.steps and t.probing is None:
            logger.info("speculative adaptive (cost): tier %s starts at %d steps, as tier %s runs", t.key, u.steps,
                        u.key)
            t.steps = u.steps

    def tier(self, bs):
        """The tier upstream routes a batch of `bs` to (padded to a captured graph's size, then the
        largest tier key at or below it): its own routing, so the two never disagree."""
        return self._by_slot[id(self.up._route(bs))]

    # -- the live figures (the folder's reader thread) ------------------------------------------
    def learning(self) -> bool:
        """The figures are the cost policy's own: not fed while it is not choosing (pinned, ema)."""
        return self.mode == "cost" and self.pinned is None

    def cycle(self, c):
        """A decode cycle read: its GPU period at its step count."""
        if c.kind != "decode" or c.steps is None or c.drained or not self.learning():
            return
        t = self.tier(c.bs)
        f = t.periods.get(c.steps)
        ms = c.period_gpu_ms
        if c.steps != t.seen_steps:  # the first at a step count: its period holds the switch
            t.seen_steps = c.steps
            return
        if f is None or ms is None:  # the first after an idle spell or a prefill: no period
            return
        # the draft model's steps: the first reads the inputs, those after it are what one more costs
        steps = c.steps_gpu_ms[1:] if len(c.steps_gpu_ms) > 1 else c.steps_gpu_ms
        f.add(ms, c.bs, sum(steps) / len(steps) if steps else 0.0)
        f.seen_at = t.cycles

    def accept(self, correct, committed, skipped, steps):
        """A cycle's acceptance settled, at the step count that cycle ran at."""
        if steps is None or not correct or not self.learning():
            return
        self.tier(len(correct) + skipped).accept.add(correct, steps)
        self.shared.add(correct, steps)

    # -- the decision (the scheduler's thread) ---------------------------------------------------
    def decide(self, t):
        t.next_decision = t.cycles + UPDATE_CYCLES
        cur = t.steps
        if t.probing is not None:
            f = t.periods[t.probing]
            if not f.measured() or f.cycles * (f.mean_bs() or 1.0) < PROBE_REQUESTS:
                return None  # the probe runs on until measured
            t.probing = None
        at = t.at_batch()
        rates = {c: t.rate(c, at=at) for c in t.candidates}
        bs = at[0] or t.key  # the batch the candidates are compared at
        t.last = {c: (None if r is None else round(r * bs * 1000.0, 1), how) for c, (r, how) in rates.items()}
        here = rates[cur][0]
        if here is None:
            return None  # nothing measured yet at the step count it runs
        # the other side of 0 (drafting or not), never run in this tier: probed once, since
        # neither side predicts the other (Tier.period)
        side = [c for c in t.candidates if (c == 0) != (cur == 0) and c not in t.probed_at]
        if side and all(rates[c][1] == "unknown" for c in side):
            return self._probe(t, min(side, key=lambda c: abs(c - cur)), here, None, "first")
        best = max((c for c in t.candidates if rates[c][0] is not None), key=lambda c: rates[c][0])
        b_rate, b_how = rates[best]
        if best != cur and b_rate > here * (1 + HYSTERESIS):
            if b_how == "measured":
                return self._switch(t, best, "measured", here, b_rate)
            return self._probe(t, best, here, b_rate)
        # explore: a neighbour not measured lately whose prediction is close enough, or one whose
        # acceptance is known from so few requests that it might still be the faster (its upper
        # bound beats the current figure), not probed in the last COOLDOWN probes' time
        i = t.candidates.index(cur)
        for j in (i - 1, i + 1):
            if 0 <= j < len(t.candidates):
                c = t.candidates[j]
                r, how = rates[c]
                if r is None:
                    continue
                if how == "predicted" and r >= here * (1 - EXPLORE_MARGIN):
                    return self._probe(t, c, here, r)
                up = t.rate(c, UPPER_Z, at)[0]
                if (up is not None and up > here * (1 + HYSTERESIS) and r >= here * (1 - EXPLORE_MARGIN)
                        and t.cycles >= t.probed_at.get(c, -10**9) + COOLDOWN * self._probe_cycles(t)):
                    return self._probe(t, c, here, r, "uncertain")
        return None

    @staticmethod
    def _probe_cycles(t):
        return max(MIN_CYCLES, PROBE_REQUESTS / max(t.periods[t.steps].mean_bs(), 1.0))

    def _probe(self, t, c, here, r, why="probe"):
        t.probing = c
        t.probed_at[c] = t.cycles
        t.periods[c] = Period()  # measured afresh: what it had is stale
        return self._switch(t, c, why, here, r)

    def _switch(self, t, new, why, old_rate, new_rate):
        old = t.steps
        t.steps = new
        self.switches += 1
        bs = t.periods[old].mean_bs() or t.key
        logger.info("speculative adaptive (cost): tier %s, steps %d -> %d (%s: %.0f -> %s tok/s at batch %.1f)",
                    t.key, old, new, why, old_rate * bs * 1000.0,
                    "unknown" if new_rate is None else f"{new_rate * bs * 1000.0:.0f}", bs)
        return new

    # -- reads ------------------------------------------------------------------------------
    def state(self) -> dict:
        """What /server_info and each profile window show of the policy."""
        mode = self.mode_name()
        try:
            tiers = {str(k): {"steps": t.steps, "probing": t.probing, "candidates": list(t.candidates),
                              "tokens_per_s": {str(c): v for c, v in t.last.items()}}
                     for k, t in self.tiers.items()}
        except Exception as e:  # read by /server_info: never raises
            tiers = {"error": f"{type(e).__name__}: {e}"}
        return {"mode": mode, "switches": self.switches, "tiers": tiers}

    def reread(self) -> None:
        """The mode from `mode_file` (its first word), when the file changed since the last read.
        Never raises nor blocks (it runs on the scheduler's thread): a file that is not a
        regular one, or not UTF-8, is refused with one warning per distinct problem."""
        if self.mode_file is None:
            return
        data = self._read_mode_file()
        if data is None or data == self._mode_text:
            return
        self._mode_text = data
        try:
            words = data.decode("utf-8").split()
        except UnicodeDecodeError:
            self._file_problem("is not UTF-8 text")
            return
        self._file_problems.clear()  # read: a problem seen again is told again
        try:
            self.set_mode(words[0] if words else "")
            logger.info("speculative adaptive policy: %s", printable(self.state()["mode"]))
        except ValueError as e:
            logger.warning("speculative adaptive policy: mode unchanged (%s)", printable(str(e)))

    def _read_mode_file(self):
        """The first 256 bytes of `mode_file`, or None (not there yet, or refused)."""
        try:
            fd = os.open(self.mode_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
        except FileNotFoundError:
            return None  # not written yet
        except OSError as e:
            self._file_problem(f"cannot be read ({e.strerror or e})")
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._file_problem("is not a regular file")
                return None
            return os.read(fd, 256)
        except OSError as e:
            self._file_problem(f"cannot be read ({e.strerror or e})")
            return None
        finally:
            os.close(fd)

    def _file_problem(self, what: str) -> None:
        """One warning per distinct problem with `mode_file` (each /server_info reads it)."""
        if what not in self._file_problems:
            self._file_problems.add(what)
            logger.warning("speculative adaptive policy: mode unchanged (%s=%s %s).", POLICY_FILE_ENV,
                           printable(self.mode_file), what)

    def set_mode(self, text: str) -> None:
        """`cost`; `ema` (upstream's rule on its own tiers); `ema-all` (upstream's rule over this
        policy's candidates); `ema:PATH` (upstream's rule with the config file PATH, e.g. one
        `report --adaptive-config` wrote); or a step count to pin every tier to (benchmarks)."""
        text = text.strip()
        if text == "cost":
            self.mode, self.pinned = "cost", None
        elif text == "ema" or text == "ema-all" or text.startswith("ema:"):
            rule = self.up if text == "ema" else self._rule(text)
            self.mode, self.pinned, self.rule = "ema", None, rule
        elif text.isdigit() and int(text) in self.candidate_steps:
            self.pinned = int(text)
        else:
            raise ValueError(f"not a mode: {text!r} (cost, ema, ema-all, ema:CONFIG, or one of the candidate "
                             f"steps {self.candidate_steps})")

    def mode_name(self) -> str:
        if self.pinned is not None:
            return f"pinned {self.pinned}"
        if self.mode == "ema" and self.rule is not self.up:
            return next((k for k, r in self._rules.items() if r is self.rule), "ema")
        return self.mode

    def _rule(self, text):
        """Upstream's own chooser, made afresh from a config: this policy's candidates per tier
        (`ema-all`, upstream's other settings of each tier kept) or the file after `ema:`. Its
        step counts must be ones this server has graphs for."""
        if text in self._rules:
            return self._rules[text]
        import json
        import tempfile

        path = text[4:] if text.startswith("ema:") else None
        initial = self.launch_steps if self.launch_steps is not None else self.tiers[self.bs_list[0]].steps
        try:
            if path is None:
                cfg = {}
                for bs, slot in self.up._slots.items():
                    cfg[str(bs)] = {k: getattr(slot, k) for k in SLOT_SETTINGS if hasattr(slot, k)}
                    cfg[str(bs)]["candidate_steps"] = list(self.tiers[bs].candidates)
                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                    json.dump(cfg, f)
                try:
                    rule = type(self.up)(initial_steps=initial, cfg_path=f.name)
                finally:
                    os.remove(f.name)
            else:
                rule = type(self.up)(initial_steps=initial, cfg_path=path)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{text}: {type(e).__name__}: {e}") from None
        missing = sorted(set(rule.candidate_steps) - set(self.candidate_steps))
        if missing:
            raise ValueError(f"{text}: step counts {missing} are not among this server's {self.candidate_steps}")
        graphs = self.up._cuda_graph_bs
        rule.set_cuda_graph_bs(graphs)
        for v in graphs or ():  # each captured batch size: a graph for every step count its tier may run
            lacking = [c for c in rule._route(v).candidate_steps if v not in (self.cuda_graph_bs_for_step(c) or ())]
            if lacking:
                raise ValueError(f"{text}: this server has no graphs at batch size {v} for step counts {lacking}")
        self._rules[text] = rule
        return rule


def follow_file(policy: CostPolicy) -> None:
    """SGLANG_SPECPROF_POLICY_FILE=PATH: `reread` (each /server_info) takes the mode from PATH."""
    path = os.environ.get(POLICY_FILE_ENV)
    if path:
        policy.mode_file = path
        logger.info("speculative adaptive policy: each /server_info reads its mode from %s", printable(path))
