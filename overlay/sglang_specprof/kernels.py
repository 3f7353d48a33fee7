"""Kernels inside the phases: a short kernel-level trace of a few cycles, attributed and classed.

The sampler in the server (`sglang.specprof.kernel_sampler`) runs the torch profiler (CUPTI
through kineto) for a few decode cycles and puts a zero-length annotation
`specprof/<cycle>/<mark>` at every phase mark. Each kernel (and copy, memset) comes back
with the correlation of the host call that launched it (`cudaLaunchKernel`,
`cudaGraphLaunch` for every kernel of a replayed graph, `cuLaunchKernel` for triton): the
kernel belongs to the phase whose closing mark is the first annotation after that call.
That holds under CUDA graphs and under the overlap scheduler (launch order on the host is
the phase order, whenever the GPU runs it).

From the same cycles, independent of the CUDA events that time the phases:

- per phase: kernel time per class, the kernel count, the phase's span as the kernels
  give it (end of the last kernel launched before its closing mark, less the same before
  its opening mark: what a CUDA event recorded at each mark measures) and the idle time
  inside that span (no kernel of the phase running);
- coverage: the share of the decode cycles' kernel time that was launched inside a named
  phase, against the kernels launched between cycles (the scheduler's own GPU work);
- with the CUDA-event times of the same cycles, each phase's event span against its
  kernel span.

No torch here: the server hands the events over as tuples (`from_kineto`), a Chrome trace
exported by the torch profiler reads the same way (`from_chrome`); kernel_trace.py reads them.
"""

from __future__ import annotations

from .kernel_trace import PREFIX, from_chrome, from_kineto, kernel_class, parse_marks, union_length  # noqa: F401
from .window import GRAPH_KINDS, bucket_key

CLASSES = ("gemm", "attention", "communication", "sampling", "copy", "other")
FORWARD_PHASES = GRAPH_KINDS  # the phases that are one forward each
TRACK_CYCLES = 2  # cycles whose kernels go into the window one by one (for the trace)
NAME_CHARS = 160  # kernel names as the window keeps them (C++ templates run to thousands)


def _new_phase() -> dict:
    return {"cycles": 0, "kernels": 0, "kernel_ms": 0.0, "busy_ms": {cls: 0.0 for cls in CLASSES}, "span_ms": 0.0,
            "own_span_ms": 0.0, "idle_ms": 0.0, "event_ms": None}


