"""Which --speculative-num-steps would be fastest, predicted from one profiled run.

`advise(summary)` is the one entry point: the report's merged summary (verify's growth fitted
over every window's buckets), or a live window (`live=True`, each bucket from itself alone:
the server's log and metrics). Around it: the model of a cycle (`model.py`), the trees of a
topk > 1 profile (`trees.py`), the fit of verify's growth (`fit.py`), the advisor's published
error (`measured_error.py`) and the text of its result (`advice_text.py`).
"""

from __future__ import annotations

from . import window
from .advice_text import error_line, format_advice, is_profiled, named_setting  # noqa: F401  (advisor's interface)
from .fit import BOUNDED_AT_ONE_STEP_COUNT, LOCAL_MIN_CYCLES, TokenCurve, bounded_growth_note, fit_verify, local_growth
from .measured_error import ERROR_FILE, last_error, with_error  # noqa: F401  (advisor's interface)
from .model import (CENTRAL, DRAFT, DRAFT_EXTEND, HIGH, HOST_BOUND_SHARE, LOW, VERIFY, Growth, Inputs,  # noqa: F401
                    acceptance, cycle_ms, expected_tokens, host_bound_cycle, host_waited, measured_positions, setting)
from .trees import tree_rows

# Algorithms that draft without a draft model (NGRAM matches its drafts in an n-gram cache on
# the host): no draft forward whose cost grows with the step count, so the model above does not
# describe their cycles
NO_DRAFT_MODEL = ("NGRAM",)
BLOCK_DRAFTERS = ("DFLASH", "DSPARK")  # a block drafted in one forward (block_draft.py)


