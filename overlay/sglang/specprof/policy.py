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

The folder feeds `cycle` (each decode cycle read) and `accept` (each list settled, with the
step count its cycle ran at), where it reads the cycles: on the scheduler's thread at each
hand-over (v2, the adaptive worker), or its reader thread (v1).

Decisions run every UPDATE_CYCLES of a tier's decode cycles on the scheduler's thread (a
sort of each candidate's 64 periods that changed, and some arithmetic).

The per-tier figures (`Period`, `Acceptance`, `Tier`) are in policy_tiers.py; the modes
benchmarks switch to (upstream's rule, a pinned step count) and the mode file that switches
them, `SGLANG_SPECPROF_POLICY_FILE`, in policy_mode.py.
"""

from __future__ import annotations

import logging
import math

from .policy_mode import POLICY_FILE_ENV, Modes, follow_file  # noqa: F401  (hooks.py imports the other two from here)
from .policy_tiers import MIN_CYCLES, UPDATE_CYCLES, Acceptance, Period, Tier

logger = logging.getLogger("sglang.specprof")

EXPLORE_MARGIN = 0.08  # explore a neighbour predicted within 8% of the current figure
HYSTERESIS = 0.02  # a measured rival takes over when 2% faster
PROBE_REQUESTS = 32  # a probe runs until this many requests ran at its step count (MIN_CYCLES at least)
UPPER_Z = 2.0  # a neighbour is probed while its acceptance 2 standard errors up would beat the current figure
COOLDOWN = 25  # ... at most once in 25 probes' time


class CostPolicy(Modes):
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
        super().__init__()  # the mode file and the rules of the `ema` modes (Modes)

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
