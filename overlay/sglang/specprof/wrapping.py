"""Methods of a worker instance wrapped so that its cycle is timed, where no line of a patch calls
the profiler: the plain profile (plain.py), NGRAM (ngram.py), multi-layer EAGLE (multilayer.py),
FROZEN_KV_MTP (frozen_kv.py), DFLASH and DSPARK (block_draft.py) and UNO (uno.py) all wrap this
way, from the scheduler's idle housekeeping (`hooks.idle`)."""

from __future__ import annotations


def decoding(batch):
    """True for a decode batch, False for a prefill, None for neither (idle under data parallel
    attention, a split prefill: passed through untimed). Never raises."""
    try:
        mode = batch.forward_mode
        if mode.is_decode():
            return True
        if mode.is_extend():
            return False
    except Exception:
        pass
    return None


def wrap(obj, name, make, marker):
    """Replace `obj.name` (the bound method) on the instance by `make(orig)`, marked with the
    attribute `marker` (how a second wrap of the same method is told)."""
    orig = getattr(obj, name)
    new = make(orig)
    new.__wrapped__ = orig
    setattr(new, marker, True)
    setattr(obj, name, new)


def verify_graph_runner(target_worker):
    """The target's decode graph runner (the verify's graphs), for the profiler's padding count;
    None where the worker has none."""
    return getattr(getattr(target_worker, "model_runner", None), "decode_cuda_graph_runner", None)


def target_forward(state: dict, target, prefill_mark: str | None = None):
    """For `wrap` on the target worker's `forward_batch_generation`, where a worker verifies with
    code of its own (no hook of the series inside): in a decode cycle the verify (`is_verify=True`:
    `verify_prep` closed as it starts, `verify` as it returns, its graph counted), in a prefill
    the target's extend (`prefill_mark` closed as it returns, where given)."""
    def make(orig):
        def forward_batch_generation(*args, **kwargs):
            p = state["p"]
            if p is None:
                return orig(*args, **kwargs)
            verify = state["decode"] and kwargs.get("is_verify", False)
            if verify:
                p.mark("verify_prep")
            out = orig(*args, **kwargs)
            if verify:
                p.mark("verify")
                state["verified"] = True  # what follows in the cycle comes after its verify
                used = getattr(out, "can_run_cuda_graph", None)
                if used is not None:
                    p.graph("verify", bool(used), verify_graph_runner(target))
            elif prefill_mark is not None and not state["decode"] and not kwargs.get("is_verify", False):
                p.mark(prefill_mark)
            return out
        return forward_batch_generation
    return make


def mark_after(state: dict, name: str):
    """For `wrap`: the method, then `name` marked on the decode cycle in flight (`state["p"]`,
    the profiler a wrapped cycle set, None outside one; `state["decode"]`, whether it decodes)."""
    def make(orig):
        def method(*args, **kwargs):
            out = orig(*args, **kwargs)
            p = state["p"]
            if p is not None and state["decode"]:
                p.mark(name)
            return out
        return method
    return make


def harvest_first(profiler_of):
    """For `wrap` on a v2 worker's `on_verify_complete_cpu`: the accepted lengths the scheduler
    hands it go to the profiler first."""
    def make(orig):
        def on_verify_complete_cpu(correct, *args, **kwargs):
            profiler_of().harvest(correct)
            return orig(correct, *args, **kwargs)
        return on_verify_complete_cpu
    return make


def worker_cycle(profiler_of, state: dict, steps, last: tuple = (None, None), v1: bool = False):
    """For `wrap` on a worker's `forward_batch_generation` (multi-layer EAGLE, FROZEN_KV_MTP,
    DFLASH, DSPARK, UNO): each decode and prefill a cycle of the profiler `profiler_of()` gives at
    its start (the hooks' `P`, which a pause or an internal error replaces), `steps` passed with a
    decode's begin; `state` holds the profiler and kind of the cycle in flight for the marks'
    wrappers ("verified": set where a decode's verify returned). `last`: the marks (decode,
    prefill) that close a cycle where no wrapped call ends it, or None, or a function giving one of
    those as the cycle ends. A decode batch with an extend in it (`is_extend_in_batch`) is timed
    as the prefill upstream runs for it.

    `v1`: a v1 worker (no overlap scheduler; its verify appends each request's tokens, cut at its
    stop: DFLASH up to 0.5.13, FROZEN_KV_MTP in 0.5.12 and 0.5.13): the correct drafts each
    request took are what its output grew by, less the bonus token, handed to the profiler as the
    cycle ends (the scheduler commits nothing more). A v2 worker's come through
    `on_verify_complete_cpu` or the scheduler's resolve."""
    def make(orig):
        def forward_batch_generation(batch, *args, **kwargs):
            p = profiler_of()
            decode = decoding(batch) if p.enabled else None
            if decode is None:
                return orig(batch, *args, **kwargs)
            try:
                reqs = batch.reqs
                if decode and getattr(batch, "is_extend_in_batch", False):
                    decode = False
                before = [len(r.output_ids) for r in reqs] if v1 and decode else None
            except Exception:  # never take the server down: the cycle goes untimed
                return orig(batch, *args, **kwargs)
            if decode:
                p.begin("decode", len(reqs), batch, steps)
            else:
                p.begin("prefill", len(reqs))
            state["p"], state["decode"], state["verified"] = p, decode, False
            try:
                out = orig(batch, *args, **kwargs)
            finally:
                state["p"] = None
            closing = last[0 if decode else 1]
            if callable(closing):
                closing = closing()
            if closing is not None:
                p.mark(closing)
            p.end()
            if before is not None:
                p.harvest([len(r.output_ids) - b - 1 for r, b in zip(reqs, before)])
            return out
        return forward_batch_generation
    return make


def prefill_marks(state: dict, before: str, after: str):
    """For `wrap` on the draft's extend over a prompt: `before` marked as it starts (the target's
    forward ends there), `after` as it returns, on a prefill cycle in flight only."""
    def make(orig):
        def method(*args, **kwargs):
            p = state["p"]
            prefill = p is not None and not state["decode"]
            if prefill:
                p.mark(before)
            out = orig(*args, **kwargs)
            if prefill:
                p.mark(after)
            return out
        return method
    return make
