"""Which --speculative-num-steps would be fastest, predicted from one profiled run.

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
  to a_K (a_K * r^(i-K), r = a_K / a_(K-1) at most 1), bounded below by 0 and above by a_K
  held.

Predicted tokens/s = batch * E(k) / T(k), scaled so that the cycle as profiled reproduces
the measured cycle time. Each prediction carries a low and a high figure from those bounds.
A profile with topk > 1 verified --speculative-num-draft-tokens a request, not K + 1: the
growth is fitted and applied from there. Its per-position acceptance is the tree's by level
(how deep the accepted path reached); from it come topk 1 chains (`_acceptance`) and the
profiled tree pruned (`tree_rows`), with wider ranges; larger trees are not predicted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

VERIFY = "verify"
DRAFT = "draft"
DRAFT_EXTEND = "draft_extend"
# Algorithms that draft without a draft model (NGRAM matches its drafts in an n-gram cache on
# the host): no draft forward whose cost grows with the step count, so the model above does not
# describe their cycles
NO_DRAFT_MODEL = ("NGRAM",)


def not_applicable(config: dict | None) -> str | None:
    """Why the step-count model does not describe a profile's cycles (one sentence), or None."""
    algorithm = str((config or {}).get("algorithm") or "").upper()
    if algorithm in NO_DRAFT_MODEL:
        return (f"the step-count advisor does not apply to {algorithm}: its drafts are matched on the host, with "
                f"no draft forward per step whose cost it could weigh against acceptance "
                f"(--speculative-num-draft-tokens sets how many tokens each request verifies)")
    return None


@dataclass
class Growth:
    """GPU ms of verify per verified token: a central figure and the bounds it lies in."""
    per_token: float
    low: float
    high: float
    how: str  # "measured", "measured across step counts", "bounded above by batch sizes", "bounded (flat to proportional)"


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
    bucket where the profile ran at 0 steps (`report.advise`)."""
    return len(inp.per_position) if inp.steps == 0 else min(len(inp.per_position), inp.steps)


def _acceptance(inp: Inputs, k: int, which: str) -> list[float]:
    """a_1..a_k. Beyond the measured positions nothing is known: `low` takes 0, `high` holds
    the last, and `central` goes on as the last two measured positions went, a_K * r^j with
    r = a_K / a_(K-1) (at most 1: a draft's conditional acceptance falls with depth, never
    climbs), which is a_K held where K < 2. From a tree (topk T > 1) the positions are its
    levels, which a chain reaches at most as often (`high`): `low` takes the draft's first
    choice to win at least 1/T of each level's acceptance, `central` halfway between."""
    a = [x if x is not None else 0.0 for x in inp.per_position[: measured_positions(inp)]]
    r = min(a[-1] / a[-2], 1.0) if len(a) >= 2 and a[-2] > 0 else 1.0
    if inp.topk > 1 and which != HIGH:
        share = 1.0 / inp.topk if which == LOW else (1.0 + 1.0 / inp.topk) / 2
        a = [x * share for x in a]
    while len(a) < k:
        a.append(0.0 if which == LOW or not a else a[-1] * (r if which == CENTRAL else 1.0))
    return a


def cycle_ms(inp: Inputs, k: int, per_token: float, tokens: int | None = None, step_share: float = 1.0) -> float:
    """T(k) with verify growing `per_token` GPU ms per verified token, verifying `tokens` a
    request (topk 1: k + 1), each draft step that runs the draft model costing `step_share`
    of a profiled one (a chain's step drafts one token a request where a tree's drafts topk)."""
    K = inp.steps
    ph = inp.phases
    fixed = sum(v for n, v in ph.items() if n not in (VERIFY, DRAFT, DRAFT_EXTEND)) + inp.between_ms
    # the steps after the first run the draft model (the first reads the inputs); at K = 0 the
    # step times are another bucket's (report.advise), all of them its own
    forward_steps = [s for s in inp.step_ms[: max((K if K else len(inp.step_ms)) - 1, 0)]]
    # at 1 step no draft step runs the draft model: one is taken to cost what its extend
    # over the verified tokens does (on the H200, 0.43 and 0.48 ms a step against 0.52 and
    # 0.70 ms of extend at 1 and 17-32 requests), which bounds it from above
    s = sum(forward_steps) / len(forward_steps) if forward_steps else ph.get(DRAFT_EXTEND, 0.0)
    draft = max(ph.get(DRAFT, 0.0) + (k - K) * s - (1.0 - step_share) * max(k - 1, 0) * s, 0.0)
    base = ph.get(VERIFY, 0.0)
    verify = max(base + per_token * inp.batch * ((k + 1 if tokens is None else tokens) - inp.verified()), 0.0)
    extend = ph.get(DRAFT_EXTEND, 0.0) * (verify / base if base > 0 else 1.0)
    return fixed + draft + verify + extend


