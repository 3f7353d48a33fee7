"""The output pipeline: what becomes of each closed window, in order, on the folder's outputs thread.

The folder hands `Outputs.publish` a closed window's summary (made once: the window's own
figures and the fields its close counted) and the kernel sample the window carries, if any.

1. The enrichment steps run in the order `Outputs.steps` lists them (`order` names them).
   Each reads the summary and returns the fields it adds; `publish` alone writes them in:
   - `kernels`: the kernel sample read into the window's `kernels` block, set against the
     window it sampled (windows without a sample add nothing);
   - `ranks` (tp > 1): this rank's window goes to the rank exchange, and on rank 0 the spread
     across ranks is added.
2. The enriched summary is kept as the latest (/server_info).
3. One read-only copy of it (`readonly.freeze`) goes to every sink in turn: the log table
   (rank 0), then the given ones (the JSONL writer, the Prometheus gauges). No sink can change
   what another reads; one that tries gets a TypeError.

A step or a sink that raises is switched off with one warning; the others go on.
"""

from __future__ import annotations

import logging

from sglang_specprof.kernels import against_window
from sglang_specprof.table import printable

from .kernel_sampler import analyse_sample
from .readonly import freeze

logger = logging.getLogger("sglang.specprof")

RECENT = 3  # windows kept for a kernel sample to be set against the window it sampled


class KernelBlock:
    """The window's kernel sample as its `kernels` block (giving the GIL back every few
    hundred events), with how much slower its cycles ran than the window's; a sample that
    cannot be read is an error line, nothing more."""

    name = "kernels"

    def __init__(self, pause_turn):
        self.pause_turn = pause_turn
        self._recent: dict = {}  # the last windows' summaries, by window

    def __call__(self, summary: dict, sample) -> dict | None:
        recent = self._recent
        recent[summary.get("window")] = summary
        while len(recent) > RECENT:
            recent.pop(next(iter(recent)))
        if sample is None:
            return None
        try:
            block = analyse_sample(sample, self.pause_turn)
        except Exception as e:
            sample.pop("prof", None)
            first = (str(e).strip().splitlines() or [""])[0]
            return {"kernels": {"window": sample.get("window"), "error": f"{type(e).__name__}: {first}"}}
        if block and "error" not in block and block.get("window") in recent:
            try:
                against_window(block, recent[block["window"]])
            except Exception:
                pass
        return {"kernels": block}


class RankSpread:
    """tp > 1: this rank's window goes to the rank exchange; rank 0 adds the spread across
    ranks (`ranks`, None until another rank has published)."""

    name = "ranks"

    def __init__(self, exchange, rank):
        self.exchange, self.rank = exchange, rank

    def __call__(self, summary: dict, sample) -> dict | None:
        try:
            self.exchange.publish(summary)
            if self.rank == 0:
                return {"ranks": self.exchange.collect(summary)}
        except OSError as e:
            raise OSError(f"the rank exchange in {self.exchange.folder} ({e.strerror}); no spread across "
                          f"ranks") from None
        return None


class Outputs:
    def __init__(self, sinks: list, pause, pause_turn, exchange=None, rank=0):
        # the enrichment, in this order: the only code that adds to a closed window's summary
        self.steps = [KernelBlock(pause_turn)] + ([RankSpread(exchange, rank)] if exchange is not None else [])
        self.sinks = sinks  # each is handed the enriched summary, read-only
        self.pause = pause
        self.latest = None

    @property
    def order(self) -> list:
        """The enrichment steps' names, in the order they run."""
        return [step.name for step in self.steps]

    def publish(self, summary: dict, kernel_sample=None) -> None:
        for step in list(self.steps):
            self.pause()
            try:
                fields = step(summary, kernel_sample)
            except Exception as e:  # a broken step must not stop the outputs
                self._switch_off(self.steps, step, e)
                continue
            if fields:
                summary.update(fields)
        self.latest = summary
        view = freeze(summary)
        for sink in list(self.sinks):
            self.pause()
            try:
                sink(view)
            except Exception as e:  # a broken output must not stop the profiler
                self._switch_off(self.sinks, sink, e)

    @staticmethod
    def _switch_off(where: list, what, e) -> None:
        where.remove(what)
        logger.warning("speculative profile: %s failed (%s: %s) and is switched off.",
                       type(what).__name__, type(e).__name__, printable(str(e)))
