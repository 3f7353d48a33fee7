"""CUDA events for the profiler: recorded on the stream the worker runs on, read with query().

The phase marks go straight to the CUDA driver through `cuda.bindings` (which SGLang
already needs): a record costs 1.4 us there against 1.6 us for torch's `Event.record(stream)`
and 6.5 us for `Event.record()`, an elapsed time 0.24 us against 0.80 (H200, torch 2.11,
cuda-bindings 13.3; `bench/event_cost.py`). Without `cuda.bindings`, torch's events do the
same work (`TorchEvents`). Events recorded inside a CUDA graph capture (the draft steps) are
torch's in both, as the capture needs.
"""

from __future__ import annotations

import functools

import torch


def CudaBackend():
    """The driver's events where `cuda.bindings` works, else torch's."""
    try:
        return DriverEvents()
    except Exception:  # an older cuda-python, or none
        return TorchEvents()


class TorchEvents:
    kind = "torch"

    def __init__(self):
        self.device = torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        # a C call a cycle (no Python frame of its own): `stream_id` runs at each cycle's end,
        # off 0.5.12's critical path (begin to the draft replay: bench/host_sensitivity.py)
        self._raw = functools.partial(raw, self.device) if raw is not None else (
            lambda: torch.cuda.current_stream().cuda_stream)
        self._streams: dict = {}
        self.stream = None
        self.stream_id = self._raw  # () -> the current stream's handle, a number (the hot path's check)
        self.sraw = None  # the handle of `stream`, a number
        self.sptr = None  # what `crec` takes for it (DriverEvents: a ctypes.c_void_p)
        self.refresh()

    def _stream(self, raw):
        return torch.cuda.current_stream()

    # `crec(handle, stream handle)`: an event record as one C call, or None (record() then)
    crec = None

    @staticmethod
    def handle(event):
        """What `crec` and the reads take for an event: the event itself, or (DriverEvents with
        the driver's calls held, `_hold_gil`) a ctypes.c_void_p of its handle."""
        return event

    # the stream's handle as `crec` takes it
    _ptr = staticmethod(lambda raw: raw)

    def refresh(self):
        """The stream the worker runs on now (the scheduler's forward stream): the long way of
        `begin` calls it, and `end` where `stream_id()` changed. Returns that stream's handle
        (`sraw`, a number); `sptr` is what `crec` takes for it."""
        raw = self._raw()
        s = self._streams.get(raw)
        if s is None:
            s = self._stream(raw)
            if len(self._streams) > 64:
                self._streams.clear()
            self._streams[raw] = s
        self.stream = s
        self.sraw = raw
        self.sptr = self._ptr(raw)
        return raw

    def attach(self) -> None:
        """On another thread that reads events: the device's context there too."""
        torch.cuda.set_device(self.device)

    def new_event(self, external: bool = False):
        return torch.cuda.Event(enable_timing=True, external=external)

    def record(self, event) -> None:
        event.record(self.stream)

    def record_captured(self, event) -> None:
        """During graph capture: on the capturing stream, which becomes an event node."""
        event.record()

    def query(self, event) -> bool:
        return event.query()

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b)

    query_captured = query
    elapsed_captured = elapsed

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