def predict(inp: Inputs, ks=range(1, 9)) -> dict | None:
    """tokens/s at each step count in `ks` (topk 1 chains), with bounds; a step count whose
    predicted cycle takes no GPU time is left out (no time measured to predict from), and with
    none left, None. A profile with topk > 1 also gets `trees` (`tree_rows`).

    `best` is the highest central figure; `recommend` the step count advised: the fastest
    central figure among those whose low end beats the profiled setting's figure, no further
    than one step past the measured positions where fewer than two are measured (else the
    profiled step count: keep it); `profile_next`, where the central best lies beyond what
    the data supports, the step count to profile at to measure it."""
    K = inp.steps
    g = inp.verify_growth()
    model_K = cycle_ms(inp, K, g.per_token, inp.verified())  # the cycle as profiled
    scale = (inp.wall_ms / model_K) if inp.wall_ms and model_K > 0 else 1.0
    # a chain's draft step, from a tree's: flat (memory-bound) to in proportion to the tokens it drafts
    shares = (1.0,) if inp.topk <= 1 else (1.0, 1.0 / inp.topk)
    rows = []
    for k in ks:
        central_t = cycle_ms(inp, k, g.per_token) * scale
        ends = [cycle_ms(inp, k, pt, step_share=sh) * scale for pt in (g.low, g.high) for sh in shares]
        t_lo, t_hi = min(ends), max(ends)
        if not (central_t > 0 and t_lo > 0):
            continue
        e_c, e_lo, e_hi = (expected_tokens(_acceptance(inp, k, which), k) for which in (CENTRAL, LOW, HIGH))
        tok = lambda e, t: inp.batch * e / (t / 1000.0)  # noqa: E731
        rows.append({
            "steps": k, "draft_tokens": k + 1,
            "expected_tokens": round(e_c, 4),
            "cycle_ms": round(central_t, 4),
            "tokens_per_s": round(tok(e_c, central_t), 2),
            "low": round(tok(e_lo, t_hi), 2),
            "high": round(tok(e_hi, t_lo), 2),
            "extrapolated": k > max(K, measured_positions(inp)),
        })
    if not rows:
        return None
    trees = tree_rows(inp, g, scale) if inp.topk > 1 else None
    return _choose(inp, rows, K, g, trees)


def tree_capacity(topk: int, steps: int) -> int:
    """The draft nodes a tree of `steps` at `topk` chooses its draft tokens from (SGLang takes
    the best-scored num-draft-tokens - 1 of topk + (steps - 1) * topk^2 candidates)."""
    return topk + (steps - 1) * topk * topk


