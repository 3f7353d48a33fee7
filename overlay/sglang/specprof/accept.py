"""The profiler's acceptance hooks: what each request of a cycle took, as the scheduler commits it.

A part of `Profiler` (profiler.py): v1 counts a cycle's correct drafts where they reach the
CPU (`harvest`), its verify having cut each request at its stop; v2 hands every request of
the batch there, and the scheduler's commit (`commit_begin` / `commit_end`) says how many
tokens reached each request, which is what the clients receive. Each cycle's lists settle
in the profiler's settlement (`_add_accept` is `Settlement.settle`, settlement.py), which
counts the tokens and closes the window at its interval.
"""

from __future__ import annotations


class AcceptHooks:
    def harvest(self, correct_per_req=None):
        """Where the cycle's correct drafts per request reach the CPU.

        v1 counts them here: its verify has already cut each request at its stop and skipped
        finished ones. v2 hands every request of the batch, so its list waits for the
        scheduler's commit (`commit_begin` / `commit_end`), which says what reached each
        request; a list whose commit never came is counted whole when the next one arrives."""
        if self.open_at_end:  # the wait for the GPU is over (Gate.shut, inline)
            g = self.gate
            g.is_open = False
            g.busy = True
        if correct_per_req is None:
            return
        try:
            correct = list(correct_per_req)
            if self.settle_on_commit:
                un = self.unsettled
                while un:
                    self.uncut_cycles += 1
                    self._add_accept(un.popleft())
                un.append(correct)
            else:
                self._add_accept(correct)
        except Exception as e:
            self._fail(e)

    def commit_begin(self, reqs):
        """v2, in the scheduler, before it appends the cycle's tokens to each request: which
        requests will take them (upstream skips finished and retracted ones) and what each
        request's client has so far."""
        try:
            if not self.unsettled:
                return
            correct = self.unsettled.popleft()
            if len(correct) != len(reqs):  # not this batch's list: count it whole, as before
                self.uncut_cycles += 1
                self._add_accept(correct)
                return
            # what each request's client has: its output up to the stop, as upstream sends it
            # (a finished or retracted request is skipped by upstream: it gets nothing)
            self.open_commit = (reqs, correct, [len(r.output_ids) if r.finished_len is None else r.finished_len
                                                for r in reqs])
        except Exception as e:
            self._fail(e)

    def commit_end(self):
        """v2, after the scheduler committed the cycle's tokens and checked each stop."""
        c = self.open_commit
        if c is None:
            return
        self.open_commit = None
        try:
            reqs, correct, before = c
            took, got = [], []
            for r, k, b in zip(reqs, correct, before):
                n = r.finished_len
                n = (len(r.output_ids) if n is None else n) - b
                if n > 0:  # a request upstream commits to takes one token at least (the bonus)
                    took.append(k)
                    got.append(n)
            self._add_accept(took, got, len(reqs) - len(took))
        except Exception as e:
            self._fail(e)
