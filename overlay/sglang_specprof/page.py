"""`report --html`: the report as one self-contained HTML page.

The page is built from the summary and the advice that the text report prints (its lines
are those of `render.render` and the functions it calls), with the figures of `plot.figures`
embedded as SVG images (data: URIs): it needs no network, no script and no file beside it.
Every string from the profile is escaped; the page's Content-Security-Policy allows no
script and nothing from outside, should one not be.
"""

from __future__ import annotations

import base64
import html
import io
import os
import tempfile

from . import advisor, kernels, plot as plot_mod, render
from .merge import by_steps
from .table import _advice_line, _f, escaped, format_summary

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto; max-width: 1500px;
       padding: 0 1em; color: #1a1a1a; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.15em; margin-top: 1.8em;
     border-bottom: 1px solid #ccc; } h3 { font-size: 1em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: .5em 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d0d0; padding: 2px 8px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; } td.name, th.name { text-align: left; }
#buckets td:last-child { white-space: normal; text-align: left; min-width: 28em; }
tr.warmup td { color: #777; background: #f7f7f7; } tr.best td { font-weight: bold; }
.swatch { display: inline-block; width: .9em; height: .9em; margin-right: .4em; vertical-align: -.1em;
          border: 1px solid #0003; }
pre { background: #f7f7f7; border: 1px solid #e0e0e0; padding: .6em; overflow-x: auto; font-size: 12px; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #e6e6e6; }
.note { color: #555; } .missing { background: #fff4e0; border: 1px solid #f0c070; padding: .5em; }
"""
# no script, nothing fetched: only the page's own style and its data: images
POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _table(head: list, rows: list, cls: str = "", row_cls=None, ident: str = "") -> str:
    """`rows` of cells already escaped (HTML), under `head` (plain text)."""
    out = [f"<table{f' id={_e(ident)!r}' if ident else ''}{f' class={_e(cls)!r}' if cls else ''}><thead><tr>"]
    out += [f"<th{' class=name' if i == 0 else ''}>{_e(h)}</th>" for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for i, r in enumerate(rows):
        rc = row_cls(i) if row_cls else ""
        out.append(f"<tr{f' class={rc!r}' if rc else ''}>"
                   + "".join(f"<td{' class=name' if j == 0 else ''}>{c}</td>" for j, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _pre(lines) -> str:
    return f"<pre>{_e(chr(10).join(lines))}</pre>" if lines else ""


def svg_figures(summary: dict):
    """([(panel name, title, SVG bytes)], what was left out), or (None, why) without matplotlib."""
    try:
        plt = plot_mod.pyplot()
    except RuntimeError:
        return None, (f"The figures need {plot_mod.MISSING}, which is not installed here: pip install matplotlib "
                      f"(or 'sglang-specprof[plot]' with the analysis wheel), and write the page again.")
    out = []
    with plt.rc_context(dict(plot_mod.TEXT, **{"svg.hashsalt": "sglang-specprof", "svg.fonttype": "path"})):
        figs, drawn = plot_mod.figures(summary, plt)
        try:
            for name, fig in figs:
                buf = io.BytesIO()
                fig.savefig(buf, format="svg", metadata={"Date": None})
                out.append((name, plot_mod.PANEL_TITLES[name], buf.getvalue()))
        finally:
            for _, fig in figs:
                plt.close(fig)
    return out, drawn["left_out"]


def page(summary: dict, advice: dict, source: str, notes=(), figures=None) -> str:
    """The page of one run's summary and advice (`advisor.advise`'s); `notes`: the report's notes.
    `figures`: `svg_figures(summary)`, drawn here when not given."""
    text = render.render(summary, advice)  # what `report` prints, its strings made printable
    figs, left = svg_figures(summary) if figures is None else figures
    s, adv = escaped(summary), escaped(advice)
    cfg = s.get("config") or {}
    buckets = {k: b for k, b in s.get("buckets", {}).items() if b.get("cycles")}
    body = [f"<h1>sglang-specprof report: {_e(source)}</h1>", f"<p>{_e(text.split(chr(10))[0])}</p>"]
    if notes:
        body.append("<ul class=note>" + "".join(f"<li>note: {_e(n)}</li>" for n in escaped(list(notes))) + "</ul>")

    body.append("<h2 id=figures>Figures</h2>")
    if figs is None:
        body.append(f"<p class=missing>{_e(left)}</p>")
    else:
        for name, title, svg in figs:
            data = base64.b64encode(svg).decode("ascii")
            body.append(f"<figure id='fig-{name}'><img alt='{_e(title)}' src='data:image/svg+xml;base64,{data}'>"
                        f"<figcaption>{_e(title)}</figcaption></figure>")
        if left:
            body.append(f"<p class=note>The figures leave out {_e(' and '.join(left))}.</p>")
        body.append(f"<p class=note>Each phase has one colour in every figure (the swatches below); buckets of "
                    f"fewer than {plot_mod.WARMUP_CYCLES} decode cycles are drawn apart, at their own scale, as "
                    f"warm-up.</p>")

    body.append("<h2 id=buckets-head>Buckets</h2>")
    rows, warm = [], []
    for key, b in buckets.items():
        acc = b["accept"]
        per = (b.get("cycle_period_gpu_ms") or {}).get("mean")
        share = b.get("between_cycles_share")
        line = _advice_line(b, cfg, adv.get(key)) or ""
        warm.append(b["cycles"] < plot_mod.WARMUP_CYCLES)
        rows.append([f"<a href='#bucket-{len(rows)}'>bs {_e(key)}</a>" + (" (warm-up)" if warm[-1] else ""),
                     _e(b["cycles"]), _e(_f(b["cycle_gpu_ms"]["mean"])), *(_e(_f(b["cycle_gpu_ms"][q])) for q in
                                                                         ("p50", "p90", "p99")),
                     _e(_f(per)), _e("-" if share is None else f"{100 * share:.1f}%"),
                     _e(_f(b["cycle_wall_ms"]["mean"])), _e(_f(acc["mean_length"], 2)),
                     _e(" ".join(_f(a, 2) for a in acc["per_position"])), _e(_f(b["tokens_per_s"], 1)),
                     _e(line.strip().removeprefix("advisor: "))])
    body.append(_table(["bucket", "cycles", "cycle GPU ms", "p50", "p90", "p99", "period GPU ms", "between cycles",
                        "host ms", "accept len", "acceptance by position", "tok/s", "advisor"], rows, ident="buckets",
                       row_cls=lambda i: "warmup" if warm[i] else ""))

    measured = by_steps(s)
    if measured:
        steps = sorted({k for v in measured.values() for k in v["tokens_per_s"]})
        rows = []
        for key, v in measured.items():
            best = v["tokens_per_s"][v["best"]]
            cells = []
            for st in steps:
                t = v["tokens_per_s"].get(st)
                cells.append("" if t is None else f"<b>{t:.1f}</b> (best)" if st == v["best"]
                             else _e(f"{t:.1f} ({100 * (t / best - 1):+.1f}%)"))
            rows.append([f"bs {_e(key)}", *cells])
        body.append("<h2 id=by-steps-head>Measured by step count (tok/s)</h2>")
        body.append(_table(["batch sizes", *(f"{st} steps" for st in steps)], rows, ident="by-steps"))
    adaptive = render.format_switches(s) + render.zero_step_lines(s, adv)
    if adaptive:
        body.append("<h2 id=switches>Switches of step count</h2>" + "".join(f"<p>{_e(x)}</p>" for x in adaptive))

    body.append("<h2 id=phases-head>Each bucket</h2>")
    colours = plot_mod.phase_colours([n for b in buckets.values() for n in b["phases"]] + [plot_mod.BETWEEN])
    for i, (key, b) in enumerate(buckets.items()):
        body.append(f"<h3 id='bucket-{i}'>bs {_e(key)}: {_e(b['cycles'])} cycles"
                    + (f" (warm-up: fewer than {plot_mod.WARMUP_CYCLES})" if warm[i] else "") + "</h3>")
        rows = []
        for name, p in list(b["phases"].items()) + [(plot_mod.BETWEEN, None)]:
            g, h = (p["gpu_ms"], p["host_ms"]) if p else (b["between_cycles_gpu_ms"], {})
            sh = "" if not p else "-" if p["share"] is None else f"{100 * p['share']:.1f}%"
            rows.append([f"<span class=swatch style='background:{colours[name]}'></span>{_e(name)}",
                         *(_e(_f(g[q])) for q in ("mean", "p50", "p90", "p99")), _e(_f(h.get("mean"))) if p else "",
                         _e(sh)])
        body.append(_table(["phase", "GPU ms", "p50", "p90", "p99", "host ms", "share"], rows, cls="phases"))
        one = dict(s, buckets={key: b}, ranks=None, kernels=None, dropped_cycles=0, steps_lost=0, marks_lost=0,
                   uncut_cycles=0, prefill_seconds=None, admissions=0, config=dict(cfg, max_running_requests=None))
        # the bucket's lines of the text report beyond its phase table (draft steps, graphs, stalls, ...)
        lines = format_summary(one, advice={key: adv[key]} if key in adv else {}).split("\n")[1:]
        body.append(_pre([x.strip() for x in _without_phase_table(lines, b)]))
        if key in adv:
            a = adv[key]
            rows = []
            for r in a["rows"]:
                mark = ("best" if r["steps"] == a["best"] else "") + (" profiled" if advisor.is_profiled(a, r) else "")
                if r.get("measured"):
                    mark += f" measured ({r['measured']} cycles)"
                rows.append([_e(f"{r['steps']}{'*' if r['extrapolated'] else ''}"), _e(r["draft_tokens"]),
                             _e(f"{r['expected_tokens']:.3f}"), _e(f"{r['cycle_ms']:.3f}"),
                             _e(f"{r['tokens_per_s']:.1f}"), _e(f"{r['low']:.1f}"), _e(f"{r['high']:.1f}"),
                             _e(mark.strip())])
            best = [r["steps"] == a["best"] for r in a["rows"]]
            body.append(_table(["steps", "draft tokens", "E[tok]", "cycle ms", "tok/s", "low", "high", ""], rows,
                               cls="advisor", row_cls=lambda j, best=best: "best" if best[j] else ""))
            body.append(_pre([f"bs {key} " + advisor.format_advice(a)]))

    k = s.get("kernels")
    if k:
        body.append("<h2 id=kernels>Kernels inside the phases</h2>")
        body.append(_pre([f"the sample of window {k.get('window')} could not be read ({k['error']})"] if k.get("error")
                         else kernels.format_block(k)))
    body.append("<h2 id=text>The text report</h2><details><summary>what <code>sglang-specprof report</code> "
                "prints</summary>" + _pre([text]) + "</details>")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<meta http-equiv=Content-Security-Policy content=\"{POLICY}\">"
            "<meta name=viewport content='width=device-width, initial-scale=1'>"
            f"<title>sglang-specprof report: {_e(source)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _without_phase_table(lines: list, b: dict) -> list:
    """A bucket's lines of the text report less its phase table (the page has it as a table): the
    table's head, a row for each phase, and the row of the time between cycles."""
    head = next((i for i, x in enumerate(lines) if x.startswith("    phase ")), None)
    if head is None:
        return lines
    return lines[:head] + lines[head + len(b["phases"]) + 2:]


def write(path: str, text: str) -> None:
    """`text` into `path` whole or not at all: written beside it, then renamed over it. OSError
    where it cannot be (nothing left behind)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".specprof-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
