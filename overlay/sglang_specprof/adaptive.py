"""SGLang's --speculative-adaptive-config, written from a profile's advice.

SGLang (0.5.12 on, v2 worker, topk 1) switches the step count per batch-size tier among
each tier's `candidate_steps`, by the accept length alone (target = round(EMA accept) + 1).
Its config is JSON: {"<smallest batch size of the tier>": {"candidate_steps": [...]}, ...};
a batch goes to the tier with the largest key at or below its size (after padding to a
captured graph size), and keys that are not integers are ignored.

Here each tier is a bucket of the profile (1, 2, 3-4, 5-8, ...: the key is its smallest
batch size) and its candidates are the step counts whose predicted tokens/s is within
`margin` of the bucket's best prediction: the cost the accept-length rule never looks at
narrows what it may choose from. From predictions alone step 0 (no drafting) is never
proposed: a profile at a fixed step count does not measure it. A profile taken under
--speculative-adaptive (0.5.16) that measured a bucket at several step counts, 0 among them,
gives that tier its candidates from the measurements: those within `margin` of the best
measured, 0 too where it measured within the margin.
"""

from __future__ import annotations

from .window import bucket_bs, bucket_order

DEFAULT_MARGIN = 0.03
MIN_CYCLES = 20  # decode cycles a bucket needs to become a tier


def candidates(adv: dict, margin: float = DEFAULT_MARGIN) -> list[int]:
    """The step counts within `margin` of the best central prediction, the best among them."""
    best = max((r for r in adv["rows"] if r["steps"] > 0), key=lambda r: r["tokens_per_s"])
    floor = best["tokens_per_s"] * (1.0 - margin)
    return sorted(r["steps"] for r in adv["rows"] if r["tokens_per_s"] >= floor and r["steps"] > 0)


def measured_candidates(row: dict, margin: float = DEFAULT_MARGIN) -> list[int]:
    """From an adaptive profile's bucket measured at several step counts (`merge.by_steps`):
    the step counts whose measured tokens/s is within `margin` of the best measured."""
    tok = row["tokens_per_s"]
    floor = tok[row["best"]] * (1.0 - margin)
    return sorted(s for s, t in tok.items() if t >= floor)


def upstream_config(summary: dict, advice: dict, margin: float = DEFAULT_MARGIN, source: str = "",
                    measured: dict | None = None) -> dict:
    """The config JSON for the buckets the advisor had figures for (none: an empty dict).
    `measured` (`merge.by_steps` of an adaptive profile): a bucket measured at several step
    counts takes its candidates from those measurements instead of the advisor's predictions."""
    cfg, why = {}, {}
    for key, row in (measured or {}).items():
        steps = measured_candidates(row, margin)
        if steps:
            bs = bucket_bs(key)
            cfg[str(bs)] = {"candidate_steps": steps}
            why[key] = {"candidate_steps": steps, "best": row["best"], "measured_tokens_per_s":
                        {str(s): t for s, t in sorted(row["tokens_per_s"].items())}, "extrapolated_steps": []}
    # an adaptive profile has a bucket per batch size and step count ("5-8@2"): a tier takes
    # the advice of the one with the most cycles
    chosen = {}
    for key in sorted(advice, key=bucket_order):
        bs = bucket_bs(key)
        cycles = (summary.get("buckets", {}).get(key) or {}).get("cycles") or 0
        if cycles < MIN_CYCLES:
            continue  # a few cycles (a warm-up, a stall) say nothing of a tier
        if bs not in chosen or cycles > chosen[bs][1]:
            chosen[bs] = (key, cycles)
    for bs, (key, _) in sorted(chosen.items()):
        if str(bs) in cfg:
            continue  # measured at several step counts
        adv = advice[key]
        steps = candidates(adv, margin)
        cfg[str(bs)] = {"candidate_steps": steps}
        why[key] = {
            "candidate_steps": steps,
            "best": adv["best"],
            "predicted_tokens_per_s": {str(r["steps"]): r["tokens_per_s"] for r in adv["rows"]},
            "extrapolated_steps": [r["steps"] for r in adv["rows"] if r["extrapolated"]],
        }
    if not cfg:
        return {}
    cfg = dict(sorted(cfg.items(), key=lambda kv: int(kv[0])))
    conf = summary.get("config", {})
    # not an integer key: SGLang's loader skips it
    cfg["specprof"] = {
        "source": source,
        "profiled_steps": conf.get("num_steps"),
        "topk": conf.get("topk"),
        "margin": margin,
        "buckets": why,
    }
    return cfg


def notes(cfg: dict) -> list[str]:
    """A line for each bucket whose candidates were all predicted beyond the profiled steps,
    where the acceptance is an extrapolation (the advisor's central figure goes on falling as it fell
    over the last two measured positions)."""
    meta = cfg.get("specprof", {})
    out = []
    for key, b in meta.get("buckets", {}).items():
        if b["candidate_steps"] and set(b["candidate_steps"]) <= set(b["extrapolated_steps"]):
            out.append(f"bs {key}: every candidate is beyond the profiled {meta.get('profiled_steps')} steps, where "
                       f"acceptance is extrapolated; a profile at {b['best']} steps would measure it")
    return out
