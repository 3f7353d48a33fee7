"""CUDA events for the profiler: recorded on the stream the worker runs on, read with query().

The phase marks go straight to the CUDA driver through `cuda.bindings` (which SGLang
already needs): a record costs 1.4 us there against 1.6 us for torch's `Event.record(stream)`
and 6.5 us for `Event.record()`, an elapsed time 0.24 us against 0.80 (H200, torch 2.11,
cuda-bindings 13.3; `bench/event_cost.py`). Without `cuda.bindings`, torch's events do the
same work. Events recorded inside a CUDA graph capture (the draft steps) are torch's, as the
capture needs.
"""

from __future__ import annotations

import torch


class CudaBackend:
    def __init__(self):
        self.device = torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw = (lambda: raw(self.device)) if raw is not None else (
            lambda: torch.cuda.current_stream().cuda_stream)
        self._streams: dict = {}
        self.stream = None
        self.kind = "torch"
        try:
            from cuda.bindings import driver

            self._d = driver
            self._ok = driver.CUresult.CUDA_SUCCESS
            self._not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
            err, self._ctx = driver.cuCtxGetCurrent()
            if err is not self._ok or not int(self._ctx):  # torch has not touched the device yet:
                err, dev = driver.cuDeviceGet(self.device)  # its primary context, as torch will use
                self._ctx = self._check(*driver.cuDevicePrimaryCtxRetain(self._check(err, dev)))
                self._check(*driver.cuCtxSetCurrent(self._ctx))
            self._new = lambda: self._check(*driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT))
            self._record = driver.cuEventRecord
            self._query = driver.cuEventQuery
            self._elapsed = driver.cuEventElapsedTime
            self.kind = "cuda.bindings"
        except Exception:  # an older cuda-python, or none: torch's events
            self._d = None
        self.refresh()

    def _check(self, err, value=None):
        if err is not self._ok:
            raise RuntimeError(f"CUDA driver call failed: {err!r}")
        return value

    def refresh(self) -> None:
        """Once per cycle: the stream the worker runs on now (the scheduler's forward stream)."""
        raw = self._raw()
        s = self._streams.get(raw)
        if s is None:
            if self._d is not None:
                s = self._d.CUstream(raw)
            else:
                s = torch.cuda.current_stream()
            if len(self._streams) > 64:
                self._streams.clear()
            self._streams[raw] = s
        self.stream = s

    def attach(self) -> None:
        """On another thread that reads events: the device's context there too."""
        if self._d is not None:
            self._check(*self._d.cuCtxSetCurrent(self._ctx))
        else:
            torch.cuda.set_device(self.device)

    def new_event(self, external: bool = False):
        if external:
            return torch.cuda.Event(enable_timing=True, external=True)
        if self._d is not None:
            return self._new()
        return torch.cuda.Event(enable_timing=True)

    def record(self, event) -> None:
        if self._d is not None:
            err = self._record(event, self.stream)[0]
            if err is not self._ok:
                raise RuntimeError(f"cuEventRecord failed: {err!r}")
        else:
            event.record(self.stream)

    def record_captured(self, event) -> None:
        """During graph capture: on the capturing stream, which becomes an event node."""
        event.record()

    def query(self, event) -> bool:
        if self._d is not None:
            err = self._query(event)[0]
            if err is self._ok:
                return True
            if err is self._not_ready:
                return False
            raise RuntimeError(f"cuEventQuery failed: {err!r}")
        return event.query()

    def elapsed(self, a, b) -> float:
        if self._d is not None:
            err, ms = self._elapsed(a, b)
            if err is not self._ok:
                raise RuntimeError(f"cuEventElapsedTime failed: {err!r}")
            return ms
        return a.elapsed_time(b)

    def query_captured(self, event) -> bool:
        return event.query()

    def elapsed_captured(self, a, b) -> float:
        return a.elapsed_time(b)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()
