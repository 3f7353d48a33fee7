"""The figures of a merged profile: where the cycle goes, acceptance by position, cycle times,
and the kernels inside each phase.

Each phase has one colour, the same in every figure of every profile (`PHASE_COLOURS`, from
the schema's list of phases); a phase the list does not hold gets one from `EXTRA_COLOURS`
picked by its name. Buckets with fewer than `WARMUP_CYCLES` decode cycles (a warm-up, a
switch of step count seen a few times) are drawn on axes of their own beside the others, at
their own scale, so that a few slow cycles do not flatten every other bar.
"""

from __future__ import annotations

import zlib

from .adaptive import MIN_CYCLES
from .kernels import CLASSES
from .schema import PHASES

PLOT_BUCKETS = 24  # batch-size buckets drawn at most (bars and legends of thousands take minutes and GBs)
PLOT_POSITIONS = 32  # draft positions drawn at most
# a bucket with fewer decode cycles is a warm-up: the report's own threshold (the fewest cycles
# a bucket needs to become a tier of the adaptive config)
WARMUP_CYCLES = MIN_CYCLES

# one colour per phase of the schema, in the cycle's order: the draft's in blues and cyans, the
# tree olive, verify's in oranges, accept and free_kv in greens, the draft extend's in purples,
# a server without speculation's forward (target_decode) red
PHASE_COLOURS = {
    "target_extend": "#8c564b", "target_decode": "#d6616b", "draft_prep": "#aec7e8", "draft_inputs": "#17becf", "draft": "#1f77b4",
    "draft_outputs": "#9edae5", "tree": "#bcbd22", "verify_prep": "#ffbb78", "verify": "#ff7f0e",
    "accept": "#2ca02c", "free_kv": "#98df8a", "draft_extend_prep": "#c5b0d5", "draft_extend": "#9467bd",
    "draft_extend_post": "#f7b6d2",
}
BETWEEN = "between cycles"
BETWEEN_COLOUR = "#7f7f7f"
# phases the schema does not name (another build's): picked by name, none of the above
EXTRA_COLOURS = ("#d62728", "#ff9896", "#e377c2", "#c49c94", "#dbdb8d", "#5254a3", "#8ca252", "#bd9e39",
                 "#ad494a", "#a55194", "#6b6ecf", "#b5cf6b", "#e7ba52", "#ce6dbd")
CLASS_COLOURS = {"gemm": "#393b79", "attention": "#637939", "communication": "#8c6d31", "sampling": "#843c39",
                 "copy": "#7b4173", "other": "#3182bd", "idle": "#d9d9d9"}
PERCENTILE_COLOURS = {"p50": "#252525", "p90": "#fd8d3c", "p99": "#bd0026"}
WARMUP_FACE = "#f2f2f2"  # the background of the warm-up buckets' axes

MISSING = "matplotlib"  # what --plot and the page's figures need


def phase_colours(names) -> dict:
    """{name: colour} for `names` (phases, and "between cycles"): the fixed one where there is one;
    else one of EXTRA_COLOURS by the name's hash, the next free one where taken (past them, a
    colour made from the name), so that no two names drawn together share a colour."""
    out = {n: PHASE_COLOURS[n] for n in names if n in PHASE_COLOURS}
    if BETWEEN in names:
        out[BETWEEN] = BETWEEN_COLOUR
    taken = set(PHASE_COLOURS.values()) | {BETWEEN_COLOUR}
    for n in names:
        if n in out:
            continue
        h = zlib.crc32(str(n).encode("utf-8", "surrogatepass"))
        free = [c for c in EXTRA_COLOURS if c not in taken]
        if free:
            start = EXTRA_COLOURS[h % len(EXTRA_COLOURS)]
            c = next((x for x in EXTRA_COLOURS[EXTRA_COLOURS.index(start):] + EXTRA_COLOURS if x in free))
        else:
            i, c = 0, f"#{h & 0xffffff:06x}"
            while c in taken:
                i += 1
                c = f"#{zlib.crc32(f'{n}/{i}'.encode('utf-8', 'surrogatepass')) & 0xffffff:06x}"
        out[n] = c
        taken.add(c)
    return out


