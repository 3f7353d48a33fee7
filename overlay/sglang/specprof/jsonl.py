"""Append one JSON object per window to a file; one line per write, flushed.

The file cannot fill a disk: once a line would take it past the cap (256 MiB by default,
`SGLANG_SPECPROF_OUTPUT_MAX_MB` to change it, 0 for none) it is renamed to PATH.1 (an
older PATH.1 is replaced) and a new PATH begins, so one rank keeps at most twice the cap.
A window line is about 8 KB: at the default interval that is about a week of windows.
"""

from __future__ import annotations

import json
import logging
import os
import stat

logger = logging.getLogger("sglang.specprof")

DEFAULT_MAX_MB = 256


def rank_path(path: str, rank: int) -> str:
    """Each TP rank's file: `.rankN` before the file name's extension (`prof.jsonl` ->
    `prof.rank0.jsonl`, `./profile` -> `./profile.rank0`); folders are left alone."""
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(folder, f"{stem}.rank{rank}{ext}")


def max_bytes_from_env() -> int:
    raw = os.environ.get("SGLANG_SPECPROF_OUTPUT_MAX_MB", "")
    try:
        mb = float(raw) if raw.strip() else DEFAULT_MAX_MB
    except ValueError:
        logger.warning("speculative profile: SGLANG_SPECPROF_OUTPUT_MAX_MB=%r is not a number; using %d.", raw,
                       DEFAULT_MAX_MB)
        mb = DEFAULT_MAX_MB
    return max(0, int(mb * 1024 * 1024))


class JsonlSink:
    def __init__(self, path: str, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
        self.broken = False
        self.rotations = 0
        if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
            raise OSError(f"{path} is not a regular file")
        with open(path, "a"):
            pass  # fail at startup, not at the first window, if it cannot be written

    def __call__(self, summary: dict) -> None:
        if self.broken:
            return
        line = (json.dumps(summary, separators=(",", ":"), allow_nan=False) + "\n").encode()
        try:
            # One write() of the whole line on an O_APPEND descriptor: a reader never sees
            # half of a line unless the process dies mid-write, and then only the last one.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if self.max_bytes and size and size + len(line) > self.max_bytes:
                    os.close(fd)
                    fd = -1
                    os.replace(self.path, self.path + ".1")
                    self.rotations += 1
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(fd, line)
            finally:
                if fd >= 0:
                    os.close(fd)
        except OSError as e:
            self.broken = True
            logger.warning("speculative profile: cannot append to %s (%s); profiling goes on, "
                           "the log and /server_info still show each window.", self.path, e.strerror)
