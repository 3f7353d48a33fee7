"""Cycles timed whole are folded without a `Cycle` (Reader.read_whole, Bucket.add_whole), and
their marks are C callables that do nothing (Recorder.show_marks): the windows a profiler
writes are the same as when every cycle goes the long way (`slot_read`, Window.add_cycle),
under any mix of batch sizes, prefills, requests finishing, gaps, idle spells and graphs."""
import json
import random

import pytest

from fakes import FakeBackend
from sglang.specprof import reader as reader_mod
from sglang.specprof.folder import AT_HAND_OVER, INLINE
from sglang.specprof.profiler import Profiler
from sglang.specprof.slots import SKIP_CALL, SKIP_MARK

MARKS = ["draft_prep", "draft", "tree", "verify_prep", "verify", "accept", "draft_extend_prep", "draft_extend",
         "draft_extend_post"]


class Req:
    def __init__(self, max_new):
        self.output_ids = [0]
        self.finished_len = None
        self.is_retracted = False
        self.max_new = max_new

    def take(self, n):
        self.output_ids.extend([0] * n)
        if len(self.output_ids) >= self.max_new:
            self.finished_len = self.max_new


class SpanBackend(FakeBackend):
    """The GPU backend's way of reading (cuda_backend._hold_gil): a cycle's readiness asked as
    its first-to-last elapsed time, None while incomplete; every driver call counted."""

    def __init__(self):
        super().__init__()
        self.calls = {"query": 0, "elapsed": 0, "span": 0}

    def query(self, ev):
        self.calls["query"] += 1
        return super().query(ev)

    def elapsed(self, a, b):
        self.calls["elapsed"] += 1
        return super().elapsed(a, b)

    def span_held(self, a, b):
        self.calls["span"] += 1
        return b.t - a.t if a.done and b.done else None


class CountingBackend(SpanBackend):
    span_held = None


def serve(seed, reading, long_way, monkeypatch, phases_every=4, backend=None):
    """A v2 server's life from one seed: requests arriving in waves of random size and length,
    a prefill for each wave, decode cycles of what runs, idle spells; every window written."""
    if long_way:
        monkeypatch.setattr(reader_mod.Reader, "read_whole", lambda self, s, window: False)
    else:
        monkeypatch.undo()
    rnd = random.Random(seed)
    b = FakeBackend() if backend is None else backend
    out = []
    p = Profiler(b, interval=rnd.choice([7, 20, 50]), sink=out.append, config={"num_steps": 3, "worker": "v2"},
                 clock=b.clock, log_table=False, reading=reading, phases_every=phases_every)
    running: list = []
    done: set = set()
    for _ in range(rnd.randint(150, 400)):
        if not running or rnd.random() < 0.04:
            wave = [Req(rnd.randint(3, 40)) for _ in range(rnd.choice([1, 2, 5, 8, 13]))]
            p.begin("prefill", len(wave))
            b.advance(rnd.uniform(1, 5))
            p.mark("target_extend")
            b.advance(0.5)
            p.mark("draft_extend")
            p.end()
            b.advance(rnd.uniform(0.05, 1.0))
            running += wave
        if rnd.random() < 0.02:  # idle: longer than a window's idle close
            b.advance(0.1, 3000.0)
            p.idle()
        reqs = list(running)
        p.begin("decode", len(reqs))
        for name in MARKS:
            b.advance(rnd.uniform(0.05, 2.0), rnd.uniform(0.02, 2.5))
            if name == "draft":
                p.graph("draft", rnd.random() < 0.8, None)
            p.mark(name)
        p.draft_end()
        p.end()
        b.advance(rnd.uniform(0.0, 0.6))
        correct = [rnd.randint(0, 3) for _ in reqs]
        p.harvest(correct)
        p.commit_begin(reqs)
        for r, c in zip(reqs, correct):
            if r.finished_len is None:
                r.take(c + 1)
        p.commit_end()
        # under overlap a finished request rides one more cycle, skipped: a cycle of only those is drained
        late = rnd.random() < 0.5
        running = [r for r in running if r.finished_len is None or (late and r not in done)]
        done = {r for r in reqs if r.finished_len is not None}
    b.advance(0.1, 3000.0)
    p.idle()
    assert p.flush()
    return out, p.totals_now()


def canon(windows):
    """The windows without the wall clock's time of writing."""
    return [{k: v for k, v in w.items() if k != "time"} for w in json.loads(json.dumps(windows, default=str))]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("reading", [INLINE, AT_HAND_OVER])
def test_whole_cycles_fold_the_same_either_way(seed, reading, monkeypatch):
    short, short_totals = serve(seed, reading, False, monkeypatch)
    long, long_totals = serve(seed, reading, True, monkeypatch)
    assert len(short) >= 2
    assert canon(short) == canon(long)
    assert short_totals == long_totals
    assert short_totals["decode_cycles"] > 100 and short_totals["drain_cycles"] > 0


