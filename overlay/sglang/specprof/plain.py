"""--speculative-profile on a server without speculation: each forward timed whole.

What a step-0 speculative cycle costs is only known against a plain decode of the same batch
size on the same model; with the flag on a server without --speculative-algorithm, each
decode forward is one cycle of one phase (`target_decode`), each prefill one of
`target_extend`, and the scheduler's commit (the hook every series has) gives each request
its one token, so `sglang-specprof compare` puts the two side by side.

No line of a patch is needed for it: the scheduler's idle housekeeping hands the Scheduler to
`hooks.idle` before the first request, which installs this profiler and wraps the model
worker's `forward_batch_generation` on that instance (the scheduler calls it in every release
from 0.5.8, inside its forward stream under overlap).
"""

from __future__ import annotations

from .profiler import Profiler
from .wrapping import decoding, wrap

DECODE_PHASE = "target_decode"
EXTEND_PHASE = "target_extend"


class PlainProfiler(Profiler):
    """A cycle is one forward; a committed decode gave each request one token, no drafts."""

    def commit_begin(self, reqs):
        # under overlap the next forward is launched before this batch's result is processed:
        # the acceptance is settled here, where the batch's own commit is
        self.harvest([0] * len(reqs))
        Profiler.commit_begin(self, reqs)


def time_forwards(worker, profiler_of) -> bool:
    """Wrap `worker.forward_batch_generation` (on the instance) so that each decode and prefill
    forward is a cycle of the profiler `profiler_of()` gives at the call (the hooks' `P`, which
    a pause or an internal error replaces). False where it was already wrapped."""
    if getattr(worker.forward_batch_generation, "specprof_plain", False):
        return False

    def make(orig):
        def forward_batch_generation(batch, *args, **kwargs):
            p = profiler_of()
            decode = decoding(batch) if p.enabled else None
            try:
                bs = len(batch.seq_lens)
            except Exception:  # never take the server down: an odd batch passes through untimed
                decode = None
            if decode is None:
                return orig(batch, *args, **kwargs)
            p.begin("decode" if decode else "prefill", bs, batch if decode else None)
            out = orig(batch, *args, **kwargs)
            p.mark(DECODE_PHASE if decode else EXTEND_PHASE)
            p.end()
            return out
        return forward_batch_generation

    wrap(worker, "forward_batch_generation", make, "specprof_plain")
    return True
