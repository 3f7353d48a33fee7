"""What changed between two profiled runs, and whether it is more than run-to-run noise.

Each side's figure is the one `report` prints for that profile: the windows merged, each
weighted by what it holds (a phase's mean by its timed cycles, the accept length by the
requests verified, tokens/s by the decode time). Noise is judged from each run's own
windows: the spread of the window figures around that mean gives its standard error; a
change counts when it exceeds twice the combined standard error of the two runs (about 95%
for normal noise) and there are at least three windows on each side. A change below the
printed precision, or under 0.1%, is no change.

Two profiles taken with different settings (worker, steps, topk, draft tokens, release,
...) compare different things: the comparison says which differ, and which phases or
batch sizes only one side has, instead of leaving them out silently.
"""

from __future__ import annotations

import math

from .table import escaped, printable
from .window import bucket_order, bucket_steps

MIN_WINDOWS = 3
NO_CHANGE_ABS = 0.0005  # below the 3 decimals printed
NO_CHANGE_REL = 0.001
SETTINGS = ("algorithm", "worker", "num_steps", "topk", "num_draft_tokens", "tp_size", "cuda_graph", "sglang",
            "phases_every")


def fields(w: dict) -> dict:
    """What the comparison reads of a window: its settings, and each bucket's cycles, phase
    means and their counts, host period, acceptance and tokens/s (a window's sampled cycles
    and kernel sample are most of its size and are not kept)."""
    return {"config": w.get("config") or {},
            "buckets": {key: {"cycles": b.get("cycles"),
                              "phases": {n: {"gpu_ms": {"mean": p["gpu_ms"]["mean"], "n": p["gpu_ms"].get("n")}}
                                         for n, p in b["phases"].items()},
                              "cycle_wall_ms": {"mean": b["cycle_wall_ms"]["mean"], "n": b["cycle_wall_ms"].get("n")},
                              "accept": {"mean_length": b["accept"]["mean_length"],
                                         "verified_requests": b["accept"].get("verified_requests"),
                                         "committed_tokens": b["accept"].get("committed_tokens")},
                              "tokens_per_s": b.get("tokens_per_s")}
                        for key, b in w["buckets"].items()}}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _weight(n) -> float:
    # a figure without its count (an old profile) counts once; so does one with an impossible
    # count (below 1), which would weigh against the others (and their sum could be 0)
    return float(n) if _number(n) and n >= 1 else 1.0


def _phase(name):
    def get(b):
        st = b["phases"].get(name, {}).get("gpu_ms", {})
        return st.get("mean"), _weight(st.get("n"))
    return get


def _wall(b):
    return b["cycle_wall_ms"]["mean"], _weight(b["cycle_wall_ms"].get("n"))


def _accept(b):
    a = b["accept"]
    return a["mean_length"], _weight(a.get("verified_requests"))


def _rate(b):
    t, c = b.get("tokens_per_s"), b["accept"].get("committed_tokens")
    # weighted by decode time: sum(tokens) / sum(time), as report
    return t, (c / t if _number(t) and t > 0 and _number(c) and c > 0 else 1.0)


def _window_values(windows, key, get):
    vals = []
    for w in windows:
        b = w["buckets"].get(key)
        if b and b["cycles"]:
            v, wt = get(b)
            if _number(v) and _number(wt) and wt > 0:
                vals.append((v, wt))
    return vals


def _stat(vals):
    """Weighted mean and its standard error (None with fewer than two windows)."""
    if not vals:
        return None, None
    tot = sum(w for _, w in vals)
    m = sum(v * w for v, w in vals) / tot
    k = len(vals)
    if k < 2:
        return m, None
    se = math.sqrt(sum((w * (v - m)) ** 2 for v, w in vals) * k / (k - 1)) / tot
    return m, se


def settings_differ(a: list[dict], b: list[dict]) -> dict:
    """{setting: [A's, B's]} for each setting the two profiles' first windows differ in."""
    ca = (a[0].get("config") or {}) if a else {}
    cb = (b[0].get("config") or {}) if b else {}
    return {k: [ca.get(k), cb.get(k)] for k in SETTINGS if ca.get(k) != cb.get(k)}


def _adaptive(windows) -> bool:
    return any(bucket_steps(k) is not None for w in windows for k in w["buckets"])


def _at_steps(windows) -> list[dict]:
    """A fixed-step profile's buckets named as an adaptive one names them ("5-8" at 3 steps is
    "5-8@3"), so that each is set beside the other profile's cycles of its step count."""
    out = []
    for w in windows:
        steps = (w.get("config") or {}).get("num_steps")
        if steps is None:
            out.append(w)
            continue
        out.append(dict(w, buckets={f"{k}@{steps}": v for k, v in w["buckets"].items()}))
    return out


