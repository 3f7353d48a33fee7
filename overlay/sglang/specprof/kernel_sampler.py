"""--speculative-profile-kernels N: every N windows, a few decode cycles at kernel level.

The torch profiler that SGLang already ships (CUPTI through kineto: kernels, copies and
memsets, those replayed from CUDA graphs included, each with the correlation of the host
call that launched it) runs on the scheduler's thread for one cycle of context and
CYCLES decode cycles; each phase mark of those cycles also leaves a zero-length
annotation `specprof/<cycle>/<mark>` (`begin` carries the kind, the batch size and, under
--speculative-adaptive, the step count). The
profiler stops at the first cycle start after the stretch's last event has completed,
so every kernel of the stretch is in. What it recorded goes to the outputs thread,
where `sglang_specprof.kernels` attributes each kernel to its phase and classes it; the
next window carries the result as `kernels`.

Nothing here runs between samples: while a sample is armed, runs or waits for its last
event, the hooks call the sampler in the profiler's place (hooks.swap, as a pause swaps),
and each of its hooks calls the profiler's own; the profiler itself is never patched. A
sample never starts while another torch profiler is on (SGLang's /start_profile): it is
skipped and counted.

torch's profiler keeps host memory for every sample it records, for good (about 140 bytes a
CUDA kernel launched, which neither releasing its results nor the allocator's trim gives back:
bench/sample_memory.py; 1.6 MB a sample in the 8B-shaped soak, bench/soak.py). So a process
takes at most SGLANG_SPECPROF_KERNELS_MAX samples (MAX_SAMPLES by default, 0 for no limit) and
says so when it has taken the last.
"""

from __future__ import annotations

import logging
import os
import time

from sglang_specprof.kernels import analyse, from_kineto

logger = logging.getLogger("sglang.specprof")

CYCLES = 4  # decode cycles per sample, after one of context: the stop costs about 12 ms a cycle recorded
WAIT_CYCLES = 64  # cycles the stretch's last event may take to complete before the sample is given up
MAX_SAMPLES = 100  # a process's samples (at the default spacing, 400 windows, about 8 hours of an 8B model's)
MAX_ENV = "SGLANG_SPECPROF_KERNELS_MAX"


def max_samples_from_env() -> int:
    """The limit from SGLANG_SPECPROF_KERNELS_MAX: a whole number of samples, 0 for none; any
    other value is one warning and the default."""
    raw = os.environ.get(MAX_ENV, "")
    if not raw.strip():
        return MAX_SAMPLES
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        logger.warning("speculative profile: %s=%s is not a number of kernel samples (0 for no limit); using %d.",
                       MAX_ENV, ascii(raw), MAX_SAMPLES)
        n = MAX_SAMPLES
    return n