def _ladder(n: int) -> list[int]:
    """`n` and the draft-token counts below it worth listing: 2, 3, 4, 6, 8, 12, 16, ..."""
    out, v = {n}, 2
    while v < n:
        out.update(x for x in (v, v * 3 // 2) if x < n)
        v *= 2
    return sorted(out, reverse=True)


def tree_bounds(a: list[float], topk: int, steps: int, tokens: int, profiled_tokens: int) -> tuple:
    """(low, measured, high) of E, the tokens a request commits a cycle, in the tree of `steps` at `topk`
    verifying `tokens`, from a profiled tree of len(a) steps (`profiled_tokens` a request) whose
    acceptance by level is `a`.

    E - 1 is the sum over the tree's draft nodes of each one's chance of being accepted; a node
    cut leaves its ancestors' chances as they were; and both trees take the best-scored of the
    same candidates down to `steps`, so this tree holds the top m' of the nodes the profiled one
    had down to that depth (m of them, unknown: the deeper levels took some of its tokens), and,
    where it has more tokens than m, candidates the profile never verified, scored below all
    it did. Taking the draft's scores to order the nodes by their chance of acceptance (what
    the tree is chosen by): low, the nodes kept hold at least their share of what the profiled
    nodes down to `steps` accepted; measured, the profiled levels down to this tree's depth;
    high, that and each node never verified at most the profiled tree's mean."""
    S, N = len(a), profiled_tokens
    run, e_s, e_depth, e_all = 1.0, 1.0, 1.0, 1.0
    for d in range(S):
        run *= a[d]
        e_all += run
        if d < steps:
            e_s += run
            if d < tokens - 1:
                e_depth += run
    most = min(N - 1, tree_capacity(topk, steps))  # profiled nodes down to `steps`, at most
    # and at least: a node below `steps` brings its ancestors down to it; the levels below
    # `steps` hold at most their candidates
    least = max(min(steps, N - 1), N - 1 - (tree_capacity(topk, S) - tree_capacity(topk, steps)))
    low = 1.0 + (e_s - 1.0) * min(1.0, (tokens - 1) / most) if most > 0 else 1.0
    unverified = max(tokens - 1 - least, 0)
    high = min(e_depth + unverified * (e_all - 1.0) / max(N - 1, 1), 1.0 + min(steps, tokens - 1))
    return min(low, e_depth), e_depth, high


def tree_rows(inp: Inputs, g: Growth, scale: float) -> dict:
    """The trees at the profiled topk that the profile can speak for: the profiled tree pruned
    (fewer draft tokens, fewer steps), each with tokens/s and a range (`tree_bounds` for its
    acceptance, central halfway between its low and measured figures; the verify growth's
    bounds for its cycle); and a sentence for each kind of setting it cannot predict."""
    T, S, N = inp.topk, inp.steps, inp.verified()
    a = [x if x is not None else 0.0 for x in inp.per_position[:S]]
    rows = []
    for s in range(S, 0, -1):
        for n in _ladder(min(N, tree_capacity(T, s) + 1)):
            profiled = s == S and n == N
            if n < 2 or (n - 1 < s and not profiled):
                continue  # a step whose level the tree has no token for: the same tree at fewer steps costs less
            lo, seen, hi = tree_bounds(a, T, s, n, N)
            central_t = cycle_ms(inp, s, g.per_token, n) * scale
            ends = (cycle_ms(inp, s, g.low, n) * scale, cycle_ms(inp, s, g.high, n) * scale)
            t_lo, t_hi = min(ends), max(ends)
            if not (central_t > 0 and t_lo > 0):
                continue
            tok = lambda e, t: inp.batch * e / (t / 1000.0)  # noqa: E731
            e_c = (lo + seen) / 2  # nodes never verified, scored below all that were, add nothing but to `high`
            rows.append({"topk": T, "steps": s, "draft_tokens": n, "expected_tokens": round(e_c, 4),
                         "expected_range": [round(lo, 4), round(hi, 4)], "cycle_ms": round(central_t, 4),
                         "tokens_per_s": round(tok(e_c, central_t), 2), "low": round(tok(lo, t_hi), 2),
                         "high": round(tok(hi, t_lo), 2), "profiled": profiled})
    cannot = []
    if N - 1 < tree_capacity(T, S):
        cannot.append(f"more than {N} draft tokens at topk {T}: the nodes a larger tree adds were never verified, "
                      f"so their acceptance is unknown; profile with --speculative-num-draft-tokens "
                      f"{min(2 * N, tree_capacity(T, S) + 1)} to measure them")
    cannot.append(f"more than {S} steps at topk {T}: the levels past {S} were never drafted; profile with "
                  f"--speculative-num-steps {S + 1} (and draft tokens to fill them) to measure them")
    cannot.append(f"topk {T + 1} or more: the candidates past the first {T} of each node were never drafted; "
                  f"profile with --speculative-eagle-topk {T + 1} or more to measure them")
    if T > 2:
        cannot.append(f"topk 2 to {T - 1}: a narrower tree keeps branches that neither a chain nor this tree pruned "
                      f"holds, and the profile records how deep each accepted path reached, not through which "
                      f"branch; profile at that topk to measure it")
    return {"topk": T, "steps": S, "draft_tokens": N, "rows": rows, "not_predicted": cannot}


def _setting(r: dict, topk: int = 1) -> dict:
    return {"topk": r.get("topk", topk), "steps": r["steps"], "draft_tokens": r["draft_tokens"],
            "tokens_per_s": r["tokens_per_s"], "low": r["low"], "high": r["high"]}


def _choose(inp: Inputs, rows: list, K: int, g, trees: dict | None = None) -> dict:
    """`predict`'s answer from its rows: the best, the recommendation, the rivals. With `trees`
    (a topk > 1 profile) the profiled setting is its profiled tree, and a tree may be
    recommended as a chain may."""
    best = max(rows, key=lambda r: r["tokens_per_s"])
    if trees is not None:
        here = next((r for r in trees["rows"] if r["profiled"]), None)
    else:
        here = next((r for r in rows if r["steps"] == K), None)
    gain = (best["tokens_per_s"] / here["tokens_per_s"] - 1) if here and here["tokens_per_s"] else None
    rivals = [r for r in rows if r is not best and r["high"] >= best["low"]]
    known = measured_positions(inp)
    reach = known + 1 if known < 2 else max(r["steps"] for r in rows)
    sure = [r for r in rows if r is not here and r["steps"] <= reach and here is not None
            and r["low"] > here["tokens_per_s"]]
    recommend = max(sure, key=lambda r: r["tokens_per_s"])["steps"] if sure else K
    profile_next = min(best["steps"], max(3, known + 2)) if best["steps"] > reach else None
    every = [_setting(r) for r in rows]
    picks = [_setting(r) for r in sure]
    if trees is not None:
        every += [_setting(r) for r in trees["rows"]]
        picks += [_setting(r) for r in trees["rows"] if here is not None and r is not here
                  and r["low"] > here["tokens_per_s"]]
    pick = max(picks, key=lambda r: r["tokens_per_s"]) if picks else None
    if trees is not None and pick is not None and pick["topk"] > 1:
        recommend = K  # a tree is advised: among the chains, none
    out = {
        "profiled_steps": K, "batch": round(inp.batch, 3), "rows": rows, "best": best["steps"],
        "recommend": recommend, "profile_next": profile_next,
        "expected_gain": None if gain is None else round(gain, 4),
        "within_uncertainty": [r["steps"] for r in rivals],
        "verify_growth": g.how,
        "verify_ms_per_token": [round(g.per_token, 5), round(g.low, 5), round(g.high, 5)],
        "profiled_setting": {"topk": max(inp.topk, 1), "steps": K, "draft_tokens": inp.verified(),
                             "tokens_per_s": here["tokens_per_s"] if here else None},
        "best_setting": max(every, key=lambda r: r["tokens_per_s"]),
        "recommend_setting": pick,  # None: keep the profiled setting
        "notes": inp.notes,
    }
    if trees is not None:
        out["trees"] = trees
    return out


def with_measured(adv: dict, inp: Inputs, steps: int, tokens_per_s: float, cycles: int,
                  cycle_ms: float | None = None) -> dict:
    """`adv` with the row of `steps` replaced by what the profile measured there (the same batch
    sizes run at that step count, `cycles` of them): low, central and high alike, so that the
    recommendation weighs a measurement, not the model. Under --speculative-adaptive 0 steps
    runs another path (no draft; a one-token verify on the decode kernel where zero_step.py
    applies), which the verify growth of the drafting step counts does not predict."""
    rows = [dict(r, tokens_per_s=round(tokens_per_s, 2), low=round(tokens_per_s, 2), high=round(tokens_per_s, 2),
                 extrapolated=False, measured=cycles, cycle_ms=round(cycle_ms, 4) if cycle_ms else r["cycle_ms"])
            if r["steps"] == steps else r for r in adv["rows"]]
    return dict(_choose(inp, rows, adv["profiled_steps"], inp.verify_growth(), adv.get("trees")), notes=adv["notes"])


def inputs_from_bucket(bucket: dict, steps: int, growth: Growth | None = None, config: dict | None = None
                       ) -> Inputs | None:
    """Advisor inputs from one (merged) bucket of a profile; None if it has no decode cycles.
    `config`: the profile's; at its step count, the tokens verified a request are its
    --speculative-num-draft-tokens (with topk > 1, more than steps + 1)."""
    if not bucket.get("cycles"):
        return None
    times = [p["gpu_ms"]["mean"] for p in bucket["phases"].values()] + [
        bucket["between_cycles_gpu_ms"]["mean"], bucket["cycle_wall_ms"]["mean"]] + [
        s["mean"] for s in bucket["draft_steps_gpu_ms"]]
    if any(t is not None and not t >= 0 for t in times):
        return None  # a GPU time below zero (a damaged profile): nothing to predict from
    acc = bucket["accept"]
    batch = acc["verified_requests"] / max(bucket["cycles"], 1) if acc.get("verified_requests") else 1.0
    phases = {n: p["gpu_ms"]["mean"] for n, p in bucket["phases"].items() if p["gpu_ms"]["mean"] is not None}
    notes = []
    if steps == 1:
        notes.append("profiled with 1 step: a draft step is taken to cost what the draft extend does, and the "
                     "acceptance beyond the first position is not measured, so more steps are guessed")
    inp = Inputs(steps=steps, batch=batch, phases=phases,
                 between_ms=bucket["between_cycles_gpu_ms"]["mean"] or 0.0,
                 wall_ms=bucket["cycle_wall_ms"]["mean"],
                 step_ms=[s["mean"] or 0.0 for s in bucket["draft_steps_gpu_ms"]],
                 per_position=acc["per_position"], growth=growth, notes=notes,
                 draft_tokens=draft_tokens(config, steps), topk=tree_topk(config, steps))
    if growth is not None and not growth.how.startswith("measured"):
        # an upper bound from batch sizes narrows the proportional one, never widens it
        inp.growth = Growth(0.0, 0.0, min(growth.high, inp.proportional()), growth.how)
    return inp


def draft_tokens(config: dict | None, steps: int) -> int | None:
    """The tokens a request verifies at `steps` when that is the profile's own step count and
    it says (--speculative-num-draft-tokens); None: steps + 1 (topk 1)."""
    config = config or {}
    d = config.get("num_draft_tokens")
    return d if steps == config.get("num_steps") and isinstance(d, int) and d > 0 else None


# the advisor's error as bench/advisor_check.py last measured it against an interleaved sweep
# (`advisor_check.py --publish` writes it), shipped with the package
ERROR_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "advisor_error.json")
_errors: dict = {}  # (path, mtime, size) -> what the file says: read once, not at every window


def _published(path: str) -> dict:
    """The file's figures by concurrency ({"by_concurrency": {...}, ...}), or {"unknown": why}."""
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in _errors:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            by = data.get("by_concurrency") if isinstance(data, dict) else None
            if not isinstance(by, dict) or not by or not all(
                    str(c).isdigit() and int(c) > 0 and isinstance(v, dict)
                    and all(isinstance(v.get(k), (int, float)) and not isinstance(v.get(k), bool)
                            for k in ("max_abs_error", "median_abs_error")) for c, v in by.items()):
                raise ValueError("no error by concurrency in it")
            _errors.clear()
            _errors[key] = data
        return _errors[key]
    except FileNotFoundError:
        return {"unknown": f"{os.path.basename(path)} is not in the package"}
    except (OSError, ValueError, AttributeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return {"unknown": f"{os.path.basename(path)} cannot be read ({type(e).__name__})"}


def last_error(batch: float, path: str | None = None) -> dict:
    """The advisor's last measured error at the load nearest `batch` requests a cycle (by
    ratio): the largest and the median |error| of its predictions relative to the profiled
    setting, the sweep's release, date and results; or {"unknown": why}."""
    data = _published(path or ERROR_FILE)
    if "unknown" in data:
        return data
    by = data["by_concurrency"]
    c = min(by, key=lambda c: abs(math.log(max(batch, 1e-9) / int(c))))
    e = by[c]
    return {"concurrency": int(c), "max_abs_error": e["max_abs_error"], "median_abs_error": e["median_abs_error"],
            "predictions": e.get("predictions"), "rounds": e.get("rounds"), "release": data.get("release"),
            "date": data.get("date"), "results": data.get("results"),
            "of": "each prediction's tokens/s relative to the profiled setting's, against the sweep's medians"}


def with_error(adv: dict) -> dict:
    """`adv` with the advisor's last measured error at its batch (`last_error`)."""
    adv["last_measured_error"] = last_error(adv.get("batch") or 1.0)
    return adv


def error_line(err: dict | None) -> str | None:
    """One line on the advisor's last measured error, or None where `err` is not given."""
    if not err:
        return None
    if "unknown" in err:
        return f"advisor's last measured error: unknown ({err['unknown']})"
    return (f"advisor's last measured error: within {100 * err['max_abs_error']:.1f}% at {err['concurrency']} "
            f"concurrent (median {100 * err['median_abs_error']:.1f}%; {err.get('release')}, {err.get('date')})")


def tree_topk(config: dict | None, steps: int) -> int:
    """--speculative-eagle-topk at `steps` when that is the profile's own step count (1 for
    another step count's bucket: upstream switches step counts at topk 1 only)."""
    config = config or {}
    t = config.get("topk")
    ok = steps == config.get("num_steps") and isinstance(t, int) and not isinstance(t, bool) and t > 1
    return t if ok else 1


def window_advice(summary: dict) -> dict:
    """The advisor's result for each bucket of one live window (predicted from that bucket
    alone), keyed by bucket; a bucket it cannot judge is left out. Never raises."""
    steps = (summary.get("config") or {}).get("num_steps")
    out = {}
    if not steps or not_applicable(summary.get("config")):
        return out
    for key, b in (summary.get("buckets") or {}).items():
        try:
            at = b.get("steps", steps)  # an adaptive profile's bucket: the step count it ran at
            if not at:
                continue
            inp = inputs_from_bucket(b, at, config=summary.get("config"))
            adv = predict(inp) if inp is not None else None
            if adv is not None:
                out[key] = with_error(adv)
        except Exception:
            pass
    return out


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row[:n])):
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _wls(xs: list[list[float]], ys: list[float], ws: list[float]):
    """Weighted least squares: coefficients and their standard errors, or None."""
    p = len(xs[0])
    xtx = [[sum(w * x[i] * x[j] for x, w in zip(xs, ws)) for j in range(p)] for i in range(p)]
    xty = [sum(w * x[i] * y for x, y, w in zip(xs, ys, ws)) for i in range(p)]
    beta = _solve(xtx, xty)
    if beta is None:
        return None
    n = len(ys)
    if n <= p:
        return beta, [float("inf")] * p
    # a point is the mean of w cycles: variance sigma^2 / w, sigma^2 from the residuals
    sigma2 = sum(w * (y - sum(b * xi for b, xi in zip(beta, x))) ** 2 for x, y, w in zip(xs, ys, ws)) / (n - p)
    se = []
    for i in range(p):
        col = _solve(xtx, [1.0 if j == i else 0.0 for j in range(p)])
        se.append(math.sqrt(max(col[i] * sigma2, 0.0)) if col else float("inf"))
    return beta, se


