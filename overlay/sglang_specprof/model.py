"""The advisor's model: what a cycle costs and commits at another step count. Plain Python.

With k draft steps (topk 1, k + 1 draft tokens) and per-position acceptance a_1..a_k
(a_i: draft token i accepted, given all before it were), a request commits on average
E(k) = 1 + sum_i prod(a_1..a_i) tokens a cycle. A cycle costs
T(k) = fixed + draft(k) + verify(k) + draft_extend(k), each term from the profile:

- fixed: every other phase and the GPU time between cycles, as measured;
- draft(k) = draft(K) + (k - K) * s, s the mean time of a draft step that runs the draft
  model (the profile's steps 1..K-1; at K = 1, where none does, the draft extend's time);
- verify(k) = verify(K) + g * batch * (k - K): g is what one more verified token costs.
  It is measured when the profile holds cycles of different batch sizes and their context
  lengths (a least-squares plane through verify time against verified tokens and KV
  tokens, so that the attention over longer or more sequences is not mistaken for the
  cost of a token), with its standard error; without context lengths, from several step
  counts at one number of requests (the slope through verify time against verified tokens
  with a level for each number of requests: an adaptive profile). Otherwise the line
  through verify time against verified tokens only bounds g from above; with one batch
  size, g lies between 0 (memory-bound: no growth) and verify(K) / tokens (in proportion);
- draft extend grows by the same ratio as verify;
- beyond the profiled K, acceptance is unknown: a_i goes on falling as it fell from a_(K-1)
  to a_K (a_K * r^(i-K), r = a_K / a_(K-1) at most 1), and where that ratio itself fell from
  a_(K-1) / a_(K-2), the ratio goes on falling by as much each position (accepted lengths
  that thin out faster than geometrically: a Gaussian spread of them, for one); bounded
  below by 0 and above by a_K held.

Predicted tokens/s = batch * E(k) / T(k), scaled so that the cycle as profiled reproduces
the measured cycle time. Each prediction carries a low and a high figure from those bounds.
A profile with topk > 1 verified --speculative-num-draft-tokens a request, not K + 1: the
growth is fitted and applied from there. Its per-position acceptance is the tree's by level
(how deep the accepted path reached); from it come topk 1 chains (`acceptance`) and the
profiled tree pruned (`tree_rows`), with wider ranges; larger trees are not predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERIFY = "verify"
DRAFT = "draft"
DRAFT_EXTEND = "draft_extend"


@dataclass
class Growth:
    """GPU ms of verify per verified token: a central figure and the bounds it lies in."""
    per_token: float
    low: float
    high: float
    how: str  # "measured", "measured across step counts", "bounded above by batch sizes", "bounded (flat to proportional)"
    curve: object = None  # fit.TokenCurve: verify's token-driven kernel time by tokens a cycle (topk 1 only)


@dataclass
class Inputs:
    steps: int  # K, the profiled --speculative-num-steps
    batch: float  # mean requests per cycle
    phases: dict[str, float]  # mean GPU ms per phase at K
    between_ms: float  # mean GPU ms between cycles
    wall_ms: float | None  # measured cycle period, for calibration
    step_ms: list[float]  # per draft step at K
    per_position: list[float | None]  # a_1..a_K
    growth: Growth | None = None  # None: bounded, flat to proportional
    notes: list[str] = field(default_factory=list)
    draft_tokens: int | None = None  # tokens verified a request at K (--speculative-num-draft-tokens); None: K + 1
    topk: int = 1  # --speculative-eagle-topk at K: above 1, per_position is the tree's acceptance by level
    host_waited_ms: float = 0.0  # GPU ms of the phases the GPU ran at the host's pace (`host_waited`)

    def verified(self) -> int:
        return self.draft_tokens or self.steps + 1

    def proportional(self) -> float:
        """g if verify grew in proportion to the tokens it verifies."""
        tokens = self.batch * self.verified()
        return self.phases.get(VERIFY, 0.0) / tokens if tokens > 0 else 0.0

    def verify_growth(self) -> Growth:
        if self.growth is not None:
            return self.growth
        return Growth(0.0, 0.0, self.proportional(), "bounded (flat to proportional)")


def expected_tokens(a: list[float], k: int) -> float:
    total, run = 1.0, 1.0
    for i in range(k):
        run *= a[i] if i < len(a) else (a[-1] if a else 0.0)
        total += run
    return total


LOW, CENTRAL, HIGH = "low", "central", "high"


def measured_positions(inp: Inputs) -> int:
    """Draft positions whose acceptance the inputs hold: the profiled K, or those of another
    bucket where the profile ran at 0 steps (`advisor.advise`)."""
    return len(inp.per_position) if inp.steps == 0 else min(len(inp.per_position), inp.steps)


def acceptance(inp: Inputs, k: int, which: str) -> list[float]:
    """a_1..a_k. Beyond the measured positions nothing is known: `low` takes 0, `high` holds
    the last, and `central` goes on as the last two measured positions went, a_K * r^j with
    r = a_K / a_(K-1) (at most 1: a draft's conditional acceptance falls with depth, never
    climbs), which is a_K held where K < 2. From a tree (topk T > 1) the positions are its
    levels, which a chain reaches at most as often (`high`): `low` takes the draft's first
    choice to win at least 1/T of each level's acceptance, `central` halfway between."""
    a = [x if x is not None else 0.0 for x in inp.per_position[: measured_positions(inp)]]
    r = min(a[-1] / a[-2], 1.0) if len(a) >= 2 and a[-2] > 0 else 1.0
    # where the ratios themselves fall (a_K / a_(K-1) below a_(K-1) / a_(K-2): a draft whose
    # accepted lengths thin out faster than geometrically), they go on falling as they fell
    q = 1.0
    if len(a) >= 3 and a[-3] > 0 and a[-2] > 0 and r < a[-2] / a[-3]:
        q = r / (a[-2] / a[-3])
    if inp.topk > 1 and which != HIGH:
        share = 1.0 / inp.topk if which == LOW else (1.0 + 1.0 / inp.topk) / 2
        a = [x * share for x in a]
    while len(a) < k:
        if which == CENTRAL:
            r *= q
        a.append(0.0 if which == LOW or not a else a[-1] * (r if which == CENTRAL else 1.0))
    return a


