"""What the patched SGLang files call. `P` is the process's profiler.

With --speculative-profile off, `P` stays a NullProfiler and each hook is one Python
call that does nothing. `install()` runs once per scheduler process, from the EAGLE (or
STANDALONE) worker's constructor, before the draft CUDA graphs are captured; on an NGRAM
server (no draft model, no graphs of its own), a multi-layer EAGLE server (its constructor is
not EAGLE's; no EAGLE draft graphs) and a server without speculation, from the scheduler's
idle housekeeping before the first request (`idle`).
"""

from __future__ import annotations

import logging
import os
import signal

from sglang_specprof.advisor import NO_DRAFT_MODEL
from sglang_specprof.table import printable

from . import zero_step
from .folder import AT_HAND_OVER, READER_THREAD
from .jsonl import JsonlSink, rank_path
from .kernel_sampler import CYCLES, KernelSampler
from . import block_draft, frozen_kv, multilayer, ngram, uno
from .null import NullProfiler
from .plain import PlainProfiler, time_forwards
from .policy import POLICY_FILE_ENV, CostPolicy, follow_file
from .profiler import Profiler
from .ranks import RankExchange, exchange_folder
from .sinks import Advice

logger = logging.getLogger("sglang.specprof")

P = NullProfiler()
_state = {"warned": False, "paused": None, "state_errors": set(), "scheduler": None}
# With this set (SIGUSR2, say), that signal to a scheduler process pauses its profiler (the
# hooks go to the null profiler, as with the flag off) and the next one resumes it: the
# flag's cost measured on and off in one process (bench/overhead.py --same-process).
PAUSE_SIGNAL_ENV = "SGLANG_SPECPROF_PAUSE_SIGNAL"
PAUSE_SIGNALS = ("SIGUSR1", "SIGUSR2")  # the others are the scheduler's (SIGTERM, SIGCHLD, ...) or fatal


def disable(reason: str) -> None:
    """An internal error in the profiler: the null profiler takes its place, one warning."""
    global P
    if not _state["warned"]:
        _state["warned"] = True
        logger.warning("speculative profile disabled after an internal error (%s); the server keeps serving.",
                       printable(reason))
    old, P = P, NullProfiler()
    policy = getattr(old, "policy", None)
    if policy is not None:  # its figures stop: upstream's rule takes over
        policy.mode = "ema"
    close = getattr(old, "close", None)
    if close is not None:
        close()


def _pause_toggle(signum=None, frame=None) -> None:
    """Pause the running profiler, or resume the paused one (between two bytecodes of the
    scheduler's thread: a cycle cut in two is dropped on resume)."""
    global P
    paused = _state["paused"]
    if paused is None:
        if P.enabled:
            _state["paused"], P = P, NullProfiler()
    else:
        _state["paused"] = None
        paused.resume()
        P = paused


def swap(old, new) -> None:
    """A kernel sample is armed, or done (kernel_sampler.py): `new` takes the hooks where
    `old` has them, installed or paused, as a pause swaps; elsewhere (replaced since) nothing."""
    global P
    if P is old:
        P = new
    elif _state["paused"] is old:
        _state["paused"] = new


def _own(p):
    """The profiler behind `p`, where its state is written: a kernel sample's stand-in reads it."""
    return p.profiler if isinstance(p, KernelSampler) else p


def _follow_pause_signal() -> None:
    name = os.environ.get(PAUSE_SIGNAL_ENV)
    if not name:
        return
    full = name.strip().upper()
    full = full if full.startswith("SIG") else "SIG" + full
    if full not in PAUSE_SIGNALS:
        logger.warning("speculative profile: %s=%s not followed: it takes SIGUSR1 or SIGUSR2 (the other signals "
                       "are the server's own).", PAUSE_SIGNAL_ENV, ascii(name))
        return
    try:
        signum = getattr(signal, full)
        signal.signal(signum, _pause_toggle)
        logger.info("speculative profile: %s to pid %d pauses it, and the next resumes it", signum.name, os.getpid())
    except (AttributeError, ValueError, OSError) as e:  # not on this platform, not the main thread
        logger.warning("speculative profile: %s=%s not followed (%s).", PAUSE_SIGNAL_ENV, full, e)


