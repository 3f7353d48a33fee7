"""Append one JSON object per window to a file; one line per write, flushed.

The file cannot fill a disk: once a line would take it past the cap (256 MiB by default,
`SGLANG_SPECPROF_OUTPUT_MAX_MB` to change it, 0 for none) it is renamed to PATH.1 (an
older PATH.1 is replaced) and a new PATH begins, so one rank keeps at most twice the cap.
A window line is about 8 KB: at the default interval that is about a week of windows.
Another server rotating the same path first is followed (its new PATH taken); a PATH.1
that cannot be replaced is one warning naming it, and PATH goes on past the cap.

No torn line is left by this writer: a short write (a full disk) is taken back, and a file
whose last line was cut by a kill gets a newline before the first window appended. Opening
never blocks: anything but a regular file at PATH is refused (one warning, the sink stops).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat

logger = logging.getLogger("sglang.specprof")

DEFAULT_MAX_MB = 256
MIN_MAX_MB = 1  # a cap below a megabyte would rotate every few windows
MAX_MB_ENV = "SGLANG_SPECPROF_OUTPUT_MAX_MB"


def rank_path(path: str, rank: int) -> str:
    """Each TP rank's file: `.rankN` before the file name's extension (`prof.jsonl` ->
    `prof.rank0.jsonl`, `./profile` -> `./profile.rank0`); folders are left alone."""
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(folder, f"{stem}.rank{rank}{ext}")


def max_bytes_from_env() -> int:
    """The cap from SGLANG_SPECPROF_OUTPUT_MAX_MB: 0 for none, else at least MIN_MAX_MB; any
    other value (not a number, negative, not finite, a fraction of a line) is one warning and
    the default."""
    raw = os.environ.get(MAX_MB_ENV, "")
    if not raw.strip():
        return DEFAULT_MAX_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (mb == 0 or MIN_MAX_MB <= mb < math.inf):  # NaN fails every comparison
        logger.warning("speculative profile: %s=%s is not a cap in megabytes (0 for none, or %d or more); "
                       "using %d.", MAX_MB_ENV, ascii(raw), MIN_MAX_MB, DEFAULT_MAX_MB)
        mb = DEFAULT_MAX_MB
    return int(mb * (1 << 20))


class JsonlSink:
    def __init__(self, path: str, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
        self.broken = False
        self.rotations = 0
        self._rotate_warned = False
        fd, st = self._open()  # fail at startup, not at the first window, if it cannot be written
        try:
            self._end_line(fd, st.st_size)
        finally:
            os.close(fd)

    def _open(self):
        """PATH opened for appending, and its stat; never blocks (a FIFO put in its place is
        refused, not waited on)."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.path)
        except FileNotFoundError:
            pass  # made here
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _end_line(self, fd, size):
        """A file whose last line was cut short (a server killed mid-write): the next line
        starts on a fresh one instead of running on from the cut."""
        if not size:
            return
        try:
            rd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                last = os.pread(rd, 1, size - 1)
            finally:
                os.close(rd)
        except OSError:
            return  # write-only: appended to as it is
        if last != b"\n":
            os.write(fd, b"\n")

    def _rotate(self, fd, st):
        """PATH becomes PATH.1 and a new PATH begins; the new (fd, stat). Another server on
        this path that rotated first: its new PATH is taken. PATH.1 that cannot be replaced
        (a folder, an immutable file): one warning naming it, and PATH grows on."""
        try:
            now = os.stat(self.path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.replace(self.path, self.path + ".1")
                self.rotations += 1
        except FileNotFoundError:
            pass  # rotated by another writer between the two calls: its new PATH is taken
        except OSError as e:
            if not self._rotate_warned:
                self._rotate_warned = True
                logger.warning("speculative profile: cannot rename %s to %s (%s); %s goes on past its cap.",
                               self.path, self.path + ".1", e.strerror or e, self.path)
            return fd, st
        os.close(fd)
        return self._open()

    def _append(self, line: bytes) -> None:
        fd, st = self._open()
        try:
            if self.max_bytes and st.st_size and st.st_size + len(line) > self.max_bytes:
                fd, st = self._rotate(fd, st)
            # One write() of the whole line on an O_APPEND descriptor: a reader never sees
            # half of a line unless the process dies mid-write, and then only the last one.
            n = os.write(fd, line)
            if n != len(line):  # a full disk: the part written is taken back, no torn line stays
                end = os.lseek(fd, 0, os.SEEK_CUR)
                if os.fstat(fd).st_size == end:  # nothing appended after it (another server)
                    os.ftruncate(fd, end - n)
                raise OSError(errno.ENOSPC, f"{n} of {len(line)} bytes written, taken back")
        finally:
            os.close(fd)

    def __call__(self, summary: dict) -> None:
        if self.broken:
            return
        line = (json.dumps(summary, separators=(",", ":"), allow_nan=False) + "\n").encode()
        try:
            self._append(line)
        except OSError as e:
            self.broken = True
            logger.warning("speculative profile: cannot append to %s (%s); profiling goes on, "
                           "the log and /server_info still show each window.", self.path, e.strerror or e)
