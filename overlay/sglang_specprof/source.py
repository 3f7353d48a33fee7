"""Reading a profile: the windows of a JSONL file (plain, .xz, .gz or .zst; torn lines skipped, in
`schema.py`) or the latest window of a live server, one at a time and each checked."""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import deque

from . import schema
from .advisor import advise
from .merge import summarize
from .schema import UNREADABLE, SourceError, why
from .trace import trace

URL_SECONDS = 30  # a live server's whole answer, not each read
MAX_ANSWER = 64 << 20


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
        except UNREADABLE as e:
            raise SourceError(f"{source}: window {w.get('window', i)!r} (the {ordinal(i + 1)} read) holds a value "
                              f"the report cannot use ({why(e)})") from None
        yield w


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


def load(source: str, last: int | None = None, keep=None) -> tuple[list[dict], list[str]]:
    """All windows (the `last` N) of a file or a live server, and the notes on lines skipped."""
    notes: list[str] = []
    windows = list(stream(source, last, notes, keep))
    return windows, notes

