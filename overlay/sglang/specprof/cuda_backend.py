"""CUDA events for the profiler: recorded on the held stream, read with query()."""

from __future__ import annotations

import torch


class CudaBackend:
    def __init__(self):
        self.stream = torch.cuda.current_stream()

    def refresh(self) -> None:
        """Once per cycle: the stream the worker runs on now (the scheduler's forward stream)."""
        self.stream = torch.cuda.current_stream()

    def new_event(self, external: bool = False):
        if external:
            return torch.cuda.Event(enable_timing=True, external=True)
        return torch.cuda.Event(enable_timing=True)

    def record(self, event) -> None:
        # Recording on the held stream costs about a third of a plain record(), which
        # looks the current stream up each time.
        event.record(self.stream)

    def record_captured(self, event) -> None:
        """During graph capture: on the capturing stream, which becomes an event node."""
        event.record()

    def query(self, event) -> bool:
        return event.query()

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()