def _resolved(server_args):
    """From 0.5.23 the record keeps the operator's input and resolution is declared beside
    it (steps, algorithm): read through SGLang's resolved view where there is one."""
    if not hasattr(server_args, "resolve_once"):
        return server_args
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        return resolved_view(server_args)
    except Exception:
        return server_args


# Where the events are read: v2 on the scheduler's thread, once a cycle (AT_HAND_OVER: only the
# closed windows go to a helper), since its wait for the GPU is short or none when the host is
# the bottleneck and a reader thread then takes the GIL from the scheduler at every torch call
# (bench/hook_cost.py --wait-kind overlap); v1 on a reader thread, which works inside the
# verify's wait for its result, a whole forward long, and is idle again when it ends.
# A server without speculation ("plain") reads as v2 does: its forward under overlap is
# launched before the result of the one before is waited for.
READING = {"v1": READER_THREAD, "v2": AT_HAND_OVER, "plain": AT_HAND_OVER}


def _tp_rank() -> int:
    """This process's TP rank from SGLang's runtime context (0.5.21+), else 0."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().tp_rank
    except Exception:
        return 0


def install(server_args, tp_rank: int | None = 0, worker: str = "v2") -> None:
    """`worker`: "v1" or "v2" (the EAGLE and STANDALONE workers' constructors; NGRAM's from
    `idle`), "plain" (`idle`, on a server without speculation). `tp_rank` None: read from
    SGLang's runtime context (a constructor that has no rank of its own)."""
    global P
    if not getattr(server_args, "speculative_profile", False):
        P = NullProfiler()
        return
    try:
        server_args = _resolved(server_args)
        if tp_rank is None:
            tp_rank = _tp_rank()
        from .cuda_backend import CudaBackend
        algorithm = server_args.speculative_algorithm
        config = {
            "algorithm": algorithm,
            # NGRAM runs no draft forward: upstream's step count (draft tokens over the BFS
            # breadth) is no count of steps, and the advisor has none to weigh
            "num_steps": None if str(algorithm).upper() in NO_DRAFT_MODEL else server_args.speculative_num_steps,
            "topk": server_args.speculative_eagle_topk,
            "num_draft_tokens": server_args.speculative_num_draft_tokens,
            "worker": worker,
            "tp_size": getattr(server_args, "tp_size", 1),
            "cuda_graph": not getattr(server_args, "disable_cuda_graph", False),
            "phases_every": getattr(server_args, "speculative_profile_phases_every", 1) or 1,
            # the running-request cap (0.5.16 sets 48 for a speculative server unless told)
            "max_running_requests": getattr(server_args, "max_running_requests", None),
        }
        if getattr(server_args, "enable_multi_layer_eagle", False):
            config["multi_layer"] = True  # each step an MTP layer (multilayer.py): no step advice
        if getattr(server_args, "speculative_adaptive", False):
            config["adaptive"] = True
            config["adaptive_policy"] = getattr(server_args, "speculative_adaptive_policy", None) or "ema"
        try:
            import sglang

            config["sglang"] = getattr(sglang, "__version__", None)
        except Exception:
            pass
        sinks = []
        advice = Advice()  # the advisor once per window, for the log table and the gauges
        path = server_args.speculative_profile_output
        if path:
            if config["tp_size"] > 1:
                path = rank_path(path, tp_rank)
            try:
                sinks.append(JsonlSink(path))
            except OSError as e:  # made unwritable since the startup check: profiled without it
                logger.warning("speculative profile: no JSONL, %s cannot be appended to (%s).", printable(path),
                               e.strerror or e)
                path = None
        if getattr(server_args, "enable_metrics", False):
            try:
                from .metrics import MetricsSink

                sinks.append(MetricsSink({"tp_rank": tp_rank}, advice=advice))
            except Exception as e:
                logger.warning("speculative profile: no Prometheus gauges (%s: %s).", type(e).__name__, e)
        exchange = None
        if config["tp_size"] > 1:
            try:
                exchange = RankExchange(exchange_folder(getattr(server_args, "port", 0)), tp_rank, config["tp_size"])
            except OSError as e:
                logger.warning("speculative profile: no spread across ranks (%s).", e)
        backend = CudaBackend()
        config["events"] = backend.kind  # "cuda.bindings", or "torch" without it
        P = (PlainProfiler if worker == "plain" else Profiler)(
                     backend, interval=server_args.speculative_profile_interval, sink=sinks,
                     config=config, rank=tp_rank, log_table=(tp_rank == 0), exchange=exchange,
                     reading=READING.get(worker, READER_THREAD), on_error=disable,
                     phases_every=config["phases_every"], advice=advice)
        P.follow_gc()
        _follow_pause_signal()
        every = getattr(server_args, "speculative_profile_kernels", 0) or 0
        kernels = ""
        if every:
            try:
                P.kernels = KernelSampler(P, every, swap=swap)
                P.config["kernels_every"] = every
                most = P.config["kernels_max"] = P.kernels.max_samples
                kernels = (f", kernel sample of {CYCLES} cycles every {every} windows, "
                           f"{'at most %d' % most if most else 'no limit'} (CUPTI ready in {P.kernels.warm_s} s)")
            except Exception as e:
                logger.warning("speculative profile: no kernel samples (%s: %s).", type(e).__name__, e)
        every_phase = config["phases_every"]
        logger.info("speculative profile on (%s, window %d cycles, %s, events through %s%s%s)",
                    "no speculation: each forward one phase" if worker == "plain" else f"{algorithm} {worker} worker",
                    server_args.speculative_profile_interval,
                    "every phase of every cycle" if every_phase == 1 else
                    f"every cycle, its phases in one of {every_phase}", backend.kind,
                    f", JSONL {path}" if path else "", kernels)
    except Exception as e:
        logger.warning("speculative profile could not start (%s: %s); serving without it.", type(e).__name__, e)
        P = NullProfiler()