def test_the_short_way_is_taken_and_a_whole_cycles_marks_cost_no_frame(monkeypatch):
    taken = []
    real = reader_mod.Reader.read_whole
    monkeypatch.setattr(reader_mod.Reader, "read_whole", lambda self, s, w: taken.append(real(self, s, w)) or taken[-1])
    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False,
                 phases_every=4)
    seen = []
    for _ in range(40):
        p.begin("decode", 8)
        seen.append((p.cur.detail, p.mark, p.draft_end, p.draft_replay_end))
        b.advance(1.0)
        p.mark("verify")
        p.end()
        p.harvest([1] * 8)
    assert p.flush()
    assert taken.count(True) == 30  # three cycles in four are timed whole, each read the short way
    for detail, mark, draft_end, replay_end in seen:
        if detail:
            assert mark.__self__ is p.recorder and draft_end.__self__ is p.recorder
            assert replay_end.__self__ is p.recorder
        else:
            assert (mark, draft_end, replay_end) == (SKIP_MARK, SKIP_CALL, SKIP_CALL)
    w = p.folder.window.buckets["5-8"]
    assert w.cycles == 40 and len(w.gpu["verify"]._kept) + len(w.gpu["verify"]._new) == 10


def test_v1_keeps_its_marks_for_the_gate():
    """v1's `verify` and `accept` marks open and shut the folder's gate: its marks stay the
    recorder's in every cycle."""
    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v1"}, clock=b.clock, log_table=False,
                 phases_every=4)
    for _ in range(9):
        p.begin("decode", 4)
        assert p.mark.__self__ is p.recorder
        b.advance(1.0)
        p.mark("verify")
        assert p.gate.is_open
        p.mark("accept")
        assert not p.gate.is_open
        p.end()
        p.harvest([1] * 4)
    assert p.flush()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("reading", [INLINE, AT_HAND_OVER])
def test_readiness_read_as_the_span_writes_the_same_windows_with_fewer_calls(seed, reading, monkeypatch):
    """With `span_held` the readiness check is the cycle's first-to-last elapsed time: the same
    windows and totals as a query and the reads after it, and for each cycle timed whole two
    driver calls where there were three (a query, its span, the gap)."""
    before, after = CountingBackend(), SpanBackend()
    queried, q_totals = serve(seed, reading, False, monkeypatch, backend=before)
    spanned, s_totals = serve(seed, reading, False, monkeypatch, backend=after)
    before, after = before.calls, after.calls
    assert canon(spanned) == canon(queried)
    assert s_totals == q_totals
    assert before["span"] == 0 and after["query"] < before["query"] // 10  # only one-event slots are queried
    assert after["span"] + after["query"] == before["query"]  # one readiness call a slot, either way
    decode, phase = s_totals["decode_cycles"], s_totals["phase_cycles"]
    # each cycle timed whole read its span in the readiness call, not in one of its own
    assert before["elapsed"] - after["elapsed"] >= (decode - phase) * 9 // 10
    assert after["elapsed"] + after["span"] + after["query"] < before["elapsed"] + before["query"]


def test_a_cycle_not_complete_is_not_read_until_it_is():
    b = SpanBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False,
                 phases_every=4)
    b.hold = True
    for _ in range(6):
        p.begin("decode", 8)
        b.advance(1.0)
        p.mark("verify")
        p.end()
        p.harvest([1] * 8)
    p.flush(timeout=0.1)
    assert p.totals_now()["decode_cycles"] == 0 and b.calls["span"] >= 1
    b.release()
    assert p.flush()
    t = p.totals_now()
    assert t["decode_cycles"] == 6 and t["decode_gpu_ms"] == pytest.approx(6.0)


class Ptr:
    """What the GPU backend's `handle` makes of an event (a ctypes.c_void_p made once)."""
    __slots__ = ("ev",)

    def __init__(self, ev):
        self.ev = ev


class HandleBackend(SpanBackend):
    """The GPU backend's reads (cuda_backend._hold_gil): they take the slot's handles, never
    its events (which the driver's functions, called without argtypes, could not convert)."""

    handle = staticmethod(Ptr)

    def _ev(self, h):
        assert isinstance(h, Ptr), f"a read was given {type(h).__name__}, not the slot's handle"
        return h.ev

    def query_held(self, h):
        return self.query(self._ev(h))

    def elapsed_held(self, a, b):
        return self.elapsed(self._ev(a), self._ev(b))

    def span_held(self, a, b):
        return SpanBackend.span_held(self, self._ev(a), self._ev(b))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("reading", [INLINE, AT_HAND_OVER])
def test_the_reads_take_the_slots_handles_and_write_the_same_windows(seed, reading, monkeypatch):
    plain, p_totals = serve(seed, reading, False, monkeypatch, backend=SpanBackend())
    b = HandleBackend()
    handled, h_totals = serve(seed, reading, False, monkeypatch, backend=b)
    assert canon(handled) == canon(plain)
    assert h_totals == p_totals
    assert b.calls["span"] > 100 and b.calls["elapsed"] > 100


def test_eager_draft_steps_are_read_through_the_handles():
    """A draft run without its graph records its steps into the slot's own events (not handles):
    the read makes handles of them first, so a backend whose reads take handles only times them."""
    b = HandleBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False,
                 phases_every=1)
    for _ in range(5):
        p.begin("decode", 4)
        b.advance(0.1)
        for i, ms in enumerate((0.2, 0.3, 0.4)):
            p.draft_step(i)
            b.advance(ms)
        p.draft_step(3)
        p.mark("draft")
        b.advance(1.0)
        p.mark("verify")
        p.end()
        p.harvest([1] * 4)
    assert p.flush()
    steps = [s.stats() for s in p.folder.window.buckets["3-4"].steps]
    assert [s["n"] for s in steps] == [5, 5, 5]
    assert [s["mean"] for s in steps] == pytest.approx([0.2, 0.3, 0.4])