class KernelSampler:
    """The profiler the hooks call while a sample is armed, runs or ends (hooks.swap puts it
    in the profiler's place and back, as a pause does): each hook is the profiler's own call,
    and, while the sample runs, the torch profiler's annotation of what it recorded. Reads of
    the profiler's other state go to the profiler (`__getattr__`)."""

    enabled = True

    def __init__(self, profiler, every: int, cycles: int = CYCLES, torch_module=None, *, swap,
                 max_samples: int | None = None):
        if torch_module is None:
            import torch as torch_module
        self.torch = torch_module
        self.profiler = profiler
        self.swap = swap  # (installed, replacement): hooks.swap
        self.every = every
        self.cycles = cycles
        self.state = "idle"  # idle, armed, running, ending; installed in the hooks but when idle
        self.prof = None
        self.left = 0
        self.seqs: set = set()  # cycles annotated in the running sample (the reader keeps their event times)
        self.event_ms: dict = {}  # reader: cycle seq -> [[phase, GPU ms], ...]
        self.end_event = None
        self.waited = 0
        self.sample = None
        self.samples = 0
        self.skipped = 0  # due, but another torch profiler was on
        self.max_samples = max_samples_from_env() if max_samples is None else max_samples  # 0: no limit
        self.ended = False  # the limit reached
        self.warm_s = self._warm()

    def __getattr__(self, name):
        if name == "profiler":  # not set yet (a failed constructor)
            raise AttributeError(name)
        return getattr(self.profiler, name)

    def _new(self):
        tp = self.torch.profiler
        return tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA], record_shapes=False,
                          with_stack=False, profile_memory=False)

    def _warm(self) -> float:
        """CUPTI's first start takes seconds: pay it at startup, not in a serving cycle."""
        t0 = time.perf_counter()
        prof = self._new()
        prof.start()
        prof.stop()
        release(prof)
        return round(time.perf_counter() - t0, 3)

    def _other_profiler_on(self) -> bool:
        try:
            return bool(self.torch._C._autograd._profiler_enabled())
        except Exception:
            return bool(getattr(self.torch.autograd.profiler, "_is_profiler_enabled", False))

    # -- on the scheduler's thread --------------------------------------------------
    def window_closed(self, index: int) -> None:
        """The profiler closed window `index`: every `every` windows a sample is armed, and
        this object takes the hooks until it is done; none after the process's limit."""
        if self.state == "idle" and (index + 1) % self.every == 0:
            if self.max_samples and self.samples >= self.max_samples:
                if not self.ended:
                    self.ended = True
                    logger.warning("speculative profile: %d kernel samples taken, the most %s allows (torch's "
                                   "profiler keeps host memory for each, for good); no more are taken.",
                                   self.samples, MAX_ENV)
                return
            self.state = "armed"
            p = self.profiler
            p.every_phase(True)  # the sampled cycles timed phase by phase, to set beside their kernels
            self.swap(p, self)

    def _annotate(self, name: str) -> None:
        with self.torch.profiler.record_function(name):
            pass

    def begin(self, kind, bs, ctx=None, steps=None):
        p = self.profiler
        if self.state == "ending":
            self._try_stop()
        p.begin(kind, bs, ctx, steps)
        st = self.state
        if st == "armed":
            if self._other_profiler_on():
                self.skipped += 1
                self._idle()
                return
            t0 = time.perf_counter()
            self.prof = self._new()
            self.prof.start()
            self.sample = {"window": p.window_index, "start_s": time.perf_counter() - t0, "t0": t0, "cycles_run": 0}
            self.left = self.cycles + 1
            self.seqs = set()
            self.state = st = "running"
        if self.sample is not None:
            self.sample["cycles_run"] += 1
        if st == "running":
            s = p.cur
            if s is not None:
                self.seqs.add(s.seq)
                tail = "" if s.steps is None else f"/{s.steps}"  # under --speculative-adaptive: its bucket's
                self._annotate(f"specprof/{s.seq}/begin/{kind}/{bs}{tail}")

    def _marked(self, hook, *args):
        """The profiler's `hook`, then, while the sample runs, an annotation of the mark it recorded, if it did."""
        s = self.profiler.cur
        if self.state != "running" or s is None:
            hook(*args)
            return
        n0 = s.n
        hook(*args)
        if s.n > n0:
            self._annotate(f"specprof/{s.seq}/{s.names[s.n - 1]}")

    def mark(self, name):
        self._marked(self.profiler.mark, name)

    def draft_replay_begin(self, runner, bs, variant=None):
        self._marked(self.profiler.draft_replay_begin, runner, bs, variant)

    def draft_replay_end(self):
        self._marked(self.profiler.draft_replay_end)

    def draft_end(self):  # records through the profiler's mark
        self._marked(self.profiler.draft_end)

    def end(self):
        p = self.profiler
        s = p.cur
        p.end()
        if self.state == "running" and s is not None and s.kind == "decode":
            self.left -= 1
            if self.left <= 0:
                self.end_event = s.events[s.n - 1]
                self.waited = 0
                self.state = "ending"

    # the other hooks: the profiler's
    def draft_step(self, i):
        self.profiler.draft_step(i)

    def graph(self, which, used, runner=None):
        self.profiler.graph(which, used, runner)

    def capture_begin(self, runner, bs, variant=None):
        self.profiler.capture_begin(runner, bs, variant)

    def capture_end(self):
        self.profiler.capture_end()

    def harvest(self, correct_per_req=None):
        self.profiler.harvest(correct_per_req)

    def commit_begin(self, reqs):
        self.profiler.commit_begin(reqs)

    def commit_end(self):
        self.profiler.commit_end()

    def idle(self):
        self.profiler.idle()

    def _try_stop(self):
        """At a cycle's start once the stretch's last event completed: stop, hand it over."""
        self.waited += 1
        p = self.profiler
        try:
            done = p.backend.query(self.end_event)
        except Exception:
            done = False
        if not done and self.waited < WAIT_CYCLES:
            return
        t0 = time.perf_counter()
        prof, smp = self.prof, self.sample
        self.prof = None
        try:
            # the stretch's work has completed: no device synchronisation on the way out
            # (torch's profiler synchronises when it knows the device), which would stall
            # the overlap scheduler for the cycle in flight
            inner = getattr(prof, "profiler", None)
            if inner is not None and hasattr(inner, "use_device"):
                inner.use_device = None
            prof.stop()
        finally:
            self._idle()
        t1 = time.perf_counter()
        smp["stop_s"] = t1 - t0
        smp["host_span_s"] = t1 - smp.pop("t0")  # from the profiler's start to its stop
        smp["complete"] = bool(done)
        smp["seqs"] = sorted(self.seqs)
        smp["prof"] = prof
        self.samples += 1
        p.add_kernel_sample(smp)

    def _idle(self):
        """Done (or skipped, or shut down): the profiler takes the hooks back."""
        self.state = "idle"
        self.sample = None
        self.end_event = None
        p = self.profiler
        p.every_phase(False)
        self.swap(self, p)

    def shutdown(self):
        """The profiler is replaced (an internal error): leave no torch profiler running."""
        prof, self.prof = self.prof, None
        self._idle()
        if prof is not None:
            try:
                prof.stop()
            except Exception:
                pass
            release(prof)


