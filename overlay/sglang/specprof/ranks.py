"""Tensor parallel: every rank profiles; rank 0 shows how far the ranks spread. Plain Python.

Ranks swap their latest window through small files in a folder they share (one per
server), written whole and renamed into place. Nothing waits on another rank: a rank
that is behind, or whose profiler stopped, is simply missing from the spread. (A
collective over the TP group would stall every rank if one profiler had switched off.)
"""

from __future__ import annotations

import atexit
import json
import os
import stat
import tempfile


class NotPrivate(OSError):
    """The exchange folder is not this user's alone; the message is one sentence."""


def exchange_folder(port) -> str:
    """Per user and server: /tmp/sglang-specprof-<uid>-<port> (made 0700, checked before use)."""
    return os.path.join(tempfile.gettempdir(), f"sglang-specprof-{os.getuid()}-{port}")


def brief(summary: dict) -> dict:
    """What rank 0 needs of another rank's window: mean GPU ms per bucket and phase."""
    return {"window": summary["window"], "rank": summary["rank"],
            "buckets": {k: {name: p["gpu_ms"]["mean"] for name, p in b["phases"].items()} | {
                "cycle": b["cycle_gpu_ms"]["mean"]} for k, b in summary["buckets"].items() if b["cycles"]}}


def spread(briefs: list[dict]) -> dict | None:
    """Per bucket and phase: min, max, max - min and the slowest rank, over ranks of one window."""
    if len(briefs) < 2:
        return None
    out = {}
    for key in sorted({k for b in briefs for k in b["buckets"]}):
        phases = {}
        names = []
        for b in briefs:
            for n in b["buckets"].get(key, {}):
                if n not in names:
                    names.append(n)
        for name in names:
            vals = [(b["buckets"][key][name], b["rank"]) for b in briefs
                    if b["buckets"].get(key, {}).get(name) is not None]
            if len(vals) < 2:
                continue
            lo, hi = min(vals), max(vals)
            phases[name] = {"min": round(lo[0], 4), "max": round(hi[0], 4), "spread": round(hi[0] - lo[0], 4),
                            "slowest_rank": hi[1]}
        if phases:
            out[key] = phases
    return {"window": briefs[0]["window"], "ranks": sorted(b["rank"] for b in briefs), "buckets": out}


class RankExchange:
    def __init__(self, folder: str, rank: int, size: int):
        self.folder = folder
        self.rank = rank
        self.size = size
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() \
                or st.st_mode & 0o077:
            # another user could switch rank 0's spread off, or feed it numbers
            raise NotPrivate(f"{folder} is not a folder of this user's alone (mode "
                             f"{stat.filemode(st.st_mode)}, owner {st.st_uid})")
        atexit.register(self.close)
        try:  # a file left by an earlier server on this port must not pose as this rank's window
            os.unlink(self._path(rank))
        except FileNotFoundError:
            pass

    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.json")

    def close(self) -> None:
        """At exit: this rank's file goes, and the folder with the last one out."""
        try:
            os.unlink(self._path(self.rank))
        except OSError:
            pass
        try:
            os.rmdir(self.folder)
        except OSError:
            pass

    def publish(self, summary: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".rank{self.rank}-")
        with os.fdopen(fd, "w") as f:
            json.dump(brief(summary), f)
        os.replace(tmp, self._path(self.rank))

    def collect(self, own: dict) -> dict | None:
        """The spread over the newest window every published rank has reached."""
        found = [brief(own)]
        for r in range(self.size):
            if r == self.rank:
                continue
            try:
                with open(self._path(r)) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                continue
        if len(found) < 2:
            return None
        common = min(b["window"] for b in found)
        same = [b for b in found if b["window"] == common]
        # A rank one window ahead of the others is compared on the window they share, when
        # this rank still has it; otherwise on the windows each has now.
        return spread(same if len(same) >= 2 else found)
