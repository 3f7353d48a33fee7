"""The runtime profiler: the hooks the patched SGLang files call with --speculative-profile on.

The profiler is the hooks' face and the wiring of its parts. The cycle's marks are recorded
on the scheduler's thread by its `recorder` (recorder.py, into the slot pool of slots.py),
whose bound methods the profiler hands out as its own hooks; the draft graphs' hooks record
there too (graphs.py). Acceptance comes in at `harvest()` and, on v2, the scheduler's commit,
which says how many tokens each request took (accept.py); each cycle's acceptance settles in
`Settlement` (settlement.py), which alone decides where the window ends and queues its close
record behind the cycles. The events are read, folded and the windows closed by the `folder`
(folder.py, reader.py), the closed windows published by the `outputs` (pipeline.py).

The clock and the events come from a backend (`cuda_backend.py` on the GPU, a fake in
the tests); this module imports neither torch nor SGLang.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from operator import attrgetter

from .accept import AcceptHooks
from .folder import INLINE, Folder
from .gc_pauses import GcPauses
from .graphs import DraftGraphs
from .null import NullProfiler
from .pipeline import Outputs
from .reader import Reader
from .recorder import MAX_MARKS, Recorder  # noqa: F401 (MAX_MARKS: the name tests import)
from .settlement import IDLE_CLOSE_S, SWITCHES_KEPT, Settlement  # noqa: F401 (the names tests and benches import)
from .sinks import Advice, LogTableSink
from .slots import POOL

logger = logging.getLogger("sglang.specprof")

# the recorder's hooks, handed out as the profiler's own (its bound methods: no call added)
RECORDER_HOOKS = ("begin", "mark", "draft_end", "end", "draft_step", "graph", "draft_replay_begin",
                  "draft_replay_end", "capture_begin", "capture_end")


def _recorders(name: str, settable: bool = False) -> property:
    """The recorder's attribute `name`, read (and, `settable`, set) through the profiler."""
    return property(attrgetter(f"recorder.{name}"),
                    (lambda self, v: setattr(self.recorder, name, v)) if settable else None)


