"""--speculative-profile on FROZEN_KV_MTP (a Gemma 4 target whose assistant drafts over the
target's KV, frozen: the draft writes none of its own), 0.5.14 and later.

`FrozenKVMTPWorkerV2` is an `EAGLEWorkerV2` with a constructor and a cycle of its own: a decode
cycle of its `forward_batch_generation` is the draft (`draft_worker.draft`: the draft input
prepared, then the assistant's seed step and `num_steps - 1` recurrent steps in one graph of its
own runner, `cuda_graph_runner.execute`, or eager in `draft_forward`; then the tree,
`build_tree_kernel_efficient` and the verify input), the verify it inherits (`EAGLEWorkerV2.verify`,
through `run_eagle_verify` from 0.5.16: the series' hooks there mark verify_prep, verify with its
graph, and accept), and the draft extend (`_draft_extend_for_decode`: the next seed picked from
the verify's hidden states, no forward). Phases: draft, tree, verify_prep, verify, accept,
draft_extend; the draft graph's replays and eager runs counted as EAGLE's are. A prefill cycle is
the target's forward (target_extend) and the seed taken from the prompt (draft_extend).

Its constructor does not call EAGLE's, so the series' install never runs: as for multi-layer
EAGLE, the scheduler's idle housekeeping installs the profiler and wraps these methods on the
worker's instances (no patch line). Acceptance: the scheduler hands the correct drafts to
`on_verify_complete_cpu`, EAGLEWorkerV2's, where the series' hook already harvests them; the
tokens are settled by the series' commit hooks. Up to 0.5.13 the worker is a v1 worker of its
own (its verify carries no hook): the startup check refuses the flag there
(`server_args.FROZEN_KV_FROM`).
"""

from __future__ import annotations

from .wrapping import mark_after, prefill_marks, v2_cycle, wrap

DRAFT = "draft"
TREE = "tree"
EXTEND = "draft_extend"
TARGET = "target_extend"
MARKER = "specprof_frozen_kv"


def is_worker(worker) -> bool:
    """The FROZEN_KV_MTP v2 worker (by its class, whatever module holds it)."""
    return type(worker).__name__ == "FrozenKVMTPWorkerV2"


def _draft_steps(state: dict, used: bool, runner=None):
    """For `wrap` on the draft graph's `execute` (`used`) or the eager `draft_forward`: the
    assistant's steps end `draft`, and the profile counts the graph replayed or not."""
    def make(orig):
        def method(*args, **kwargs):
            out = orig(*args, **kwargs)
            p = state["p"]
            if p is not None and state["decode"]:
                p.mark(DRAFT)
                p.graph(DRAFT, used, runner)
            return out
        return method
    return make


def time_cycles(worker, profiler_of) -> bool:
    """Wrap the worker's cycle (on its instances) so that each decode and prefill is a cycle of
    the profiler `profiler_of()` gives at its start. False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, MARKER, False):
        return False
    draft_worker = worker.draft_worker
    steps = getattr(worker, "speculative_num_steps", None)
    state = {"p": None, "decode": False}  # the profiler and kind of the cycle in flight

    def _wrap(obj, name, make):
        wrap(obj, name, make, MARKER)

    runner = getattr(draft_worker, "cuda_graph_runner", None)  # None: no graph (one step, or disabled)
    if runner is not None:
        _wrap(runner, "execute", _draft_steps(state, True, runner))
    _wrap(draft_worker, "draft_forward", _draft_steps(state, False))
    _wrap(draft_worker, "draft", mark_after(state, TREE))
    _wrap(draft_worker, "_draft_extend_for_decode", mark_after(state, EXTEND))
    _wrap(draft_worker, "_draft_extend_for_prefill", prefill_marks(state, TARGET, EXTEND))
    _wrap(worker, "forward_batch_generation", v2_cycle(profiler_of, state, steps))  # last: the rest are in place
    return True
