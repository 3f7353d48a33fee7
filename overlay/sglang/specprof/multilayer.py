"""--speculative-profile on multi-layer EAGLE (`--enable-multi-layer-eagle`, or SGLang turning it
on for MiMoV2 and Step3p5 models): its v2 worker, in every release.

`MultiLayerEagleWorkerV2` drafts with the MTP layers inside its draft extend: a decode cycle of
its `forward_batch_generation` is the draft (`draft_worker.draft`: the draft input prepared and
`draft_forward`, which runs no model, only reorders the last extend's top-k), the tree
(`build_eagle_verify_input` from 0.5.16, inline in the draft before), from 0.5.20 the draft
extend's plan staged ahead of the verify (`_draft_extend_plan_for_decode`), the verify and the
draft extend, every MTP layer once (`_draft_extend_for_decode`). Phases: draft, tree,
[draft_extend_plan,] verify_prep, verify, accept, draft_extend. A prefill cycle is the target's
forward (target_extend) and the draft's extend over the prompt (draft_extend).

The verify: from 0.5.16 `run_eagle_verify`, shared with EAGLE, whose series hooks mark
verify_prep, verify and accept; up to 0.5.15 a `verify` of the worker's own, with no hook inside:
its target forward (`target_worker.forward_batch_generation(..., is_verify=True)`) is wrapped to
close verify_prep as it starts and verify as it returns (`wrapping.target_forward`), and the
method's return closes accept (the sampling, the bonus tokens, the draft input).

Its constructor is not EAGLE's and carries no hook: as for NGRAM, the scheduler's idle
housekeeping (before the first request) installs the profiler and wraps these methods on the
worker's instances. The tree mark comes from the series' hook in `build_eagle_verify_input`
where a release has it there (0.5.16 to 0.5.20), else from the draft's return. Acceptance: from
0.5.12 the scheduler hands the correct drafts to `on_verify_complete_cpu` (BaseSpecWorker's, which
does nothing here; wrapped); up to 0.5.11 the series harvests them where the scheduler resolves a
v2 batch's tokens, whatever its worker. The tokens are settled where the series' commit hooks see
the scheduler commit them. Up to 0.5.12 SGLang runs the v1 `MultiLayerEagleWorker` instead where
the overlap scheduler is off (0.5.8 to 0.5.10 unless SGLANG_ENABLE_SPEC_V2 is set, which SGLang
does itself for MiMoV2 and Step3p5; 0.5.11 and 0.5.12 with --disable-overlap-schedule, topk > 1
or SGLANG_ENABLE_SPEC_V2=0): the startup check refuses the flag there in one sentence
(`server_args.multi_layer_v1`).
"""

from __future__ import annotations

from .wrapping import harvest_first, mark_after, prefill_marks, target_forward, worker_cycle, wrap

DRAFT = "draft"
TREE = "tree"
ACCEPT = "accept"
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


def _own_verify(worker) -> bool:
    """Whether the worker verifies with code of its own (up to 0.5.15), not through the series'
    hooked `run_eagle_verify` (0.5.16 on)."""
    verify = getattr(type(worker), "verify", None)
    code = getattr(verify, "__code__", None)
    return code is not None and "run_eagle_verify" not in code.co_names


def time_cycles(worker, profiler_of, tree_hooked: bool | None = None, own_verify: bool | None = None) -> bool:
    """Wrap the worker's cycle (on its instances) so that each decode and prefill is a cycle of
    the profiler `profiler_of()` gives at its start (the hooks' `P`, which a pause or an internal
    error replaces). False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, MARKER, False):
        return False
    if tree_hooked is None:
        tree_hooked = _tree_hooked()
    if own_verify is None:
        own_verify = _own_verify(worker)
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
    if own_verify:  # up to 0.5.15: no hook of the series inside
        target = worker.target_worker
        _wrap(target, "forward_batch_generation", target_forward(state, target))
        _wrap(worker, "verify", mark_after(state, ACCEPT))
    if hasattr(worker, "on_verify_complete_cpu"):  # 0.5.12 on (before, the series harvests in the scheduler)
        _wrap(worker, "on_verify_complete_cpu", harvest_first(profiler_of))
    _wrap(worker, "forward_batch_generation", worker_cycle(profiler_of, state, steps))  # last: its mark says the rest are in place
    return True
