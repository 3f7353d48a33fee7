"""Merge a profile's windows into one summary per batch-size bucket, and report it."""

from __future__ import annotations

import json
import urllib.request

from . import advisor, kernels, schema, window
from .table import format_summary


class SourceError(ValueError):
    """A profile that cannot be read; the message is one sentence."""


# what a field of the wrong type raises somewhere in the report (the schema checks the shape only)
_UNREADABLE = (TypeError, KeyError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError,
               RecursionError)


def readable(windows: list[dict], source: str) -> list[dict]:
    """Each window through the report on its own first: one whose fields hold values of the
    wrong type is named in one sentence, not a traceback halfway through the report."""
    from .trace import trace

    for i, w in enumerate(windows):
        try:
            s = summarize([w])
            advise(s)
            json.dumps(s, allow_nan=False)
            json.dumps(trace([w]), allow_nan=False)
        except _UNREADABLE as e:
            first = (str(e).strip().splitlines() or [""])[0][:120]
            raise SourceError(f"{source}: window {w.get('window', i)!r} (the {i + 1}th read) holds a value the "
                              f"report cannot use ({type(e).__name__}: {first})") from None
    return windows


def load(source: str, last: int | None = None) -> tuple[list[dict], list[str]]:
    """Windows from a JSONL file, or the latest window of a live server (http://host:port)."""
    if source.startswith(("http://", "https://")):
        url = source.rstrip("/") + "/server_info"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                info = json.load(r)
        except (OSError, ValueError) as e:
            raise SourceError(f"cannot read {url}: {e}") from None
        if not isinstance(info, dict) or not isinstance(info.get("internal_states") or [], list):
            raise SourceError(f"{url} did not answer with server info (a JSON object with internal_states)")
        wins = []
        for n, st in enumerate(info.get("internal_states") or []):
            prof = (st if isinstance(st, dict) else {}).get("speculative_profile") or {}
            if isinstance(prof, dict) and prof.get("latest"):
                bad = schema.problems(prof["latest"])
                if bad:
                    raise SourceError(f"{url}: internal state {n} is not a {schema.SCHEMA} window: {'; '.join(bad[:3])}")
                wins.append(prof["latest"])
        if not wins:
            raise SourceError(f"{source} reports no profile window yet (is --speculative-profile on, "
                              f"and have {''}enough decode cycles run to close a window?)")
        return readable(wins, source), []
    try:
        windows, notes = schema.read(source, skip_torn=True)
    except FileNotFoundError:
        raise SourceError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{source} is a folder, not a profile") from None
    if not windows:
        raise SourceError(f"{source} holds no profile window")
    windows = windows[-last:] if last else windows
    return readable(windows, source), notes


def _wmean(pairs):
    pairs = [(v, n) for v, n in pairs if v is not None and n]
    tot = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / tot if tot else None


def _wmedian(pairs):
    pairs = sorted((v, n) for v, n in pairs if v is not None and n)
    tot = sum(n for _, n in pairs)
    acc = 0
    for v, n in pairs:
        acc += n
        if acc >= tot / 2:
            return v
    return None


def _merge_stats(stats: list[dict]) -> dict:
    """Count-weighted mean; the percentiles are count-weighted medians of the windows' ones."""
    pairs = [(s, s.get("n") or 0) for s in stats]
    out = {"n": sum(n for _, n in pairs)}
    out["mean"] = _r(_wmean([(s["mean"], n) for s, n in pairs]))
    for q in ("p50", "p90", "p99"):
        out[q] = _r(_wmedian([(s[q], n) for s, n in pairs]))
    highs = [s["max"] for s, n in pairs if n and s.get("max") is not None]
    out["max"] = max(highs) if highs else None
    return out


def _r(x):
    return None if x is None else round(x, 4)


def _sum_lists(lists) -> list:
    out = []
    for xs in lists:
        for i, c in enumerate(xs):
            while len(out) <= i:
                out.append(0)
            out[i] += c
    return out