def analyse(norm: dict, event_ms: dict | None = None, tracks: int = TRACK_CYCLES, pause=None) -> dict:
    """The `kernels` block of a window from one sampled stretch.

    `event_ms`: {cycle seq: [[phase, GPU ms by the CUDA events], ...]} for the same cycles.
    The first cycle of the stretch is context only (kernels launched before the profiler
    started would be missing from it); the figures cover the decode cycles after it."""
    marks, cycles = parse_marks(norm["annotations"])
    launches = norm["launches"]
    seqs = sorted(cycles)
    counted = [q for q in seqs[1:] if cycles[q]["kind"] == "decode"]
    counted_set = set(counted)
    # each kernel: its launch time and the annotation that follows the launch
    placed = []  # (launch ts, start, end, name)
    unmatched = 0
    for i, (start, end, corr, name) in enumerate(norm["kernels"]):
        if pause is not None and i % 128 == 127:
            pause()
        lt = launches.get(corr)
        if lt is None:
            unmatched += 1
            continue
        placed.append((lt, start, end, name))
    placed.sort()
    # phase of each kernel; the boundary time at each mark (latest end of anything launched before it)
    per_phase: dict = {}  # (seq, mark index) -> list of (start, end, name)
    between: dict = {}  # seq -> kernels launched after the previous cycle's last mark, before its begin
    boundary = {}  # (seq, mark index) -> ns
    latest = None
    k = 0
    for ts, seq, mark, j in marks:
        while k < len(placed) and placed[k][0] < ts:
            lt, start, end, name = placed[k]
            latest = end if latest is None or end > latest else latest
            if mark == "begin":
                if seq in counted_set:
                    between.setdefault(seq, []).append((start, end, name))
            elif seq in counted_set:
                per_phase.setdefault((seq, j), []).append((start, end, name))
            k += 1
        boundary[(seq, j)] = latest
    phases: dict = {}
    in_phase = 0
    tracks_out = []
    names_table: list = []
    name_ix: dict = {}
    ev = event_ms or {}
    for n, seq in enumerate(counted):
        c = cycles[seq]
        evrows = ev.get(seq) or ev.get(str(seq)) or []
        evrow = {}
        for name, ms in evrows:
            evrow.setdefault(name, []).append(ms)
        used = {}
        track = {"cycle": seq, "bs": c["bs"], "phases": [], "kernels": []} if n < tracks else None
        b0 = boundary.get((seq, 0))
        for j in range(1, len(c["marks"])):
            pname = c["marks"][j][1]
            ks = per_phase.get((seq, j), [])
            lo, hi = boundary.get((seq, j - 1)), boundary.get((seq, j))
            span = (hi - lo) if lo is not None and hi is not None else None
            p = phases.setdefault(pname, _new_phase())
            p["cycles"] += 1
            p["kernels"] += len(ks)
            for start, end, kname in ks:
                d = (end - start) / 1e6
                p["busy_ms"][kernel_class(kname)] += d
                p["kernel_ms"] += d
                in_phase += end - start
            if span is not None:
                p["span_ms"] += span / 1e6
                if ks:  # from the phase's first kernel: the opening mark's event completes in between
                    p["own_span_ms"] += max(hi - min(a for a, _, _ in ks), 0) / 1e6
                clipped = [(max(a, lo), min(b, hi)) for a, b, _ in ks if min(b, hi) > max(a, lo)]
                p["idle_ms"] += (span - union_length(clipped)) / 1e6
            i = used.get(pname, 0)
            used[pname] = i + 1
            got = evrow.get(pname) or []
            if i < len(got):
                p["event_ms"] = (p["event_ms"] or 0.0) + got[i]
            if track is not None and b0 is not None and lo is not None and hi is not None:
                track["phases"].append([pname, round((lo - b0) / 1e3, 3), round((hi - lo) / 1e3, 3)])
                for start, end, kname in ks:
                    if kname not in name_ix:
                        name_ix[kname] = len(names_table)
                        names_table.append(kname[:NAME_CHARS])
                    track["kernels"].append([round((start - b0) / 1e3, 3), round((end - start) / 1e3, 3),
                                             len(track["phases"]) - 1, CLASSES.index(kernel_class(kname)),
                                             name_ix[kname]])
        if track is not None:
            track["events"] = [[name, round(ms, 4)] for name, ms in evrows]
            tracks_out.append(track)
    gap_busy = {cls: 0.0 for cls in CLASSES}
    gap_names: dict = {}
    gap_total = 0
    gap_count = 0
    for seq, ks in between.items():
        for start, end, kname in ks:
            gap_total += end - start
            gap_count += 1
            gap_busy[kernel_class(kname)] += (end - start) / 1e6
            gap_names[kname] = gap_names.get(kname, 0) + (end - start)
    for p in phases.values():
        for key in ("kernel_ms", "span_ms", "own_span_ms", "idle_ms", "event_ms"):
            if p[key] is not None:
                p[key] = round(p[key], 4)
        p["busy_ms"] = {cls: round(v, 4) for cls, v in p["busy_ms"].items()}
        _agreement(p)
    total = in_phase + gap_total
    return {
        "cycles": len(counted),
        "bs": [cycles[q]["bs"] for q in counted],
        **({"steps": [cycles[q]["steps"] for q in counted]} if any(cycles[q]["steps"] is not None for q in counted)
           else {}),
        "coverage": round(in_phase / total, 5) if total else None,
        "kernel_ms": round(total / 1e6, 4),
        "phases": phases,
        "between_cycles": {"kernels": gap_count, "kernel_ms": round(gap_total / 1e6, 4),
                           "busy_ms": {cls: round(v, 4) for cls, v in gap_busy.items()},
                           "top": [[n[:NAME_CHARS], round(v / 1e6, 4)] for n, v in
                                   sorted(gap_names.items(), key=lambda x: -x[1])[:5]]},
        "unmatched_kernels": unmatched,
        "classes": list(CLASSES),
        "tracks": tracks_out,
        "names": names_table,
    }


AGREE = 0.02  # an event span agrees with the kernels' when it lies between their two spans, 2% either side


def _agreement(p: dict) -> None:
    """A CUDA event recorded at a mark completes once the stream's earlier work ended and the
    host recorded it: after the previous phase's last kernel, before this phase's first. So
    the phase's event span lies between the kernels' `own_span_ms` (first kernel's start to
    the closing boundary) and `span_ms` (the previous boundary to the closing one)."""
    ev, lo, hi = p.get("event_ms"), p.get("own_span_ms"), p.get("span_ms")
    p["span_vs_events"] = round(hi / ev, 4) if ev and hi else None
    if ev and hi and p.get("kernels"):
        p["events_agree"] = (lo or 0.0) * (1 - AGREE) <= ev <= hi * (1 + AGREE)
    else:
        p["events_agree"] = None


