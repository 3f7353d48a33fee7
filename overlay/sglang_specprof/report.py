"""Merge a profile's windows into one summary per batch-size bucket, and report it."""

from __future__ import annotations

import math

import json
import re
import statistics
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from array import array
from collections import deque

from . import advisor, compare, kernels, schema, window
from .window import rounded as _r
from .table import cap_lines, escaped, format_summary  # noqa: F401  (cap_lines: part of report's interface)
from .trace import trace


class SourceError(ValueError):
    """A profile that cannot be read; the message is one sentence."""


# what a field of the wrong type raises somewhere in the report (the schema checks the shape only)
UNREADABLE = _UNREADABLE = (TypeError, KeyError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError,
               RecursionError)


URL_SECONDS = 30  # a live server's whole answer, not each read
MAX_ANSWER = 64 << 20


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:120]
    return f"{type(e).__name__}: {first}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, ..."""
    return f"{n}{'th' if n % 100 in (11, 12, 13) else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def readable(windows, source: str):
    """Each window through the report on its own first, as it is read: one whose fields hold
    values of the wrong type is named in one sentence, not a traceback halfway through the
    report. A generator: the windows go on one at a time."""
    for i, w in enumerate(windows):
        try:
            s = summarize([w])
            advise(s)
            json.dumps(s, allow_nan=False)
            json.dumps(trace([w]), allow_nan=False)
        except _UNREADABLE as e:
            raise SourceError(f"{source}: window {w.get('window', i)!r} (the {ordinal(i + 1)} read) holds a value "
                              f"the report cannot use ({_why(e)})") from None
        yield w


def add_window(merge: "Merge", w: dict, source: str) -> None:
    """`merge.add(w)`, a value of another type than the windows before it held (each window
    alone passed `readable`) named in one sentence."""
    try:
        merge.add(w)
    except _UNREADABLE as e:
        raise SourceError(f"{source}: window {w.get('window')!r} holds a value of another kind than the windows "
                          f"before it, which the report cannot merge ({_why(e)})") from None


def unmergeable(source: str, e: BaseException) -> SourceError:
    """The sentence for windows that each read alone and together hold values the report cannot use."""
    return SourceError(f"{source}: its windows hold values that the report cannot put together ({_why(e)})")


def _server_info(url: str) -> dict:
    """GET url within URL_SECONDS in all (a server that answers slowly cannot keep the
    command waiting), at most MAX_ANSWER bytes."""
    box: dict = {}

    def get():
        try:
            with urllib.request.urlopen(url, timeout=URL_SECONDS) as r:
                body = r.read(MAX_ANSWER + 1)
            if len(body) > MAX_ANSWER:
                box["error"] = f"its answer is over {MAX_ANSWER >> 20} MiB"
            else:
                box["info"] = json.loads(body)
        except RecursionError:
            box["error"] = "its answer is JSON nested too deep to be server info"
        except urllib.error.HTTPError as e:
            loop = "infinite loop" in str(e)  # urllib's message for it runs over three lines
            box["error"] = f"it redirects in a loop (HTTP {e.code})" if loop else f"HTTP {e.code} {e.reason}"
        except Exception as e:  # noqa: BLE001  (any failure here is said in one sentence, not a thread's traceback)
            box["error"] = " ".join(str(e).split())[:200] or type(e).__name__  # one line

    t = threading.Thread(target=get, name="specprof-url", daemon=True)
    t.start()
    t.join(URL_SECONDS)
    if t.is_alive():
        raise SourceError(f"cannot read {url}: no whole answer within {URL_SECONDS} s")
    if "info" not in box:
        raise SourceError(f"cannot read {url}: {box.get('error', 'no answer')}")
    return box["info"]


