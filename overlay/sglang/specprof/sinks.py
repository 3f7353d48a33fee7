"""The server's own sinks: the log table, and the advisor's result they share.

A sink is called with each closed window's enriched summary, read-only (pipeline.py); the
JSONL writer (jsonl.py) and the Prometheus gauges (metrics.py) are the others. The advisor
runs once per window (`Advice`), for every sink that shows it.
"""

from __future__ import annotations

import logging

from sglang_specprof.advisor import window_advice
from sglang_specprof.table import format_summary

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


class LogTableSink:
    """The window's table in the server log (TP rank 0)."""

    def __init__(self, pause, advice):
        self.pause, self.advice = pause, advice

    def __call__(self, summary):
        logger.info("speculative profile\n%s", format_summary(summary, self.pause, self.advice(summary)))