def fit_verify(points: list, steps: int, draft_tokens: int | None = None) -> Growth | None:
    """What a verified token adds to verify, from [requests per cycle, context tokens, verify ms,
    cycles(, step count)] points (one per window and bucket, `report.verify_points`; a point
    without its own step count was run at `steps`, verifying `draft_tokens` a request, or
    steps + 1)."""
    own = [len(p) > 4 and p[4] is not None for p in points]  # run at a step count of its own (adaptive)
    at = [p[4] if o else steps for p, o in zip(points, own)]
    per_req = [draft_tokens if draft_tokens and not o else k + 1 for k, o in zip(at, own)]
    pts = [(p[0] * d, p[1], p[2], p[3], p[0], k) for p, k, d in zip(points, at, per_req) if p[3] and p[0]]
    if len({round(t, 3) for t, *_ in pts}) < 2:
        return None  # one batch size: verify's growth with tokens is not seen
    ws = [c for _, _, _, c, _, _ in pts]
    ys = [v for _, _, v, _, _, _ in pts]

    def growth(xs, ys, ws, col, how):
        fit = _wls(xs, ys, ws)
        if fit is None or not math.isfinite(fit[1][col]):
            return None
        g, se = fit[0][col], fit[1][col]
        return Growth(max(g, 0.0), max(g - 2 * se, 0.0), max(g + 2 * se, 0.0), how)

    found = None
    if all(ctx is not None for _, ctx, *_ in pts) and len(pts) >= 4:
        found = growth([[1.0, t, ctx] for t, ctx, *_ in pts], ys, ws, 1, "measured")
    if found is None:
        # Several step counts at one number of requests (an adaptive profile, or profiles
        # merged): there the verified tokens differ and the requests (whose attention over
        # their context the tokens' cost would be mistaken for) do not. Verify time against
        # verified tokens, with a level of its own for each number of requests, so that only
        # the step counts' differences at one number of requests measure a token's cost.
        groups: dict[int, list] = {}
        for p in pts:
            groups.setdefault(round(p[4]), []).append(p)
        mixed = [g for g in groups.values() if len({p[5] for p in g}) >= 2]
        used = [p for g in mixed for p in g]
        if mixed and len(used) >= len(mixed) + 2:
            xs = [[1.0 if i == j else 0.0 for j in range(len(mixed))] + [p[0]]
                  for i, g in enumerate(mixed) for p in g]
            found = growth(xs, [p[2] for p in used], [p[3] for p in used], len(mixed),
                           "measured across step counts (no context lengths in the profile)")
    if found is not None:
        return found
    fit = _wls([[1.0, t] for t, *_ in pts], ys, ws)
    if fit is None:
        return None
    slope = max(fit[0][1], 0.0)
    return Growth(0.0, 0.0, slope, "bounded above by batch sizes (no context lengths in the profile)")


