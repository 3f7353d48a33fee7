"""--speculative-profile on FROZEN_KV_MTP (a Gemma 4 target whose assistant drafts over the
target's KV, frozen: the draft writes none of its own), every release that has it (0.5.12 on).

From 0.5.14 `FrozenKVMTPWorkerV2` is an `EAGLEWorkerV2` with a constructor and a cycle of its own:
a decode cycle of its `forward_batch_generation` is the draft (`draft_worker.draft`: the draft
input prepared, then the assistant's seed step and `num_steps - 1` recurrent steps in one graph
of its own runner, `cuda_graph_runner.execute`, or eager in `draft_forward`; then the tree,
`build_tree_kernel_efficient` and the verify input), the verify it inherits (`EAGLEWorkerV2.verify`,
through `run_eagle_verify` from 0.5.16: the series' hooks there mark verify_prep, verify with its
graph, and accept), and the draft extend (`_draft_extend_for_decode`: the next seed picked from
the verify's hidden states, no forward). Phases: draft, tree, verify_prep, verify, accept,
draft_extend; the draft graph's replays and eager runs counted as EAGLE's are. A prefill cycle is
the target's forward (target_extend) and the seed taken from the prompt (draft_extend).
Acceptance: the scheduler hands the correct drafts to `on_verify_complete_cpu`, EAGLEWorkerV2's,
where the series' hook already harvests them; the tokens are settled by the series' commit hooks.

In 0.5.12 and 0.5.13 SGLang runs the v1 `FrozenKVMTPWorker` (no overlap scheduler; the v2 class
there is a placeholder that raises): the worker drafts itself (`draft`: `cuda_graph_runner.replay`
or `draft_forward`, then the tree), verifies with its own `verify` (the target's verify forward,
wrapped for verify_prep and verify, then `EagleVerifyInput.verify`, which appends each request's
tokens; in 0.5.12 the series' v1 hook there marks accept, and the verify's return closes
free_kv, the KV of the rejected drafts freed; in 0.5.13, which has no v1 series, the return
closes accept), and `forward_draft_extend_after_decode` (draft_extend); a prefill is
`forward_target_extend` and `forward_draft_extend`. Its correct drafts are what each request's
output grew by (`wrapping.worker_cycle`).

The constructors do not call EAGLE's, so the series' install never runs: as for multi-layer
EAGLE, the scheduler's idle housekeeping installs the profiler and wraps these methods on the
worker's instances (no patch line).
"""

from __future__ import annotations

from .wrapping import mark_after, prefill_marks, target_forward, worker_cycle, wrap

DRAFT = "draft"
TREE = "tree"
ACCEPT = "accept"
FREE_KV = "free_kv"
EXTEND = "draft_extend"
TARGET = "target_extend"
MARKER = "specprof_frozen_kv"
V1 = "FrozenKVMTPWorker"  # 0.5.12 and 0.5.13


def is_worker(worker) -> bool:
    """A FROZEN_KV_MTP worker, v2 or v1 (by its class, whatever module holds it)."""
    return type(worker).__name__ in ("FrozenKVMTPWorkerV2", V1)


def worker_kind(worker) -> str:
    """"v1" for the v1 worker (its verify commits the tokens), else "v2"."""
    return "v1" if type(worker).__name__ == V1 else "v2"


def _accept_hooked() -> bool:
    """Whether the series' v1 hook marks accept inside `EagleVerifyInput.verify` (0.5.12)."""
    try:
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        code = EagleVerifyInput.verify.__code__
        return "specprof" in code.co_names and ACCEPT in code.co_consts
    except Exception:
        return False


def _draft_steps(state: dict, used: bool, runner=None):
    """For `wrap` on the draft graph's `execute` or `replay` (`used`) or the eager `draft_forward`: the
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


def time_cycles(worker, profiler_of, accept_hooked: bool | None = None) -> bool:
    """Wrap the worker's cycle (on its instances) so that each decode and prefill is a cycle of
    the profiler `profiler_of()` gives at its start. False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, MARKER, False):
        return False
    steps = getattr(worker, "speculative_num_steps", None)
    state = {"p": None, "decode": False}  # the profiler and kind of the cycle in flight

    def _wrap(obj, name, make):
        wrap(obj, name, make, MARKER)

    # the v1 worker drafts itself, its graph runner `replay`s; v2's draft worker `execute`s
    v1 = worker_kind(worker) == "v1"
    drafter = worker if v1 else worker.draft_worker
    runner = getattr(drafter, "cuda_graph_runner", None)  # None: no graph (one step, or disabled)
    if runner is not None:
        _wrap(runner, "replay" if v1 else "execute", _draft_steps(state, True, runner))
    _wrap(drafter, "draft_forward", _draft_steps(state, False))
    _wrap(drafter, "draft", mark_after(state, TREE))
    if v1:  # its verify is its own code: the target's verify forward, then EagleVerifyInput.verify
        if accept_hooked is None:
            accept_hooked = _accept_hooked()
        target = worker.target_worker
        _wrap(target, "forward_batch_generation", target_forward(state, target))
        _wrap(worker, "verify", mark_after(state, FREE_KV if accept_hooked else ACCEPT))
        _wrap(worker, "forward_draft_extend_after_decode", mark_after(state, EXTEND))
        _wrap(worker, "forward_draft_extend", prefill_marks(state, TARGET, EXTEND))
    else:  # the verify and its harvest are EAGLE v2's, with the series' hooks
        _wrap(drafter, "_draft_extend_for_decode", mark_after(state, EXTEND))
        _wrap(drafter, "_draft_extend_for_prefill", prefill_marks(state, TARGET, EXTEND))
    _wrap(worker, "forward_batch_generation", worker_cycle(profiler_of, state, steps, v1=v1))  # last: the rest in place
    return True
