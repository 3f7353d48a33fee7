"""sglang-specprof: read the profiles a --speculative-profile server writes.

    sglang-specprof report PROFILE.jsonl [--last N] [--json] [--plot out.png] [--html out.html] [--trace out.json]
                                         [--adaptive-config out.json [--adaptive-margin PCT]]
    sglang-specprof report http://HOST:PORT            # the live server's latest window
    sglang-specprof compare A.jsonl B.jsonl [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque

from . import adaptive, advisor, compare as compare_mod, page, render, report
from .plot import plot
from .schema import ProfileError
from .table import printable
from .trace import fields as trace_fields, trace

TRACE_WINDOWS = 500  # --trace draws the sampled cycles of the last 500 windows read at most (--last picks others)
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "svgz")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang-specprof", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="per-phase table, acceptance, tokens/s and the step-count advisor")
    r.add_argument("source", help="a profile JSONL file, or http://host:port of a running server")
    r.add_argument("--last", type=int, metavar="N", help="only the last N windows")
    r.add_argument("--json", action="store_true", help="print the merged summary and the advice as JSON")
    r.add_argument("--plot", metavar="PNG", help="also draw the phases, acceptance and cycle times (needs matplotlib)")
    r.add_argument("--html", metavar="FILE",
                   help="also write the report as one self-contained HTML page: its tables, the advice and the "
                        "figures (the figures need matplotlib; without it the page says so)")
    r.add_argument("--trace", metavar="JSON", help="also write a Chrome/Perfetto trace of the sampled cycles")
    r.add_argument("--adaptive-config", metavar="JSON",
                   help="also write SGLang's --speculative-adaptive-config: per batch-size bucket, the step counts "
                        "predicted within --adaptive-margin of the fastest")
    r.add_argument("--adaptive-margin", type=float, default=adaptive.DEFAULT_MARGIN * 100, metavar="PCT",
                   help="how far below the fastest prediction a step count may be and still be a candidate "
                        "(default %(default)g)")
    c = sub.add_parser("compare", help="what changed from run A to run B, against run-to-run noise")
    c.add_argument("a", metavar="A", help="the first run's profile (JSONL, .xz, .gz or .zst)")
    c.add_argument("b", metavar="B", help="the second run's profile, compared with A bucket by bucket")
    c.add_argument("--json", action="store_true", help="the comparison as JSON instead of the table")
    return p


def _say(line: str) -> None:
    """A line on stderr, its control characters escaped (a profile's names, a path, go into it)."""
    print(f"sglang-specprof: {printable(line)}", file=sys.stderr)


def _write(path: str, text: str) -> None:
    """`text` into `path` whole or not at all (a full disk leaves neither a partial file nor the
    old one damaged)."""
    try:
        page.write(path, text)
    except OSError as e:
        raise report.SourceError(f"cannot write {path}: {e.strerror or e}") from None


def _same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file (a link, a hard link, another spelling)."""
    try:
        if os.path.samefile(a, b):
            return True
    except (OSError, ValueError):
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _check_outputs(args) -> None:
    """Refuse an output path that is the profile read, or another output's: writing it would
    overwrite what was read (or what another option wrote) without a word."""
    outs = [(f"--{k.replace('_', '-')}", getattr(args, k)) for k in ("trace", "adaptive_config", "plot", "html")
            if getattr(args, k)]
    local = not args.source.startswith(("http://", "https://"))
    for i, (flag, path) in enumerate(outs):
        if local and _same_file(path, args.source):
            raise report.SourceError(f"{flag} {path} is the profile being read: writing it would overwrite the "
                                     f"profile; give another path")
        for other, there in outs[:i]:
            if _same_file(path, there):
                raise report.SourceError(f"{flag} and {other} name the same file ({path}): give each its own")


def _plot_path(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if not ext:
        return path + ".png"  # what matplotlib writes for a name without one: say so
    if ext not in PLOT_FORMATS:
        raise report.SourceError(f"--plot {path}: .{ext} is not a figure format; use one of "
                                 f"{', '.join('.' + f for f in PLOT_FORMATS)}")
    return path


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "report":
            if args.last is not None and args.last < 1:
                raise report.SourceError("--last must be 1 or more")
            if not 0 <= args.adaptive_margin < 100:
                raise report.SourceError("--adaptive-margin must be at least 0 and below 100 (a percentage)")
            if args.plot:
                args.plot = _plot_path(args.plot)
            _check_outputs(args)
            # the windows are merged as they are read: only the merges (and, for --trace, each
            # window's sampled cycles) are held, whatever the profile's length
            traced, notes, lost = deque(maxlen=TRACE_WINDOWS), [], []
            runs = report.read(args.source, args.last, notes,
                               (lambda w: traced.append(trace_fields(w))) if args.trace else None)
            try:
                done = report.advised(runs, notes, lost)  # (summary, advice, by step count) of each run
                text = render.runs(runs, done, args.json)
            except report.UNREADABLE as e:
                raise report.unmergeable(args.source, e) from None
            for n in notes:
                _say(f"note: {n}")
            if lost:
                _say(f"note: {report.overflow_note(lost)}")
            print(text)
            summary, advice, measured = done[0]
            if args.adaptive_config:
                why = advisor.not_applicable(summary.get("config"))
                if why:
                    raise report.SourceError(f"{args.source}: {why}; {args.adaptive_config} was not written")
                conf = adaptive.upstream_config(summary, advice, args.adaptive_margin / 100, args.source,
                                                measured=measured)
                if not conf:
                    raise report.SourceError(f"{args.source} holds no decode cycles to advise from; "
                                             f"{args.adaptive_config} was not written")
                _write(args.adaptive_config, json.dumps(conf, indent=1) + "\n")
                tiers = ", ".join(f"bs {k}+: {v['candidate_steps']}" for k, v in conf.items() if k.isdigit())
                top = max(s for k, v in conf.items() if k.isdigit() for s in v["candidate_steps"])
                # SGLang sizes its graph buffers by the launch step count: a larger candidate stops it at capture
                _say(f"adaptive config in {args.adaptive_config} ({tiers}); serve with "
                     f"--speculative-adaptive --speculative-adaptive-config {args.adaptive_config} "
                     f"--speculative-num-steps {top} --speculative-num-draft-tokens {top + 1} (the largest candidate: "
                     f"SGLang sizes its graph buffers by the launch step count)")
                for n in adaptive.notes(conf):
                    _say(f"note: {n}")
            if args.trace:
                tr = trace(list(traced))
                if not tr["otherData"]["cycles"]:
                    raise report.SourceError(f"{args.source} holds no sampled cycles to trace "
                                             f"(it was written by a build that did not keep them)")
                _write(args.trace, json.dumps(tr))
                of = (f", the sampled cycles of the last {TRACE_WINDOWS} of {runs.count} windows (--last N "
                      f"for others)" if runs.count > TRACE_WINDOWS else "")
                _say(f"trace of {tr['otherData']['cycles']} cycles in {args.trace}{of} "
                     f"(open it in ui.perfetto.dev or chrome://tracing)")
            if args.plot:
                try:
                    drawn = plot(summary, args.plot)
                except RuntimeError as e:
                    raise report.SourceError(str(e)) from None
                except OSError as e:
                    raise report.SourceError(f"cannot write {args.plot}: {e.strerror}") from None
                _say(f"figure in {args.plot}")
                if drawn["left_out"]:
                    _say(f"note: the figure leaves out {' and '.join(drawn['left_out'])}")
            if args.html:
                html = page.page(summary, advice, args.source, notes + ([report.overflow_note(lost)] if lost else []))
                try:
                    page.write(args.html, html)
                except OSError as e:
                    raise report.SourceError(f"cannot write {args.html}: {e.strerror or e}; nothing was written") \
                        from None
                _say(f"page in {args.html}")
        else:
            # each profile folded into its side as it is read: a few sums per bucket and figure are
            # held, not its windows, whatever its length
            sides, notes = [], []
            for source in (args.a, args.b):
                side = compare_mod.Side()
                for w in report.stream(source, None, notes):
                    try:
                        side.add(w)
                    except report.UNREADABLE as e:
                        raise report.unmergeable(source, e) from None
                sides.append(side)
            for n in notes:
                _say(f"note: {n}")
            try:
                result = compare_mod.compare(*sides)
                text = (json.dumps(result, indent=1, allow_nan=False) if args.json
                        else compare_mod.format_compare(result, args.a, args.b))
            except report.UNREADABLE as e:
                raise report.unmergeable(f"{args.a} and {args.b}", e) from None
            if result["overflowed"]:
                _say(f"note: {report.overflow_note(result['overflowed'], 'the comparison', 'not in the table')}")
            print(text)
        return 0
    except (ProfileError, report.SourceError) as e:
        _say(f"error: {e}")
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
