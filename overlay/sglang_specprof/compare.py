"""What changed between two profiled runs, and whether it is more than run-to-run noise.

Noise is judged from each run's own windows: the spread of a phase's window means gives
a standard error for the run's mean; a change counts when it exceeds twice the combined
standard error of the two runs (about 95% for normal noise) and there are at least three
windows on each side.
"""

from __future__ import annotations

import math

MIN_WINDOWS = 3


def fields(w: dict) -> dict:
    """What the comparison reads of a window: each bucket's cycles, phase means, host period,
    accept length and tokens/s (a window's sampled cycles and kernel sample are most of its
    size and are not kept)."""
    return {"buckets": {key: {"cycles": b.get("cycles"),
                              "phases": {n: {"gpu_ms": {"mean": p["gpu_ms"]["mean"]}} for n, p in b["phases"].items()},
                              "cycle_wall_ms": {"mean": b["cycle_wall_ms"]["mean"]},
                              "accept": {"mean_length": b["accept"]["mean_length"]},
                              "tokens_per_s": b.get("tokens_per_s")}
                        for key, b in w["buckets"].items()}}


def _window_means(windows, key, get):
    vals = []
    for w in windows:
        b = w["buckets"].get(key)
        if b and b["cycles"]:
            v = get(b)
            if v is not None:
                vals.append(v)
    return vals


def _stat(vals):
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return m, math.sqrt(var / len(vals))


def compare(a: list[dict], b: list[dict]) -> dict:
    keys = sorted({k for w in a for k in w["buckets"]} & {k for w in b for k in w["buckets"]},
                  key=lambda k: int(k.split("-")[0]))
    out = {}
    for key in keys:
        names = []
        for w in a + b:
            for n in w["buckets"].get(key, {}).get("phases", {}):
                if n not in names:
                    names.append(n)
        rows = []
        metrics = [(f"{n} gpu ms", (lambda n: lambda bk: bk["phases"].get(n, {}).get("gpu_ms", {}).get("mean"))(n))
                   for n in names]
        metrics += [("cycle wall ms", lambda bk: bk["cycle_wall_ms"]["mean"]),
                    ("accept length", lambda bk: bk["accept"]["mean_length"]),
                    ("tokens/s", lambda bk: bk.get("tokens_per_s"))]
        for label, get in metrics:
            va, vb = _window_means(a, key, get), _window_means(b, key, get)
            ma, sa = _stat(va)
            mb, sb = _stat(vb)
            if ma is None or mb is None:
                continue
            delta = mb - ma
            if len(va) < MIN_WINDOWS or len(vb) < MIN_WINDOWS or sa is None or sb is None:
                verdict = "too few windows to judge"
            else:
                noise = 2 * math.sqrt(sa ** 2 + sb ** 2)
                verdict = "beyond noise" if abs(delta) > noise else "within noise"
            rows.append({"metric": label, "a": round(ma, 4), "b": round(mb, 4), "delta": round(delta, 4),
                         "relative": round(delta / ma, 4) if ma else None,
                         "noise": None if sa is None or sb is None else round(2 * math.sqrt(sa ** 2 + sb ** 2), 4),
                         "windows": [len(va), len(vb)], "verdict": verdict})
        out[key] = rows
    return out


def format_compare(result: dict, name_a: str, name_b: str) -> str:
    lines = [f"compare A = {name_a}  B = {name_b}  (noise: 2 x the combined standard error of the window means)"]
    for key, rows in result.items():
        lines.append(f"  bs {key}")
        lines.append(f"    {'metric':<26}{'A':>10}{'B':>10}{'B-A':>10}{'rel':>8}{'noise':>9}  verdict")
        for r in rows:
            rel = "-" if r["relative"] is None else f"{100 * r['relative']:+.1f}%"
            noise = "-" if r["noise"] is None else f"{r['noise']:.3f}"
            lines.append(f"    {r['metric']:<26}{r['a']:>10.3f}{r['b']:>10.3f}{r['delta']:>+10.3f}{rel:>8}{noise:>9}  {r['verdict']}")
    if not result:
        lines.append("  no batch-size bucket appears in both runs")
    return "\n".join(lines)
