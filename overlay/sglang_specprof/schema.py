"""The profile JSONL: one summary window per line. Plain Python.

Schema "sglang-specprof/2" (docs/profile-schema.md has every field; version 1 still reads):

    schema, window, rank, time, config{...}, decode_cycles, seconds, wall_seconds,
    tokens_per_s, buckets{"<bs bucket>": bucket}, graphs{...}, dropped_cycles,
    steps_lost, marks_lost, uncut_cycles, totals{...}, [ranks{...}], [kernels{...}]

A reader takes each line on its own; a line cut short by a killed process is reported
with its number and skipped by `read(..., skip_torn=True)`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import stat
import zlib

SCHEMA = "sglang-specprof/2"
READS = ("sglang-specprof/1", SCHEMA)  # what a reader takes: this version and the one before
# The names of a cycle's phases: the series' `mark(name)` calls close these, and the profiler
# itself closes `draft_inputs`, `draft` and `draft_outputs` around a draft graph replay
# (`draft_end()` closes `draft` when the draft ran eagerly). tests/test_series.py checks
# every series against this list.
PHASES = ("target_extend", "target_decode", "draft_prep", "draft_inputs", "draft", "draft_outputs", "tree", "verify_prep", "verify",
          "accept", "free_kv", "draft_extend_prep", "draft_extend", "draft_extend_post")

_TOP = {
    "schema": str, "window": int, "rank": int, "time": (int, float), "config": dict,
    "decode_cycles": int, "seconds": (int, float, type(None)), "tokens_per_s": (int, float, type(None)),
    "buckets": dict, "graphs": dict, "dropped_cycles": int, "steps_lost": int,
}
_BUCKET = {
    "cycles": int, "prefill_cycles": int, "phases": dict, "draft_steps_gpu_ms": list, "cycle_gpu_ms": dict,
    "between_cycles_gpu_ms": dict, "cycle_wall_ms": dict, "accept": dict, "graph": dict,
}
_STATS = ("mean", "p50", "p90", "p99", "n")
_ACCEPT = {"verified_requests": int, "mean_length": (int, float, type(None)), "histogram": list,
           "per_position": list, "committed_tokens": int}


class ProfileError(ValueError):
    """A line that is not a profile window; the message names the line."""


class SourceError(ValueError):
    """A profile that cannot be read; the message is one sentence."""


# what a field of the wrong type raises somewhere in the report (the schema checks the shape only)
UNREADABLE = (TypeError, KeyError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError,
              RecursionError)


def why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:120]
    return f"{type(e).__name__}: {first}"


def unmergeable(source: str, e: BaseException) -> SourceError:
    """The sentence for windows that each read alone and together hold values the report cannot use."""
    return SourceError(f"{source}: its windows hold values that the report cannot put together ({why(e)})")


class NotJSON(ProfileError):
    """A line that is not JSON at all: a line cut short (a killed writer, a full disk), or another file."""


def _type_name(t):
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def problems(obj) -> list[str]:
    """What makes `obj` not a valid window (empty: valid)."""
    if not isinstance(obj, dict):
        return ["not a JSON object"]
    out = []
    if obj.get("schema") not in READS:
        return [f"schema is {obj.get('schema')!r}, not {' or '.join(map(repr, READS))}"]
    for key, t in _TOP.items():
        if key not in obj:
            out.append(f"missing {key}")
        elif isinstance(obj[key], bool) or not isinstance(obj[key], t):
            out.append(f"{key} is not {_type_name(t)}")
    for name, b in (obj.get("buckets") or {}).items() if isinstance(obj.get("buckets"), dict) else []:
        if not isinstance(b, dict):
            out.append(f"bucket {name} is not an object")
            continue
        for key, t in _BUCKET.items():
            if key not in b or not isinstance(b[key], t):
                out.append(f"bucket {name}: {key} missing or not {_type_name(t)}")
        for phase, p in (b.get("phases") or {}).items() if isinstance(b.get("phases"), dict) else []:
            for side in ("gpu_ms", "host_ms"):
                st = p.get(side) if isinstance(p, dict) else None
                if not isinstance(st, dict) or any(k not in st for k in _STATS):
                    out.append(f"bucket {name}: phase {phase} has no {side} statistics")
        acc = b.get("accept")
        if isinstance(acc, dict):
            for key, t in _ACCEPT.items():
                if key not in acc or not isinstance(acc[key], t):
                    out.append(f"bucket {name}: accept.{key} missing or not {_type_name(t)}")
    k = obj.get("kernels")
    if k is not None:
        if not isinstance(k, dict):
            out.append("kernels is not an object")
        elif "error" not in k and not isinstance(k.get("phases"), dict):
            out.append("kernels has neither phases nor an error")
    return out


class _NotFinite(ValueError):
    pass


def _no_constant(name):
    raise _NotFinite(name)


def parse_line(text: str, where: str = "line") -> dict:
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except _NotFinite as e:
        raise ProfileError(f"{where} holds {e} (not a number a profile writes); the file is not a profile.") from None
    except RecursionError:
        raise ProfileError(f"{where} is nested too deep to be a profile window.") from None
    except json.JSONDecodeError as e:
        raise NotJSON(f"{where} is not JSON ({e.msg} at column {e.colno}); the file may be cut short "
                           f"or not a profile.") from None
    bad = problems(obj)
    if bad:
        raise ProfileError(f"{where} is not a {SCHEMA} window: {'; '.join(bad[:3])}.")
    return obj


MAX_LINE = 64 << 20  # a window line is 8-100 KB; a longer one is no window (an endless or binary input)


# what a compressed profile starts with (its format is told by these, not by the file's name)
_MAGIC = ((b"\xfd7zXZ\x00", "xz"), (b"\x1f\x8b", "gz"), (b"\x28\xb5\x2f\xfd", "zst"))


def _zstd_open(path: str):
    try:
        import zstandard
    except ImportError:
        raise ProfileError(f"{path} is compressed with zstd, which needs the zstandard package to read: "
                           f"pip install zstandard (or decompress it with unzstd).") from None
    return zstandard.open(path, "rt", encoding="utf-8", errors="replace")


def _corrupt_errors() -> tuple:
    """What reading damaged compressed data raises (zstd's when its package is there)."""
    errs = (lzma.LZMAError, gzip.BadGzipFile, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errs
    return errs + (zstandard.ZstdError,)


def open_text(path: str):
    """`path` as text, decompressed where it is xz, gzip or zstd (told by its first bytes). A
    file that is not a regular one (a FIFO, a device) is refused before it is opened: opening
    or reading it could wait forever."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(mode):
        raise ProfileError(f"{path} is not a regular file (a FIFO, a device or a socket): give the profile's file, "
                           f"decompressed or not.")
    with open(path, "rb") as f:
        head = f.read(6)
    kind = next((k for magic, k in _MAGIC if head.startswith(magic)), None)
    if kind == "xz":
        return lzma.open(path, "rt", encoding="utf-8", errors="replace")
    if kind == "gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if kind == "zst":
        return _zstd_open(path)
    return open(path, encoding="utf-8", errors="replace")


TORN_NOTES = 5  # lines skipped that are named one by one; the rest are counted in one note
TORN_LEAD = 8  # lines not JSON before any window: the file is not a profile (it is not read on)
_STARTS = ('{"window"', '{"schema"')  # how a writer's line starts (the key order of 1 and 2)


def _after_torn(text: str, where: str):
    """The whole window that follows a cut one on the same line (a full disk: the cut window's
    line gets no newline, and the next window's is written on after it), or None."""
    at = max(text.rfind(k) for k in _STARTS)
    if at <= 0:
        return None
    try:
        return parse_line(text[at:], where)
    except ProfileError:
        return None


def iter_windows(path: str, skip_torn: bool = False, notes: list | None = None, drop_repeats: bool = False):
    """The windows of a profile file one at a time, a line at a time: the file is never held
    whole (an xz, gzip or zstd file is decompressed as it is read). With `skip_torn`, a line
    that is not JSON (cut short: the server stopped mid-write, or a full disk cut it and the
    next window was written on after it, which is then read) is skipped with a note appended
    to `notes`, unless no window is read before TORN_LEAD of them or in the whole file: then
    the first one's error is raised (the file is not a profile). Any other bad line raises
    ProfileError. With `drop_repeats`, a line that repeats an earlier one exactly (a file put
    together with itself, a window appended twice) is counted once, with a note."""
    n = read = 0
    torn: list = []  # (line, error) of the lines skipped
    seen, repeats = set(), []  # the lines' digests; the line numbers of those that repeat one
    notes = [] if notes is None else notes

    def note(text):
        if len(torn) <= TORN_NOTES:
            notes.append(text)

    try:
        with open_text(path) as f:
            while True:
                text = f.readline(MAX_LINE + 1)
                if not text:
                    break
                n += 1
                where = f"{path} line {n}"
                if len(text) > MAX_LINE:
                    raise ProfileError(f"{where} is over {MAX_LINE / (1 << 20):g} MiB long: no profile window is; "
                                       f"the file is not a profile.")
                if not text.strip():
                    continue
                try:
                    w = parse_line(text, where)
                except NotJSON as e:
                    if not skip_torn:
                        raise
                    torn.append((n, e))
                    if not read and len(torn) >= TORN_LEAD:
                        raise torn[0][1] from None
                    w = _after_torn(text, where)
                    if w is not None:
                        note(f"{where} holds a window cut short (a full disk?) and then a whole one; the cut "
                             f"one skipped.")
                    elif not text.endswith("\n"):  # the writer ends every window with a newline
                        note(f"{where} is cut short (the server stopped mid-write); skipped.")
                    else:
                        note(f"{where} is not JSON (a window cut short, as a full disk leaves); skipped.")
                    if w is None:
                        continue
                    text = text[max(text.rfind(k) for k in _STARTS):]
                if drop_repeats:
                    digest = hashlib.blake2b(text.strip().encode("utf-8", "surrogatepass"), digest_size=16).digest()
                    if digest in seen:
                        repeats.append(n)
                        continue
                    seen.add(digest)
                read += 1
                yield w
    except EOFError:
        # a compressed file cut short: what it held up to there has been read
        if not skip_torn:
            raise ProfileError(f"{path} is compressed and cut short after line {n}.") from None
        notes.append(f"{path} is compressed and cut short: read up to line {n}, the rest is lost.")
    except _corrupt_errors() as e:
        at = f"after line {n}" if n else "at its start"
        raise ProfileError(f"{path} is damaged compressed data {at} ({e}).") from None
    if torn and not read:
        raise torn[0][1]  # nothing in it is a window: not a profile, said of its first line
    if repeats:
        lines = ", ".join(map(str, repeats[:3])) + (f" and {len(repeats) - 3} more" if len(repeats) > 3 else "")
        notes.append(f"{path}: {len(repeats)} {'lines repeat' if len(repeats) > 1 else 'line repeats'} an earlier "
                     f"window exactly (line {lines}): counted once.")
    if len(torn) > TORN_NOTES:
        notes.append(f"{path}: {len(torn) - TORN_NOTES} more lines that are not JSON skipped "
                     f"(the last, line {torn[-1][0]}).")


def read(path: str, skip_torn: bool = False) -> tuple[list[dict], list[str]]:
    """All windows of a profile file, and one note per line skipped (torn last line only)."""
    notes: list[str] = []
    windows = list(iter_windows(path, skip_torn, notes))
    return windows, notes
