"""One figure of a merged profile: where the cycle goes, acceptance by position, cycle times."""

from __future__ import annotations

from .kernels import CLASSES


PLOT_BUCKETS = 24  # batch-size buckets drawn at most (bars and legends of thousands take minutes and GBs)
PLOT_POSITIONS = 32  # draft positions drawn at most


def plot(summary: dict, path: str) -> dict:
    """Write the figure to `path`; returns the numbers it drew (for checking)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or 'sglang-specprof[plot]' with the "
                           "analysis wheel)") from None
    # the labels are the profile's own names (phases, settings): a "$" in one is text, not math
    with plt.rc_context({"text.parse_math": False, "text.usetex": False}):
        return _draw(plt, summary, path)


def _draw(plt, summary: dict, path: str) -> dict:
    buckets = {k: b for k, b in summary["buckets"].items() if b["cycles"]}
    left_out = []
    if len(buckets) > PLOT_BUCKETS:  # the buckets with the most cycles, in their order
        most = sorted(buckets, key=lambda k: -buckets[k]["cycles"])[:PLOT_BUCKETS]
        left_out.append(f"{len(buckets) - PLOT_BUCKETS} of {len(buckets)} batch-size buckets (those with the fewest "
                        f"cycles)")
        buckets = {k: b for k, b in buckets.items() if k in most}
    keys = list(buckets)
    names = []
    for b in buckets.values():
        for n in b["phases"]:
            if n not in names:
                names.append(n)
    kern = summary.get("kernels")
    if kern and kern.get("phases"):
        fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(24, 5.5),
                                                 gridspec_kw={"width_ratios": [1.25, 1, 1, 1.25]})
    else:
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5.5), gridspec_kw={"width_ratios": [1.25, 1, 1]})
        ax4 = None
    cfg = summary.get("config", {})
    fig.suptitle(f"{cfg.get('algorithm')} {cfg.get('worker')} worker, steps {cfg.get('num_steps')}, topk "
                 f"{cfg.get('topk')}: {summary.get('decode_cycles')} decode cycles, "
                 f"{summary.get('tokens_per_s') or 0:.0f} tok/s")
    drawn = {"phases": {}, "per_position": {}, "cycle_ms": {}}
    cmap = plt.get_cmap("tab20")
    bottoms = [0.0] * len(keys)
    for i, n in enumerate(names + ["between cycles"]):
        vals = []
        for key in keys:
            b = buckets[key]
            if n == "between cycles":
                vals.append(b["between_cycles_gpu_ms"]["mean"] or 0.0)
            else:
                vals.append((b["phases"].get(n, {}).get("gpu_ms", {}).get("mean")) or 0.0)
        ax1.bar(keys, vals, bottom=bottoms, label=n, color=cmap(i % 20))
        drawn["phases"][n] = vals
        bottoms = [x + v for x, v in zip(bottoms, vals)]
    ax1.set_title("Where a decode cycle goes (GPU ms, mean)")
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("ms")
    handles, labels = ax1.get_legend_handles_labels()
    ax1.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # top phase first
    for key in keys:
        rates = buckets[key]["accept"]["per_position"][:PLOT_POSITIONS]
        xs = [i + 1 for i, a in enumerate(rates) if a is not None]
        ys = [a for a in rates if a is not None]
        ax2.plot(xs, ys, marker="o", label=f"bs {key}")
        drawn["per_position"][key] = ys
    longest = max((len(b["accept"]["per_position"]) for b in buckets.values()), default=1)
    if longest > PLOT_POSITIONS:
        left_out.append(f"draft positions past {PLOT_POSITIONS} (of {longest})")
    ax2.set_xticks(range(1, min(longest, PLOT_POSITIONS) + 1))
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_title("Acceptance by draft position\n(given all earlier drafts accepted)")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.legend(fontsize=8)
    width = 0.8 / max(len(keys), 1)
    for j, key in enumerate(keys):
        st = buckets[key]["cycle_gpu_ms"]
        qs = [st["p50"] or 0, st["p90"] or 0, st["p99"] or 0]
        ax3.bar([x + j * width for x in range(3)], qs, width=width, label=f"bs {key}")
        drawn["cycle_ms"][key] = qs
    ax3.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(3)], ["p50", "p90", "p99"])
    ax3.set_title("Cycle GPU time distribution")
    ax3.set_ylabel("ms")
    ax3.legend(fontsize=8)
    if ax4 is not None:
        drawn["kernels"] = _kernel_bars(ax4, kern, cmap)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    drawn["left_out"] = left_out
    return drawn


def _kernel_bars(ax, kern: dict, cmap) -> dict:
    """Per phase, per sampled cycle: kernel time by class, then the idle time in its span."""
    phases = list(kern["phases"])
    drawn = {}
    bottoms = [0.0] * len(phases)
    for i, cls in enumerate(list(CLASSES) + ["idle"]):
        vals = []
        for n in phases:
            p = kern["phases"][n]
            cyc = max(p.get("cycles") or 1, 1)
            v = p.get("idle_ms") if cls == "idle" else (p.get("busy_ms") or {}).get(cls)
            vals.append((v or 0.0) / cyc)
        ax.bar(phases, vals, bottom=bottoms, label=cls, color="lightgrey" if cls == "idle" else cmap(2 * i % 20))
        drawn[cls] = vals
        bottoms = [x + v for x, v in zip(bottoms, vals)]
    cov = kern.get("coverage")
    ax.set_title(f"Inside each phase (kernel samples: {kern.get('cycles')} cycles, "
                 f"coverage {'-' if cov is None else f'{100 * cov:.1f}%'})")
    ax.set_ylabel("ms per cycle")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend(fontsize=8)
    return drawn
