"""What changed between two profiled runs, and whether it is more than run-to-run noise.

Each side's figure is the one `report` prints for that profile: the windows merged, each
weighted by what it holds (a phase's mean by its timed cycles, the accept length by the
requests verified, tokens/s by the decode time). Noise is judged from each run's own
windows: the spread of the window figures around that mean gives its standard error; a
change counts when it exceeds twice the combined standard error of the two runs (about 95%
for normal noise) and there are at least three windows on each side. A change below the
printed precision, or under 0.1%, is no change.

Each profile is folded in as it is read, one window at a time, into a few sums per bucket
and figure (`Side`): two long profiles compare in less memory than `report` needs for one.

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
PLAIN = "plain"  # the worker of a profile of a server without speculation (--speculative-profile alone)
# a step-0 cycle's phases against a plain decode's one forward (target_decode): the draft
# extend, the verify that is the target's forward, and the rest of the scaffolding
TAX_PARTS = (("draft extend", ("draft_extend_prep", "draft_extend", "draft_extend_post")),
             ("verify", ("verify_prep", "verify")))
SETTINGS = ("algorithm", "worker", "num_steps", "topk", "num_draft_tokens", "tp_size", "cuda_graph", "sglang",
            "phases_every")


def fields(w: dict) -> dict:
    """What the comparison reads of a window, as a smaller window: its settings, and each
    bucket's cycles, phase means and their counts, host period, acceptance and tokens/s (a
    window's sampled cycles and kernel sample are most of its size and are not kept). The
    report keeps it of its last windows, to set a kernel sample beside the window it was taken in."""
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


class _Figure:
    """One figure of one bucket over a profile's windows, added one window at a time: the count,
    the weights' sum and the weighted sum (the mean, added in window order as a list of the
    windows would add it), and, for the standard error, sums of the squared weights times the
    values' distance from the first value (shifted, so that the spread is not lost beside a
    large value; weights scaled by the first one, so that large weights do not overflow)."""

    __slots__ = ("k", "tot", "sum", "shift", "scale", "w2", "w2d", "w2d2")

    def __init__(self):
        self.k = 0
        self.tot = self.sum = self.w2 = self.w2d = self.w2d2 = 0.0
        self.shift = self.scale = None

    def add(self, v: float, w: float) -> None:
        if self.k == 0:
            self.shift, self.scale = v, w
        self.k += 1
        self.tot += w
        self.sum += v * w
        d, s = v - self.shift, w / self.scale
        self.w2 += s * s
        self.w2d += s * s * d
        self.w2d2 += s * s * d * d

    def stat(self):
        """Weighted mean and its standard error (None with fewer than two windows):
        sqrt(sum((w * (v - mean))^2) * k / (k - 1)) / sum(w)."""
        if not self.k:
            return None, None
        m = self.sum / self.tot
        if self.k < 2:
            return m, None
        dm = m - self.shift
        spread = max(self.w2d2 - 2 * dm * self.w2d + dm * dm * self.w2, 0.0)  # sum((w/scale)^2 (v-m)^2)
        return m, math.sqrt(spread * self.k / (self.k - 1)) / (self.tot / self.scale)


class _Key:
    """One batch-size bucket of a profile, its windows added one at a time: whether any ran
    cycles, its phases in first-seen order, and each figure's _Figure."""

    __slots__ = ("cycles", "names", "figures")

    def __init__(self):
        self.cycles = False
        self.names: dict = {}  # phase name -> None, in first-seen order
        self.figures: dict = {}  # metric label -> _Figure

    def add(self, b: dict) -> None:
        for n, p in (b.get("phases") or {}).items():
            if p["gpu_ms"]["mean"] is not None:
                self.names.setdefault(n)
        if not b["cycles"]:
            return
        self.cycles = True
        metrics = [(f"{n} gpu ms", _phase(n)) for n in b["phases"]]
        metrics += [("cycle wall ms", _wall), ("accept length", _accept), ("tokens/s", _rate)]
        for label, get in metrics:
            v, wt = get(b)
            if _number(v) and _number(wt) and wt > 0:
                f = self.figures.get(label)
                if f is None:
                    f = self.figures[label] = _Figure()
                f.add(v, wt)


class Side:
    """One profile's side of a comparison, its windows folded in as they are read (`add`):
    what it holds is a few sums per bucket and figure, whatever the profile's length. A
    fixed-step profile's buckets are also kept named as an adaptive one names them ("5-8" at
    3 steps is "5-8@3"), for when the other side is adaptive."""

    def __init__(self, windows=()):
        self.config = None  # the first window's settings
        self.adaptive = False
        self.keys: dict = {}  # bucket name -> _Key
        self.at_steps: dict | None = {}  # "5-8@3" -> _Key, until a window shows the profile adaptive
        for w in windows:
            self.add(w)

    def add(self, w: dict) -> None:
        if self.config is None:
            self.config = w.get("config") or {}
        buckets = w["buckets"]
        if not self.adaptive and any(bucket_steps(k) is not None for k in buckets):
            self.adaptive, self.at_steps = True, None
        steps = (w.get("config") or {}).get("num_steps")
        if steps is None and (w.get("config") or {}).get("worker") == PLAIN:
            steps = 0  # a server without speculation: its buckets beside an adaptive run's at 0 steps
        for k, b in buckets.items():
            for keys, name in ((self.keys, k), (self.at_steps, k if steps is None else f"{k}@{steps}")):
                if keys is not None:
                    acc = keys.get(name)
                    if acc is None:
                        acc = keys[name] = _Key()
                    acc.add(b)

    def buckets(self, other_adaptive: bool) -> dict:
        """The buckets by name, those of a fixed-step profile at its step count beside an adaptive one."""
        return self.at_steps if other_adaptive and not self.adaptive else self.keys


