"""Where the profiler's open window ends: the one place that decides it.

A part of `Profiler` (profiler.py), on the scheduler's thread. Each decode cycle's
acceptance settles here (`settle`, called by the acceptance hooks in accept.py), which
counts the committed tokens and the window's decode cycles; the window closes after its
`interval`-th, or (`idle`) once the server sat idle IDLE_CLOSE_S with cycles in it. A
close queues the window's fields that live on this thread (the close record) with the
items the profiler's recorder holds (recorder.py); the folder closes the window from them
(folder.py). Under --speculative-adaptive the step-count changes between decode cycles are
kept here too (`switched`) and go with the close record; a switch does not close a window.
"""

from __future__ import annotations

import time

from sglang_specprof.schema import SCHEMA

# A window holding decode cycles closes after the server sat fully idle this long. Not 1 s:
# with --sleep-on-idle upstream's idle housekeeping runs once a second (its poll's timeout),
# so a threshold of 1 s falls where the calls do, and under tensor parallelism (whose ranks
# loop in step) one rank could close at a call where another does not; here each rank
# closes at the third call, 2 s in, half a second past the threshold.
IDLE_CLOSE_S = 1.5
SWITCHES_KEPT = 256  # step-count changes a window keeps (--speculative-adaptive); beyond, counted


class Settlement:
    """The open window's count of settled decode cycles, its close, and the close record."""

    def __init__(self, profiler, interval: int, adaptive: bool):
        self.p = profiler
        self.rec = profiler.recorder  # the held items, the cycle in flight and its counts (slots.py)
        self.interval = interval
        self.adaptive = adaptive
        self.window_index = 0  # windows handed to the folder to close
        self.window_decode = 0  # decode cycles settled into the open window
        self.idle_seen = None  # (window, decode cycles in it, host time) where `idle` last found it
        # --speculative-adaptive: each change of the step count between decode cycles (which
        # batch size, from and to, when), SWITCHES_KEPT a window at most, the rest counted
        self.last_steps = None
        self.switches: list = []
        self.switches_over = 0
        # The tokens since start, counted on this thread where they are committed, so that
        # any two reads of /server_info give the exact totals between them (the cycles and
        # their GPU time are the reader's).
        self.tokens = {"committed_tokens": 0, "verified_requests": 0, "skipped_requests": 0, "cut_tokens": 0}

    def settle(self, correct, committed=None, skipped=0):
        """One decode cycle's acceptance. `correct`: correct drafts of each request that took
        the cycle's tokens; `committed`: the tokens each of them got (correct + 1 unless cut at
        a stop; UNO commits two tokens beside the drafts). The window closes after its
        `interval`-th."""
        if committed is None:
            committed = [c + 1 for c in correct]
        t = self.tokens
        got = sum(committed)
        t["committed_tokens"] += got
        t["verified_requests"] += len(correct)
        t["skipped_requests"] += skipped
        cut = sum(correct) + len(correct) - got  # below 0 where a request took more than its drafts and one
        t["cut_tokens"] += cut if cut >= 0 else sum(max(c + 1 - k, 0) for c, k in zip(correct, committed))
        self.rec.items.append(("accept", correct, committed, skipped))
        self.window_decode = n = self.window_decode + 1  # one line: the hot path's line budget (test_profiler)
        if n >= self.interval:
            self.close()

    def switched(self, bs, steps) -> bool:
        """The step count changed between decode cycles: kept for the window; True but for the first."""
        old, self.last_steps = self.last_steps, steps
        if old is None:
            return False
        if len(self.switches) < SWITCHES_KEPT:
            self.switches.append({"t_s": round(self.p.clock(), 6), "bs": bs, "from": old, "to": steps})
        else:
            self.switches_over += 1
        return True

    def idle(self):
        """Upstream's idle housekeeping (see `Profiler.idle`): once no decode cycle has settled
        for IDLE_CLOSE_S, and no cycle or acceptance is half done, the open window closes with
        the cycles it has."""
        n = self.window_decode
        p = self.p
        if not n or self.rec.cur is not None or p.unsettled or p.open_commit is not None:
            return
        try:
            now = p.clock()
            seen = self.idle_seen
            if seen is None or seen[0] != self.window_index or seen[1] != n:
                self.idle_seen = (self.window_index, n, now)  # cycles ran since: idle from here
            elif now - seen[2] >= IDLE_CLOSE_S:
                self.idle_seen = None
                self.close(idle=True)
        except Exception as e:
            p._fail(e)

    def close(self, idle=False):
        """O(1) here: the close record goes with the last items to the folder, which closes the
        window and hands it to the outputs. `idle`: closed by `idle`, with fewer decode cycles
        than the interval."""
        p = self.p
        self.rec.items.append(("close", self.record(idle)))
        if self.adaptive:
            self.switches = []
            self.switches_over = 0
        p.window_closed(self.window_index)
        self.window_index += 1
        self.window_decode = 0

    def record(self, idle: bool) -> dict:
        """The window's fields that live on the scheduler's thread, for the folder's close."""
        p, rec = self.p, self.rec
        g = p.graphs
        return {
            "schema": SCHEMA,
            "rank": p.rank,
            "time": round(time.time(), 3),
            "config": p.config,
            "graphs": {"draft_replays": g.total_replays(), "steps_read_late": g.read_late,
                       "eager": dict(rec.eager),
                       "capture_s": {k: dict(v) for k, v in g.capture_s.items()}},
            "marks_lost": rec.marks_lost,
            "uncut_cycles": p.uncut_cycles,
            "closed_idle": idle,
            "dropped": rec.dropped,
            "tokens": dict(self.tokens),
            **({"adaptive": {"steps": self.last_steps, "switches": self.switches,
                             "switches_not_kept": self.switches_over,
                             "policy": None if p.policy is None else p.policy.state()}}
               if self.adaptive else {}),
        }