class Profiler(AcceptHooks, NullProfiler):
    """The hooks with --speculative-profile on: the cycle's marks and the draft graphs' hooks
    are its `recorder`'s (recorder.py, graphs.py), the acceptance hooks in accept.py; its other
    parts, held as attributes: `settlement` (where the window ends), `graphs`, `reader`,
    `folder`, `outputs`, `gc_pauses`."""

    enabled = True

    def __init__(self, backend, interval=100, sink=None, config=None, clock=time.perf_counter, rank=0,
                 log_table=True, exchange=None, reading=INLINE, on_error=None, phases_every=1, advice=None):
        self.backend = backend
        self.interval = interval
        self.on_error = on_error
        self.config = dict(config or {})
        self.clock = clock
        self.rank = rank
        self.graphs = DraftGraphs(backend, clock)
        if not self.graphs.timed:
            self.config["draft_steps"] = False  # the report says why a bucket has no step times
        # the scheduler's thread's recording: the slot pool, the cycle in flight, the held items
        self.recorder = rec = Recorder(backend, clock, self.graphs, self.config, phases_every, self._fail)
        for name in RECORDER_HOOKS:
            setattr(self, name, getattr(rec, name))
        self._hand_over = rec._hand_over  # the items held on this thread to the folder
        self.reader = Reader(backend, rec.free, self.graphs, rec.behind, pool=POOL)
        # Reading the events, folding and window closes run in `folder` (helper threads in the
        # server); this thread records the events and hands each cycle's slot over.
        self.folder = Folder(self.reader, interval, self.config.get("num_steps"), on_error=self._fail,
                             reading=reading)
        given = [] if sink is None else list(sink) if isinstance(sink, (list, tuple)) else [sink]
        sinks = ([LogTableSink(self.folder.pause, advice or Advice())] if log_table else []) + given
        self.outputs = Outputs(sinks, self.folder.pause, self.folder.pause_turn, exchange, rank)
        self.folder.on_close = self.outputs.publish
        # the acceptance hooks' shut of the gate (harvest): the folder's gate, as the recorder's
        self.gate = self.folder.gate
        self.open_at_end = rec.open_at_end
        # v2 (and a server without speculation): acceptance is settled against the requests
        # where the scheduler commits it
        self.settle_on_commit = self.config.get("worker") in ("v2", "plain")
        self.unsettled: deque = deque()  # correct-draft lists harvested, waiting for their commit
        self.open_commit = None  # (reqs, correct, visible before) between commit_begin and commit_end
        self.uncut_cycles = 0  # v2 cycles counted without their commit (a hook not reached): counted as verified
        self.policy = None  # the cost policy (policy.py), when it chooses the step counts
        self.gc_pauses = GcPauses(self)  # the collector's pauses inside each cycle, once followed
        # where the open window ends (settlement.py); each decode cycle's acceptance settles
        # there, through the bound method the acceptance hooks call
        self.settlement = st = Settlement(self, interval, rec.adaptive)
        rec.connect(self.reader, self.folder, st)
        rec.face = self  # a cycle timed whole gets marks that do nothing (Recorder.show_marks)
        self._add_accept = st.settle
        self.tokens = st.tokens

    # the parts' figures, under the names the tests, the hooks and the sampler read;
    # kernels: --speculative-profile-kernels' sampler (kernel_sampler.KernelSampler), or None
    kernels = property(lambda self: self.reader.kernels, lambda self, k: setattr(self.reader, "kernels", k))
    sinks = property(lambda self: self.outputs.sinks)
    read_dropped = property(lambda self: self.reader.dropped)
    steps_lost = property(lambda self: self.graphs.lost)
    capture_s = property(lambda self: self.graphs.capture_s)
    window_index = property(lambda self: self.settlement.window_index)
    window_decode = property(lambda self: self.settlement.window_decode)
    last_steps = property(lambda self: self.settlement.last_steps)
    switches = property(lambda self: self.settlement.switches)
    _gc_cb = property(lambda self: self.gc_pauses.cb)
    _on_gc = property(lambda self: self.gc_pauses.on_gc)
    # the recorder's state (slots.py), where it lives: one place, read through here
    cur = _recorders("cur")
    seq = _recorders("seq")
    free = _recorders("free")
    next_slot = _recorders("next_slot")
    items = _recorders("items")
    detail_all = _recorders("detail_all")
    phases_every = _recorders("phases_every")
    dropped = _recorders("dropped")
    marks_lost = _recorders("marks_lost")
    eager = _recorders("eager")
    adaptive = _recorders("adaptive")
    broken = _recorders("broken")
    scheduler = _recorders("scheduler", settable=True)  # hooks.idle: its waiting queue is read

    def follow_gc(self):
        """Time the garbage collector's pauses of the host inside each cycle (the server's
        profiler does; they are where the device can sit waiting on the host)."""
        self.gc_pauses.follow()

    def resume(self):
        """After a pause (hooks.PAUSE_SIGNAL_ENV): what was open when it began is dropped, the
        cycle in flight and the acceptance waiting for its commit, so nothing is half counted."""
        rec = self.recorder
        if rec.cur is not None:
            self.reader.recycle(rec.cur)
            rec.cur = None
        self.unsettled.clear()
        self.open_commit = None
        rec.items.append(("resync",))  # the reader lines cycles and acceptance up again

    def steer_by(self, policy) -> None:
        """The cost policy (hooks.adaptive): it chooses the step counts, and the folder tells
        it of each cycle read and each acceptance list settled."""
        self.policy = policy
        self.folder.observer = policy

    def every_phase(self, on: bool) -> None:
        """The kernel sampler's (kernel_sampler.py): from the next cycle, every cycle timed
        phase by phase (`on`: its sample's, the one made ready at the last end too), or again
        one in `phases_every`."""
        rec = self.recorder
        rec.detail_all = on or rec.phases_every == 1
        if on:
            rec._decide_next(count=False)

    def add_kernel_sample(self, smp: dict) -> None:
        """A kernel sample the torch profiler recorded, to the folder in order with the cycles."""
        self.recorder.items.append(("kernels", smp))

    def close(self):
        """Stop following the garbage collector (the profiler is being replaced)."""
        self.gc_pauses.stop()

    def window_closed(self, index):
        """The settlement queued window `index`'s close: the items go to the folder, and the
        next window times each batch size's first cycle by phase; the kernel sampler hears it."""
        self.recorder.next_window()
        k = self.reader.kernels
        if k is not None:
            k.window_closed(index)

    def idle(self):
        """Upstream's idle housekeeping (the scheduler has no batch to run; called before
        upstream's own guard, about once a second with --sleep-on-idle, or on every loop
        without): the settlement closes the open window once it sat idle long enough, so that
        what ran before a pause (or before a shutdown: the scheduler is killed, nothing flushes
        then) is in the outputs and the JSONL instead of waiting for the traffic."""
        self.settlement.idle()

    # -- reads ------------------------------------------------------------------------
    @property
    def window(self):
        """The open window (inline: with every item held; else up to the last batch
        folded, see `flush`)."""
        if not self.folder.reading_thread:
            self._hand_over()
        return self.folder.window

    def flush(self, timeout: float = 10.0, outputs: bool = True) -> bool:
        """Hand over what is held and wait until what completed is read and folded and
        (`outputs`) the outputs ran (tests, benchmarks, /server_info)."""
        self._hand_over()
        return self.folder.flush(timeout, outputs)

    def latest(self):
        return self.outputs.latest

    def catch_up(self, timeout: float = 0.05) -> None:
        """Before a read of the totals (/server_info): the cycles whose events completed are
        read first, waiting `timeout` at most (the reader works while the scheduler waits)."""
        if not self.broken:
            self.flush(timeout, outputs=False)

    def totals_now(self) -> dict:
        return self.reader.totals(self.tokens)

    # -- failure ----------------------------------------------------------------------
    def _fail(self, e):
        """Any internal error: this profiler stops, and `on_error` (the hooks' `disable`,
        which puts the null profiler in its place) hears why; without one, a warning."""
        first = (str(e).strip().splitlines() or [""])[0]
        reason = f"{type(e).__name__}: {first}"
        if self.broken:
            return
        rec = self.recorder
        rec.broken = True
        rec.cur = None
        rec.next_slot = None
        k = self.reader.kernels
        if k is not None:
            k.shutdown()
        if self.on_error is not None:
            self.on_error(reason)
        else:
            logger.warning("speculative profile disabled after an internal error (%s).", reason)
