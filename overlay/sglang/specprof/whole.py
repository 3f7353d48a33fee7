"""Most cycles timed whole, read and folded without a `Cycle` (a part of the reader, reader.py).

Three decode cycles in four are timed whole (their first and last event) at the default
--speculative-profile-phases-every; `Reader.slot_read` makes a `Cycle` of each and the window
folds it (Window.add_cycle). Here the same figures go straight to the window's bucket
(Bucket.add_whole): no object made, about 2 us a cycle less on the scheduler's thread, where
the cycles are read at each hand-over (tests/test_whole_fold.py: the same windows either way).
"""

from __future__ import annotations


class WholeReading:
    def read_whole(self, s, window) -> bool:
        """Most cycles timed whole, read and folded into `window` without a `Cycle` (the same
        figures as `slot_read` and Window.add_cycle: Bucket.add_whole); False, with nothing
        done, for the others (`slot_read` then): a prefill, the first cycle after prefills or
        after a switch, one found drained before it was read, one with step times or in a
        kernel sample."""
        if (s.detail or s.kind != "decode" or s.switched or s.eager_steps or s.steps_key is not None
                or self.prefill_chain_bs or self.drain_pending):
            return False
        k = self.kernels
        if k is not None and s.seq in k.seqs:
            return False
        el = self.elapsed_held or self.backend.elapsed
        ev, host = s.h, s.host
        n = s.n
        h0 = host[0]
        span = s.span if self.span_held is not None else el(ev[0], ev[1]) if n > 1 else 0.0  # slot_ready read it
        s.span = span
        gap = period = gpu_period = None
        p = self.prev_done
        if p is not None and p.seq == s.seq - 1 and p.kind == "decode":
            gap = el(p.h[p.n - 1], ev[0])
            gpu_period = p.span + gap
            period = (h0 - p.host[0]) * 1000.0
        ms = span + (gap or 0.0)
        with self.lock:
            t = self.timing
            t["decode_cycles"] += 1
            t["decode_gpu_ms"] += ms
            i = self.decode_read
            self.decode_read = i + 1
            if s.steps is not None:
                self.unsettled_steps.append((i, s.steps, False))
            self.charged.append((i, window.index, s.bs, ms, s.steps))
        end = host[n - 1]
        window.add_whole(s.bs, s.steps, span, (end - h0) * 1000.0, gap, period, gpu_period, s.graph, s.gc_ms, h0,
                         end)
        if p is not None:
            self.recycle(p)
        self.prev_done = s
        return True
