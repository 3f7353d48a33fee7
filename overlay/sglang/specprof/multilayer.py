"""--speculative-profile on multi-layer EAGLE (`--enable-multi-layer-eagle`, or SGLang turning it
on for MiMoV2 and Step3p5 models), 0.5.16 and later.

`MultiLayerEagleWorkerV2` drafts with the MTP layers inside its draft extend: a decode cycle of
its `forward_batch_generation` is the draft (`draft_worker.draft`: the draft input prepared and
`draft_forward`, which runs no model, only reorders the last extend's top-k), the tree
(`build_eagle_verify_input`), from 0.5.20 the draft extend's plan staged ahead of the verify
(`_draft_extend_plan_for_decode`), the verify (`run_eagle_verify`, shared with EAGLE: its hooks
mark verify_prep, verify and accept), and the draft extend, every MTP layer once
(`_draft_extend_for_decode`). Phases: draft, tree, [draft_extend_plan,] verify_prep, verify,
accept, draft_extend. A prefill cycle is the target's forward (target_extend) and the draft's
extend over the prompt (draft_extend).

Its constructor is not EAGLE's and carries no hook: as for NGRAM, the scheduler's idle
housekeeping (before the first request) installs the profiler and wraps these methods on the
worker's instances. The tree mark comes from the series' hook in `build_eagle_verify_input`
where a release has it there (0.5.16 to 0.5.20), else from the draft's return. Acceptance: the
scheduler hands the correct drafts to `on_verify_complete_cpu` (BaseSpecWorker's, which does
nothing here) and commits the tokens where the series' commit hooks settle them. Up to 0.5.15
the worker verifies with code of its own (no hook inside) and 0.5.12's v1 worker has its own
tree: the startup check refuses the flag there (`server_args.MULTI_LAYER_FROM`).
"""

from __future__ import annotations

from .wrapping import harvest_first, mark_after, prefill_marks, v2_cycle, wrap

DRAFT = "draft"
TREE = "tree"
PLAN = "draft_extend_plan"
EXTEND = "draft_extend"
TARGET = "target_extend"
MARKER = "specprof_multilayer"


def is_worker(worker) -> bool:
    """The multi-layer EAGLE v2 worker (by its class, whatever module holds it)."""
    return type(worker).__name__ == "MultiLayerEagleWorkerV2"


def _tree_hooked() -> bool:
    """Whether the series' hook marks the tree inside `build_eagle_verify_input` (0.5.16 to 0.5.20;
    0.5.21 moved it into the EAGLE worker's draft)."""
    try:
        from sglang.srt.speculative import eagle_worker_common as common

        code = common.build_eagle_verify_input.__code__
        return "specprof" in code.co_names and TREE in code.co_consts
    except Exception:
        return False


def time_cycles(worker, profiler_of, tree_hooked: bool | None = None) -> bool:
    """Wrap the worker's cycle (on its instances) so that each decode and prefill is a cycle of
    the profiler `profiler_of()` gives at its start (the hooks' `P`, which a pause or an internal
    error replaces). False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, MARKER, False):
        return False
    if tree_hooked is None:
        tree_hooked = _tree_hooked()
    draft_worker = worker.draft_worker
    steps = getattr(worker, "speculative_num_steps", None)
    state = {"p": None, "decode": False}  # the profiler and kind of the cycle in flight

    def _wrap(obj, name, make):
        wrap(obj, name, make, MARKER)

    _wrap(draft_worker, "draft_forward", mark_after(state, DRAFT))
    if not tree_hooked:
        _wrap(draft_worker, "draft", mark_after(state, TREE))
    if hasattr(draft_worker, "_draft_extend_plan_for_decode"):  # 0.5.20+
        _wrap(draft_worker, "_draft_extend_plan_for_decode", mark_after(state, PLAN))
    _wrap(draft_worker, "_draft_extend_for_decode", mark_after(state, EXTEND))
    _wrap(draft_worker, "_draft_extend_for_prefill", prefill_marks(state, TARGET, EXTEND))
    _wrap(worker, "on_verify_complete_cpu", harvest_first(profiler_of))
    _wrap(worker, "forward_batch_generation", v2_cycle(profiler_of, state, steps))  # last: its mark says the rest are in place
    return True