# Phases a tree's cycle runs that a chain's does not: v1's move of the accepted path's KV to the
# front (topk > 1 only)
TREE_ONLY = ("free_kv",)
# Phases whose work follows the tree's width (its draft tokens a request): the accept (the path's
# search and, in v2, its KV move), the draft extend over the verified tokens and its outputs
TREE_WIDTH = ("accept", "draft_extend_post")


def cycle_ms(inp: Inputs, k: int, per_token: float, tokens: int | None = None, step_share: float = 1.0,
             verify_delta: float | None = None, width: float | None = None) -> float:
    """T(k) with verify growing `per_token` GPU ms per verified token, verifying `tokens` a
    request (topk 1: k + 1), each draft step that runs the draft model costing `step_share`
    of a profiled one (a chain's step drafts one token a request where a tree's drafts topk);
    `verify_delta`, where given, is verify's change from K to k itself (`fit.TokenCurve`).
    `width`, for a chain predicted from a tree: the share of the tree's width-bound work
    (TREE_WIDTH phases and the draft extend) the chain keeps, its TREE_ONLY phases dropped."""
    K = inp.steps
    ph = inp.phases
    w = 1.0 if width is None else width
    fixed = sum(v * (w if n in TREE_WIDTH else 1.0) for n, v in ph.items()
                if n not in (VERIFY, DRAFT, DRAFT_EXTEND) and not (width is not None and n in TREE_ONLY))
    fixed += inp.between_ms
    # the steps after the first run the draft model (the first reads the inputs); at K = 0 the
    # step times are another bucket's (advisor.advise), all of them its own
    forward_steps = [s for s in inp.step_ms[: max((K if K else len(inp.step_ms)) - 1, 0)]]
    # at 1 step no draft step runs the draft model: one is taken to cost what its extend
    # over the verified tokens does (on the H200, 0.43 and 0.48 ms a step against 0.52 and
    # 0.70 ms of extend at 1 and 17-32 requests), which bounds it from above
    if forward_steps:
        s = sum(forward_steps) / len(forward_steps)
    elif K > 1 and ph.get(DRAFT):
        s = ph[DRAFT] / (K - 1)  # no step times (not timed, or none read): the draft's replay over its forwards
    else:
        s = ph.get(DRAFT_EXTEND, 0.0)
    draft = max(ph.get(DRAFT, 0.0) + (k - K) * s - (1.0 - step_share) * max(k - 1, 0) * s, 0.0)
    base = ph.get(VERIFY, 0.0)
    if verify_delta is None:
        verify_delta = per_token * inp.batch * ((k + 1 if tokens is None else tokens) - inp.verified())
    verify = max(base + verify_delta, 0.0)
    extend = ph.get(DRAFT_EXTEND, 0.0) * (verify / base if base > 0 else 1.0) * w
    return fixed + draft + verify + extend



# A phase whose host time is at least this share of its GPU span ran at the host's pace: the GPU
# waited on the host's launches (bucket.py judges stalls by the same share)
HOST_PACED = 0.8
# Where such phases hold more than this share of the profiled cycle, the cycle is host-bound: GPU
# work taken out may leave the GPU waiting on the host instead, and work added may fill a wait.
# Measured: an 8B-shaped pair 0.01-0.05 on an H100, 0.10-0.12 at one request on an H200 (where
# the advisor's plain figures held within 5%); a 1B-shaped one 0.13-0.44 on an H100 (where they
# were up to 17% off at one step)
HOST_BOUND_SHARE = 0.125


def host_waited(phases: dict) -> float:
    """GPU ms of the phases ({name: (gpu mean, host mean)}) that ran at the host's pace."""
    return sum(g for g, h in phases.values() if g and h is not None and h >= HOST_PACED * g)


def host_bound_cycle(inp: "Inputs", profiled_ms: float, central: float, low: float, high: float) -> tuple:
    """(central, low, high) cycle ms at another setting, where the profiled cycle (`profiled_ms`,
    as measured) is host-bound: GPU work saved saves from all of it to none (the host's own time
    then holds the cycle at the profiled one), GPU work added costs from all of it to what the
    GPU's waits on the host absorb. Central: halfway for work saved; for work added, all of it (the
    cycle is then the GPU's, above the host's: the 1B-shaped sweeps measured 5 steps against 3
    costing most of what the GPU added). Unchanged where the cycle is not host-bound."""
    waited = inp.host_waited_ms * (profiled_ms / max(_gpu_cycle(inp), 1e-9))
    if not profiled_ms or waited < HOST_BOUND_SHARE * profiled_ms:
        return central, low, high
    if central < profiled_ms:
        return (central + profiled_ms) / 2, low, max(high, profiled_ms)
    floor = max(profiled_ms, central - waited)
    return central, min(low, floor), high


def _gpu_cycle(inp: "Inputs") -> float:
    return sum(inp.phases.values()) + inp.between_ms


def setting(r: dict, topk: int = 1) -> dict:
    return {"topk": r.get("topk", topk), "steps": r["steps"], "draft_tokens": r["draft_tokens"],
            "tokens_per_s": r["tokens_per_s"], "low": r["low"], "high": r["high"]}