def settings_differ(a: Side, b: Side) -> dict:
    """{setting: [A's, B's]} for each setting the two profiles' first windows differ in."""
    ca, cb = a.config or {}, b.config or {}
    return {k: [ca.get(k), cb.get(k)] for k in SETTINGS if ca.get(k) != cb.get(k)}


def compare(a, b) -> dict:
    """The comparison of two profiles: each a Side (its windows folded in as read) or its windows."""
    a, b = (x if isinstance(x, Side) else Side(x) for x in (a, b))
    ba, bb = a.buckets(b.adaptive), b.buckets(a.adaptive)
    ka = {k for k, acc in ba.items() if acc.cycles}
    kb = {k for k, acc in bb.items() if acc.cycles}
    out = {"settings_differ": settings_differ(a, b), "buckets": {}, "only_in": {}, "overflowed": [],
           "buckets_only_in": {"a": sorted(ka - kb, key=bucket_order), "b": sorted(kb - ka, key=bucket_order)}}
    for key in sorted(ka & kb, key=bucket_order):
        seen = {"a": list(ba[key].names), "b": list(bb[key].names)}
        names = [n for n in seen["a"] if n in seen["b"]]
        only = {"a": [n for n in seen["a"] if n not in seen["b"]], "b": [n for n in seen["b"] if n not in seen["a"]]}
        if only["a"] or only["b"]:
            out["only_in"][key] = only
        labels = [f"{n} gpu ms" for n in names] + ["cycle wall ms", "accept length", "tokens/s"]
        rows = []
        for label in labels:
            fa, fb = ba[key].figures.get(label, _Figure()), bb[key].figures.get(label, _Figure())
            ma, sa = fa.stat()
            mb, sb = fb.stat()
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
            elif fa.k < MIN_WINDOWS or fb.k < MIN_WINDOWS or noise is None:
                verdict = "too few windows to judge"
            else:
                verdict = "beyond noise" if abs(delta) > noise else "within noise"
            rows.append({"metric": label, "a": round(ma, 4), "b": round(mb, 4), "delta": round(delta, 4),
                         "relative": round(delta / ma, 4) if ma else None,
                         "noise": None if noise is None else round(noise, 4),
                         "windows": [fa.k, fb.k], "verdict": verdict})
        out["buckets"][key] = rows
        if PLAIN in (_worker(a), _worker(b)) and _worker(a) != _worker(b):
            tax = zero_step_tax(ba[key], bb[key], plain_is_a=_worker(a) == PLAIN)
            if tax is not None:
                out.setdefault("zero_step_tax", {})[key] = tax
    return out


def _worker(side: Side):
    return (side.config or {}).get("worker")


def _mean(key: _Key, label: str):
    f = key.figures.get(label)
    return None if f is None else f.stat()[0]


def zero_step_tax(ka: _Key, kb: _Key, plain_is_a: bool) -> dict | None:
    """A bucket run at 0 steps against the same batch size on a server without speculation:
    what the speculative scaffolding adds over one plain decode forward, by part (the draft
    extend, the verify, the rest of the cycle's phases), in GPU ms a cycle, and the tokens/s
    ratio. None where either side lacks the figures (cycles not timed by phase)."""
    plain, spec = (ka, kb) if plain_is_a else (kb, ka)
    base = _mean(plain, "target_decode gpu ms")
    phases = {n: _mean(spec, f"{n} gpu ms") for n in spec.names}
    phases = {n: v for n, v in phases.items() if v is not None}
    if not base or not phases:
        return None
    total = sum(phases.values())
    parts, seen = {}, set()
    for label, names in TAX_PARTS:
        parts[label] = round(sum(phases.get(n, 0.0) for n in names), 4)
        seen.update(names)
    parts["the rest"] = round(sum(v for n, v in phases.items() if n not in seen), 4)
    rp, rs = _mean(plain, "tokens/s"), _mean(spec, "tokens/s")
    return {"plain_gpu_ms": round(base, 4), "step0_gpu_ms": round(total, 4), "tax": round(total / base - 1, 4),
            "parts_gpu_ms": parts, "verify_over_plain": round(parts["verify"] / base - 1, 4),
            "tokens_per_s_ratio": round(rs / rp, 4) if rp and rs else None}


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
    tax = result.get("zero_step_tax") or {}
    if tax:
        lines.append("  the zero-step tax: a cycle at 0 steps against one decode forward of a server without "
                     "speculation (GPU ms a cycle)")
        for key, t in tax.items():
            parts = ", ".join(f"{k} {v:.3f}" for k, v in t["parts_gpu_ms"].items())
            ratio = "" if t["tokens_per_s_ratio"] is None else f"; tokens/s at 0 steps {t['tokens_per_s_ratio']:.3f}x the plain server's"
            lines.append(f"    bs {key}: {t['step0_gpu_ms']:.3f} against {t['plain_gpu_ms']:.3f} ({100 * t['tax']:+.1f}%): "
                         f"{parts} (the verify {100 * t['verify_over_plain']:+.1f}% over the plain forward){ratio}")
    return "\n".join(lines)