class DriverEvents(TorchEvents):
    """The phase marks through the driver; the captured ones stay torch's."""

    kind = "cuda.bindings"

    def __init__(self):
        from cuda.bindings import driver

        self._d = driver
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
        self._record = driver.cuEventRecord
        self._query = driver.cuEventQuery
        self._elapsed = driver.cuEventElapsedTime
        self.device = torch.cuda.current_device()
        err, self._ctx = driver.cuCtxGetCurrent()
        if err is not self._ok or not int(self._ctx):  # torch has not touched the device yet:
            dev = self._check(*driver.cuDeviceGet(self.device), call="cuDeviceGet")  # its primary context
            self._ctx = self._check(*driver.cuDevicePrimaryCtxRetain(dev), call="cuDevicePrimaryCtxRetain")
            self._check(*driver.cuCtxSetCurrent(self._ctx), call="cuCtxSetCurrent")
        super().__init__()
        try:
            self._hold_gil()
        except Exception:  # no libcuda.so.1 by that name: the helpers read through cuda.bindings
            pass

    def _hold_gil(self):
        """`query_held` / `elapsed_held` (and the captured events' too): the driver's calls
        through ctypes.PyDLL, which keep the GIL. The reads use them (on the scheduler's thread,
        or v1's reader thread), so a read never lets another thread take the GIL and hold it
        (cuda.bindings lets it go in every call, and on a reader thread each such hand-over
        costs the scheduler a thread switch; bench/event_cost.py: 0.8 and 1.6 us a call against
        0.5 and 0.2)."""
        import ctypes

        lib = ctypes.PyDLL("libcuda.so.1")
        q, r = lib.cuEventQuery, lib.cuEventRecord
        # the elapsed time's current entry point (drivers of CUDA 12.8 on; what cuda.h calls
        # cuEventElapsedTime since 13.0): the first one took 2.1 us a call against 0.27 through
        # cuda.bindings on an H100 machine (bench/event_cost.py); older drivers have only that one.
        # Both answer CUDA_ERROR_NOT_READY while either event is incomplete (span_held's readiness);
        # the second does not report errors of other pending work, which the server meets itself
        try:
            e, self.elapsed_symbol = lib.cuEventElapsedTime_v2, "cuEventElapsedTime_v2"
        except AttributeError:
            e, self.elapsed_symbol = lib.cuEventElapsedTime, "cuEventElapsedTime"
        # No argtypes: each call is given ctypes.c_void_p objects made once (an event's when its
        # slot is made: `handle`; the stream's at `refresh`), not an int() of a cuda.bindings
        # object and a c_void_p made from it at every call: an elapsed time inside the cycles took
        # 0.65 us against 1.0 on an H100 machine (bench/hand_overs.py)
        r.restype = q.restype = e.restype = ctypes.c_int
        ms = ctypes.c_float()
        out = ctypes.byref(ms)  # one buffer: every call holds the GIL, so none overlaps another
        ptr = ctypes.c_void_p

        def query_held(ev):
            err = q(ev)
            if err == 0:
                return True
            if err == 600:  # CUDA_ERROR_NOT_READY
                return False
            raise RuntimeError(f"cuEventQuery failed: CUresult {err}")

        def elapsed_held(a, b):
            err = e(out, a, b)
            if err:
                raise RuntimeError(f"cuEventElapsedTime failed: CUresult {err}")
            return ms.value

        def span_held(a, b):
            """The elapsed time, or None where `b` (or `a`) has not completed: a cycle's
            readiness and its span in one call (Reader.slot_ready)."""
            err = e(out, a, b)
            if err == 0:
                return ms.value
            if err == 600:  # CUDA_ERROR_NOT_READY
                return None
            raise RuntimeError(f"cuEventElapsedTime failed: CUresult {err}")

        self._probe = self.new_event()
        probe = ptr(int(self._probe))
        if query_held(probe) is not True:  # an event never recorded is complete: the call works here
            return
        # from here each slot's handles are c_void_p objects, which every read and record takes
        self.handle = lambda ev: ptr(int(ev))
        self._ptr = ptr
        self.sptr = ptr(self.sraw)
        if r(probe, self.sptr) == 0:  # the record too, on the current stream
            self.crec = r  # the hot path's records: one C call, no wrapper (profiler.py)
        self.query_held, self.elapsed_held, self.span_held = query_held, elapsed_held, span_held
        self.query_captured_held = lambda ev: query_held(ptr(ev.cuda_event))
        self.elapsed_captured_held = lambda a, b: elapsed_held(ptr(a.cuda_event), ptr(b.cuda_event))

    def _check(self, err, value=None, call="a CUDA driver call"):
        if err is not self._ok:
            raise RuntimeError(f"{call} failed: {err!r}")
        return value

    def _stream(self, raw):
        return self._d.CUstream(raw)

    def attach(self) -> None:
        self._check(*self._d.cuCtxSetCurrent(self._ctx), call="cuCtxSetCurrent")

    def new_event(self, external: bool = False):
        if external:
            return super().new_event(external=True)
        return self._check(*self._d.cuEventCreate(self._d.CUevent_flags.CU_EVENT_DEFAULT), call="cuEventCreate")

    def record(self, event) -> None:
        err = self._record(event, self.stream)[0]
        if err is not self._ok:
            raise RuntimeError(f"cuEventRecord failed: {err!r}")

    def query(self, event) -> bool:
        err = self._query(event)[0]
        if err is self._ok:
            return True
        if err is self._not_ready:
            return False
        raise RuntimeError(f"cuEventQuery failed: {err!r}")

    def elapsed(self, a, b) -> float:
        err, ms = self._elapsed(a, b)
        return self._check(err, ms, call="cuEventElapsedTime")