def is_profiled(adv: dict, r: dict) -> bool:
    """Whether chain row `r` is the profiled setting (never, where a tree was profiled)."""
    return r["steps"] == adv["profiled_steps"] and (adv.get("profiled_setting") or {}).get("topk", 1) <= 1


def named_setting(st: dict) -> str:
    """A setting as the flags that run it."""
    topk = f" --speculative-eagle-topk {st['topk']}" if st.get("topk", 1) > 1 else ""
    return f"--speculative-num-steps {st['steps']}{topk} --speculative-num-draft-tokens {st['draft_tokens']}"


def format_advice(adv: dict) -> str:
    best = next(r for r in adv["rows"] if r["steps"] == adv["best"])
    g = adv.get("verify_ms_per_token")
    per_token = f", {g[0]:.4f} ms per verified token ({g[1]:.4f}-{g[2]:.4f})" if g else ""
    trees = adv.get("trees")
    tree = f", topk {trees['topk']}, {trees['draft_tokens']} draft tokens" if trees else ""
    lines = [f"advisor (profiled at {adv['profiled_steps']} steps{tree}, batch {adv['batch']}, verify growth "
             f"{adv['verify_growth']}{per_token}):"]
    if trees:
        t = trees["topk"]
        lines.append(f"  topk 1 chains: a level's acceptance at most the tree's (high) and at least 1/{t} of it "
                     f"(low: the draft's first choice winning at least its share), central halfway; a draft step "
                     f"costs from 1/{t} of the tree's to the tree's")
    lines.append(f"  {'steps':>5} {'tokens':>6} {'E[tok]':>7} {'cycle ms':>9} {'tok/s':>9} {'low':>9} {'high':>9}")
    for r in adv["rows"]:
        mark = " <- best" if r["steps"] == adv["best"] else (" (profiled)" if is_profiled(adv, r) else "")
        if r.get("measured"):
            mark += f" (measured: {r['measured']} cycles at these batch sizes)"
        ext = "*" if r["extrapolated"] else " "
        lines.append(f"  {r['steps']:>5}{ext}{r['draft_tokens']:>6} {r['expected_tokens']:>7.3f} {r['cycle_ms']:>9.3f} "
                     f"{r['tokens_per_s']:>9.1f} {r['low']:>9.1f} {r['high']:>9.1f}{mark}")
    if trees:
        lines += _format_trees(adv, trees)
    gain = adv["expected_gain"]
    lines.append(f"  best{' topk 1 chain' if trees else ''}: --speculative-num-steps {best['steps']} "
                 f"--speculative-num-draft-tokens {best['draft_tokens']}"
                 + (f", expected {100 * gain:+.1f}% tokens/s" if gain is not None else "")
                 + (" against the profiled tree" if trees and gain is not None else ""))
    if trees:
        b = adv["best_setting"]
        lines.append(f"  best of all predicted: {named_setting(b)}, {b['tokens_per_s']:.1f} tok/s "
                     f"({b['low']:.1f}-{b['high']:.1f})")
    if adv["within_uncertainty"]:
        lines.append(f"  within the uncertainty of the best: steps {', '.join(map(str, adv['within_uncertainty']))}")
    lines += _recommended(adv)
    if adv.get("profile_next") is not None:
        lines.append(f"  profile next at --speculative-num-steps {adv['profile_next']}: the best predicted lies "
                     f"beyond the draft positions measured, where acceptance is extrapolated")
    err = error_line(adv.get("last_measured_error"))
    if err:
        lines.append(f"  {err}" + ("; measured on topk 1 step counts: the trees' predictions have not been checked"
                                   if trees and "unknown" not in adv["last_measured_error"] else ""))
    lines.append("  * beyond the measured draft positions, where acceptance is extrapolated: each further position's "
                 "rate is the one before it times r, the last measured rate over the one before that (r at most 1: "
                 "a rise is held level; with one position measured, r = 1); low: 0; high: the last measured rate "
                 "held")
    lines += [f"  note: {n}" for n in adv["notes"]]
    return "\n".join(lines)


