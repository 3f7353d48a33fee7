"""Where each closed window goes, on the folder's outputs thread.

`Outputs.publish` takes a closed window's summary, adds its kernel sample's block if it has
one, keeps it as the latest (for /server_info) and gives it to each sink in turn: the rank
spread first (it adds `ranks`), the log table, then the given ones (the JSONL writer, the
Prometheus gauges). A sink that raises is switched off with one warning; the others go on.
The advisor runs once per window (`advice`), for every sink that shows it.
"""

from __future__ import annotations

import logging

from sglang_specprof.advisor import window_advice
from sglang_specprof.kernels import against_window
from sglang_specprof.table import format_summary, printable

from .kernel_sampler import analyse_sample

logger = logging.getLogger("sglang.specprof")


class Advice:
    """The advisor's result per bucket of the window being published, computed once."""

    def __init__(self):
        self._window = None
        self._value = None

    def __call__(self, summary: dict) -> dict:
        if self._window is not summary:
            self._value = window_advice(summary)
            self._window = summary
        return self._value


class RankSpreadSink:
    """tp > 1: publish this rank's window; on rank 0, add the spread across ranks (`ranks`)."""

    def __init__(self, exchange, rank):
        self.exchange, self.rank = exchange, rank

    def __call__(self, summary):
        try:
            self.exchange.publish(summary)
            if self.rank == 0:
                summary["ranks"] = self.exchange.collect(summary)
        except OSError as e:
            raise OSError(f"the rank exchange in {self.exchange.folder} ({e.strerror}); no spread across "
                          f"ranks") from None


class LogTableSink:
    """The window's table in the server log (TP rank 0)."""

    def __init__(self, pause, advice):
        self.pause, self.advice = pause, advice

    def __call__(self, summary):
        logger.info("speculative profile\n%s", format_summary(summary, self.pause, self.advice(summary)))


class Outputs:
    def __init__(self, sinks: list, pause, pause_turn):
        self.sinks = sinks
        self.pause, self.pause_turn = pause, pause_turn
        self.latest = None
        self._recent: dict = {}  # the last windows' summaries, for a kernel sample's comparison

    def publish(self, summary):
        smp = summary.pop("_kernel_sample", None)
        if smp is not None:
            summary["kernels"] = self._kernel_block(smp)
        self._recent[summary.get("window")] = summary
        while len(self._recent) > 3:
            self._recent.pop(next(iter(self._recent)))
        k = summary.get("kernels")
        if k and "error" not in k and k.get("window") in self._recent:
            try:
                against_window(k, self._recent[k["window"]])
            except Exception:
                pass
        self.latest = summary
        for sink in list(self.sinks):
            self.pause()
            try:
                sink(summary)
            except Exception as e:  # a broken output must not stop the profiler
                self.sinks.remove(sink)
                logger.warning("speculative profile: %s failed (%s: %s) and is switched off.",
                               type(sink).__name__, type(e).__name__, printable(str(e)))

    def _kernel_block(self, smp):
        """A kernel sample as the window's `kernels` block (giving the GIL back every few
        hundred events); one that cannot be read is an error line, nothing more."""
        try:
            return analyse_sample(smp, self.pause_turn)
        except Exception as e:
            smp.pop("prof", None)
            first = (str(e).strip().splitlines() or [""])[0]
            return {"window": smp.get("window"), "error": f"{type(e).__name__}: {first}"}