def merge_buckets(windows: list[dict]) -> dict:
    keys = []
    for w in windows:
        for k in w["buckets"]:
            if k not in keys:
                keys.append(k)
    merged = {}
    for key in sorted(keys, key=lambda k: int(k.split("-")[0])):
        bs = [w["buckets"][key] for w in windows if key in w["buckets"]]
        cycles = sum(b["cycles"] for b in bs)
        names = []
        for b in bs:
            for n in b["phases"]:
                if n not in names:
                    names.append(n)
        phases = {n: {"gpu_ms": _merge_stats([b["phases"][n]["gpu_ms"] for b in bs if n in b["phases"]]),
                      "host_ms": _merge_stats([b["phases"][n]["host_ms"] for b in bs if n in b["phases"]])}
                  for n in names}
        cyc = _merge_stats([b["cycle_gpu_ms"] for b in bs])
        # the cycles the phases were timed in (all of them before --speculative-profile-phases-every)
        timed = _merge_stats([b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"] for b in bs])
        for p in phases.values():
            p["share"] = _r(p["gpu_ms"]["mean"] / timed["mean"]) if timed["mean"] and p["gpu_ms"]["mean"] is not None else None
        nsteps = max((len(b["draft_steps_gpu_ms"]) for b in bs), default=0)
        steps = [_merge_stats([b["draft_steps_gpu_ms"][i] for b in bs if len(b["draft_steps_gpu_ms"]) > i])
                 for i in range(nsteps)]
        hist = _sum_lists(b["accept"]["histogram"] for b in bs)
        # correct drafts per request, uncut (schema 2); schema 1 had the accept lengths only
        drafts = _sum_lists(b["accept"]["drafts_histogram"] if "drafts_histogram" in b["accept"]
                            else b["accept"]["histogram"][1:] for b in bs)
        verified = sum(hist)
        committed = sum(b["accept"]["committed_tokens"] for b in bs)
        positions = max([len(drafts) - 1] + [len(b["accept"]["per_position"]) for b in bs])
        busy = sum(b["accept"]["committed_tokens"] / b["tokens_per_s"] for b in bs if b.get("tokens_per_s"))
        counted = sum(b["accept"]["committed_tokens"] for b in bs if b.get("tokens_per_s"))
        wall = _merge_stats([b["cycle_wall_ms"] for b in bs])
        gap = _merge_stats([b["between_cycles_gpu_ms"] for b in bs])
        gpu_period = _merge_stats([b["cycle_period_gpu_ms"] for b in bs if b.get("cycle_period_gpu_ms")])
        accept_cycles = sum(b["accept"]["committed_tokens"] / b["accept"]["tokens_per_cycle"]
                            for b in bs if b["accept"].get("tokens_per_cycle"))
        ctx = [b["context_tokens"] for b in bs if (b.get("context_tokens") or {}).get("n")]
        stalled = {"cycles": 0, "gpu_ms": 0.0, "phases": {}}
        for b in bs:
            st = b.get("stalled") or {}
            stalled["cycles"] += st.get("cycles") or 0
            stalled["gpu_ms"] += st.get("gpu_ms") or 0.0
            for n, e in (st.get("phases") or {}).items():
                m = stalled["phases"].setdefault(n, {"n": 0, "gpu_ms": 0.0, "host_ms": 0.0})
                for f in m:
                    m[f] += e.get(f) or 0
        stalled["gpu_ms"] = _r(stalled["gpu_ms"])
        merged[key] = {
            "cycles": cycles,
            "prefill_cycles": sum(b["prefill_cycles"] for b in bs),
            "phases": phases,
            "draft_steps_gpu_ms": steps,
            "cycle_gpu_ms": cyc,
            "phase_cycle_gpu_ms": timed,
            "context_tokens": _merge_stats(ctx) if ctx else None,
            "between_cycles_gpu_ms": gap,
            "cycle_period_gpu_ms": gpu_period,
            "stalled": stalled,
            "cycle_wall_ms": wall,
            "between_cycles_share": _r(gap["mean"] / gpu_period["mean"]) if gpu_period["mean"] and gap["mean"] is not None
            else None,
            "graph": {
                "replays": {g: sum(b["graph"]["replays"].get(g, 0) for b in bs) for g in ("draft", "verify", "draft_extend")},
                "eager": {g: sum(b["graph"]["eager"].get(g, 0) for b in bs) for g in ("draft", "verify", "draft_extend")},
                "padding_mean": _r(_wmean([(b["graph"]["padding_mean"], b["cycles"]) for b in bs])),
            },
            "accept": {"verified_requests": verified, "mean_length": _r(committed / verified) if verified else None,
                       "skipped_requests": sum(b["accept"].get("skipped_requests") or 0 for b in bs),
                       "histogram": hist, "drafts_histogram": drafts,
                       "per_position": window.per_position([0] + drafts, positions),
                       "committed_tokens": committed,
                       "cut_requests": sum(b["accept"].get("cut_requests") or 0 for b in bs),
                       "cut_tokens": sum(b["accept"].get("cut_tokens") or 0 for b in bs),
                       "tokens_per_cycle": _r(committed / accept_cycles) if accept_cycles else None},
            "tokens_per_s": _r(counted / busy) if busy else None,
        }
    return merged


def _kernel_blocks(windows: list[dict]) -> list:
    """Each window's kernel sample, compared with the window it was taken in where the profile
    holds it and the sample does not carry the comparison yet."""
    by = {(w.get("rank", 0), w["window"]): w for w in windows}
    out = []
    for w in windows:
        k = w.get("kernels")
        if k and "error" not in k and "slowed" not in k:
            src = by.get((w.get("rank", 0), k.get("window")))
            if src is not None:
                kernels.against_window(k, src)
        out.append(k)
    return out


def summarize(windows: list[dict]) -> dict:
    buckets = merge_buckets(windows)
    busy = sum(w["seconds"] or 0 for w in windows)
    committed = sum(b["accept"]["committed_tokens"] for w in windows for b in w["buckets"].values())
    first = windows[0]
    return {"window": f"{first['window']}-{windows[-1]['window']}" if len(windows) > 1 else first["window"],
            "rank": first.get("rank"), "config": first.get("config", {}),
            "decode_cycles": sum(w["decode_cycles"] for w in windows), "seconds": _r(busy),
            "tokens_per_s": _r(committed / busy) if busy else None, "buckets": buckets,
            "verify_points": verify_points(windows),
            "dropped_cycles": max((w.get("dropped_cycles") or 0) for w in windows),
            "steps_lost": max((w.get("steps_lost") or 0) for w in windows),
            "marks_lost": max((w.get("marks_lost") or 0) for w in windows),
            "uncut_cycles": max((w.get("uncut_cycles") or 0) for w in windows),
            "kernels": kernels.merge(_kernel_blocks(windows))}


def verify_points(windows: list[dict]) -> list[list]:
    """[requests per cycle, context tokens per cycle or None, verify GPU ms, cycles] for each
    window's buckets: what the advisor fits the growth of verify with tokens on."""
    pts = []
    for w in windows:
        for b in w["buckets"].values():
            v = (b["phases"].get(advisor.VERIFY) or {}).get("gpu_ms", {}).get("mean")
            reqs = b["accept"].get("verified_requests")
            if v is None or not b["cycles"] or not reqs:
                continue
            ctx = (b.get("context_tokens") or {}).get("mean")
            pts.append([round(reqs / b["cycles"], 4), ctx, v, b["cycles"]])
    return pts


def advise(summary: dict) -> dict:
    """The advisor for each bucket of a merged summary."""
    steps = summary.get("config", {}).get("num_steps")
    topk = summary.get("config", {}).get("topk")
    out = {}
    if not steps:
        return out
    fit = advisor.fit_verify(summary.get("verify_points") or [], steps)
    for key, b in summary["buckets"].items():
        inp = advisor.inputs_from_bucket(b, steps, fit)
        if inp is None:
            continue
        if topk and topk > 1:
            inp.notes.append(f"profiled with topk {topk}; the advice is for topk 1")
        out[key] = advisor.predict(inp)
    return out


def render(summary: dict, advice: dict) -> str:
    text = [format_summary(summary)]
    for key, adv in advice.items():
        text.append(f"bs {key} " + advisor.format_advice(adv))
    if summary.get("kernels"):
        k = summary["kernels"]  # its table is in format_summary's
        text.append(f"({k['samples']} kernel samples merged; {k['unmatched_kernels']} kernels whose launch the "
                    f"trace did not hold left out)")
    return "\n".join(text)
