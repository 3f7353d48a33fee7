"""Rendering a report: the text of a run's summary and advice, its figures made JSON-safe."""

from __future__ import annotations

import json
import math

from .advice_text import format_advice
from .bucket_merge import MARKS_MIN_CYCLES, MARKS_MIN_WINDOWS
from .merge import by_steps
from .table import escaped, format_summary
from .window import bucket_steps


def finite(obj, where: str = "", lost: list | None = None):
    """`obj` with each number that is not finite (a sum of windows past the largest float, and
    what was figured from it) as None, and the paths of those (`lost`): what strict JSON
    writes, and what the text shows as "-" rather than inf or nan."""
    lost = [] if lost is None else lost
    if isinstance(obj, float) and not math.isfinite(obj):
        lost.append(where or "(the figure)")
        return None
    if isinstance(obj, dict):
        return {k: finite(v, f"{where}.{k}" if where else str(k), lost) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v, f"{where}[{i}]", lost) for i, v in enumerate(obj)]
    return obj


def overflow_note(lost: list, what: str = "the windows merged", left: str = "shown as - (null in --json)") -> str:
    shown = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
    n = f"{len(lost)} figures" if len(lost) > 1 else "1 figure"
    return (f"{n} of {what} overflowed (past the largest number a float holds: the profile's figures are too "
            f"large to add up) and {'are' if len(lost) > 1 else 'is'} left out, {left}: {shown}.")



def zero_step_lines(summary: dict, advice: dict) -> list[str]:
    """A line for each bucket run at 0 steps that the advisor could not judge."""
    return [f"bs {key}: run at 0 steps, and these batch sizes never ran with drafting: no acceptance to predict "
            f"other step counts from (profile them at 1 step or more)"
            for key, b in summary.get("buckets", {}).items()
            if bucket_steps(key) == 0 and b.get("cycles") and key not in advice]



def format_by_steps(rows: dict) -> list[str]:
    lines = []
    for key, v in rows.items():
        best = v["tokens_per_s"][v["best"]]
        cells = ", ".join(f"{s}: {t:.1f}{' (best)' if s == v['best'] else f' ({100 * (t / best - 1):+.1f}%)'}"
                          for s, t in sorted(v["tokens_per_s"].items()))
        lines.append(f"bs {key} measured by step count, tok/s: {cells}")
    return lines


def format_switches(summary: dict) -> list[str]:
    s = summary.get("switch_cycles")
    if not s or not s.get("cycles"):
        return []
    other = s.get("other_cycles_mean_gpu_ms")
    return [f"switches of step count: {s['cycles']} first cycles at the new count, kept out of the buckets; "
            f"{s['mean_gpu_ms']} ms GPU each (of which {s['gap_gpu_ms'] / s['cycles']:.3f} ms idle before it, "
            f"the worker's swap)" + (f" against {other} ms for the other decode cycles" if other else "")
            + f"; {s['gpu_ms'] / 1000.0:.3f} s in all"]


# Above this share of all cycles' time, what timing by phase adds is worth halving: one cycle of 2K timed
# by phase (its figures from half as many cycles) instead of one of K
MARKS_SHARE_TO_HALVE = 0.005


def _marks_line(m, phases_every=None) -> str | None:
    """What timing by phase adds to a cycle, or why the profile does not say; where it is above
    MARKS_SHARE_TO_HALVE of all cycles' time (a small model's short cycles), the K that halves it."""
    if not m or m["gpu_ms"] is None:
        return None
    judged, (timed, whole) = m.get("judged", "measured"), m.get("cycles") or (None, None)
    if judged == "too few cycles":
        return (f"what timing by phase adds is not said: it would rest on {timed} cycles timed by phase against "
                f"{whole} timed whole, too few ({MARKS_MIN_CYCLES} of each at least)")
    if judged == "too few windows":
        return (f"what timing by phase adds is not said: {m['windows']} windows hold cycles of both kinds, too few "
                f"to judge it against the noise ({MARKS_MIN_WINDOWS} at least)")
    if judged == "within noise":
        return (f"timing by phase adds no GPU time to a cycle measurable against the noise (those cycles against "
                f"the ones timed whole, the median of {m['windows']} windows within +-{1000 * m['noise_gpu_ms']:.1f} "
                f"us of none)")
    share = "" if m["share_of_all"] is None else f", {100 * m['share_of_all']:.2f}% of all cycles' time"
    if m["share_of_all"] is not None and m["share_of_all"] >= MARKS_SHARE_TO_HALVE and phases_every:
        share += (f"; --speculative-profile-phases-every {2 * phases_every} would make it about "
                  f"{50 * m['share_of_all']:.2f}% (phases timed in half as many cycles)")
    return (f"timing by phase adds {1000 * m['gpu_ms']:.1f} us of GPU time to each cycle it times (median of "
            f"{m['windows']} windows, those cycles against the ones timed whole){share}")


def render(summary: dict, advice: dict) -> str:
    # a profile's names and settings as text: a control character in one is shown, not acted on
    summary, advice = escaped(summary), escaped(advice)
    text = [format_summary(summary, advice=advice)]
    text += format_by_steps(by_steps(summary))
    text += format_switches(summary)
    text += zero_step_lines(summary, advice)
    for key, adv in advice.items():
        text.append(f"bs {key} " + format_advice(adv))
    phases_every = (summary.get("config") or {}).get("phases_every")
    for key, b in summary.get("buckets", {}).items():
        line = _marks_line(b.get("phase_marks_added"), phases_every)
        if line:
            text.append(f"bs {key}: {line}")
    if summary.get("kernels"):
        k = summary["kernels"]  # its table is in format_summary's
        text.append(f"({k['samples']} kernel samples merged; {k['unmatched_kernels']} kernels whose launch the "
                    f"trace did not hold left out)")
    return "\n".join(text)


def runs(merged, done: list, as_json: bool) -> str:
    """The report of each run (`done`: `report.advised`'s) as text, or as JSON: the first run's
    summary, advice and figures by step count, and the others in other_runs."""
    if as_json:
        outs = []
        for summary, advice, measured in done:
            outs.append({"summary": summary, "advice": advice, **({"by_steps": measured} if measured else {})})
        out = dict(outs[0], **({"other_runs": outs[1:], "runs_differ": merged.differ()} if len(outs) > 1 else {}))
        return json.dumps(out, indent=1, allow_nan=False)
    if len(done) == 1:
        return render(*done[0][:2])
    return "\n".join(f"{merged.header(i)}\n{render(s, a)}" for i, (s, a, _) in enumerate(done))