def _server_url(source: str) -> str | None:
    """http(s)://host:port[/path] + /server_info (the scheme in any case), or None for a file;
    an address with a ?query or a #fragment is refused (the path after it would be lost)."""
    parts = urllib.parse.urlsplit(source)
    if parts.scheme.lower() not in ("http", "https") or not source[len(parts.scheme):].startswith("://"):
        return None
    if "#" in source or "?" in source:
        raise SourceError(f"{source}: a server's address takes no ?query or #fragment (give http://host:port)")
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc, parts.path.rstrip("/") + "/server_info",
                                    "", ""))


def _live(source: str) -> list[dict]:
    if re.search(r"[\s\x00-\x1f\x7f-\x9f]", source):
        raise SourceError(f"{source!r} is not a server's address: it holds a space or a control character")
    url = _server_url(source)
    info = _server_info(url)
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
                          f"and have enough decode cycles run to close a window?)")
    return wins


def stream(source: str, last: int | None = None, notes: list | None = None, keep=None):
    """The windows of a JSONL file (the `last` N only, if given) or the latest window of a live
    server (http://host:port), one at a time and each checked (`readable`): a profile is never
    held whole. `keep`: applied to each window kept (a caller that needs some fields only)."""
    seen = 0
    try:
        if _server_url(source) is not None:
            got = _live(source)
        else:
            got = schema.iter_windows(source, skip_torn=True, notes=notes, drop_repeats=True)
            if last:
                got = deque(got, maxlen=min(last, sys.maxsize))  # a larger N: every window
        for w in readable(got, source):
            seen += 1
            yield w if keep is None else keep(w)
    except FileNotFoundError:
        hint = ""
        if re.fullmatch(r"[\w.-]+:\d+(/.*)?", source):  # host:port, as a user types a server's address
            hint = f" (a running server is read as http://{source})"
        raise SourceError(f"{source}: no such file{hint}") from None
    except IsADirectoryError:
        raise SourceError(f"{source} is a folder, not a profile") from None
    except PermissionError:
        raise SourceError(f"{source}: not readable (permission denied)") from None
    except MemoryError:
        raise SourceError(f"{source}: out of memory while reading it") from None
    if not seen:
        raise SourceError(f"{source} holds no profile window")


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


def load(source: str, last: int | None = None, keep=None) -> tuple[list[dict], list[str]]:
    """All windows (the `last` N) of a file or a live server, and the notes on lines skipped."""
    notes: list[str] = []
    windows = list(stream(source, last, notes, keep))
    return windows, notes


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


class _Stats:
    """Stats objects merged one at a time: a count-weighted mean, and each percentile the
    count-weighted median of the windows' ones (their values and counts kept in arrays, 16
    bytes a window, so that a long profile is never held whole)."""

    __slots__ = ("n", "wsum", "wtot", "q", "max")
    QUANTILES = ("p50", "p90", "p99")

    def __init__(self):
        self.n = 0
        self.wsum = 0.0
        self.wtot = 0
        self.q = tuple((array("d"), array("d")) for _ in self.QUANTILES)
        self.max = None

    def add(self, s: dict) -> None:
        n = s.get("n") or 0
        self.n += n
        if not n:
            return
        m = s["mean"]
        if m is not None:
            self.wsum += m * n
            self.wtot += n
        for (vs, ns), key in zip(self.q, self.QUANTILES):
            v = s[key]
            if v is not None:
                vs.append(v)
                ns.append(n)
        mx = s.get("max")
        if mx is not None and (self.max is None or mx > self.max):
            self.max = mx

    def result(self) -> dict:
        out = {"n": self.n, "mean": _r(self.wsum / self.wtot) if self.wtot else None}
        for (vs, ns), key in zip(self.q, self.QUANTILES):
            out[key] = _r(_wmedian(zip(vs, ns)))
        out["max"] = self.max
        return out


