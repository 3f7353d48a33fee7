"""`sglang-specprof report`: a profile read, merged, advised and rendered.

    source.stream (files, .xz/.gz/.zst, torn lines, a live server's URL; each window checked)
      -> merge.Runs (one merge a run, each bucket a bucket_merge.MergedBucket)
      -> advisor.advise (the step-count advisor, the one place advice is made)
      -> render (text, JSON) and page (HTML)

The names below are the report's interface (tests and tools import them from here).
"""

from __future__ import annotations

from .advisor import advise, config_problems  # noqa: F401
from .merge import Merge, Runs, by_steps, marks_added, merge_buckets, summarize, verify_points  # noqa: F401
from .render import (finite, format_by_steps, format_switches, overflow_note, render,  # noqa: F401
                     zero_step_lines)
from .schema import UNREADABLE, SourceError, unmergeable  # noqa: F401
from .source import load, ordinal, readable, stream  # noqa: F401
from .table import cap_lines  # noqa: F401


def read(source: str, last: int | None, notes: list, each=None) -> Runs:
    """The windows of `source` (the `last` N) merged by run as they are read: only the merges
    are held, whatever the profile's length. `each`: called with each window read (--trace
    keeps their sampled cycles); `notes`: the notes on lines skipped and on runs apart."""
    runs = Runs()
    for w in stream(source, last, notes):
        runs.add(w, source)
        if each is not None:
            each(w)
    if len(runs.merges) > 1:
        notes.append(runs.note())
    return runs


def advised(runs: Runs, notes: list, lost: list) -> list[tuple]:
    """(summary, advice, by step count) of each run, the figures that overflowed in `lost`, the
    settings the advisor refuses in `notes`. Raises one of UNREADABLE where the windows merged
    hold values the report cannot use."""
    done = []
    for i, merge in enumerate(runs.merges.values()):
        summary = finite(merge.result(), "summary" if not i else f"other_runs[{i - 1}]", lost)
        done.append((summary, finite(advise(summary), "advice", lost),
                     by_steps(summary)))  # an adaptive profile: what each step count measured
        notes += [n for n in config_problems(summary["config"]) if n not in notes]
    return done
