"""Which --speculative-num-steps would be fastest, predicted from one profiled run.

With k draft steps (topk 1, k + 1 draft tokens) and per-position acceptance a_1..a_k
(a_i: draft token i accepted, given all before it were), a request commits on average
E(k) = 1 + sum_i prod(a_1..a_i) tokens a cycle. A cycle costs
T(k) = fixed + draft(k) + verify(k) + draft_extend(k), each term from the profile:

- fixed: every other phase and the GPU time between cycles, as measured;
- draft(k) = draft(K) + (k - K) * s, s the mean time of a draft step that runs the draft
  model (the profile's steps 1..K-1);
- verify and draft extend process k + 1 tokens a request. Their growth with tokens is
  measured when the profile has several batch sizes (a line through verify time against
  tokens per cycle); otherwise it is bounded: no growth at all (memory-bound) and growth
  in proportion to the tokens (compute-bound);
- beyond the profiled K, acceptance is unknown: a_i = a_K, bounded below by 0.

Predicted tokens/s = batch * E(k) / T(k), scaled so that k = K reproduces the measured
cycle time. Each prediction carries a low and a high figure from those bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERIFY = "verify"
DRAFT = "draft"
DRAFT_EXTEND = "draft_extend"


@dataclass
class Inputs:
    steps: int  # K, the profiled --speculative-num-steps
    batch: float  # mean requests per cycle
    phases: dict[str, float]  # mean GPU ms per phase at K
    between_ms: float  # mean GPU ms between cycles
    wall_ms: float | None  # measured cycle period, for calibration
    step_ms: list[float]  # per draft step at K
    per_position: list[float | None]  # a_1..a_K
    verify_fit: tuple[float, float] | None = None  # (ms at 0 tokens, ms per token), from several batch sizes
    notes: list[str] = field(default_factory=list)


def expected_tokens(a: list[float], k: int) -> float:
    total, run = 1.0, 1.0
    for i in range(k):
        run *= a[i] if i < len(a) else (a[-1] if a else 0.0)
        total += run
    return total


def _acceptance(inp: Inputs, k: int, low: bool) -> list[float]:
    a = [x if x is not None else 0.0 for x in inp.per_position[: inp.steps]]
    while len(a) < k:
        a.append(0.0 if low else (a[-1] if a else 0.0))
    return a


def _scaled(ms: float, k: int, K: int, mode: str) -> float:
    """A phase that processes k + 1 tokens a request, measured at K + 1."""
    if mode == "flat":
        return ms
    return ms * (k + 1) / (K + 1)


def cycle_ms(inp: Inputs, k: int, mode: str) -> float:
    K = inp.steps
    ph = inp.phases
    fixed = sum(v for n, v in ph.items() if n not in (VERIFY, DRAFT, DRAFT_EXTEND)) + inp.between_ms
    forward_steps = [s for s in inp.step_ms[: max(K - 1, 0)]]
    s = sum(forward_steps) / len(forward_steps) if forward_steps else 0.0
    draft = max(ph.get(DRAFT, 0.0) + (k - K) * s, 0.0)
    verify = ph.get(VERIFY, 0.0)
    if mode == "fit" and inp.verify_fit is not None:
        a0, per_token = inp.verify_fit
        verify = max(verify + per_token * inp.batch * (k - K), 0.0)
        extend = ph.get(DRAFT_EXTEND, 0.0)  # small next to verify; grows like it: scale by the same ratio
        base = ph.get(VERIFY, 0.0)
        extend = extend * (verify / base) if base > 0 else extend
    else:
        m = "flat" if mode == "fit" else mode
        verify = _scaled(verify, k, K, m)
        extend = _scaled(ph.get(DRAFT_EXTEND, 0.0), k, K, m)
    return fixed + draft + verify + extend


def predict(inp: Inputs, ks=range(1, 9)) -> dict:
    K = inp.steps
    model_K = cycle_ms(inp, K, "fit")
    scale = (inp.wall_ms / model_K) if inp.wall_ms and model_K > 0 else 1.0
    rows = []
    for k in ks:
        central_t = cycle_ms(inp, k, "fit") * scale
        flat_t = cycle_ms(inp, k, "flat") * scale
        prop_t = cycle_ms(inp, k, "proportional") * scale
        e_c = expected_tokens(_acceptance(inp, k, low=False), k)
        e_lo = expected_tokens(_acceptance(inp, k, low=True), k)
        tok = lambda e, t: inp.batch * e / (t / 1000.0) if t > 0 else float("nan")  # noqa: E731
        # fewer tokens than profiled: cost falls at most in proportion, at least not at all
        t_lo, t_hi = (min(flat_t, prop_t), max(flat_t, prop_t))
        rows.append({
            "steps": k, "draft_tokens": k + 1,
            "expected_tokens": round(e_c, 4),
            "cycle_ms": round(central_t, 4),
            "tokens_per_s": round(tok(e_c, central_t), 2),
            "low": round(tok(e_lo, t_hi), 2),
            "high": round(tok(e_c, t_lo), 2),
            "extrapolated": k > K,
        })
    best = max(rows, key=lambda r: r["tokens_per_s"])
    here = next((r for r in rows if r["steps"] == K), None)
    gain = (best["tokens_per_s"] / here["tokens_per_s"] - 1) if here and here["tokens_per_s"] else None
    rivals = [r for r in rows if r is not best and r["high"] >= best["low"]]
    return {
        "profiled_steps": K, "batch": round(inp.batch, 3), "rows": rows, "best": best["steps"],
        "expected_gain": None if gain is None else round(gain, 4),
        "within_uncertainty": [r["steps"] for r in rivals],
        "verify_growth": "measured from batch sizes" if inp.verify_fit else "bounded (flat to proportional)",
        "notes": inp.notes,
    }


def inputs_from_bucket(bucket: dict, steps: int, verify_fit=None) -> Inputs | None:
    """Advisor inputs from one (merged) bucket of a profile; None if it has no decode cycles."""
    if not bucket.get("cycles"):
        return None
    acc = bucket["accept"]
    batch = acc["verified_requests"] / max(bucket["cycles"], 1) if acc.get("verified_requests") else 1.0
    phases = {n: p["gpu_ms"]["mean"] for n, p in bucket["phases"].items() if p["gpu_ms"]["mean"] is not None}
    notes = []
    if steps < 2:
        notes.append("profiled with 1 step: the cost of a draft step is not measured, so more steps are guessed")
    return Inputs(steps=steps, batch=batch, phases=phases,
                  between_ms=bucket["between_cycles_gpu_ms"]["mean"] or 0.0,
                  wall_ms=bucket["cycle_wall_ms"]["mean"],
                  step_ms=[s["mean"] or 0.0 for s in bucket["draft_steps_gpu_ms"]],
                  per_position=acc["per_position"], verify_fit=verify_fit, notes=notes)


def fit_verify(buckets: dict, steps: int) -> tuple[float, float] | None:
    """A line through mean verify ms against tokens verified a cycle, over the buckets."""
    pts = []
    for b in buckets.values():
        v = b["phases"].get(VERIFY, {}).get("gpu_ms", {}).get("mean")
        n = b["accept"].get("verified_requests")
        if v is None or not b["cycles"] or not n:
            continue
        pts.append((n / b["cycles"] * (steps + 1), v, b["cycles"]))
    if len({round(x, 3) for x, _, _ in pts}) < 2:
        return None
    w = sum(c for _, _, c in pts)
    mx = sum(x * c for x, _, c in pts) / w
    my = sum(y * c for _, y, c in pts) / w
    sxx = sum(c * (x - mx) ** 2 for x, _, c in pts)
    sxy = sum(c * (x - mx) * (y - my) for x, y, c in pts)
    slope = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
    return (my - slope * mx, slope)


def format_advice(adv: dict) -> str:
    best = next(r for r in adv["rows"] if r["steps"] == adv["best"])
    lines = [f"advisor (profiled at {adv['profiled_steps']} steps, batch {adv['batch']}, verify growth "
             f"{adv['verify_growth']}):",
             f"  {'steps':>5} {'tokens':>6} {'E[tok]':>7} {'cycle ms':>9} {'tok/s':>9} {'low':>9} {'high':>9}"]
    for r in adv["rows"]:
        mark = " <- best" if r["steps"] == adv["best"] else (" (profiled)" if r["steps"] == adv["profiled_steps"] else "")
        ext = "*" if r["extrapolated"] else " "
        lines.append(f"  {r['steps']:>5}{ext}{r['draft_tokens']:>6} {r['expected_tokens']:>7.3f} {r['cycle_ms']:>9.3f} "
                     f"{r['tokens_per_s']:>9.1f} {r['low']:>9.1f} {r['high']:>9.1f}{mark}")
    gain = adv["expected_gain"]
    lines.append(f"  best: --speculative-num-steps {best['steps']} --speculative-num-draft-tokens {best['draft_tokens']}"
                 + (f", expected {100 * gain:+.1f}% tokens/s" if gain is not None else ""))
    if adv["within_uncertainty"]:
        lines.append(f"  within the uncertainty of the best: steps {', '.join(map(str, adv['within_uncertainty']))}")
    lines.append("  * beyond the profiled steps: acceptance there is assumed equal to the last measured position")
    lines += [f"  note: {n}" for n in adv["notes"]]
    return "\n".join(lines)