def marks_added(b: dict):
    """In one window's bucket, what its cycles timed by phase took on the GPU beyond those
    timed whole (ms): about ten more events each, and the marks' host time where the GPU
    waits for the host. None unless the bucket holds both kinds (phases in one cycle of K)."""
    every, detail = b.get("cycle_gpu_ms") or {}, b.get("phase_cycle_gpu_ms") or {}
    n, nd = every.get("n") or 0, detail.get("n") or 0
    if not (0 < nd < n) or every.get("mean") is None or detail.get("mean") is None:
        return None
    whole = (every["mean"] * n - detail["mean"] * nd) / (n - nd)
    return detail["mean"] - whole


MARKS_MIN_CYCLES = 20  # cycles of each kind (timed by phase, timed whole) the figure of what timing adds needs
MARKS_MIN_WINDOWS = 3  # windows whose differences give the noise it is judged against


def _marks_judged(diffs, cycles, added: float) -> dict:
    """Whether the median of the windows' differences (`added`) says what timing by phase adds:
    "too few cycles" (a warm-up bucket of a few cycles), "too few windows" to judge the noise,
    "within noise" (no more than twice the median's standard error from the windows' spread:
    below zero too), else "measured"."""
    k = len(diffs)
    if min(cycles) < MARKS_MIN_CYCLES:
        return {"noise_gpu_ms": None, "judged": "too few cycles"}
    if k < MARKS_MIN_WINDOWS:
        return {"noise_gpu_ms": None, "judged": "too few windows"}
    # the median's standard error from the windows' spread, robustly (a window with a stall in it
    # must not widen it): 1.4826 x the median absolute deviation for the deviation, 1.2533 / sqrt(k)
    # for a median of k
    mad = statistics.median(abs(d - added) for d in diffs)
    noise = 2 * 1.2533 * 1.4826 * mad / math.sqrt(k)
    return {"noise_gpu_ms": _r(noise), "judged": "within noise" if added <= noise else "measured"}


def _sum_into(out: list, xs) -> None:
    for i, c in enumerate(xs):
        while len(out) <= i:
            out.append(0)
        out[i] += c


