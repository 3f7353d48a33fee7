"""--speculative-profile on UNO (0.5.20 and later): the target model drafts for itself, under a
LoRA adapter (`--uno-lora-path`), a block of proposals in one forward, and verifies them in a
second.

`UnoWorkerV2` has no draft worker and no hook of the series. A decode cycle of its
`forward_batch_generation` (`_forward_decode`, topk 1) is:
- draft_prep: the draft input (the seed and noise tokens, their positions) and its forward batch;
- draft: the target's forward under the adapter (`_run_draft_block`, which calls
  `_run_target_block`: that call is the draft's, not the verify's);
- verify_prep: the candidates sampled (or taken greedy) and the verify's forward batch;
- verify: the target's forward without the adapter (`_run_target_block`, outside the draft);
- accept: the accepted prefix, the correction and the next draft input, up to the cycle's end
  (`_accept_and_pack` or `run_uno_sampling`).
With topk > 1 (`_forward_decode_tree`) the draft is the same call, then the tree
(`build_eagle_verify_input`, whose series hook marks `tree` up to 0.5.20), the verify through
`run_eagle_verify` (the series' hooks mark verify_prep, verify and accept), and `pack` up to the
cycle's end (`pack_uno_tree_result`). A prefill cycle is the target's forward (target_extend).

The scheduler's idle housekeeping installs the profiler and wraps these methods on the worker's
instance (no patch line). Acceptance: the scheduler hands the accepted proposals to
`on_verify_complete_cpu` (BaseSpecWorker's, which does nothing here; wrapped: accept length
less UNO's two tokens that are not drafts) and commits the tokens where the series' commit hooks
settle them.
"""

from __future__ import annotations

from .wrapping import harvest_first, worker_cycle, verify_graph_runner, wrap

DRAFT_PREP = "draft_prep"
DRAFT = "draft"
VERIFY_PREP = "verify_prep"
VERIFY = "verify"
ACCEPT = "accept"
PACK = "pack"
TARGET = "target_extend"
MARKER = "specprof_uno"


def is_worker(worker) -> bool:
    """UNO's v2 worker (by its class, whatever module holds it)."""
    return type(worker).__name__ == "UnoWorkerV2"


def _graph_used(out):
    """Whether a `_run_*_block` result (result, predictions) replayed a graph; None: not said."""
    try:
        return getattr(out[0], "can_run_cuda_graph", None)
    except Exception:
        return None


def _draft_block(state: dict):
    """For `wrap` on `_run_draft_block`: `draft_prep` closed as it starts, `draft` as it returns;
    the target blocks it runs are the draft's (`state["depth"]`)."""
    def make(orig):
        def _run_draft_block(*args, **kwargs):
            p = state["p"]
            if p is None or not state["decode"]:
                return orig(*args, **kwargs)
            p.mark(DRAFT_PREP)
            state["depth"] += 1
            try:
                out = orig(*args, **kwargs)
            finally:
                state["depth"] -= 1
            p.mark(DRAFT)
            used = _graph_used(out)
            if used is not None:
                p.graph(DRAFT, bool(used))
            return out
        return _run_draft_block
    return make


def _target_block(state: dict, worker):
    """For `wrap` on `_run_target_block`: outside a draft block it is the verify (`verify_prep`
    closed as it starts, `verify` as it returns, its graph counted)."""
    def make(orig):
        def _run_target_block(*args, **kwargs):
            p = state["p"]
            if p is None or not state["decode"] or state["depth"]:
                return orig(*args, **kwargs)
            p.mark(VERIFY_PREP)
            out = orig(*args, **kwargs)
            p.mark(VERIFY)
            used = _graph_used(out)
            if used is not None:
                p.graph(VERIFY, bool(used), verify_graph_runner(worker.target_worker))
            return out
        return _run_target_block
    return make


def time_cycles(worker, profiler_of) -> bool:
    """Wrap the worker's cycle (on its instance) so that each decode and prefill is a cycle of the
    profiler `profiler_of()` gives at its start. False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, MARKER, False):
        return False
    state = {"p": None, "decode": False, "depth": 0}  # the cycle in flight; inside a draft block

    def _wrap(name, make):
        wrap(worker, name, make, MARKER)

    _wrap("_run_draft_block", _draft_block(state))
    _wrap("_run_target_block", _target_block(state, worker))
    _wrap("on_verify_complete_cpu", harvest_first(profiler_of))
    closing = PACK if getattr(worker, "tree_mode", False) else ACCEPT
    steps = getattr(worker, "speculative_num_steps", None)
    _wrap("forward_batch_generation", worker_cycle(profiler_of, state, steps, (closing, TARGET)))  # last
    return True