TREE_LINES = 12  # tree rows the text shows (--json has them all)


def _format_trees(adv: dict, trees: dict) -> list[str]:
    t, rows = trees["topk"], trees["rows"]
    shown = rows if len(rows) <= TREE_LINES else sorted(
        rows, key=lambda r: (not r["profiled"], -r["tokens_per_s"]))[:TREE_LINES]
    lines = [f"  trees at topk {t}, the profiled one pruned (the draft's scores taken to order the nodes by their "
             f"chance of acceptance): low, the nodes kept holding their share of what the profiled ones accepted; "
             f"central, halfway to the profiled levels; high, nodes the profile never verified (fewer steps make room "
             f"for them) adding at most its mean each",
             f"  {'steps':>5} {'tokens':>6} {'E[tok]':>7} {'E range':>11} {'cycle ms':>9} {'tok/s':>9} {'low':>9} "
             f"{'high':>9}"]
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    for r in rows:
        if r not in shown:
            continue
        mark = " (profiled)" if r["profiled"] else (" <- best" if r is best else "")
        span = f"{r['expected_range'][0]:.2f}-{r['expected_range'][1]:.2f}"
        lines.append(f"  {r['steps']:>5} {r['draft_tokens']:>6} {r['expected_tokens']:>7.3f} {span:>11} "
                     f"{r['cycle_ms']:>9.3f} {r['tokens_per_s']:>9.1f} {r['low']:>9.1f} {r['high']:>9.1f}{mark}")
    if len(shown) < len(rows):
        lines.append(f"  ({len(rows) - len(shown)} slower trees more in --json)")
    lines += [f"  not predicted: {x}" for x in trees["not_predicted"]]
    return lines