class _Bucket:
    """One batch-size bucket of a profile, its windows' buckets added one at a time."""

    GRAPHS = window.GRAPH_KINDS

    def __init__(self):
        self.cycles = self.prefill_cycles = 0
        self.phases: dict = {}  # name -> (gpu _Stats, host _Stats), in first-seen order
        self.steps: list = []
        self.cyc, self.timed, self.wall, self.gap, self.period = (_Stats() for _ in range(5))
        self.ctx = None
        self.kv = None
        self.waiting = None
        self.hist: list = []
        self.drafts: list = []
        self.positions = 0
        self.committed = self.skipped = self.cut_requests = self.cut_tokens = 0
        self.busy = self.counted = self.accept_cycles = 0.0
        self.stalled = {"cycles": 0, "gpu_ms": 0.0, "phases": {}}
        self.replays = dict.fromkeys(self.GRAPHS, 0)
        self.eager = dict.fromkeys(self.GRAPHS, 0)
        self.padding: list = []  # (padding_mean, cycles) of each window
        # each window's cycles timed by phase against those timed whole (ms of GPU span)
        self.marks = array("d")
        self.marks_cycles = [0, 0]  # the cycles timed by phase, and whole, of the windows in `marks`

    def add(self, b: dict) -> None:
        self.cycles += b["cycles"]
        self.prefill_cycles += b["prefill_cycles"]
        for n, p in b["phases"].items():
            st = self.phases.get(n)
            if st is None:
                st = self.phases[n] = (_Stats(), _Stats())
            st[0].add(p["gpu_ms"])
            st[1].add(p["host_ms"])
        self.cyc.add(b["cycle_gpu_ms"])
        # the cycles the phases were timed in (all of them before --speculative-profile-phases-every)
        self.timed.add(b.get("phase_cycle_gpu_ms") or b["cycle_gpu_ms"])
        diff = marks_added(b)
        if diff is not None:
            self.marks.append(diff)
            nd = b["phase_cycle_gpu_ms"]["n"]
            self.marks_cycles[0] += nd
            self.marks_cycles[1] += b["cycle_gpu_ms"]["n"] - nd
        for i, s in enumerate(b["draft_steps_gpu_ms"]):
            if len(self.steps) <= i:
                self.steps.append(_Stats())
            self.steps[i].add(s)
        acc = b["accept"]
        _sum_into(self.hist, acc["histogram"])
        # correct drafts per request, uncut (schema 2); schema 1 had the accept lengths only
        drafts = acc["drafts_histogram"] if "drafts_histogram" in acc else acc["histogram"][1:]
        _sum_into(self.drafts, drafts)
        self.positions = max(self.positions, len(acc["per_position"]))
        self.committed += acc["committed_tokens"]
        if b.get("tokens_per_s"):
            self.busy += acc["committed_tokens"] / b["tokens_per_s"]
            self.counted += acc["committed_tokens"]
        if acc.get("tokens_per_cycle"):
            self.accept_cycles += acc["committed_tokens"] / acc["tokens_per_cycle"]
        self.skipped += acc.get("skipped_requests") or 0
        self.cut_requests += acc.get("cut_requests") or 0
        self.cut_tokens += acc.get("cut_tokens") or 0
        self.wall.add(b["cycle_wall_ms"])
        self.gap.add(b["between_cycles_gpu_ms"])
        if b.get("cycle_period_gpu_ms"):
            self.period.add(b["cycle_period_gpu_ms"])
        if (b.get("context_tokens") or {}).get("n"):
            if self.ctx is None:
                self.ctx = _Stats()
            self.ctx.add(b["context_tokens"])
        if (b.get("kv_used_share") or {}).get("n"):
            if self.kv is None:
                self.kv = _Stats()
            self.kv.add(b["kv_used_share"])
        if (b.get("waiting_requests") or {}).get("n"):
            if self.waiting is None:
                self.waiting = _Stats()
            self.waiting.add(b["waiting_requests"])
        st = b.get("stalled") or {}
        stalled = self.stalled
        stalled["cycles"] += st.get("cycles") or 0
        stalled["gpu_ms"] += st.get("gpu_ms") or 0.0
        for n, e in (st.get("phases") or {}).items():
            m = stalled["phases"].setdefault(n, {"n": 0, "gpu_ms": 0.0, "host_ms": 0.0})
            for f in m:
                m[f] += e.get(f) or 0
        for g in self.GRAPHS:
            self.replays[g] += b["graph"]["replays"].get(g, 0)
            self.eager[g] += b["graph"]["eager"].get(g, 0)
        self.padding.append((b["graph"]["padding_mean"], b["cycles"]))

    def result(self) -> dict:
        phases = {n: {"gpu_ms": g.result(), "host_ms": h.result()} for n, (g, h) in self.phases.items()}
        cyc, timed = self.cyc.result(), self.timed.result()
        for p in phases.values():
            p["share"] = _r(p["gpu_ms"]["mean"] / timed["mean"]) if timed["mean"] and p["gpu_ms"]["mean"] is not None else None
        gap, period = self.gap.result(), self.period.result()
        verified = sum(self.hist)
        positions = max(len(self.drafts) - 1, self.positions)
        stalled = dict(self.stalled, gpu_ms=_r(self.stalled["gpu_ms"]))
        marks = None
        if self.marks and cyc["n"] and timed["n"] and cyc["mean"]:
            added = statistics.median(self.marks)
            marks = {"gpu_ms": _r(added), "windows": len(self.marks),
                     "share_of_all": _r(added * timed["n"] / cyc["n"] / cyc["mean"]),
                     "cycles": list(self.marks_cycles), **_marks_judged(self.marks, self.marks_cycles, added)}
        return {
            "cycles": self.cycles,
            "prefill_cycles": self.prefill_cycles,
            "phases": phases,
            "draft_steps_gpu_ms": [s.result() for s in self.steps],
            "cycle_gpu_ms": cyc,
            "phase_cycle_gpu_ms": timed,
            "phase_marks_added": marks,
            "context_tokens": self.ctx.result() if self.ctx is not None else None,
            "kv_used_share": self.kv.result() if self.kv is not None else None,
            "waiting_requests": self.waiting.result() if self.waiting is not None else None,
            "between_cycles_gpu_ms": gap,
            "cycle_period_gpu_ms": period,
            "stalled": stalled,
            "cycle_wall_ms": self.wall.result(),
            "between_cycles_share": _r(gap["mean"] / period["mean"]) if period["mean"] and gap["mean"] is not None
            else None,
            "graph": {"replays": self.replays, "eager": self.eager, "padding_mean": _r(_wmean(self.padding))},
            "accept": {"verified_requests": verified, "mean_length": _r(self.committed / verified) if verified else None,
                       "skipped_requests": self.skipped,
                       "histogram": self.hist, "drafts_histogram": self.drafts,
                       "per_position": window.per_position([0] + self.drafts, positions),
                       "committed_tokens": self.committed,
                       "cut_requests": self.cut_requests,
                       "cut_tokens": self.cut_tokens,
                       "tokens_per_cycle": _r(self.committed / self.accept_cycles) if self.accept_cycles else None},
            "tokens_per_s": _r(self.counted / self.busy) if self.busy else None,
        }