def pyplot():
    """matplotlib's pyplot, drawing to files only (Agg); RuntimeError, one sentence, without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(f"--plot needs {MISSING}: pip install matplotlib (or 'sglang-specprof[plot]' with the "
                           f"analysis wheel)") from None
    return plt


# the labels are the profile's own names (phases, settings): a "$" in one is text, not math
TEXT = {"text.parse_math": False, "text.usetex": False}


def plot(summary: dict, path: str) -> dict:
    """Write the figure to `path`; returns the numbers it drew (for checking)."""
    plt = pyplot()
    with plt.rc_context(TEXT):
        fig, drawn = figure(summary, plt)
        try:
            fig.savefig(path, dpi=110)
        finally:
            plt.close(fig)
    return drawn


def figure(summary: dict, plt=None):
    """(the whole figure: each panel a row of it, the numbers drawn); the caller closes it."""
    plt = plt or pyplot()
    plan = _plan(summary)
    names = _panels(plan)
    fig = plt.figure(figsize=(_width(plan), sum(_HEIGHT[n] for n in names) + 0.6), layout="constrained")
    fig.suptitle(_title(summary))
    subs = fig.subfigures(len(names), 1, height_ratios=[_HEIGHT[n] for n in names])
    subs = [subs] if len(names) == 1 else list(subs)
    for name, sub in zip(names, subs):
        _DRAW[name](sub, plan)
    return fig, plan["drawn"]


def figures(summary: dict, plt=None) -> tuple[list, dict]:
    """([(panel name, figure)], the numbers drawn): each panel a figure of its own (the page's);
    the caller closes them."""
    plt = plt or pyplot()
    plan = _plan(summary)
    out = []
    for name in _panels(plan):
        fig = plt.figure(figsize=(_width(plan), _HEIGHT[name]), layout="constrained")
        _DRAW[name](fig, plan)
        out.append((name, fig))
    return out, plan["drawn"]


PANEL_TITLES = {"phases": "Where a decode cycle goes", "acceptance": "Acceptance by draft position",
                "cycle": "Cycle GPU time", "kernels": "Inside each phase (kernel samples)"}
_HEIGHT = {"phases": 4.8, "acceptance": 3.8, "cycle": 3.6, "kernels": 4.6}


def _title(summary: dict) -> str:
    cfg = summary.get("config", {})
    return (f"{cfg.get('algorithm')} {cfg.get('worker')} worker, steps {cfg.get('num_steps')}, topk {cfg.get('topk')}: "
            f"{summary.get('decode_cycles')} decode cycles, {summary.get('tokens_per_s') or 0:.0f} tok/s")


def _plan(summary: dict) -> dict:
    """The buckets drawn (the others' count in left_out), split into the trusted and the warm-up
    ones, the phases in the cycle's order and their colours."""
    buckets = {k: b for k, b in summary["buckets"].items() if b["cycles"]}
    left_out = []
    if len(buckets) > PLOT_BUCKETS:  # the buckets with the most cycles, in their order
        most = sorted(buckets, key=lambda k: -buckets[k]["cycles"])[:PLOT_BUCKETS]
        left_out.append(f"{len(buckets) - PLOT_BUCKETS} of {len(buckets)} batch-size buckets (those with the fewest "
                        f"cycles)")
        buckets = {k: b for k, b in buckets.items() if k in most}
    keys = list(buckets)
    warm = [k for k in keys if buckets[k]["cycles"] < WARMUP_CYCLES]
    main = [k for k in keys if k not in warm]
    if not main:  # every bucket is short: nothing to set apart from
        main, warm = warm, []
    seen = []
    for b in buckets.values():
        for n in b["phases"]:
            if n not in seen:
                seen.append(n)
    names = [n for n in PHASES if n in seen] + [n for n in seen if n not in PHASES]
    longest = max((len(b["accept"]["per_position"]) for b in buckets.values()), default=0)
    if longest > PLOT_POSITIONS:
        left_out.append(f"draft positions past {PLOT_POSITIONS} (of {longest})")
    kern = summary.get("kernels")
    colours = phase_colours(names + [BETWEEN])
    return {"buckets": buckets, "main": main, "warm": warm, "names": names + [BETWEEN], "colours": colours,
            "positions": min(longest, PLOT_POSITIONS), "kernels": kern if kern and kern.get("phases") else None,
            "drawn": {"phases": {}, "per_position": {}, "cycle_ms": {}, "buckets": main, "warmup": warm,
                      "colours": colours, "left_out": left_out}}


def _panels(plan: dict) -> list[str]:
    return ["phases", "acceptance", "cycle"] + (["kernels"] if plan["kernels"] else [])


def _width(plan: dict) -> float:
    """Inches: the axes' share grows with the buckets drawn, beside the legend's room."""
    w = 3.5 + 0.5 * max(len(plan["main"]), 10)
    if plan["warm"]:
        w += 1.5 + 0.5 * len(plan["warm"])
    if plan["kernels"]:
        w = max(w, 4.5 + 0.7 * len(plan["kernels"]["phases"]))
    return w


def _axes(sub, plan: dict, title: str):
    """(the trusted buckets' axes, the warm-up buckets' axes or None), side by side."""
    if not plan["warm"]:
        ax = sub.subplots(1, 1)
        ax.set_title(title)
        return ax, None
    ax, wax = sub.subplots(1, 2, width_ratios=[max(len(plan["main"]), 2), max(len(plan["warm"]), 1) + 1])
    ax.set_title(title)
    wax.set_title(f"warm-up: under {WARMUP_CYCLES} cycles\n(own scale, not to be trusted)", fontsize=9)
    wax.set_facecolor(WARMUP_FACE)
    return ax, wax


def _bucket_ticks(ax, keys: list, slots: int = 4) -> None:
    """Each bucket's name under its place, turned; room for `slots` buckets at least (a bar of
    one of two buckets as wide as the axes says nothing more)."""
    ax.set_xticks(range(len(keys)), [f"bs {k}" for k in keys], rotation=45, ha="right", rotation_mode="anchor",
                  fontsize=8 if len(keys) > 12 else 9)
    pad = max(slots - len(keys), 0) / 2
    ax.set_xlim(-0.6 - pad, len(keys) - 0.4 + pad)


def _phases(sub, plan: dict) -> None:
    ax, wax = _axes(sub, plan, "Where a decode cycle goes (GPU ms, mean)")
    drawn = plan["drawn"]["phases"]
    for axis, keys in ((ax, plan["main"]), (wax, plan["warm"])):
        if axis is None:
            continue
        bottoms = [0.0] * len(keys)
        for n in plan["names"]:
            vals = []
            for key in keys:
                b = plan["buckets"][key]
                if n == BETWEEN:
                    vals.append(b["between_cycles_gpu_ms"]["mean"] or 0.0)
                else:
                    vals.append((b["phases"].get(n, {}).get("gpu_ms", {}).get("mean")) or 0.0)
                drawn.setdefault(n, {})[key] = vals[-1]
            axis.bar(range(len(keys)), vals, bottom=bottoms, label=n, color=plan["colours"][n], width=0.75)
            bottoms = [x + v for x, v in zip(bottoms, vals)]
        _bucket_ticks(axis, keys)
        axis.set_ylabel("ms")
    # each phase's list in the summary's bucket order (the trusted and the warm-up ones alike)
    plan["drawn"]["phases"] = {n: [drawn[n][k] for k in plan["buckets"] if k in drawn[n]] for n in drawn}
    handles, labels = ax.get_legend_handles_labels()
    (wax or ax).legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       title="phase (top first)", title_fontsize=8)


def _acceptance(sub, plan: dict) -> None:
    import numpy as np

    ax, wax = _axes(sub, plan, "Acceptance by draft position (given all earlier drafts accepted)")
    npos = max(plan["positions"], 1)
    image = None
    for axis, keys in ((ax, plan["main"]), (wax, plan["warm"])):
        if axis is None:
            continue
        grid = np.full((npos, len(keys)), np.nan)
        for j, key in enumerate(keys):
            rates = plan["buckets"][key]["accept"]["per_position"][:PLOT_POSITIONS]
            plan["drawn"]["per_position"][key] = [a for a in rates if a is not None]
            for i, a in enumerate(rates):
                if a is not None:
                    grid[i, j] = a
        image = axis.imshow(np.ma.masked_invalid(grid), aspect="auto", origin="lower", vmin=0.0, vmax=1.0,
                            cmap=_viridis(), extent=(-0.5, len(keys) - 0.5, 0.5, npos + 0.5), interpolation="nearest")
        if grid.size <= 400:
            for (i, j), a in np.ndenumerate(grid):
                if a == a:  # not NaN
                    axis.text(j, i + 1, f"{a:.2f}", ha="center", va="center", fontsize=7,
                              color="black" if a > 0.6 else "white")
        _bucket_ticks(axis, keys, slots=0)
        axis.set_yticks(range(1, npos + 1) if npos <= 16 else range(1, npos + 1, 2))
        axis.set_ylabel("draft position")
    if image is not None:
        sub.colorbar(image, ax=[a for a in (ax, wax) if a is not None], label="acceptance rate", pad=0.01)


def _viridis():
    import matplotlib

    return matplotlib.colormaps["viridis"].with_extremes(bad="#ffffff")  # a position the bucket did not reach


def _cycle(sub, plan: dict) -> None:
    ax, wax = _axes(sub, plan, "Cycle GPU time (ms): p50, p90, p99")
    width = 0.26
    for axis, keys in ((ax, plan["main"]), (wax, plan["warm"])):
        if axis is None:
            continue
        for key in keys:
            st = plan["buckets"][key]["cycle_gpu_ms"]
            plan["drawn"]["cycle_ms"][key] = [st["p50"] or 0, st["p90"] or 0, st["p99"] or 0]
        for i, q in enumerate(PERCENTILE_COLOURS):
            axis.bar([j + (i - 1) * width for j in range(len(keys))], [plan["drawn"]["cycle_ms"][k][i] for k in keys],
                     width=width, label=q, color=PERCENTILE_COLOURS[q])
        _bucket_ticks(axis, keys)
        axis.set_ylabel("ms")
    (wax or ax).legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def _kernel_panel(sub, plan: dict) -> None:
    """Per phase, per sampled cycle: kernel time by class, then the idle time in its span."""
    kern = plan["kernels"]
    ax = sub.subplots(1, 1)
    phases = list(kern["phases"])
    drawn = {}
    bottoms = [0.0] * len(phases)
    for cls in list(CLASSES) + ["idle"]:
        vals = []
        for n in phases:
            p = kern["phases"][n]
            cyc = max(p.get("cycles") or 1, 1)
            v = p.get("idle_ms") if cls == "idle" else (p.get("busy_ms") or {}).get(cls)
            vals.append((v or 0.0) / cyc)
        ax.bar(range(len(phases)), vals, bottom=bottoms, label=cls, color=CLASS_COLOURS.get(cls, "#000000"))
        drawn[cls] = vals
        bottoms = [x + v for x, v in zip(bottoms, vals)]
    cov = kern.get("coverage")
    ax.set_title(f"Inside each phase (kernel samples: {kern.get('cycles')} cycles, "
                 f"coverage {'-' if cov is None else f'{100 * cov:.1f}%'})")
    ax.set_ylabel("ms per cycle")
    ax.set_xticks(range(len(phases)), phases, rotation=45, ha="right", rotation_mode="anchor", fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="kernel class", title_fontsize=8)
    plan["drawn"]["kernels"] = drawn


_DRAW = {"phases": _phases, "acceptance": _acceptance, "cycle": _cycle, "kernels": _kernel_panel}