def not_applicable(config: dict | None) -> str | None:
    """Why the step-count model does not describe a profile's cycles (one sentence), or None."""
    algorithm = str((config or {}).get("algorithm") or "").upper()
    if (config or {}).get("multi_layer"):
        return ("the step-count advisor does not apply to multi-layer EAGLE: each step is an MTP layer of its own, "
                "run in the draft extend rather than as a draft step, which its model does not describe")
    if algorithm == "FROZEN_KV_MTP":
        return ("the step-count advisor does not apply to FROZEN_KV_MTP: its assistant's steps run in one graph of "
                "the frozen-KV worker's own, timed whole as the draft, and its model needs each step's cost")
    if algorithm == "UNO":
        return ("the step-count advisor does not apply to UNO: the target drafts for itself under a LoRA adapter, "
                "a block of --speculative-num-draft-tokens proposals in one forward, not step by step")
    if algorithm in BLOCK_DRAFTERS:
        return (f"the step-count advisor does not apply to {algorithm}: it drafts a whole block in one forward of its "
                f"draft model (--speculative-{algorithm.lower()}-block-size sets its width), not step by step")
    if algorithm in NO_DRAFT_MODEL:
        return (f"the step-count advisor does not apply to {algorithm}: its drafts are matched on the host, with "
                f"no draft forward per step whose cost it could weigh against acceptance "
                f"(--speculative-num-draft-tokens sets how many tokens each request verifies)")
    return None


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
    curve = g.curve if inp.topk <= 1 else None
    for k in ks:
        if curve is not None:  # verify's change read off the kernel view's token curve
            d_c, d_lo, d_hi = curve.delta(inp.batch * inp.verified(), inp.batch * (k + 1))
            central_t = cycle_ms(inp, k, 0.0, verify_delta=d_c) * scale
            ends = [cycle_ms(inp, k, 0.0, verify_delta=d) * scale for d in (d_lo, d_hi)]
        elif inp.topk > 1:  # a chain from a tree: its draft steps and width-bound work from flat to its share
            # its width-bound work (accept, the draft extend) from the tree's to its share of the
            # tokens and of one branch in topk: a chain runs it without the tree's mask and paths
            # (measured, 1B-shaped, 0.5.16 topk 4 and 2: a chain of as many tokens as the tree
            # extended in 0.57-0.59 of the tree's time and accepted in 0.64)
            narrow = min((k + 1) / inp.verified(), 1.0) / inp.topk
            widths = (1.0, narrow)
            # the host's side of a chain's cycle: from the tree's (the cycle scaled as profiled) to
            # none beyond the GPU's. SGLang's topk-1 paths run less host code than a tree's (the
            # 1B-shaped sweeps, 0.5.16, 9-16 requests: accept's host time 0.61 ms in chains, 1.12-1.34
            # in trees of topk 2 and 4), so a host-bound tree says little of a chain's host time;
            # the host-bound rule (`host_bound_cycle`), which holds the host's time, is not applied
            hosts = (scale, min(scale, 1.0))
            central_t = cycle_ms(inp, k, g.per_token, step_share=sum(shares) / 2, width=sum(widths) / 2) * (
                sum(hosts) / 2)
            ends = [cycle_ms(inp, k, pt, step_share=sh, width=w) * h
                    for pt in (g.low, g.high) for sh in shares for w in widths for h in hosts]
        else:
            central_t = cycle_ms(inp, k, g.per_token) * scale
            ends = [cycle_ms(inp, k, pt, step_share=sh) * scale for pt in (g.low, g.high) for sh in shares]
        t_lo, t_hi = min(ends), max(ends)
        if k != K and inp.topk <= 1:
            central_t, t_lo, t_hi = host_bound_cycle(inp, model_K * scale, central_t, t_lo, t_hi)
        if not (central_t > 0 and t_lo > 0):
            continue
        e_c, e_lo, e_hi = (expected_tokens(acceptance(inp, k, which), k) for which in (CENTRAL, LOW, HIGH))
        tok = lambda e, t: inp.batch * e / (t / 1000.0)  # noqa: E731
        rows.append({
            "steps": k, "draft_tokens": k + 1,
            "expected_tokens": round(e_c, 4),
            "expected_range": [round(min(e_lo, e_c), 4), round(max(e_hi, e_c), 4)],
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
    every = [setting(r) for r in rows]
    picks = [setting(r) for r in sure]
    if trees is not None:
        every += [setting(r) for r in trees["rows"]]
        picks += [setting(r) for r in trees["rows"] if here is not None and r is not here
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
    waited = host_waited({n: (p["gpu_ms"]["mean"], (p.get("host_ms") or {}).get("mean"))
                          for n, p in bucket["phases"].items()})
    cycle = sum(phases.values()) + (bucket["between_cycles_gpu_ms"]["mean"] or 0.0)
    if cycle > 0 and waited >= HOST_BOUND_SHARE * cycle:
        notes.append(f"host-bound: the GPU ran at the host's pace in phases holding {100 * waited / cycle:.0f}% of the "
                     f"cycle, so GPU work a setting takes out may leave the GPU waiting on the host instead, and "
                     f"work it adds may fill such a wait: each range runs from the GPU's figure to the host's (central "
                     f"halfway for fewer steps)")
    inp = Inputs(steps=steps, batch=batch, phases=phases, host_waited_ms=waited,
                 between_ms=bucket["between_cycles_gpu_ms"]["mean"] or 0.0,
                 wall_ms=bucket["cycle_wall_ms"]["mean"],
                 step_ms=[s["mean"] or 0.0 for s in bucket["draft_steps_gpu_ms"]],
                 per_position=acc["per_position"], growth=growth, notes=notes,
                 draft_tokens=draft_tokens(config, steps), topk=tree_topk(config, steps))
    if growth is not None and not growth.how.startswith("measured"):
        # an upper bound from batch sizes narrows the proportional one, never widens it
        high = min(growth.high, inp.proportional())
        inp.growth = Growth(min(growth.per_token, high), 0.0, high, growth.how)
    return inp


def draft_tokens(config: dict | None, steps: int) -> int | None:
    """The tokens a request verifies at `steps` when that is the profile's own step count and
    it says (--speculative-num-draft-tokens); None: steps + 1 (topk 1)."""
    config = config or {}
    d = config.get("num_draft_tokens")
    return d if steps == config.get("num_steps") and isinstance(d, int) and d > 0 else None



def tree_topk(config: dict | None, steps: int) -> int:
    """--speculative-eagle-topk at `steps` when that is the profile's own step count (1 for
    another step count's bucket: upstream switches step counts at topk 1 only)."""
    config = config or {}
    t = config.get("topk")
    ok = steps == config.get("num_steps") and isinstance(t, int) and not isinstance(t, bool) and t > 1
    return t if ok else 1


def config_problems(config: dict) -> list[str]:
    """Settings no server runs with (a damaged profile): the advisor does not advise from them."""
    out = []
    for k, least in (("num_steps", 0), ("topk", 1), ("num_draft_tokens", 1)):
        v = (config or {}).get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            out.append(f"the profile's {k} is {v!r}, which no server runs with: no step-count advice from it")
    return out


def advise(summary: dict, live: bool = False) -> dict:
    """The advisor's result for each bucket of a summary, keyed by bucket; a bucket it cannot
    judge is left out.

    A profile's merged summary (the report's): in an adaptive profile (buckets at a step count
    each) 0 steps is predicted too, and a bucket run at 0 steps is advised from the acceptance
    and draft step times of the same batch sizes at another step count (the one with the most
    cycles); where there is none, it gets no advice (`render.zero_step_lines` says so).

    One live window (`live`): each bucket predicted from itself alone (`bucket_advice`); never
    raises."""
    return _window(summary) if live else _profile(summary)


def bucket_advice(bucket: dict, steps: int, config: dict | None, error: bool = True) -> dict | None:
    """One bucket predicted from itself alone at `steps` (with the advisor's last measured error
    unless not `error`), or None where it cannot be judged: fewer than LOCAL_MIN_CYCLES cycles (a
    warm-up's compiling ones, a batch size passed through) hold their noise more than their setting."""
    if (bucket.get("cycles") or 0) < LOCAL_MIN_CYCLES:
        return None
    inp = inputs_from_bucket(bucket, steps, config=config)
    adv = predict(inp) if inp is not None else None
    return with_error(adv) if adv is not None and error else adv


def _window(summary: dict) -> dict:
    steps = (summary.get("config") or {}).get("num_steps")
    out = {}
    if not steps or not_applicable(summary.get("config")):
        return out
    for key, b in (summary.get("buckets") or {}).items():
        try:
            at = b.get("steps", steps)  # an adaptive profile's bucket: the step count it ran at
            if not at:
                continue
            adv = bucket_advice(b, at, summary.get("config"))
            if adv is not None:
                out[key] = adv
        except Exception:
            pass
    return out


def window_advice(summary: dict) -> dict:
    """`advise(summary, live=True)`: what the server's log and metrics show of one window."""
    return advise(summary, live=True)


def _profile(summary: dict) -> dict:
    steps = summary.get("config", {}).get("num_steps")
    out = {}
    if not steps or config_problems(summary.get("config")) or not_applicable(summary.get("config")):
        return out
    fit = fit_verify(summary.get("verify_points") or [], steps, draft_tokens(summary.get("config"), steps))
    curve = TokenCurve.fit(summary.get("kernel_points") or [], steps, draft_tokens(summary.get("config"), steps))
    by_steps_at = _by_batch_sizes(summary)
    local = {prefix: local_growth(runs) for prefix, runs in by_steps_at.items()}
    for key, b in summary["buckets"].items():
        at = window.bucket_steps(key)
        prefix = key.partition("@")[0]
        sib = _drafting_sibling(by_steps_at.get(prefix, {})) if at == 0 else None
        if at == 0 and sib is None:
            continue  # no drafting at these batch sizes: no acceptance to predict from
        inp = inputs_from_bucket(b, steps if at is None else at, local.get(prefix) or fit, summary.get("config"))
        if inp is None:
            continue
        if curve is not None and local.get(prefix) is None and inp.topk <= 1 and inp.steps > 0:
            m = inp.batch * inp.verified()
            c, lo, hi = (max(d / inp.batch, 0.0) for d in curve.delta(m, m + inp.batch))  # one step more
            inp.growth = Growth(c, lo, hi, curve.how, curve)
        elif inp.verify_growth().how.startswith(BOUNDED_AT_ONE_STEP_COUNT):
            inp.notes.append(bounded_growth_note(inp.verify_growth().how))
        if sib is not None:
            sk, sb = sib
            inp.per_position = list(sb["accept"]["per_position"])
            inp.step_ms = [x["mean"] or 0.0 for x in sb["draft_steps_gpu_ms"]]
            inp.notes.append(f"run at 0 steps: acceptance and draft step times taken from bs {sk} "
                             f"({sb['cycles']} cycles)")
        adv = predict(inp, ks=range(0, 9) if at is not None else range(1, 9))
        if adv is None:
            continue
        zero = summary["buckets"].get(prefix + "@0") if at else None
        if zero and zero.get("tokens_per_s"):
            if zero.get("cycles", 0) >= LOCAL_MIN_CYCLES:
                adv = with_measured(adv, inp, 0, zero["tokens_per_s"], zero["cycles"],
                                    (zero.get("cycle_period_gpu_ms") or {}).get("mean"))
            here = next((r for r in adv["rows"] if r["steps"] == at), None)
            rel = f" ({100 * (zero['tokens_per_s'] / here['tokens_per_s'] - 1):+.1f}% against {at} steps as " \
                  f"predicted)" if here and here["tokens_per_s"] else ""
            adv["notes"].append(f"0 steps (speculation off at these batch sizes) measured {zero['tokens_per_s']:.1f} "
                                f"tok/s here{rel}")
        out[key] = with_error(adv)
    return out


def _by_batch_sizes(summary: dict) -> dict:
    """An adaptive profile's buckets by batch sizes, then step count: {"5-8": {2: (key, bucket)}}."""
    out: dict = {}
    for k, b in summary["buckets"].items():
        s = window.bucket_steps(k)
        if s is not None:
            out.setdefault(k.partition("@")[0], {})[s] = (k, b)
    return out


def _drafting_sibling(runs: dict):
    """(key, bucket) among `runs` ({step count: (key, bucket)} of one bucket's batch sizes) run at
    a step count above 0, with the most cycles."""
    sibs = [(k, b) for s, (k, b) in runs.items() if s > 0 and b.get("cycles") and b["accept"].get("per_position")]
    return max(sibs, key=lambda kb: kb[1]["cycles"], default=None)