KERNEL_SOURCES = 16  # windows whose phase means are kept, to compare a kernel sample with the window it was taken in


class Merge:
    """A profile's windows merged one at a time into one summary (`result()`): what the
    report holds is the merge, not the windows, so a profile of any length reads in bounded
    memory (a few arrays that grow by 16 bytes a window and stats object)."""

    def __init__(self):
        self.buckets: dict = {}
        self.first = self.last = None
        self.count = 0
        self.decode_cycles = 0
        self.busy = 0.0
        self.committed = 0
        self.points: list = []
        self.lost = dict.fromkeys(("dropped_cycles", "steps_lost", "marks_lost", "uncut_cycles"), 0)
        self.kernels: list = []
        self.beside = dict.fromkeys(("prefill_seconds", "beside_prefill_seconds", "admissions"), 0)
        self.switch = dict.fromkeys(("cycles", "gpu_ms", "gap_gpu_ms", "committed_tokens"), 0)
        self.recent: dict = {}  # (rank, window) -> window, the last KERNEL_SOURCES

    def add(self, w: dict) -> None:
        if self.first is None:
            self.first = {k: w.get(k) for k in ("window", "rank", "config")}
        self.last = w["window"]
        self.count += 1
        for key, b in w["buckets"].items():
            acc = self.buckets.get(key)
            if acc is None:
                window.bucket_order(key)  # a key that is no batch size is refused here
                acc = self.buckets[key] = _Bucket()
            acc.add(b)
            self.committed += b["accept"]["committed_tokens"]
        self.decode_cycles += w["decode_cycles"]
        self.busy += w["seconds"] or 0
        for k, v in (w.get("switch_cycles") or {}).items():
            if k in self.switch and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.switch[k] += v
        for k in self.beside:
            self.beside[k] += w.get(k) or 0
        self.points.extend(verify_points([w]))
        for k in self.lost:
            self.lost[k] = max(self.lost[k], w.get(k) or 0)
        src = (w.get("rank", 0), w["window"])
        self.recent[src] = compare.fields(w)  # its phase means: what against_window reads
        if len(self.recent) > KERNEL_SOURCES:
            self.recent.pop(next(iter(self.recent)))
        k = w.get("kernels")
        if k and "error" not in k and "slowed" not in k:
            # compared with the window it was taken in, where the profile holds it and the
            # sample does not carry the comparison yet
            taken = self.recent.get((w.get("rank", 0), k.get("window")))
            if taken is not None:
                kernels.against_window(k, taken)
        self.kernels.append(k)


    def result(self) -> dict:
        first = self.first or {}
        busy = self.busy
        return {"window": f"{first.get('window')}-{self.last}" if self.count > 1 else self.last,
                "rank": first.get("rank"), "config": first.get("config") or {},
                "decode_cycles": self.decode_cycles, "seconds": _r(busy),
                "tokens_per_s": _r(self.committed / busy) if busy else None,
                **{k: (v if k == "admissions" else _r(v)) for k, v in self.beside.items()},
                "buckets": {k: window.with_steps(k, self.buckets[k].result())
                            for k in sorted(self.buckets, key=window.bucket_order)},
                "verify_points": self.points,
                **({"switch_cycles": self._switches()} if self.switch["cycles"] else {}),
                **self.lost,
                "kernels": kernels.merge(self.kernels)}


    def _switches(self) -> dict:
        """The first cycle after each change of step count, summed: what the switches cost beside
        what the other decode cycles took on average."""
        s = dict(self.switch, gpu_ms=_r(self.switch["gpu_ms"]), gap_gpu_ms=_r(self.switch["gap_gpu_ms"]))
        s["mean_gpu_ms"] = _r(self.switch["gpu_ms"] / s["cycles"]) if s["cycles"] else None
        cycles = sum(b.cycles for b in self.buckets.values())
        s["other_cycles_mean_gpu_ms"] = _r(1000.0 * self.busy / cycles) if cycles and self.busy else None
        return s


