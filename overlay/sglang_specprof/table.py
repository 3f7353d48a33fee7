"""The readable table of one summary window, for the server log."""

from __future__ import annotations

import re

from .advisor import bucket_advice, named_setting, not_applicable
from .fit import LOCAL_MIN_CYCLES
from .kernels import format_block

# what a terminal acts on rather than shows: C0 and C1 controls (escape sequences, a newline
# inside a name), and the marks that reorder text (bidirectional overrides)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with each control character written as its escape (\\x1b, \\n, \\u202e)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", str(text))


def escaped(obj):
    """`obj` with every string in it, keys too, `printable`: what the text output shows of a
    profile's names and settings."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {escaped(k): escaped(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [escaped(v) for v in obj]
    return obj


def printable_lines(text: str) -> str:
    """`text`, line by line, `printable`: a name or a setting read from outside cannot move the
    cursor, recolour or clear a terminal showing the log."""
    return "\n".join(printable(line) for line in str(text).split("\n"))


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


AT_CAP = 0.95  # a bucket whose mean batch is this share of the running-request cap or more ran at it
KV_TARGET = 0.8  # the KV pool's share in use that an advised cap aims at


def cap_lines(summary: dict) -> list[str]:
    """A line for each bucket that ran at the running-request cap (--max-running-requests; 0.5.16
    sets 48 for a speculative server unless told) with requests waiting for a slot: what held
    the batch there, the cap or the KV pool, and the cap that would run the waiting requests
    too (the running ones and the most that waited at one cycle) without filling the pool past
    KV_TARGET. A profile without the waiting count (before
    it was recorded) is judged by the batch alone: at the cap, requests beyond it wait."""
    cap = (summary.get("config") or {}).get("max_running_requests")
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        return []
    out = []
    for key, b in summary.get("buckets", {}).items():
        n = (b.get("accept") or {}).get("verified_requests")
        if not b.get("cycles") or not n:
            continue
        batch = (n + ((b.get("accept") or {}).get("skipped_requests") or 0)) / b["cycles"]
        if batch < AT_CAP * cap:
            continue
        w = b.get("waiting_requests") or {}
        waiting = w.get("mean") if w.get("n") else None
        if waiting is not None and not w.get("max"):
            continue  # at the cap, and nothing waited: the cap held nothing back
        kv = b.get("kv_used_share") or {}
        line = f"bs {key}: {batch:.1f} requests a cycle against the running-request cap of {cap}"
        peak = w.get("max") if waiting is not None else None  # the most that waited at one cycle
        if waiting is not None:
            line += f", {waiting:.0f} waiting for a slot (at most {peak:.0f})"
        if kv.get("max") is not None:
            line += f", the KV pool {100 * kv['mean']:.0f}% used (at most {100 * kv['max']:.0f}%)"
            if kv["max"] < KV_TARGET:
                room = int(cap * KV_TARGET / max(kv["max"], 1e-3))  # the running requests the pool holds
                # the cap that runs every request that wanted to run at once: those running and the
                # most that waited (the mean would leave a load that comes in waves a tail to run alone)
                advised = room if waiting is None else max(cap + 1, min(room, round(batch + peak)))
                line += (f": the cap, not the memory, held the batch (requests beyond {cap} wait for a slot); "
                         f"--max-running-requests {advised} would run "
                         + ("them" if waiting is not None and advised >= batch + peak else
                            f"more, the pool filled to about {100 * KV_TARGET:.0f}%"))
            else:
                line += ": the KV pool is near full too; a larger cap needs more KV memory"
        else:
            line += " (the KV pool's use is not in this profile: requests beyond the cap wait for a slot)"
        out.append(line)
    return out


def format_summary(s: dict, pause=None, advice: dict | None = None) -> str:
    """`pause`: called after each bucket (the folder's thread gives the GIL back there);
    `advice`: the advisor's result per bucket where the caller has it (the report's, from
    the whole profile), so that each bucket's line is the table's; without it (the live
    log) each bucket's line is predicted from that bucket alone."""
    cfg = s.get("config", {})
    plain = cfg.get("worker") == "plain"  # a server without speculation: each forward timed whole
    setting = (f"steps={cfg.get('num_steps')} topk={cfg.get('topk')} " if cfg.get("num_steps") is not None
               else "no draft model, ")  # NGRAM: upstream's step count is no count of draft steps
    kind = " multi-layer" if cfg.get("multi_layer") else ""
    lines = [
        f"window {s.get('window')} rank {s.get('rank')}: {s.get('decode_cycles')} decode cycles in "
        f"{_f(s.get('seconds'), 2)} s, {_f(s.get('tokens_per_s'), 1)} tok/s  "
        + ("[no speculation: each forward timed whole]" if plain else
           f"[{cfg.get('algorithm')}{kind} {cfg.get('worker')} {setting}draft_tokens={cfg.get('num_draft_tokens')}]")
    ]
    why = None if plain else not_applicable(cfg)
    if why:  # said once, in place of each bucket's advice line
        lines.append(f"  advisor: {why}")
    n_adm = s.get("admissions") or 0
    if s.get("prefill_seconds") or n_adm:
        beside = s.get("beside_prefill_seconds") or 0.0
        lines.append(f"  prefills {_f(s.get('prefill_seconds'), 3)} s GPU; GPU idle beside them {_f(beside, 3)} s "
                     f"({_f(1000 * beside / n_adm if n_adm else None, 2)} ms at each of {n_adm} admissions: host work "
                     f"admitting requests, neither decode nor prefill time)")
    for key, b in s.get("buckets", {}).items():
        if not b["cycles"]:
            continue
        acc = b["accept"]
        pos = " ".join(_f(a, 2) for a in acc["per_position"])
        per = (b.get("cycle_period_gpu_ms") or {}).get("mean")
        share = b.get("between_cycles_share")
        # the GPU period is not in a profile of schema 1 (nor where no cycle followed another)
        period = "" if per is None else (f"period {_f(per)} ms GPU"
                                         + ("" if share is None else f" ({100 * share:.1f}% between cycles)") + ", ")
        lines.append(
            f"  bs {key}: {b['cycles']} cycles, cycle {_f(b['cycle_gpu_ms']['mean'])} ms GPU, {period}"
            f"host {_f(b['cycle_wall_ms']['mean'])} ms, "
            + ("" if plain else f"accept len {_f(acc['mean_length'], 2)} (by position {pos}), ")
            + f"{_f(b['tokens_per_s'], 1)} tok/s"
        )
        skipped, cut = acc.get("skipped_requests") or 0, acc.get("cut_tokens") or 0
        if skipped or cut:
            lines.append(f"    not committed: {skipped} requests already finished or retracted when their tokens "
                         f"came, {cut} tokens past a stop ({acc.get('cut_requests') or 0} requests)")
        timed = (b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"]).get("n")
        where = (f"phases timed in {timed} of {b['cycles']} cycles; " if (cfg.get("phases_every") or 1) > 1
                 and timed is not None else "")
        lines.append(f"    {'phase':<20}{'gpu ms':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'host ms':>9}"
                     f"{'share':>8}  ({where}share: of those cycles' mean GPU time)")
        for name, p in b["phases"].items():
            g, h = p["gpu_ms"], p["host_ms"]
            share = "-" if p["share"] is None else f"{100 * p['share']:.1f}%"
            lines.append(f"    {name:<20}{_f(g['mean']):>9}{_f(g['p50']):>9}{_f(g['p90']):>9}{_f(g['p99']):>9}"
                         f"{_f(h['mean']):>9}{share:>8}")
        gap = b["between_cycles_gpu_ms"]
        lines.append(f"    {'(between cycles)':<20}{_f(gap['mean']):>9}{_f(gap['p50']):>9}{_f(gap['p90']):>9}"
                     f"{_f(gap['p99']):>9}")
        gr = b["graph"]
        if b["draft_steps_gpu_ms"]:
            steps = " ".join(_f(st["mean"]) for st in b["draft_steps_gpu_ms"])
            lines.append(f"    draft steps gpu ms: {steps}")
        elif cfg.get("draft_steps") is False and not plain:
            lines.append("    draft steps: not timed (SGLANG_SPECPROF_DRAFT_STEPS=0: the draft is one phase)")
        elif s.get("steps_lost") and (gr["replays"] or {}).get("draft"):
            lines.append("    draft steps: none read here (each replay's step times rewritten by the next replay "
                         "first: 'lost' below)")
        if not plain:  # the speculative forwards' graphs (a plain forward's are upstream's own)
            # without a draft model the verify is the only forward a cycle runs
            replays, eager = ((_only(gr["replays"], "verify"), _only(gr["eager"], "verify")) if why
                              else (gr["replays"], gr["eager"]))
            lines.append(f"    graph replays: {_counts(replays)}; eager: {_counts(eager)}; "
                         f"padding {_f(gr['padding_mean'], 2)}")
        line = None if why else _advice_line(b, cfg, None if advice is None else advice.get(key))
        if line:
            lines.append(line)
        st = b.get("stalled") or {}
        if st.get("cycles"):
            parts = ", ".join(f"{n} {_f(e['gpu_ms'], 1)} ms GPU / {_f(e['host_ms'], 1)} ms host"
                              for n, e in st["phases"].items())
            lines.append(f"    stalled: {st['cycles']} cycles ({_f(st['gpu_ms'], 1)} ms) where the device waited on "
                         f"the host ({parts}; a kernel compiled for a new shape, a pause): left out of the phase "
                         f"figures, counted in tok/s")
        rare = [n for n, p in b["phases"].items() if _above_p99(p["gpu_ms"])]
        if rare:
            # the max is not in a profile of schema 1
            parts = ", ".join(n if b["phases"][n]["gpu_ms"].get("max") is None
                              else f"{n} (max {_f(b['phases'][n]['gpu_ms']['max'])} ms)" for n in rare)
            lines.append(f"    mean above p99 in {parts}: fewer than 1 cycle in 100 took far longer, mostly "
                         f"the device waiting on the host (a kernel compiled for a new shape, a pause); p50 is "
                         f"the usual cost")
        slow = [n for n, p in b["phases"].items() if p["host_ms"]["mean"] is not None and p["gpu_ms"]["mean"]
                is not None and p["host_ms"]["mean"] > p["gpu_ms"]["mean"] + 0.05]
        if slow:
            lines.append(f"    host time above GPU time (CPU work, or the host waiting on the device): {', '.join(slow)}")
        if pause is not None:
            pause()
    ranks = s.get("ranks")
    if ranks:
        for key, phases in ranks["buckets"].items():
            worst = sorted(phases.items(), key=lambda kv: -kv[1]["spread"])[:3]
            parts = ", ".join(f"{n} {_f(p['spread'])} ms (rank {p['slowest_rank']} slowest)" for n, p in worst)
            lines.append(f"  across ranks {ranks['ranks']} (window {ranks['window']}), bs {key}, max-min: {parts}")
    lost = [(s.get(k) or 0, what) for k, what in (
        ("dropped_cycles", "cycles dropped (events never completed)"),
        ("steps_lost", "draft-step reads lost (the graph replayed first)"),
        ("marks_lost", "marks past a cycle's room"),
        ("uncut_cycles", "cycles counted without the scheduler's commit (tokens not checked against stops)"))]
    if any(n for n, _ in lost):
        lines.append("  lost: " + ", ".join(f"{n} {what}" for n, what in lost if n))
    k = s.get("kernels")
    if k:
        if k.get("error"):
            lines.append(f"  kernels: the sample of window {k.get('window')} could not be read ({k['error']})")
        else:
            lines.extend("  " + line for line in format_block(k))
    try:
        lines.extend("  " + line for line in cap_lines(s))
    except Exception:  # the live log never fails on a field it does not expect
        pass
    return printable_lines("\n".join(lines))  # phase names and settings come from the profile


def _only(d, key):
    return {key: d.get(key, 0)} if isinstance(d, dict) else d


def _counts(d) -> str:
    """{"draft": 1052, "verify": 1052} as "draft 1052, verify 1052"."""
    if not isinstance(d, dict):
        return str(d)
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def _above_p99(st: dict) -> bool:
    m, p99 = st.get("mean"), st.get("p99")
    return m is not None and p99 is not None and m > p99


def _advice_line(bucket: dict, cfg: dict, adv: dict | None = None) -> str | None:
    """One line of the step-count advisor (`adv`, or predicted from the bucket); never raises."""
    try:
        steps = cfg.get("num_steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            return None  # no step count (or one no server runs with, a damaged profile): nothing to advise from
        if adv is None:
            adv = bucket_advice(bucket, steps, cfg, error=False)
            if adv is None:
                n = bucket.get("cycles") or 0
                return (f"    advisor: {n} cycles, too few to predict from ({LOCAL_MIN_CYCLES} at least)"
                        if n < LOCAL_MIN_CYCLES else None)
        if adv.get("trees"):
            return _tree_line(adv) + _error_tail(adv)
        best = next(r for r in adv["rows"] if r["steps"] == adv["best"])
        if adv["best"] == steps:
            return f"    advisor: --speculative-num-steps {steps} is the best predicted" + _error_tail(adv)
        topk = " with topk 1" if (cfg.get("topk") or 1) > 1 else ""
        spread = _spread(best)
        rec, at, nxt = adv.get("recommend", adv["best"]), adv["profiled_steps"], adv.get("profile_next")
        tail = "" if rec == adv["best"] else (f"; recommended: keep {at}, no other's low end beats it" if rec == at
                                              else f"; recommended: --speculative-num-steps {rec}")
        tail += f"; profile at {nxt} next" if nxt is not None else ""
        return (f"    advisor: --speculative-num-steps {best['steps']}{topk} predicted {_f(best['tokens_per_s'], 1)} "
                f"tok/s ({100 * (adv['expected_gain'] or 0):+.1f}%{spread}){tail}" + _error_tail(adv))
    except Exception:
        return None


def _spread(row: dict) -> str:
    """", range LOW-HIGH" of a prediction, or nothing where they print the same."""
    return "" if _f(row["low"], 1) == _f(row["high"], 1) else f", range {_f(row['low'], 1)}-{_f(row['high'], 1)}"


def _tree_line(adv: dict) -> str:
    """The line of a topk > 1 profile: the best setting predicted among chains and pruned trees."""
    best, here, rec = adv["best_setting"], adv["profiled_setting"], adv.get("recommend_setting")
    same = lambda a, b: all(a[k] == b[k] for k in ("topk", "steps", "draft_tokens"))  # noqa: E731
    if same(best, here):
        line = f"    advisor: the profiled tree ({named_setting(here)}) is the best predicted"
    else:
        spread = _spread(best)
        gain = best["tokens_per_s"] / here["tokens_per_s"] - 1 if here.get("tokens_per_s") else 0.0
        line = (f"    advisor: {named_setting(best)} predicted {_f(best['tokens_per_s'], 1)} tok/s "
                f"({100 * gain:+.1f}%{spread})")
        if rec is None:
            line += "; recommended: keep the profiled tree, no other's low end beats it"
        elif not same(rec, best):
            line += f"; recommended: {named_setting(rec)}"
    return line + f"; larger trees not predicted (topk above {here['topk']}, more steps or draft tokens)"


def _error_tail(adv: dict) -> str:
    """The advisor's last measured error at the bucket's load, in short."""
    err = adv.get("last_measured_error")
    if not err or "unknown" in err:
        return "; its last measured error unknown" if err else ""
    return f"; last measured error within {100 * err['max_abs_error']:.1f}% at {err['concurrency']} concurrent"