def release(prof) -> None:
    """A stopped torch profiler's recorded events freed now, not whenever Python's cyclic
    garbage collector reaches them: the profile object is in a reference cycle (its action map
    holds its own bound methods), and in a serving process the collector can leave hundreds of
    samples' events (megabytes each) piled up first (bench/soak.py, bench/sample_memory.py)."""
    if prof is None:
        return
    try:
        inner = prof.profiler
        if inner is not None:
            inner.kineto_results = None
        prof.profiler = None
        prof.action_map.clear()  # the cycle broken: the object goes with its last reference
    except Exception:
        pass


def analyse_sample(smp: dict, pause=None) -> dict:
    """On the outputs thread: the recorded sample as the window's `kernels` block."""
    t0 = time.perf_counter()
    prof = smp.pop("prof", None)
    try:
        events = prof.profiler.kineto_results.events()
        records = len(events)  # what torch recorded (it keeps host memory for each: MAX_ENV)
        norm = from_kineto(events, pause)
        del events
    finally:
        release(prof)
    del prof
    block = analyse(norm, smp.get("event_ms"), pause=pause)
    block["window"] = smp.get("window")
    block["complete"] = smp.get("complete", True)
    block["host_s"] = {"start": round(smp.get("start_s", 0.0), 5), "stop": round(smp.get("stop_s", 0.0), 5),
                       "analyse": round(time.perf_counter() - t0, 5),
                       "span": round(smp.get("host_span_s", 0.0), 5)}
    block["cycles_run"] = smp.get("cycles_run")  # cycles started while the torch profiler ran
    block["records"] = records
    return block