def against_window(block: dict, window: dict) -> None:
    """How much slower the sampled cycles ran than the window's cycles of the same batch sizes
    (the torch profiler records every host operation of the scheduler's thread while it runs:
    a host-bound phase runs slower, and the wait shows as idle time in the sample). Adds
    `window_ms` (the window's mean GPU ms of the phase, over the buckets of the sampled batch
    sizes, weighted by the sample's cycles) and `slowed` (`event_ms` per cycle / `window_ms`)
    to each phase, and `slowed` for the whole cycle."""
    buckets = window.get("buckets") or {}
    bss = block.get("bs") or []
    steps = block.get("steps") or [None] * len(bss)  # an adaptive profile's: its buckets are "5-8@2"
    keys = [bucket_key(bs, st) for bs, st in zip(bss, steps) if bs is not None]
    if not keys:
        return
    ev_total = win_total = 0.0
    for name, p in (block.get("phases") or {}).items():
        means = [((buckets.get(k) or {}).get("phases", {}).get(name) or {}).get("gpu_ms", {}).get("mean")
                 for k in keys]
        if any(m is None for m in means) or not p.get("event_ms") or not p.get("cycles"):
            continue
        win = sum(means) / len(means)
        p["window_ms"] = round(win, 4)
        per = p["event_ms"] / p["cycles"]
        p["slowed"] = round(per / win, 4) if win > 0 else None
        ev_total += per
        win_total += win
    if win_total > 0:
        block["slowed"] = round(ev_total / win_total, 4)


def merge(blocks: list[dict]) -> dict | None:
    """Several windows' `kernels` blocks as one (sums; coverage and ratios from the sums)."""
    blocks = [b for b in blocks if b and b.get("phases") is not None]
    if not blocks:
        return None
    phases: dict = {}
    in_phase = gap = 0.0
    gap_busy = {cls: 0.0 for cls in CLASSES}
    for b in blocks:
        for name, p in b["phases"].items():
            q = phases.setdefault(name, _new_phase())
            for key in ("cycles", "kernels", "kernel_ms", "span_ms", "own_span_ms", "idle_ms"):
                q[key] += p.get(key) or 0
            if p.get("event_ms") is not None:
                q["event_ms"] = (q["event_ms"] or 0.0) + p["event_ms"]
            for cls, v in (p.get("busy_ms") or {}).items():
                q["busy_ms"][cls] = q["busy_ms"].get(cls, 0.0) + v
            in_phase += p.get("kernel_ms") or 0
        g = b.get("between_cycles") or {}
        gap += g.get("kernel_ms") or 0
        for cls, v in (g.get("busy_ms") or {}).items():
            gap_busy[cls] = gap_busy.get(cls, 0.0) + v
    for p in phases.values():
        if not p["own_span_ms"]:
            p["own_span_ms"] = None  # samples from before the field: the bracket's lower side unknown
        _agreement(p)
    slowed = [b["slowed"] for b in blocks if b.get("slowed")]
    total = in_phase + gap
    return {"samples": len(blocks), "slowed": round(sum(slowed) / len(slowed), 4) if slowed else None, "cycles": sum(b.get("cycles") or 0 for b in blocks),
            "coverage": round(in_phase / total, 5) if total else None, "kernel_ms": round(total, 4),
            "phases": phases, "between_cycles": {"kernel_ms": round(gap, 4), "busy_ms": gap_busy},
            "unmatched_kernels": sum(b.get("unmatched_kernels") or 0 for b in blocks)}


def format_block(k: dict) -> list[str]:
    """Lines for the log and the report: coverage, then each phase's kernel time by class."""
    if not k or not k.get("phases"):
        return []
    cov = k.get("coverage")
    head = (f"kernels ({k.get('cycles')} sampled decode cycles): coverage "
            f"{'-' if cov is None else f'{100 * cov:.2f}%'} of kernel time inside a phase, between cycles "
            f"{(k.get('between_cycles') or {}).get('kernel_ms', 0):.3f} ms")
    if k.get("slowed"):
        head += (f"; the sampled cycles ran {100 * (k['slowed'] - 1):+.1f}% against the window's "
                 f"(the sampler's own host cost, shown as idle)")
    lines = [head, f"{'phase':<20}{'own ms':>9}{'span ms':>9}{'events':>9}{'agree':>6}{'kern ms':>9}{'idle ms':>9}"
             f"{'n':>6}  " + " ".join(f"{c[:6]:>7}" for c in CLASSES)]
    for name, p in k["phases"].items():
        cyc = max(p.get("cycles") or 1, 1)
        kern = p.get("kernel_ms") or 0.0
        shares = " ".join(f"{(100 * (p['busy_ms'].get(c) or 0) / kern if kern else 0):>6.1f}%" for c in CLASSES)
        evm, own, ok = p.get("event_ms"), p.get("own_span_ms"), p.get("events_agree")
        lines.append(f"{name:<20}{'-' if own is None else f'{own / cyc:.3f}':>9}{p['span_ms'] / cyc:>9.3f}"
                     f"{'-' if evm is None else f'{evm / cyc:.3f}':>9}{'-' if ok is None else ('yes' if ok else 'NO'):>6}"
                     f"{kern / cyc:>9.3f}{(p.get('idle_ms') or 0) / cyc:>9.3f}{p['kernels'] // cyc:>6}  {shares}")
    lines.append("(per cycle, from the kernels: `own` from the phase's first kernel, `span` from the previous "
                 "phase's last, to the phase's last; `events` the CUDA events' span, which agrees when it lies "
                 "between the two (2%); class shares of the phase's kernel time)")
    return lines
