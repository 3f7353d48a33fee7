"""The profiler the hooks call when --speculative-profile is off (and after an internal error,
or while paused): every hook a series calls, each doing nothing. `Profiler` (profiler.py)
takes its place with the flag on; tests/test_series.py checks each series' calls against
both."""

from __future__ import annotations


class NullProfiler:
    """What the hooks call when --speculative-profile is off: each method does nothing."""

    enabled = False

    def begin(self, kind, bs, ctx=None, steps=None):
        pass

    def mark(self, name):
        pass

    def draft_end(self):
        pass

    def end(self):
        pass

    def draft_step(self, i):
        pass

    def graph(self, which, used, runner=None):
        pass

    def draft_replay_begin(self, runner, bs, variant=None):
        pass

    def draft_replay_end(self):
        pass

    def capture_begin(self, runner, bs, variant=None):
        pass

    def capture_end(self):
        pass

    def harvest(self, correct_per_req=None):
        pass

    def commit_begin(self, reqs):
        pass

    def commit_end(self):
        pass

    def idle(self):
        pass

    def latest(self):
        return None

    def catch_up(self, timeout=0.05):
        pass

    def totals_now(self):
        return None