RUN_FIELDS = ("rank",) + compare.SETTINGS  # windows that differ in one of these are another run's


def run_of(w: dict) -> str:
    """The key of the run a window belongs to: its rank and settings (what one merge may hold)."""
    cfg = w.get("config") or {}
    return json.dumps([w.get("rank", 0)] + [cfg.get(k) for k in compare.SETTINGS], sort_keys=True, default=str)


class Runs:
    """A profile's windows merged by run (`run_of`), in the order the runs first appear: windows
    of another rank, release or setting (a server restarted onto the same file, two ranks'
    files put together) are merged apart, not into one summary under the first one's header."""

    def __init__(self):
        self.merges: dict = {}
        self.count = 0

    def add(self, w: dict, source: str) -> None:
        key = run_of(w)
        m = self.merges.get(key)
        if m is None:
            m = self.merges[key] = Merge()
        add_window(m, w, source)
        self.count += 1

    def differ(self) -> dict:
        """{field: [each run's value]} for each field the runs differ in."""
        firsts = [m.first or {} for m in self.merges.values()]
        vals = {f: [(x.get("rank") if f == "rank" else (x.get("config") or {}).get(f)) for x in firsts]
                for f in RUN_FIELDS}
        return {f: v for f, v in vals.items() if len({json.dumps(x, default=str) for x in v}) > 1}

    def header(self, i: int) -> str:
        m = list(self.merges.values())[i]
        what = ", ".join(f"{f} {v[i]}" for f, v in self.differ().items())
        span = f"windows {m.first.get('window')}-{m.last}" if m.count > 1 else f"window {m.last}"
        return f"== run {i + 1} of {len(self.merges)}: {what} ({span}, {m.count} windows) =="

    def note(self) -> str:
        parts = ", ".join(f"{f} {' and '.join(map(str, dict.fromkeys(map(str, v))))}" for f, v in self.differ().items())
        return (f"the profile holds windows of {len(self.merges)} runs that differ in their settings ({parts}): each "
                f"is merged and reported on its own, under a header of its own (--json: the first as summary, "
                f"the others in other_runs; --adaptive-config, --plot and --html: the first)")


def config_problems(config: dict) -> list[str]:
    """Settings no server runs with (a damaged profile): the advisor does not advise from them."""
    out = []
    for k, least in (("num_steps", 0), ("topk", 1), ("num_draft_tokens", 1)):
        v = (config or {}).get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            out.append(f"the profile's {k} is {v!r}, which no server runs with: no step-count advice from it")
    return out


def summarize(windows) -> dict:
    m = Merge()
    for w in windows:
        m.add(w)
    return m.result()