# workers whose constructor carries no install hook: their cycle is wrapped from `idle` (v2, and the v1
# workers of DFLASH and FROZEN_KV_MTP, each module's `worker_kind`)
WRAPPED_V2 = (("multi-layer", multilayer), ("frozen-KV MTP", frozen_kv), ("DFLASH / DSPARK", block_draft),
              ("UNO", uno))


def idle(scheduler=None) -> None:
    """Upstream's idle housekeeping (scheduler-idle-window.patch), before its own guard: the
    profiler's idle close (`Profiler.idle`), and, the first time, the Scheduler itself, which
    idles before its first request: the profiler reads its waiting queue from then on, and on a
    server without speculation given --speculative-profile, the plain profile starts here, on
    an NGRAM server the NGRAM worker's (ngram.py), on a multi-layer EAGLE server its worker's
    (multilayer.py), on a FROZEN_KV_MTP server its worker's (frozen_kv.py), on a DFLASH or
    DSPARK server its worker's (block_draft.py), on a UNO server its worker's (uno.py)."""
    if scheduler is not _state["scheduler"]:
        _attach(scheduler)
    P.idle()


def _attach(scheduler) -> None:
    _state["scheduler"] = scheduler
    if scheduler is None:
        return
    try:
        args = getattr(scheduler, "server_args", None)
        if (args is not None and getattr(args, "speculative_profile", False) and not P.enabled
                and _state["paused"] is None and not _state["warned"]):
            algorithm = getattr(_resolved(args), "speculative_algorithm", None)
            worker = getattr(scheduler, "model_worker", None) or scheduler.tp_worker
            rank = getattr(scheduler, "tp_rank", 0) or 0
            if algorithm is None:
                install(args, rank, "plain")
                if P.enabled:
                    time_forwards(worker, lambda: P)
            elif str(algorithm).upper() == "NGRAM":  # no constructor hook: its cycle wrapped here (ngram.py)
                install(args, rank, ngram.worker_kind(worker))
                if P.enabled:
                    ngram.time_cycles(worker, lambda: P)
            else:  # nor have multi-layer EAGLE's, FROZEN_KV_MTP's, DFLASH's, DSPARK's and UNO's (WRAPPED_V2)
                for name, module in WRAPPED_V2:
                    if module.is_worker(worker):
                        install(args, rank, getattr(module, "worker_kind", lambda w: "v2")(worker))
                        if P.enabled:
                            try:
                                module.time_cycles(worker, lambda: P)
                            except Exception as e:  # a worker not shaped as the releases read: serve unprofiled
                                disable(f"the {name} worker's cycle could not be wrapped: {type(e).__name__}: {e}")
                        break
                else:
                    if type(worker).__name__ == "MultiLayerEagleWorker":  # a topk SGLang chose for the model
                        _state["warned"] = True
                        logger.warning("speculative profile off: SGLang runs multi-layer EAGLE's v1 worker here (the "
                                       "overlap scheduler off), which it does not time; the server keeps serving.")
        for p in (P, _state["paused"]):
            if p is not None and p.enabled:
                _own(p).scheduler = scheduler
    except Exception as e:
        logger.warning("speculative profile: the scheduler's queue is not read (%s: %s); the server keeps serving.",
                       type(e).__name__, printable(str(e)))


