"""--speculative-profile on the NGRAM worker: no draft model, drafts matched on the CPU.

A decode cycle of `NGRAMWorker.forward_batch_generation` is, in every release from 0.5.8:
the draft tokens matched against the n-gram cache on the host (`_prepare_draft_tokens`;
from 0.5.14, under overlap, it first copies the previous cycle's accepted tokens to the host,
upstream's wait for that cycle's verify, inside this phase), their tree's indices and
masks built and copied to the device (the rest of `_prepare_for_speculative_decoding`), the
target's verify forward (`target_worker.forward_batch_generation(..., is_verify=True)`), the
sampling and acceptance, and the cache updated with what was accepted (`_update_ngram_cache`,
`_update_ngram_corpus` from 0.5.10). Phases: ngram_match, verify_prep, verify, accept,
ngram_update. A prefill cycle is one target forward (target_extend).

No line of a patch is needed: the scheduler's idle housekeeping hands the Scheduler to
`hooks.idle` before the first request, which installs the profiler and wraps these methods
on the worker instance (and the verify forward on its target worker's instance, timed only
inside an NGRAM cycle).

Acceptance: up to 0.5.13.post1 the worker is v1-shaped (no overlap; its verify appends each
request's tokens, cut at a stop): a cycle's correct drafts are what each request's output
grew by, less the bonus token, counted where the cycle ends. From 0.5.14 it is a v2 worker:
the scheduler hands the correct drafts to `on_verify_complete_cpu` and commits the tokens
itself, where the commit hooks every series has settle them, as for EAGLE v2.
"""

from __future__ import annotations

from .wrapping import decoding, harvest_first, mark_after, wrap

MATCH = "ngram_match"
PREP = "verify_prep"
VERIFY = "verify"
ACCEPT = "accept"
UPDATE = "ngram_update"
EXTEND = "target_extend"
PHASES = (MATCH, PREP, VERIFY, ACCEPT, UPDATE)
UPDATE_METHODS = ("_update_ngram_corpus", "_update_ngram_cache")  # 0.5.10+, before


def worker_kind(worker) -> str:
    """"v2" where the scheduler hands the accepted lengths to the worker (0.5.14+), else "v1"."""
    return "v2" if hasattr(worker, "on_verify_complete_cpu") else "v1"


def _wrap(obj, name, make):
    wrap(obj, name, make, "specprof_ngram")


def time_cycles(worker, profiler_of) -> bool:
    """Wrap the NGRAM worker's cycle (on the instance) so that each decode and prefill is a
    cycle of the profiler `profiler_of()` gives at its start (the hooks' `P`, which a pause or
    an internal error replaces). False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, "specprof_ngram", False):
        return False
    v1 = worker_kind(worker) == "v1"
    state = {"p": None, "decode": False}  # the profiler and kind of the cycle in flight, else None

    def forward(orig):
        def forward_batch_generation(batch, *args, **kwargs):
            p = profiler_of()
            decode = decoding(batch) if p.enabled else None
            if decode is None:
                return orig(batch, *args, **kwargs)
            reqs = batch.reqs
            try:
                before = [len(r.output_ids) for r in reqs] if v1 and decode else None
            except Exception:  # never take the server down: this cycle's acceptance is not counted
                before = None
            p.begin("decode" if decode else "prefill", len(reqs), batch if decode else None)
            state["p"], state["decode"] = p, decode
            try:
                out = orig(batch, *args, **kwargs)
            finally:
                state["p"] = None
            p.mark(UPDATE if decode else EXTEND)
            p.end()
            if before is not None:
                # v1: the verify appended each request's tokens, cut at its stop: what it got
                p.harvest([len(r.output_ids) - b - 1 for r, b in zip(reqs, before)])
            return out
        return forward_batch_generation

    def update(orig):
        def method(*args, **kwargs):
            p = state["p"]
            if p is not None and state["decode"]:
                p.mark(ACCEPT)
            return orig(*args, **kwargs)
        return method

    def verify(orig):
        def forward_batch_generation(*args, **kwargs):
            out = orig(*args, **kwargs)
            p = state["p"]
            if p is not None and state["decode"] and kwargs.get("is_verify"):
                p.mark(VERIFY)
                runner = worker_runner(worker)
                p.graph("verify", getattr(out, "can_run_cuda_graph", False), runner)
            return out
        return forward_batch_generation

    _wrap(worker, "_prepare_draft_tokens", mark_after(state, MATCH))
    _wrap(worker, "_prepare_for_speculative_decoding", mark_after(state, PREP))
    for name in UPDATE_METHODS:
        if hasattr(worker, name):
            _wrap(worker, name, update)
            break
    target = worker.target_worker
    if not getattr(target.forward_batch_generation, "specprof_ngram", False):
        _wrap(target, "forward_batch_generation", verify)
    if not v1:
        _wrap(worker, "on_verify_complete_cpu", harvest_first(profiler_of))
    _wrap(worker, "forward_batch_generation", forward)  # last: its mark says the rest are in place
    return True


def worker_runner(worker):
    """The target's decode CUDA graph runner (its `bs` is the padded batch size replayed):
    `graph_runner` up to 0.5.13.post1, `decode_cuda_graph_runner` from 0.5.14."""
    runner = getattr(worker, "model_runner", None) or worker.target_worker.model_runner
    return getattr(runner, "decode_cuda_graph_runner", None) or getattr(runner, "graph_runner", None)