def _recommended(adv: dict) -> list[str]:
    """The recommendation: another setting whose low end beats the profiled one's figure, or keep it."""
    here = adv.get("profiled_setting") or {}
    mine = here.get("tokens_per_s")
    if mine is None:  # an older result (a caller's own): the profiled step count's row
        mine = next((r["tokens_per_s"] for r in adv["rows"] if r["steps"] == adv["profiled_steps"]), None)
    rec = adv.get("recommend_setting")
    if rec is None and "recommend_setting" not in adv and adv.get("recommend", adv["best"]) != adv["profiled_steps"]:
        rec = _setting(next(r for r in adv["rows"] if r["steps"] == adv["recommend"]))
    if rec is None or mine is None:
        within = " within what the profile measured" if adv.get("profile_next") else ""
        if here.get("topk", 1) > 1:
            return [f"  recommended: keep the profiled tree, {named_setting(here)}: no other setting's low end "
                    f"beats it{within}"]
        return [f"  recommended: keep {adv['profiled_steps']} steps (no other setting's low end beats it{within})"]
    row = next((r for r in adv["rows"] if r["steps"] == rec["steps"]), {}) if rec["topk"] <= 1 else {}
    if rec["steps"] == 0:
        named = "--speculative-num-steps 0 (speculation off at this batch size)"
    else:
        named = named_setting(rec) + (" (topk 1)" if here.get("topk", 1) > 1 and rec["topk"] <= 1 else "")
    figure = (f"{rec['tokens_per_s']:.1f} tok/s measured" if row.get("measured")
              else f"{rec['low']:.1f}-{rec['high']:.1f} tok/s")
    return [f"  recommended: {named}, {figure} against {mine:.1f} as profiled"]
