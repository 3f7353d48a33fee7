"""Append one JSON object per window to a file; one line per write, flushed."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("sglang.specprof")


class JsonlSink:
    def __init__(self, path: str):
        self.path = path
        self.broken = False
        with open(path, "a"):
            pass  # fail at startup, not at the first window, if it cannot be written

    def __call__(self, summary: dict) -> None:
        if self.broken:
            return
        line = json.dumps(summary, separators=(",", ":"), allow_nan=False) + "\n"
        try:
            # One write() of the whole line on an O_APPEND descriptor: a reader never sees
            # half of a line unless the process dies mid-write, and then only the last one.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:
            self.broken = True
            logger.warning("speculative profile: cannot append to %s (%s); profiling goes on, "
                           "the log and /server_info still show each window.", self.path, e.strerror)