def merge_buckets(windows) -> dict:
    return summarize(windows)["buckets"]


def verify_points(windows: list[dict]) -> list[list]:
    """[requests per cycle, context tokens per cycle or None, verify GPU ms, cycles, step count
    or None] for each window's buckets: what the advisor fits the growth of verify with tokens
    on (the step count: a bucket of an adaptive profile's, else the profile's)."""
    pts = []
    for w in windows:
        for key, b in w["buckets"].items():
            v = (b["phases"].get(advisor.VERIFY) or {}).get("gpu_ms", {}).get("mean")
            reqs = b["accept"].get("verified_requests")
            if v is None or not b["cycles"] or not reqs:
                continue
            ctx = (b.get("context_tokens") or {}).get("mean")
            pts.append([round(reqs / b["cycles"], 4), ctx, v, b["cycles"], window.bucket_steps(key)])
    return pts


def advise(summary: dict) -> dict:
    """The advisor for each bucket of a merged summary. In an adaptive profile (buckets at a
    step count each) 0 steps is predicted too, and a bucket run at 0 steps is advised from the
    acceptance and draft step times of the same batch sizes at another step count (the one
    with the most cycles); where there is none, it gets no advice (`zero_step_lines` says so)."""
    steps = summary.get("config", {}).get("num_steps")
    out = {}
    if not steps or config_problems(summary.get("config")) or advisor.not_applicable(summary.get("config")):
        return out
    fit = advisor.fit_verify(summary.get("verify_points") or [], steps,
                             advisor.draft_tokens(summary.get("config"), steps))
    by_steps_at = _by_batch_sizes(summary)
    local = {prefix: local_growth(runs) for prefix, runs in by_steps_at.items()}
    for key, b in summary["buckets"].items():
        at = window.bucket_steps(key)
        prefix = key.partition("@")[0]
        sib = _drafting_sibling(by_steps_at.get(prefix, {})) if at == 0 else None
        if at == 0 and sib is None:
            continue  # no drafting at these batch sizes: no acceptance to predict from
        inp = advisor.inputs_from_bucket(b, steps if at is None else at, local.get(prefix) or fit,
                                         summary.get("config"))
        if inp is None:
            continue
        if sib is not None:
            sk, sb = sib
            inp.per_position = list(sb["accept"]["per_position"])
            inp.step_ms = [x["mean"] or 0.0 for x in sb["draft_steps_gpu_ms"]]
            inp.notes.append(f"run at 0 steps: acceptance and draft step times taken from bs {sk} "
                             f"({sb['cycles']} cycles)")
        adv = advisor.predict(inp, ks=range(0, 9) if at is not None else range(1, 9))
        if adv is None:
            continue
        zero = summary["buckets"].get(prefix + "@0") if at else None
        if zero and zero.get("tokens_per_s"):
            if zero.get("cycles", 0) >= LOCAL_MIN_CYCLES:
                adv = advisor.with_measured(adv, inp, 0, zero["tokens_per_s"], zero["cycles"],
                                            (zero.get("cycle_period_gpu_ms") or {}).get("mean"))
            here = next((r for r in adv["rows"] if r["steps"] == at), None)
            rel = f" ({100 * (zero['tokens_per_s'] / here['tokens_per_s'] - 1):+.1f}% against {at} steps as " \
                  f"predicted)" if here and here["tokens_per_s"] else ""
            adv["notes"].append(f"0 steps (speculation off at these batch sizes) measured {zero['tokens_per_s']:.1f} "
                                f"tok/s here{rel}")
        out[key] = advisor.with_error(adv)
    return out


LOCAL_MIN_CYCLES = 20  # cycles a bucket needs to be a point of the growth at its own batch sizes


