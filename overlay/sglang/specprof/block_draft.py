"""--speculative-profile on the block drafters: DFLASH and DSPARK, every release that has them
(DFLASH 0.5.11 on, DSPARK 0.5.16 on).

Both draft a whole block of tokens in one forward of their draft model, over the target's hidden
states written into the draft's KV cache, and verify the block with one target forward; neither
has an EAGLE draft worker or a hook of the series. A decode cycle of `DFlashWorkerV2` /
`DSparkWorkerV2.forward_batch_generation` is:
- draft_prep: the block's inputs (the bonus token and mask tokens, their embeddings, positions
  and cache locations; DSPARK's proposer plans the block);
- draft: the draft model's forward over the block (`draft_model_runner.forward`, a graph or
  eager: counted as EAGLE's draft replays are);
- verify_prep: the block sampled from the draft's logits and the verify's input prepared;
- verify: the target's forward over the block (`target_worker.forward_batch_generation` with
  `is_verify=True`, a graph or eager);
- accept: the accepted prefix and the bonus token found (DSPARK: `accept_and_finalize`);
- draft_kv: the verified tokens' target hidden states projected into the draft's KV cache
  (DFLASH: `_append_target_hidden_to_draft_kv_by_loc`, DSPARK: `commit_hidden`). Where a release
  folds a step into a graph (DSPARK 0.5.23's sampling-accept graph, and its commit folded into
  it), the phases it holds merge into the next one marked, and a cycle whose draft KV was not
  written by a wrapped call is closed by `accept` as it ends.
A prefill cycle is the target's forward (target_extend) and the prompt's hidden states written
into the draft's KV (draft_kv).

The scheduler's idle housekeeping installs the profiler and wraps these methods on the instances
(the worker, its draft model runner, its target worker; DSPARK's verify executor and KV
injector), with no patch line. Acceptance: the scheduler hands the correct drafts to
`on_verify_complete_cpu` (BaseSpecWorker's, which does nothing here; wrapped) and commits the
tokens where the series' commit hooks settle them.

DFLASH up to 0.5.13 is `DFlashWorker`, a v1 worker of its own (no overlap scheduler): the same
phases, from its draft model runner's `forward`, the target's verify forward and
`_append_target_hidden_to_draft_kv` (counted as accept / draft_kv after the cycle's verify only:
the append of the last verify's tokens before the block's draft stays in draft_prep); its verify
appends each request's tokens, whose growth is the correct drafts (`wrapping.worker_cycle`).
"""

from __future__ import annotations

from .wrapping import harvest_first, mark_after, target_forward, worker_cycle, wrap

DRAFT_PREP = "draft_prep"
DRAFT = "draft"
VERIFY_PREP = "verify_prep"
VERIFY = "verify"
ACCEPT = "accept"
DRAFT_KV = "draft_kv"
TARGET = "target_extend"
MARKER = "specprof_block"
V1 = "DFlashWorker"  # DFLASH 0.5.11 to 0.5.13: a v1 worker of its own
WORKERS = ("DFlashWorkerV2", "DSparkWorkerV2", V1)


def is_worker(worker) -> bool:
    """A DFLASH or DSPARK worker (by its class, whatever module holds it)."""
    return type(worker).__name__ in WORKERS


def worker_kind(worker) -> str:
    """"v1" for DFLASH's v1 worker (its verify commits the tokens), else "v2"."""
    return "v1" if type(worker).__name__ == V1 else "v2"


def _draft_forward(state: dict):
    """For `wrap` on the draft model runner's `forward`: `draft_prep` closed as the block's
    forward starts, `draft` as it returns, the graph replayed or not counted."""
    def make(orig):
        def forward(*args, **kwargs):
            p = state["p"]
            if p is None or not state["decode"]:
                return orig(*args, **kwargs)
            p.mark(DRAFT_PREP)
            state["kv"] = False  # until a wrapped call writes the draft's KV
            out = orig(*args, **kwargs)
            p.mark(DRAFT)
            used = getattr(out, "can_run_graph", None)
            if used is not None:
                p.graph(DRAFT, bool(used))
            return out
        return forward
    return make


def _kv_step(state: dict, accept_before: bool = False, in_decode: bool = True, after_verify: bool = False):
    """For `wrap` on a step that writes the target's hidden states into the draft's KV: `draft_kv`
    closed as it returns, in a prefill and (`in_decode`) a decode cycle; in a decode cycle
    `accept` closed as it starts (`accept_before`: where no wrapper of the acceptance did), and
    (`after_verify`) only once the cycle's verify returned."""
    def make(orig):
        def method(*args, **kwargs):
            p = state["p"]
            if p is not None and state["decode"] and (not in_decode or after_verify and not state["verified"]):
                # DSPARK's injector inside commit_hidden, which marks it; DFLASH v1's append of
                # the last cycle's tokens before the block's draft (part of draft_prep)
                p = None
            if p is not None and state["decode"] and accept_before:
                p.mark(ACCEPT)
            out = orig(*args, **kwargs)
            if p is not None:
                p.mark(DRAFT_KV)
                state["kv"] = True
            return out
        return method
    return make


def time_cycles(worker, profiler_of) -> bool:
    """Wrap the worker's cycle (on its instances) so that each decode and prefill is a cycle of
    the profiler `profiler_of()` gives at its start. False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, MARKER, False):
        return False
    state = {"p": None, "decode": False, "kv": True}  # the cycle in flight; its draft KV marked
    target = worker.target_worker

    def _wrap(obj, name, make):
        wrap(obj, name, make, MARKER)

    _wrap(worker.draft_model_runner, "forward", _draft_forward(state))
    _wrap(target, "forward_batch_generation", target_forward(state, target, TARGET))
    if worker_kind(worker) == "v1":  # the same phases; the tokens committed inside its verify
        _wrap(worker, "_append_target_hidden_to_draft_kv", _kv_step(state, accept_before=True, after_verify=True))
        _wrap(worker, "forward_batch_generation", worker_cycle(profiler_of, state, None, v1=True))  # last
        return True
    if type(worker).__name__ == "DSparkWorkerV2":
        executor = worker._verify_executor
        _wrap(executor, "accept_and_finalize", mark_after(state, ACCEPT))
        _wrap(executor, "commit_hidden", _kv_step(state))
        injector = worker._kv_injector
        for name in ("inject_target_hidden", "inject_prefill"):  # a prefill's (the latter 0.5.23)
            if hasattr(injector, name):
                _wrap(injector, name, _kv_step(state, in_decode=False))
    else:
        _wrap(worker, "_append_target_hidden_to_draft_kv_by_loc", _kv_step(state, accept_before=True))
    _wrap(worker, "on_verify_complete_cpu", harvest_first(profiler_of))
    steps = getattr(worker, "speculative_num_steps", None)
    closing = (lambda: None if state["kv"] else ACCEPT, None)  # a decode whose acceptance and KV a graph held
    _wrap(worker, "forward_batch_generation", worker_cycle(profiler_of, state, steps, closing))  # last: the rest in place
    return True
