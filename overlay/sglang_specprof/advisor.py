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
growth is fitted and applied from there, and the advice is for topk 1 (chains of k + 1).
"""

from __future__ import annotations

import math
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
    climbs), which is a_K held where K < 2."""
    a = [x if x is not None else 0.0 for x in inp.per_position[: measured_positions(inp)]]
    r = min(a[-1] / a[-2], 1.0) if len(a) >= 2 and a[-2] > 0 else 1.0
    while len(a) < k:
        a.append(0.0 if which == LOW or not a else a[-1] * (r if which == CENTRAL else 1.0))
    return a


def cycle_ms(inp: Inputs, k: int, per_token: float, tokens: int | None = None) -> float:
    """T(k) with verify growing `per_token` GPU ms per verified token, verifying `tokens` a
    request (topk 1: k + 1)."""
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
    draft = max(ph.get(DRAFT, 0.0) + (k - K) * s, 0.0)
    base = ph.get(VERIFY, 0.0)
    verify = max(base + per_token * inp.batch * ((k + 1 if tokens is None else tokens) - inp.verified()), 0.0)
    extend = ph.get(DRAFT_EXTEND, 0.0) * (verify / base if base > 0 else 1.0)
    return fixed + draft + verify + extend


def predict(inp: Inputs, ks=range(1, 9)) -> dict | None:
    """tokens/s at each step count in `ks`, with bounds; a step count whose predicted cycle
    takes no GPU time is left out (no time measured to predict from), and with none left,
    None.

    `best` is the highest central figure; `recommend` the step count advised: the fastest
    central figure among those whose low end beats the profiled setting's figure, no further
    than one step past the measured positions where fewer than two are measured (else the
    profiled step count: keep it); `profile_next`, where the central best lies beyond what
    the data supports, the step count to profile at to measure it."""
    K = inp.steps
    g = inp.verify_growth()
    model_K = cycle_ms(inp, K, g.per_token, inp.verified())  # the cycle as profiled
    scale = (inp.wall_ms / model_K) if inp.wall_ms and model_K > 0 else 1.0
    rows = []
    for k in ks:
        central_t = cycle_ms(inp, k, g.per_token) * scale
        ends = (cycle_ms(inp, k, g.low) * scale, cycle_ms(inp, k, g.high) * scale)
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
    return _choose(inp, rows, K, g)


def _choose(inp: Inputs, rows: list, K: int, g) -> dict:
    """`predict`'s answer from its rows: the best, the recommendation, the rivals."""
    best = max(rows, key=lambda r: r["tokens_per_s"])
    here = next((r for r in rows if r["steps"] == K), None)
    gain = (best["tokens_per_s"] / here["tokens_per_s"] - 1) if here and here["tokens_per_s"] else None
    rivals = [r for r in rows if r is not best and r["high"] >= best["low"]]
    known = measured_positions(inp)
    reach = known + 1 if known < 2 else max(r["steps"] for r in rows)
    sure = [r for r in rows if r is not here and r["steps"] <= reach and here is not None
            and r["low"] > here["tokens_per_s"]]
    recommend = max(sure, key=lambda r: r["tokens_per_s"])["steps"] if sure else K
    profile_next = min(best["steps"], max(3, known + 2)) if best["steps"] > reach else None
    return {
        "profiled_steps": K, "batch": round(inp.batch, 3), "rows": rows, "best": best["steps"],
        "recommend": recommend, "profile_next": profile_next,
        "expected_gain": None if gain is None else round(gain, 4),
        "within_uncertainty": [r["steps"] for r in rivals],
        "verify_growth": g.how,
        "verify_ms_per_token": [round(g.per_token, 5), round(g.low, 5), round(g.high, 5)],
        "notes": inp.notes,
    }


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
    return dict(_choose(inp, rows, adv["profiled_steps"], inp.verify_growth()), notes=adv["notes"])


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
                 draft_tokens=draft_tokens(config, steps))
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
                out[key] = adv
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


def format_advice(adv: dict) -> str:
    best = next(r for r in adv["rows"] if r["steps"] == adv["best"])
    g = adv.get("verify_ms_per_token")
    per_token = f", {g[0]:.4f} ms per verified token ({g[1]:.4f}-{g[2]:.4f})" if g else ""
    lines = [f"advisor (profiled at {adv['profiled_steps']} steps, batch {adv['batch']}, verify growth "
             f"{adv['verify_growth']}{per_token}):",
             f"  {'steps':>5} {'tokens':>6} {'E[tok]':>7} {'cycle ms':>9} {'tok/s':>9} {'low':>9} {'high':>9}"]
    for r in adv["rows"]:
        mark = " <- best" if r["steps"] == adv["best"] else (" (profiled)" if r["steps"] == adv["profiled_steps"] else "")
        if r.get("measured"):
            mark += f" (measured: {r['measured']} cycles at these batch sizes)"
        ext = "*" if r["extrapolated"] else " "
        lines.append(f"  {r['steps']:>5}{ext}{r['draft_tokens']:>6} {r['expected_tokens']:>7.3f} {r['cycle_ms']:>9.3f} "
                     f"{r['tokens_per_s']:>9.1f} {r['low']:>9.1f} {r['high']:>9.1f}{mark}")
    gain = adv["expected_gain"]
    lines.append(f"  best: --speculative-num-steps {best['steps']} --speculative-num-draft-tokens {best['draft_tokens']}"
                 + (f", expected {100 * gain:+.1f}% tokens/s" if gain is not None else ""))
    if adv["within_uncertainty"]:
        lines.append(f"  within the uncertainty of the best: steps {', '.join(map(str, adv['within_uncertainty']))}")
    rec = adv.get("recommend", adv["best"])
    here = next((r for r in adv["rows"] if r["steps"] == adv["profiled_steps"]), None)
    if rec == adv["profiled_steps"] or here is None:
        lines.append(f"  recommended: keep {adv['profiled_steps']} steps (no other setting's low end beats it"
                     + (" within what the profile measured" if adv.get("profile_next") else "") + ")")
    else:
        r = next(x for x in adv["rows"] if x["steps"] == rec)
        lines.append(f"  recommended: --speculative-num-steps {rec}" + (" (speculation off at this batch size)"
                     if rec == 0 else f" --speculative-num-draft-tokens {r['draft_tokens']}")
                     + (f", {r['tokens_per_s']:.1f} tok/s measured" if r.get("measured") else
                        f", {r['low']:.1f}-{r['high']:.1f} tok/s") + f" against {here['tokens_per_s']:.1f} as profiled")
    if adv.get("profile_next") is not None:
        lines.append(f"  profile next at --speculative-num-steps {adv['profile_next']}: the best predicted lies "
                     f"beyond the draft positions measured, where acceptance is extrapolated")
    lines.append("  * beyond the measured draft positions, where acceptance is extrapolated: each further position's "
                 "rate is the one before it times r, the last measured rate over the one before that (r at most 1: "
                 "a rise is held level; with one position measured, r = 1); low: 0; high: the last measured rate "
                 "held")
    lines += [f"  note: {n}" for n in adv["notes"]]
    return "\n".join(lines)
