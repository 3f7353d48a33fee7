"""What a cycle timed by phase records of its batch at its start (recorder.py, slots.py): the
KV tokens of its requests, the share of the KV pool in use and the requests waiting for a
running slot, from what the hooks pass. Each never raises and never reads a device tensor.
"""

from __future__ import annotations


def _on_cpu(t) -> bool:
    return getattr(getattr(t, "device", None), "type", None) == "cpu"


def context_tokens(ctx):
    """KV tokens of a cycle, from what the hook passes: a number, a CPU tensor of sequence
    lengths, or (v2 from 0.5.13) the ScheduleBatch, whose CPU copy of the lengths upstream
    keeps only where its attention backend asks for one: else the sum over its requests of
    prompt and output tokens (the output as committed, a cycle behind under overlap). A
    device tensor is never read: that would wait. None where none of these is there; never
    raises (called in `begin`, in the cycles timed by phase only)."""
    if ctx is None or isinstance(ctx, (int, float)):
        return ctx
    try:  # a CPU tensor's lengths summed as Python ints: a third of what its `sum()` costs (a torch op)
        if _on_cpu(ctx):
            return sum(ctx.tolist())
        lens = getattr(ctx, "seq_lens_cpu", None)
        if lens is not None and _on_cpu(lens):
            return sum(lens.tolist())
        reqs = getattr(ctx, "reqs", None)
        if reqs:
            return sum(len(r.origin_input_ids) + len(r.output_ids) for r in reqs)
    except Exception:
        pass
    return None


def kv_share(ctx):
    """The share of the KV pool the running requests hold at a cycle's start, from the
    ScheduleBatch the v2 hook passes: 1 - (free + evictable prefix cache) / size of its
    token-to-KV allocator; None where there is none. Never raises (called in `begin`, in the
    cycles timed by phase only)."""
    try:
        alloc = getattr(ctx, "token_to_kv_pool_allocator", None)
        if alloc is None:
            return None
        size = alloc.size
        cache = getattr(ctx, "tree_cache", None)
        free = alloc.available_size() + (cache.evictable_size() if cache is not None else 0)
        return max(0.0, 1.0 - free / size) if size else None
    except Exception:
        return None


def waiting_requests(scheduler):
    """The requests in the scheduler's waiting queue (admitted, not yet running: beyond the
    running-request cap or the KV pool's room); None where there is none. Never raises."""
    try:
        return len(scheduler.waiting_queue)
    except Exception:
        return None


def batch_state(ctx):
    """(context tokens, KV pool share in use) of a cycle, from what the hook passes (not a
    number: the profiler takes a number as it is)."""
    return context_tokens(ctx), kv_share(ctx)
