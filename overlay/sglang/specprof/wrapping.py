"""Methods of a worker instance wrapped so that its cycle is timed, where no line of a patch calls
the profiler: the plain profile (plain.py), NGRAM (ngram.py) and multi-layer EAGLE
(multilayer.py) all wrap this way, from the scheduler's idle housekeeping (`hooks.idle`)."""

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