def compare(a: list[dict], b: list[dict]) -> dict:
    if _adaptive(a) != _adaptive(b):
        a, b = (a, _at_steps(b)) if _adaptive(a) else (_at_steps(a), b)
    ka = {k for w in a for k, bk in w["buckets"].items() if bk["cycles"]}
    kb = {k for w in b for k, bk in w["buckets"].items() if bk["cycles"]}
    out = {"settings_differ": settings_differ(a, b), "buckets": {}, "only_in": {}, "overflowed": [],
           "buckets_only_in": {"a": sorted(ka - kb, key=bucket_order), "b": sorted(kb - ka, key=bucket_order)}}
    for key in sorted(ka & kb, key=bucket_order):
        seen = {}
        for side, ws in (("a", a), ("b", b)):
            names = []
            for w in ws:
                bk = w["buckets"].get(key)
                for n, p in ((bk or {}).get("phases") or {}).items():
                    if n not in names and p["gpu_ms"]["mean"] is not None:
                        names.append(n)
            seen[side] = names
        names = [n for n in seen["a"] if n in seen["b"]]
        only = {"a": [n for n in seen["a"] if n not in seen["b"]], "b": [n for n in seen["b"] if n not in seen["a"]]}
        if only["a"] or only["b"]:
            out["only_in"][key] = only
        metrics = [(f"{n} gpu ms", _phase(n)) for n in names]
        metrics += [("cycle wall ms", _wall), ("accept length", _accept), ("tokens/s", _rate)]
        rows = []
        for label, get in metrics:
            va, vb = _window_values(a, key, get), _window_values(b, key, get)
            ma, sa = _stat(va)
            mb, sb = _stat(vb)
            if ma is None or mb is None:
                continue
            delta = mb - ma
            noise = None if sa is None or sb is None else 2 * math.sqrt(sa ** 2 + sb ** 2)
            if not all(math.isfinite(x) for x in (ma, mb, delta, delta / ma if ma else 0.0)):
                out["overflowed"].append(f"bs {key} {label}")  # windows' figures too large to add up
                continue
            if noise is not None and not math.isfinite(noise):
                noise = None
            if abs(delta) < NO_CHANGE_ABS or (ma and abs(delta / ma) < NO_CHANGE_REL):
                verdict = "no change"
            elif len(va) < MIN_WINDOWS or len(vb) < MIN_WINDOWS or noise is None:
                verdict = "too few windows to judge"
            else:
                verdict = "beyond noise" if abs(delta) > noise else "within noise"
            rows.append({"metric": label, "a": round(ma, 4), "b": round(mb, 4), "delta": round(delta, 4),
                         "relative": round(delta / ma, 4) if ma else None,
                         "noise": None if noise is None else round(noise, 4),
                         "windows": [len(va), len(vb)], "verdict": verdict})
        out["buckets"][key] = rows
    return out


def format_compare(result: dict, name_a: str, name_b: str) -> str:
    # the profiles' names and settings as text: a control character in one is shown, not acted on
    result, name_a, name_b = escaped(result), printable(name_a), printable(name_b)
    lines = [f"compare A = {name_a}  B = {name_b}  (A and B as `report` prints them; noise: 2 x the combined "
             f"standard error of the window figures)"]
    diff = result.get("settings_differ") or {}
    if diff:
        parts = ", ".join(f"{k} {va} vs {vb}" for k, (va, vb) in diff.items())
        lines.append(f"  note: the runs differ in their settings ({parts}): a change below is the settings' as much as "
                     f"the code's or the load's")
    for side in ("a", "b"):
        only = (result.get("buckets_only_in") or {}).get(side)
        if only:
            lines.append(f"  batch sizes only in {side.upper()}: {', '.join(only)} (not compared)")
    for key, rows in result["buckets"].items():
        lines.append(f"  bs {key}")
        only = (result.get("only_in") or {}).get(key) or {}
        for side in ("a", "b"):
            if only.get(side):
                lines.append(f"    phases only in {side.upper()}: {', '.join(only[side])} (not compared)")
        lines.append(f"    {'metric':<26}{'A':>10}{'B':>10}{'B-A':>10}{'rel':>8}{'noise':>9}  verdict")
        for r in rows:
            rel = "-" if r["relative"] is None else f"{100 * r['relative']:+.1f}%"
            noise = "-" if r["noise"] is None else f"{r['noise']:.3f}"
            lines.append(f"    {r['metric']:<26}{r['a']:>10.3f}{r['b']:>10.3f}{r['delta']:>+10.3f}{rel:>8}{noise:>9}  {r['verdict']}")
    if not result["buckets"]:
        lines.append("  no batch-size bucket appears in both runs")
    return "\n".join(lines)