def adaptive(controller, server_args) -> None:
    """SGLang's adaptive controller was made (--speculative-adaptive): with
    --speculative-adaptive-policy cost (or SGLANG_SPECPROF_POLICY_FILE set, for benchmarks) its chooser
    becomes the cost policy, fed by the profiler (policy.py). With the profile on or off, its
    0-step state verifies through the decode attention kernel where that is exact (zero_step.py)."""
    try:
        zero_step.install(controller.worker)
    except Exception as e:
        logger.warning("step-0 verify keeps upstream's path (%s: %s)", type(e).__name__, e)
    mode = getattr(server_args, "speculative_adaptive_policy", None) or "ema"
    if not P.enabled or (mode == "ema" and not os.environ.get(POLICY_FILE_ENV)):
        return
    try:
        # no config file: the policy's candidates are every step count up to the launch one
        policy = CostPolicy(controller.params, mode=mode,
                            launch_steps=getattr(server_args, "speculative_num_steps", None),
                            widen=getattr(server_args, "speculative_adaptive_config", None) is None)
        controller.params = policy
        own = _own(P)
        own.steer_by(policy)
        follow_file(policy)
        logger.info("speculative adaptive policy %s (tiers %s; candidates %s)", mode,
                    ", ".join(map(str, policy.bs_list)),
                    "; ".join(f"{k}: {t.candidates}" for k, t in policy.tiers.items()))
    except Exception as e:
        logger.warning("speculative adaptive policy could not start (%s: %s); upstream's rule is used.",
                       type(e).__name__, e)


def internal_state() -> dict:
    """The key added to /server_info's internal_states.

    Runs on the scheduler's thread, between batches: it first lets the reader read the cycles
    whose events have completed (50 ms at most), so `totals` covers every cycle up to the last
    finished one. Never raises (upstream calls it unguarded): an error is the answer's
    `error`, and one warning per distinct error.
    """
    try:
        P.catch_up()
        out = {"enabled": P.enabled, "latest": P.latest(), "totals": P.totals_now()}
        policy = getattr(P, "policy", None) or getattr(_state["paused"], "policy", None)
        if policy is not None:
            policy.reread()
            out["adaptive_policy"] = policy.state()
        return out
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        reason = f"{type(e).__name__}: {first}"
        seen = _state["state_errors"]
        if reason not in seen and len(seen) < 32:  # bounded: an error whose text changes each call
            seen.add(reason)
            logger.warning("speculative profile: /server_info without the profile (%s); the server keeps serving.",
                           printable(reason))
        return {"enabled": bool(getattr(P, "enabled", False)), "error": reason}