def _by_batch_sizes(summary: dict) -> dict:
    """An adaptive profile's buckets by batch sizes, then step count: {"5-8": {2: (key, bucket)}}."""
    out: dict = {}
    for k, b in summary["buckets"].items():
        s = window.bucket_steps(k)
        if s is not None:
            out.setdefault(k.partition("@")[0], {})[s] = (k, b)
    return out


def local_growth(runs: dict):
    """In an adaptive profile, verify's growth per verified token at one bucket's batch sizes
    alone (`runs`: {step count: (key, bucket)} of those batch sizes): the weighted slope of
    verify time against verified tokens a cycle among the step counts they ran at (three at
    least). Attention over each request's context makes the growth differ with the batch size
    (on the H200, 0.006 ms a token at 17-32 requests, 0.015 at 65-128), which one plane through
    every bucket averages away. None where there are too few."""
    pts = []
    for s, (_, b) in runs.items():
        v = (b["phases"].get(advisor.VERIFY) or {}).get("gpu_ms", {}).get("mean")
        n = b["accept"].get("verified_requests")
        if v is None or not n or b["cycles"] < LOCAL_MIN_CYCLES:
            continue
        pts.append((n / b["cycles"] * (s + 1), v, b["cycles"]))
    if len({round(t, 3) for t, _, _ in pts}) < 3:
        return None
    fit = advisor._wls([[1.0, t] for t, _, _ in pts], [v for _, v, _ in pts], [c for _, _, c in pts])
    if fit is None or not math.isfinite(fit[1][1]):
        return None
    g, se = fit[0][1], fit[1][1]
    return advisor.Growth(max(g, 0.0), max(g - 2 * se, 0.0), max(g + 2 * se, 0.0),
                          "measured across step counts at these batch sizes")


def _drafting_sibling(runs: dict):
    """(key, bucket) among `runs` ({step count: (key, bucket)} of one bucket's batch sizes) run at
    a step count above 0, with the most cycles."""
    sibs = [(k, b) for s, (k, b) in runs.items() if s > 0 and b.get("cycles") and b["accept"].get("per_position")]
    return max(sibs, key=lambda kb: kb[1]["cycles"], default=None)


def zero_step_lines(summary: dict, advice: dict) -> list[str]:
    """A line for each bucket run at 0 steps that the advisor could not judge."""
    return [f"bs {key}: run at 0 steps, and these batch sizes never ran with drafting: no acceptance to predict "
            f"other step counts from (profile them at 1 step or more)"
            for key, b in summary.get("buckets", {}).items()
            if window.bucket_steps(key) == 0 and b.get("cycles") and key not in advice]


def by_steps(summary: dict) -> dict:
    """An adaptive profile (buckets "5-8@2", ...): for each batch-size bucket run at more than
    one step count, the tokens/s measured at each (its decode cycles' GPU time), and the best."""
    out = {}
    for key, b in summary["buckets"].items():
        steps = window.bucket_steps(key)
        if steps is None or not b["cycles"] or b["tokens_per_s"] is None:
            continue
        row = out.setdefault(key.partition("@")[0], {"tokens_per_s": {}, "cycles": {}})
        row["tokens_per_s"][steps] = b["tokens_per_s"]
        row["cycles"][steps] = b["cycles"]
    out = {k: v for k, v in out.items() if len(v["tokens_per_s"]) > 1}
    for v in out.values():
        v["best"] = max(v["tokens_per_s"], key=v["tokens_per_s"].get)
    return out


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


def _marks_line(m) -> str | None:
    """What timing by phase adds to a cycle, or why the profile does not say."""
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
        text.append(f"bs {key} " + advisor.format_advice(adv))
    for key, b in summary.get("buckets", {}).items():
        line = _marks_line(b.get("phase_marks_added"))
        if line:
            text.append(f"bs {key}: {line}")
    if summary.get("kernels"):
        k = summary["kernels"]  # its table is in format_summary's
        text.append(f"({k['samples']} kernel samples merged; {k['unmatched_kernels']} kernels whose launch the "
                    f"trace did not hold left out)")
    return "\n".join(text)
