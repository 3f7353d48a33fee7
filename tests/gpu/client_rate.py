"""Decode time as the clients saw it, from each request's chunk arrival times (plain Python).

Used by exact_check.py on the GPU machine, and by the CPU tests that replay its runs.
"""
from __future__ import annotations

from sglang_specprof.kernels import union_length  # the installed sglang-specprof (tests: overlay/)


def client_decode_seconds(chunks, merge_s=0.0015):
    """`chunks`: each request's chunk times (first token first). The union of the requests'
    decode spans (first token to last), less what each prefill that ran while other requests
    were decoding put into their streams: a running request's interval across an arrival's
    first token holds the prefill and a cycle at the new batch size, the interval after it
    that cycle alone; the difference is the prefill's (median over the running requests).

    First tokens within `merge_s` of the one before came from one prefill; each interval of a
    request is taken out once at most (two arrivals close together fall in the same one)."""
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
            if j is not None and 0 < j < len(c) - 1 and (k, j) not in used:
                used.add((k, j))
                excess.append((c[j] - c[j - 1]) - (c[j + 1] - c[j]))
        if excess:
            stall += max(0.0, sorted(excess)[len(excess) // 2])
    return max(0.0, span - stall)
