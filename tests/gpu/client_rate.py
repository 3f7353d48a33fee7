"""Decode time as the clients saw it, from each request's chunk arrival times (plain Python).

Used by exact_check.py on the GPU machine, and by the CPU tests that replay its runs.
"""
from __future__ import annotations

import statistics

from sglang_specprof.kernels import union_length  # the installed sglang-specprof (tests: overlay/)

BASE_INTERVALS = 5  # a running request's intervals before an arrival that set its usual pace
MIN_BASE = 3


def client_decode_seconds(chunks, merge_s=0.0015):
    """`chunks`: each request's chunk times (first token first). The union of the requests'
    decode spans (first token to last), less what each prefill that ran while other requests
    were decoding put into their streams (the median over the running requests).

    Under the overlap scheduler a running batch's tokens reach its clients after the host
    has launched the next batch, so a prefill shows in three of a running request's
    intervals: the one before the arrival's first token (its batch's output waited for the
    prefill), the one across it, and the one after (shorter: the output catching up). Where
    the request has MIN_BASE intervals before those, the prefill's share is the three less
    three of its usual interval (their median). A request without that history (it arrived
    just before) gives the interval across the arrival less the one after it instead.

    First tokens within `merge_s` of the one before came from one prefill; each interval of a
    request is taken out once at most (two arrivals close together share theirs)."""
    runs = [c for c in chunks if len(c) >= 2]
    span = union_length([(c[0], c[-1]) for c in runs])
    batches, last = [], None
    for f in sorted(c[0] for c in runs):
        if last is None or f - last > merge_s:
            batches.append(f)
        last = f
    stall, used = 0.0, set()
    for f in batches:
        excess = []
        for k, c in enumerate(runs):
            if not c[0] < f - merge_s:
                continue
            j = next((i for i, t in enumerate(c) if t >= f - merge_s), None)
            if j is None or not 0 < j < len(c) - 1:
                continue
            base = [c[i] - c[i - 1] for i in range(max(1, j - 1 - BASE_INTERVALS), j - 1)]
            if len(base) >= MIN_BASE:
                usual = statistics.median(base)
                e = 0.0
                for i in (j - 1, j, j + 1):
                    if (k, i) not in used:
                        used.add((k, i))
                        e += (c[i] - c[i - 1]) - usual
                excess.append(e)
            elif (k, j) not in used:
                used.add((k, j))
                excess.append((c[j] - c[j - 1]) - (c[j + 1] - c[j]))
        if excess:
            stall += max(0.0, sorted(excess)[len(excess) // 2])
    return max(0.0, span - stall)
