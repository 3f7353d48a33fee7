"""The timing subsystem on the CPU: fake events on a fake clock, the real profiler code."""
import json
import os
import logging
import multiprocessing
import tracemalloc

import pytest

from fakes import FakeBackend
from sglang.specprof import hooks, profiler as profiler_mod
from sglang_specprof import schema
from sglang.specprof.folder import AT_HAND_OVER, INLINE, READER_THREAD
from sglang.specprof.jsonl import JsonlSink
from sglang.specprof.profiler import POOL, NullProfiler, Profiler
from sglang.specprof.ranks import RankExchange
from sglang_specprof.table import format_summary
from sglang_specprof.window import Series, bucket_of, percentile

PHASES = [("draft_prep", 0.5), ("draft", 0.7), ("tree", 0.1), ("verify", 6.0), ("accept", 0.3), ("draft_extend", 1.0)]


def run_cycle(p, b, bs=1, correct=None, phases=PHASES, gap=0.4, steps=(0.2, 0.2, 0.2), host_scale=1.0,
              harvest=True):
    p.begin("decode", bs)
    for name, ms in phases:
        if name == "draft" and steps:
            b.advance(ms - sum(steps), (ms - sum(steps)) * host_scale)
            for i, st in enumerate(steps):
                p.draft_step(i)
                b.advance(st, st * host_scale)
            p.draft_step(len(steps))
        else:
            b.advance(ms, ms * host_scale)
        p.mark(name)
    p.end()
    b.advance(gap, gap * host_scale)
    if harvest:
        p.harvest([2] * bs if correct is None else correct)


def run_overlapped(p, b, n, last=True):
    """`n` cycles as v2 runs them: each one's result comes after the next cycle launched (the
    last one's too, with `last`)."""
    for i in range(n):
        run_cycle(p, b, harvest=False)
        if i:
            p.harvest([2])
    if last:
        p.harvest([2])


@pytest.fixture
def fake():
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=10, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False)
    return p, b, out


def test_phases_add_up_to_the_cycle(fake):
    p, b, out = fake
    for _ in range(11):
        run_cycle(p, b)
    (s,) = out
    bucket = s["buckets"]["1"]
    got = {n: ph["gpu_ms"]["mean"] for n, ph in bucket["phases"].items()}
    assert got == pytest.approx(dict(PHASES))
    assert list(got) == [n for n, _ in PHASES]  # in cycle order
    assert bucket["cycle_gpu_ms"]["mean"] == pytest.approx(8.6)
    assert sum(ph["share"] for ph in bucket["phases"].values()) == pytest.approx(1.0, abs=1e-3)
    assert bucket["between_cycles_gpu_ms"]["mean"] == pytest.approx(0.4)
    assert bucket["cycle_wall_ms"]["mean"] == pytest.approx(9.0)
    assert bucket["cycle_period_gpu_ms"]["mean"] == pytest.approx(9.0)
    assert bucket["between_cycles_share"] == pytest.approx(0.4 / 9.0, abs=1e-4)
    assert [st["mean"] for st in bucket["draft_steps_gpu_ms"]] == pytest.approx([0.2, 0.2, 0.2])


def test_every_hook_is_the_profilers_own_and_its_state_has_one_place(fake):
    """No hook of a profiler falls through to the null profiler's, which does nothing: each is
    its class's or its recorder's (handed out bound, profiler.RECORDER_HOOKS); the recorder's
    state read through the profiler is the recorder's, rebound there."""
    p, b, out = fake
    for name in vars(NullProfiler):
        hook = getattr(p, name)
        if not name.startswith("_") and callable(hook):
            assert getattr(hook, "__func__", None) is not getattr(NullProfiler, name), name
    assert all(getattr(p, n).__self__ is p.recorder for n in profiler_mod.RECORDER_HOOKS)
    run_cycle(p, b)
    assert p.seq == p.recorder.seq and p.next_slot is p.recorder.next_slot is not None
    p.begin("decode", 1)
    assert p.cur is p.recorder.cur is not None and p.next_slot is None
    p._hand_over()
    assert p.items == [] and p.items is p.recorder.items


def test_totals_cover_every_read_cycle_even_between_windows(fake, monkeypatch):
    p, b, out = fake
    monkeypatch.setattr(hooks, "P", p)
    for _ in range(13):
        run_cycle(p, b)
    state = hooks.internal_state()  # reads what completed; the window of 10 closed, 3 more are open
    assert state["enabled"] and state["latest"]["window"] == 0
    t = state["totals"]
    assert t["decode_cycles"] == 13 and t["committed_tokens"] == 39
    assert t["phase_gpu_ms"]["verify"] == pytest.approx(13 * 6.0)
    assert out[0]["totals"]["decode_cycles"] == 10


def test_host_time_is_measured_apart_from_gpu_time(fake):
    p, b, out = fake
    for _ in range(11):
        run_cycle(p, b, host_scale=0.5)  # the host runs ahead of the GPU
    bucket = out[0]["buckets"]["1"]
    assert bucket["phases"]["verify"]["gpu_ms"]["mean"] == pytest.approx(6.0)
    assert bucket["phases"]["verify"]["host_ms"]["mean"] == pytest.approx(3.0)
    # the host period is half the GPU's here; tokens/s follows the GPU's
    assert bucket["cycle_wall_ms"]["mean"] == pytest.approx(4.5)
    assert bucket["cycle_period_gpu_ms"]["mean"] == pytest.approx(9.0)
    # 10 cycles of 8.6 ms and the 9 gaps between them: the GPU's decode time, not the host's
    assert bucket["tokens_per_s"] == pytest.approx(30 / 0.0896, rel=1e-4)


def test_time_between_cycles_is_reported_as_unattributed(fake):
    p, b, out = fake
    for _ in range(11):
        p.begin("decode", 1)
        b.advance(2.0)
        p.mark("verify")
        p.end()
        b.advance(1.0)
        b.host += 0.002  # 2 ms of host wall time that no GPU interval covers
        p.harvest([1])
    bucket = out[0]["buckets"]["1"]
    assert bucket["cycle_wall_ms"]["mean"] == pytest.approx(5.0)
    # the GPU: 2 ms of the phase and 1 ms between cycles, which no phase holds
    assert bucket["cycle_period_gpu_ms"]["mean"] == pytest.approx(3.0)
    assert bucket["between_cycles_share"] == pytest.approx(1.0 / 3.0, abs=1e-4)


def test_window_closes_every_interval_decode_cycles_only(fake):
    p, b, out = fake
    for _ in range(5):
        p.begin("prefill", 1)
        b.advance(3.0)
        p.mark("target_extend")
        b.advance(1.0)
        p.mark("draft_extend")
        p.end()
    for _ in range(25):
        run_cycle(p, b)
    assert [w["window"] for w in out] == [0, 1]
    assert [w["decode_cycles"] for w in out] == [10, 10]
    first = out[0]["buckets"]["1"]
    assert first["prefill_cycles"] == 5
    assert first["prefill_phases_gpu_ms"]["target_extend"]["mean"] == pytest.approx(3.0)
    assert first["cycles"] == 10


def test_no_period_across_a_prefill_or_idle(fake):
    p, b, out = fake
    run_cycle(p, b)
    b.advance(5000.0)  # the server sat idle
    p.begin("prefill", 1)
    b.advance(3.0)
    p.mark("target_extend")
    p.end()
    for _ in range(10):
        run_cycle(p, b)
    bucket = out[0]["buckets"]["1"]
    assert bucket["cycle_wall_ms"]["n"] == 8  # 10 decode cycles; the first, and the one after the prefill, have none
    assert bucket["cycle_wall_ms"]["mean"] == pytest.approx(9.0)
    # decode time: 10 cycles of 8.6 ms and 8 gaps of 0.4 (none before the first, none after the prefill)
    assert out[0]["tokens_per_s"] == pytest.approx(30 / (0.086 + 0.0032), rel=1e-6)


def _prefill(p, b, bs=1, before=0.0, ms=3.0):
    b.advance(before)  # the device idle before the prefill (host work, or an idle server)
    p.begin("prefill", bs)
    b.advance(ms)
    p.mark("target_extend")
    p.end()


def test_time_beside_prefills_is_neither_decode_nor_idle(fake):
    """The GPU time between a prefill and the cycles next to it is counted apart: before the
    prefill when the batch it joined goes on (not an idle server), between prefills, and
    after the last one until the next decode cycle."""
    p, b, out = fake
    for _ in range(3):
        run_cycle(p, b, bs=2)  # ends with 0.4 ms of gap
    _prefill(p, b, before=50.0)  # a kernel compiled for the new shape: the device waits 50.4 ms
    _prefill(p, b, before=2.0)
    b.advance(7.0)
    for _ in range(3):
        run_cycle(p, b, bs=4)  # the two running requests and the two new ones
    run_cycle(p, b, bs=4)
    b.advance(5000.0)  # every request finished; the server sits idle
    _prefill(p, b, bs=3, before=0.0)
    b.advance(1.0)
    for _ in range(3):
        run_cycle(p, b, bs=3)  # only the new requests: the gap before this prefill was idle time
    totals = p.totals_now()
    assert totals["admissions"] == 2
    assert totals["prefill_cycles"] == 3
    assert totals["prefill_gpu_ms"] == pytest.approx(9.0)
    # 50.4 + 2 + 7 at the first admission; the idle 5000.4 left out, the 1 ms after kept
    assert totals["beside_prefill_gpu_ms"] == pytest.approx(59.4 + 1.0)
    # decode time is the cycles and the gaps between consecutive decode cycles only
    assert totals["decode_gpu_ms"] == pytest.approx(10 * 8.6 + 7 * 0.4)
    (w,) = out
    assert w["admissions"] == 2
    assert w["beside_prefill_seconds"] == pytest.approx(0.0604)
    assert w["prefill_seconds"] == pytest.approx(0.009)
    assert w["buckets"]["3-4"]["beside_prefill_gpu_ms"]["n"] == 2
    assert "GPU idle beside them 0.060 s (30.20 ms at each of 2 admissions" in format_summary(w)


def test_buckets_by_batch_size(fake):
    p, b, out = fake
    for bs in [1, 2, 3, 4, 1, 2, 3, 4, 8, 5]:
        run_cycle(p, b, bs=bs)
    run_cycle(p, b)
    assert set(out[0]["buckets"]) == {"1", "2", "3-4", "5-8"}
    assert out[0]["buckets"]["3-4"]["cycles"] == 4
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == ["1", "2", "3-4", "3-4", "5-8", "5-8", "9-16",
                                                                      "9-16", "17-32"]


def test_percentiles_match_linear_interpolation():
    v = [float(x) for x in range(1, 101)]
    assert percentile(v, 0.5) == pytest.approx(50.5)
    assert percentile(v, 0.9) == pytest.approx(90.1)
    assert percentile(v, 0.99) == pytest.approx(99.01)
    s = Series()
    for x in reversed(v):
        s.add(x)
    st = s.stats()
    assert (st["mean"], st["p50"], st["p90"], st["n"]) == (50.5, 50.5, 90.1, 100)


def test_acceptance_histogram_and_per_position_rates(fake):
    p, b, out = fake
    # correct drafts per request over 10 cycles of 4 requests: a known mix
    pattern = [[0, 1, 2, 3]] * 5 + [[3, 3, 2, 1]] * 5
    for correct in pattern:
        run_cycle(p, b, bs=4, correct=correct)
    run_cycle(p, b, bs=4, correct=[0, 0, 0, 0])
    acc = out[0]["buckets"]["3-4"]["accept"]
    flat = [c for cyc in pattern for c in cyc]
    assert acc["verified_requests"] == 40
    assert acc["histogram"] == [0, flat.count(0), flat.count(1), flat.count(2), flat.count(3)]
    assert acc["mean_length"] == pytest.approx(sum(c + 1 for c in flat) / 40)
    reach = [sum(c >= k for c in flat) for k in range(4)]
    assert acc["per_position"] == pytest.approx([reach[1] / reach[0], reach[2] / reach[1], reach[3] / reach[2]],
                                                abs=1e-4)
    assert acc["tokens_per_cycle"] == pytest.approx(sum(c + 1 for c in flat) / 10)


def test_fixed_acceptance_gives_one_one_zero(fake):
    p, b, out = fake
    for _ in range(11):
        run_cycle(p, b, correct=[2])
    acc = out[0]["buckets"]["1"]["accept"]
    assert acc["mean_length"] == 3.0
    assert acc["per_position"] == [1.0, 1.0, 0.0]


def captured_graph(p, b, key, steps):
    """Capture: the draft runner names the graph, draft_forward records one event per step."""
    b.capture = True
    p.capture_begin(*key)  # the runner and its batch size
    evs = []
    for i in range(steps + 1):
        p.draft_step(i)
    evs = list(p.graphs.step_events[p.graphs.key(*key)])
    b.capture = False
    b.host += 0.25  # the capture took 250 ms of host time
    p.capture_end()
    return evs


def replay(b, evs, step_ms, ran=True):
    """What a replay does to the event nodes: each gets the device time of its step boundary
    (`ran`: the device reached its last one before the cycle ends)."""
    t = b.gpu
    evs[0].t, evs[0].done = t, True
    for ev, ms in zip(evs[1:], step_ms):
        t += ms
        ev.t, ev.done = t, True
    evs[-1].done = ran


def graph_cycle(p, b, key, evs, step_ms, ran=True):
    p.begin("decode", 1)
    b.advance(0.3)
    p.mark("draft_prep")
    b.advance(0.25)  # the graph runner copies the inputs and sets the attention metadata
    p.draft_replay_begin(*key)
    replay(b, evs, step_ms, ran)
    b.advance(sum(step_ms))
    p.draft_replay_end()
    b.advance(0.05)  # the runner hands the replay's outputs back
    p.draft_end()
    p.graph("draft", True, type("R", (), {"bs": 2})())
    b.advance(6.0)
    p.mark("verify")
    p.end()
    b.advance(0.2)


def test_draft_steps_inside_a_captured_graph(fake):
    p, b, out = fake
    evs = captured_graph(p, b, ("g", 2), 3)
    assert len(evs) == 4 and all(e.external for e in evs)
    for k in range(11):
        # under the overlap scheduler the next replay comes before this cycle is read
        graph_cycle(p, b, ("g", 2), evs, [0.1 * (k + 1), 0.2, 0.3])
        p.harvest([2])
    assert p.capture_s["draft"] == {"2": 0.25}  # capture time per batch size
    bucket = out[0]["buckets"]["1"]
    steps = [s["mean"] for s in bucket["draft_steps_gpu_ms"]]
    assert steps == pytest.approx([sum(0.1 * (k + 1) for k in range(10)) / 10, 0.2, 0.3])
    assert bucket["graph"]["replays"]["draft"] == 10
    assert bucket["graph"]["padding_mean"] == 1.0
    # the graph's input preparation and its outputs are phases of their own; `draft` is the replay alone
    ph = {n: v["gpu_ms"]["mean"] for n, v in bucket["phases"].items()}
    assert list(ph) == ["draft_prep", "draft_inputs", "draft", "draft_outputs", "verify"]
    assert ph["draft_inputs"] == pytest.approx(0.25)
    assert ph["draft"] == pytest.approx(sum(steps))
    assert ph["draft_outputs"] == pytest.approx(0.05)
    assert out[0]["steps_lost"] == 0


def test_draft_steps_not_timed_leave_no_event_in_the_graph(monkeypatch):
    """SGLANG_SPECPROF_DRAFT_STEPS=0: capture records no event node inside the draft graph (each
    one is GPU work in every replay), an eager draft none either; the draft is timed as one phase,
    the profile says its steps were not timed, and the report says why there is no step line."""
    from sglang_specprof.table import format_summary

    monkeypatch.setenv("SGLANG_SPECPROF_DRAFT_STEPS", "0")
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=10, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False)
    external = []
    new_event = b.new_event

    def counted(*a, **kw):
        if kw.get("external") or (a and a[0]):
            external.append(1)
        return new_event(*a, **kw)

    b.new_event = counted
    b.capture = True
    p.capture_begin("g", 2)
    for i in range(4):
        p.draft_step(i)
    b.capture = False
    p.capture_end()
    assert p.graphs.step_events == {} and not p.graphs.timed
    for k in range(11):
        p.begin("decode", 1)
        b.advance(0.3)
        p.mark("draft_prep")
        p.draft_replay_begin("g", 2)
        b.advance(1.2)
        p.draft_replay_end()
        p.draft_end()
        for i in range(4):  # a draft run eagerly in the same cycle: no step events either
            p.draft_step(i)
        b.advance(6.0)
        p.mark("verify")
        p.end()
        b.advance(0.2)
        p.harvest([2])
    assert external == []  # no event made for a graph's node
    s = out[0]
    bucket = s["buckets"]["1"]
    assert bucket["draft_steps_gpu_ms"] == [] and s["steps_lost"] == 0
    assert bucket["phases"]["draft"]["gpu_ms"]["mean"] == pytest.approx(1.2)
    assert s["config"]["draft_steps"] is False
    text = format_summary(s)
    assert "draft steps: not timed (SGLANG_SPECPROF_DRAFT_STEPS=0" in text and "draft steps gpu ms" not in text
    monkeypatch.setenv("SGLANG_SPECPROF_DRAFT_STEPS", "1")  # the default: timed, and nothing said
    assert Profiler(b, interval=10, config={"num_steps": 3}, clock=b.clock, log_table=False).graphs.timed
    assert "draft_steps" not in Profiler(b, interval=10, config={}, clock=b.clock, log_table=False).config


def test_replay_before_the_previous_one_completed_loses_only_that_read(fake):
    p, b, out = fake
    evs = captured_graph(p, b, ("g", 1), 2)
    graph_cycle(p, b, ("g", 1), evs, [0.5, 0.5], ran=False)  # the device has not reached its end yet
    graph_cycle(p, b, ("g", 1), evs, [0.5, 0.5])
    assert p.steps_lost == 1


def test_a_bucket_whose_step_reads_were_all_lost_says_so(fake):
    """Every replay rewritten before its step times were read (the overlap scheduler launches the
    next one before the GPU ends this draft): the bucket has no step line, and the report says why
    instead of leaving it out."""
    from sglang_specprof.table import format_summary

    p, b, out = fake
    evs = captured_graph(p, b, ("g", 1), 2)
    for _ in range(11):
        graph_cycle(p, b, ("g", 1), evs, [0.5, 0.5], ran=False)
        p.harvest([1])
    s = out[0]
    assert s["steps_lost"] >= 10 and s["buckets"]["1"]["draft_steps_gpu_ms"] == []
    text = format_summary(s)
    assert "draft steps: none read here (each replay's step times rewritten by the next replay first" in text
    assert "draft steps gpu ms" not in text


def test_a_replay_done_by_its_cycle_end_is_read_there(fake):
    """Read at the cycle's end when the device ran it: the next replay (on 0.5.12 launched
    where the GPU waits for the host) has nothing to read, and a read it could not make
    (its own events in flight) loses nothing."""
    p, b, out = fake
    evs = captured_graph(p, b, ("g", 1), 2)
    for k in range(3):
        graph_cycle(p, b, ("g", 1), evs, [0.4, 0.6])
        evs[-1].done = False  # the next replay is in flight before this cycle is read
        p.harvest([1])
    assert p.steps_lost == 0
    p.flush()
    slot_steps = [c.steps_gpu_ms for c in p.window.samples]
    assert slot_steps and all(st == pytest.approx([0.4, 0.6]) for st in slot_steps)


@pytest.mark.full  # 5 minutes on 2 cores
def test_bounded_memory_over_a_million_cycles():
    b = FakeBackend()
    p = Profiler(b, interval=1000, sink=None, config={"num_steps": 3}, clock=b.clock, log_table=False)
    phases = [("draft", 1.0), ("verify", 6.0)]
    for _ in range(20_000):
        run_cycle(p, b, phases=phases, steps=(), gap=0.1)
    tracemalloc.start()
    for _ in range(80_000):
        run_cycle(p, b, phases=phases, steps=(), gap=0.1)
    early, _ = tracemalloc.get_traced_memory()
    for _ in range(900_000):
        run_cycle(p, b, phases=phases, steps=(), gap=0.1)
    late, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert p.seq - (p.next_slot is not None) == 1_000_000  # numbered: the cycles begun and the one made ready
    assert p.window_index == 1000
    assert late - early < 64 * 1024, (early, late)


def test_events_that_never_complete_are_dropped_oldest_first(fake):
    p, b, out = fake
    b.hold = True
    for _ in range(POOL + 10):
        run_cycle(p, b)
    assert len(p.free) == 0  # every slot waits for its events: no more are made
    untimed = p.dropped + p.read_dropped
    assert untimed == 10
    b.hold = False
    b.release()
    for _ in range(20):
        run_cycle(p, b)
    assert out and out[-1]["dropped_cycles"] == 10
    p.catch_up()
    assert p.totals_now()["decode_cycles"] == POOL + 10 + 20 - 10


def test_null_profiler_is_the_default_and_does_nothing():
    assert isinstance(hooks.P, NullProfiler) and not hooks.P.enabled
    n = NullProfiler()
    n.begin("decode", 1)
    n.mark("verify")
    n.draft_step(0)
    n.graph("draft", True, None)
    n.draft_replay_begin("g", 1)
    n.draft_replay_end()
    n.draft_end()
    n.capture_begin("g", 1)
    n.capture_end()
    n.end()
    n.harvest([1])
    assert n.latest() is None
    hooks.install(type("A", (), {"speculative_profile": False})())
    assert isinstance(hooks.P, NullProfiler)
    assert hooks.internal_state() == {"enabled": False, "latest": None, "totals": None}


class Boom(FakeBackend):
    def record(self, ev):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")


def test_an_internal_error_disables_the_profiler_with_one_warning(caplog, monkeypatch):
    b = Boom()
    p = Profiler(b, interval=10, clock=b.clock, log_table=False, on_error=hooks.disable)
    monkeypatch.setattr(hooks, "P", p)
    monkeypatch.setitem(hooks._state, "warned", False)
    with caplog.at_level(logging.WARNING, logger="sglang.specprof"):
        for _ in range(3):
            hooks.P.begin("decode", 1)  # the worker's call: it must not raise
            hooks.P.mark("verify")
            hooks.P.end()
            hooks.P.harvest([1])
    warnings = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(warnings) == 1
    assert "the server keeps serving" in warnings[0].getMessage()
    assert "more detail" not in warnings[0].getMessage()
    assert isinstance(hooks.P, NullProfiler)


def test_a_broken_sink_is_dropped_and_profiling_goes_on(fake, caplog):
    p, b, out = fake

    def broken(summary):
        raise ValueError("gauge rejected a label")

    p.sinks.insert(0, broken)
    for _ in range(21):
        run_cycle(p, b)
    assert len(out) == 2 and len(p.sinks) == 1


def test_jsonl_lines_follow_the_schema(fake, tmp_path):
    p, b, out = fake
    path = tmp_path / "prof.jsonl"
    p.sinks.append(JsonlSink(str(path)))
    for _ in range(31):
        run_cycle(p, b)
    windows, notes = schema.read(str(path))
    assert len(windows) == 3 and notes == []
    assert windows == json.loads(json.dumps(out))
    assert all(w["schema"] == "sglang-specprof/2" for w in windows)


def test_torn_last_line_is_reported_and_skipped(fake, tmp_path):
    p, b, out = fake
    path = tmp_path / "prof.jsonl"
    p.sinks.append(JsonlSink(str(path)))
    for _ in range(21):
        run_cycle(p, b)
    data = path.read_text()
    path.write_text(data + data.splitlines()[0][:57])  # killed while writing the third window
    with pytest.raises(schema.ProfileError, match="line 3 is not JSON"):
        schema.read(str(path))
    windows, notes = schema.read(str(path), skip_torn=True)
    assert len(windows) == 2 and notes == [f"{path} line 3 is cut short (the server stopped mid-write); skipped."]


def test_foreign_json_is_named_by_line(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text('{"schema": "sglang-specprof/1"}\n{"hello": 1}\n')
    with pytest.raises(schema.ProfileError, match=r"line 1 is not a sglang-specprof/2 window: missing window"):
        schema.read(str(path))
    path.write_text('{"hello": 1}\n')
    with pytest.raises(schema.ProfileError, match=r"line 1 .*schema is None"):
        schema.read(str(path), skip_torn=True)


def test_unwritable_jsonl_later_warns_once_and_goes_on(fake, tmp_path, caplog):
    p, b, out = fake
    folder = tmp_path / "d"
    folder.mkdir()
    sink = JsonlSink(str(folder / "p.jsonl"))
    p.sinks.append(sink)
    (folder / "p.jsonl").unlink()
    folder.rmdir()  # the folder vanishes under the running server
    with caplog.at_level(logging.WARNING, logger="sglang.specprof"):
        for _ in range(31):
            run_cycle(p, b)
    assert len(out) == 3 and sink.broken
    assert len([r for r in caplog.records if "cannot append" in r.getMessage()]) == 1


def test_log_table_names_every_phase(fake):
    p, b, out = fake
    for _ in range(11):
        run_cycle(p, b, host_scale=2.0)
    text = format_summary(out[0])
    for name, _ in PHASES:
        assert f"    {name} " in text
    assert "accept len 3.00 (by position 1.00 1.00 0.00)" in text
    assert "draft steps gpu ms: 0.200 0.200 0.200" in text
    assert "host time above GPU time (CPU work, or the host waiting on the device): draft_prep, draft, tree, verify, accept, draft_extend" in text


def test_log_table_escapes_control_characters(fake):
    """A phase name or a setting holding an escape sequence (a hostile profile, a config
    string) is shown escaped: the terminal showing the log is not driven by it."""
    p, b, out = fake
    for _ in range(11):
        run_cycle(p, b, phases=[("draft\x1b[2J", 1.0), ("verify", 6.0)], steps=())
    w = dict(out[0], config=dict(out[0]["config"], algorithm="EAGLE3\x1b]0;owned\x07", worker="v2\r"))
    text = format_summary(w)
    assert not any(c in text for c in "\x1b\x07\r")
    assert "    draft\\x1b[2J " in text and "[EAGLE3\\x1b]0;owned\\x07 v2\\x0d steps=3" in text
    assert text.count("\n") == format_summary(out[0]).count("\n")  # the newlines between lines stay


def _rank(rank, folder, verify_ms, barrier, q):
    b = FakeBackend()
    out = []
    ex = RankExchange(folder, rank, 2)
    p = Profiler(b, interval=10, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False,
                 exchange=ex, rank=rank)
    phases = [("draft", 1.0), ("verify", verify_ms)]
    for w in range(3):
        for _ in range(10 if w else 11):
            run_cycle(p, b, phases=phases, steps=())
        barrier.wait()  # both ranks closed window w (the exchange itself never waits)
    q.put((rank, out[-1]))


def test_spread_across_two_ranks(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), 6.0 + 0.5 * r, barrier, q)) for r in range(2)]
    [x.start() for x in procs]
    got = dict(q.get(timeout=60) for _ in procs)
    [x.join(60) for x in procs]
    spread = got[0]["ranks"]
    assert spread["ranks"] == [0, 1]
    verify = spread["buckets"]["1"]["verify"]
    assert verify["spread"] == pytest.approx(0.5) and verify["slowest_rank"] == 1
    assert spread["buckets"]["1"]["draft"]["spread"] == pytest.approx(0.0)
    assert "ranks" not in got[1]  # only rank 0 reports the spread
    assert "verify 0.500 ms (rank 1 slowest)" in format_summary(got[0])


def test_context_length_of_each_cycle_is_kept_and_a_tensor_is_never_read(fake):
    p, b, out = fake

    class Tensorish:
        def __init__(self, device, values):
            self.device = type("D", (), {"type": device})()
            self.values = values

        def tolist(self):
            if self.device.type != "cpu":  # a device tensor's values would make the host wait
                raise AssertionError("read")
            return list(self.values)

    for i in range(12):
        ctx = (1000 + 100 * i if i < 9 else Tensorish("cpu", [900, 1000]) if i == 9
               else Tensorish("cuda", [1, 2]))
        p.begin("decode", 2, ctx)
        for name, ms in PHASES:
            b.advance(ms)
            p.mark(name)
        p.end()
        b.advance(0.4)
        p.harvest([2, 2])
    ctx = out[0]["buckets"]["2"]["context_tokens"]
    assert ctx["n"] == 10 and ctx["mean"] == pytest.approx(1450.0)  # the device tensor is not counted


def test_context_length_from_the_batch_where_upstream_keeps_no_cpu_lengths():
    """v2 from 0.5.13 passes the ScheduleBatch: its CPU lengths where upstream keeps them,
    else its requests' prompt and output tokens; a device tensor is never read, and a batch
    that has neither (or breaks) gives no context, never an error."""
    from sglang.specprof.batch_state import context_tokens

    class T:
        def __init__(self, device, values):
            self.device = type("D", (), {"type": device})()
            self.values = values

        def tolist(self):
            assert self.device.type == "cpu", "a device tensor was read"
            return list(self.values)

    class R:
        def __init__(self, prompt, out):
            self.origin_input_ids, self.output_ids = [0] * prompt, [0] * out

    class Batch:
        def __init__(self, lens, reqs):
            self.seq_lens_cpu, self.reqs = lens, reqs

    reqs = [R(100, 20), R(300, 5)]
    assert context_tokens(Batch(T("cpu", [121, 306]), reqs)) == 427  # upstream's own copy first
    assert context_tokens(Batch(None, reqs)) == 425  # the backend opted out: the requests
    assert context_tokens(Batch(T("cuda", [1]), reqs)) == 425
    assert context_tokens(Batch(None, [])) is None
    assert context_tokens(Batch(None, [object()])) is None  # not a request: no context, no error
    assert context_tokens(object()) is None


class Req:
    """What the commit hooks read of a request: its output ids, where it stops, its state."""

    def __init__(self, max_new, out=1, stop_at=None):
        self.output_ids = [0] * out  # the prefill's token
        self.finished_len = None
        self.finished_reason = None
        self.is_retracted = False
        self.max_new = max_new
        self.stop_at = stop_at  # output length at which a stop token comes

    def finished(self):
        return self.finished_reason is not None

    def take(self, n):
        """What the scheduler's loop does with a verified run of n tokens."""
        self.output_ids.extend([0] * n)
        if len(self.output_ids) >= self.max_new:
            self.finished_reason, self.finished_len = "length", self.max_new
        elif self.stop_at is not None and len(self.output_ids) >= self.stop_at:
            self.finished_reason, self.finished_len = "stop", self.stop_at


def v2_cycle(p, b, reqs, correct):
    """A v2 decode cycle of `reqs` and its result: harvest, then the scheduler's commit."""
    p.begin("decode", len(reqs))
    b.advance(1.0)
    p.mark("verify")
    p.end()
    p.harvest(correct)
    p.commit_begin(reqs)
    for r, c in zip(reqs, correct):
        if not (r.finished() or r.is_retracted):  # upstream skips these under overlap
            r.take(c + 1)
    p.commit_end()


def test_v2_commits_only_what_reaches_requests():
    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False)
    reqs = [Req(24), Req(24), Req(24, stop_at=10), Req(24)]
    for cycle in range(12):
        if cycle == 3:
            reqs[3].is_retracted = True  # retracted while its batch was in flight
        v2_cycle(p, b, reqs, [3, 2, 3, 1])
    # what the clients get: up to each stop; the first token is the prefill's
    client = sum((r.finished_len or len(r.output_ids)) - 1 for r in reqs)
    t = p.totals_now()
    assert t["committed_tokens"] == client == 23 + 23 + 9 + 3 * 2
    assert t["skipped_requests"] > 0 and t["cut_tokens"] > 0
    acc = p.window.summary(3)["buckets"]["3-4"]["accept"]
    assert acc["committed_tokens"] == client
    assert sum(n * c for n, c in enumerate(acc["histogram"])) == client
    # acceptance by position counts each live request's verify whole: a cut is not a rejection
    assert acc["per_position"][0] == 1.0 and acc["drafts_histogram"][3] > 0


def test_v2_without_its_commit_counts_whole_and_says_so():
    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False)
    for _ in range(3):
        p.begin("decode", 2)
        b.advance(1.0)
        p.mark("verify")
        p.end()
        p.harvest([2, 2])  # no commit hooks reached
    assert p.totals_now()["committed_tokens"] == 12  # two lists of 2 x 3 tokens, counted when the next came
    assert p.uncut_cycles == 2
    assert "cycles counted without the scheduler's commit" in format_summary(
        dict(p.window.summary(3), uncut_cycles=p.uncut_cycles, config={}))


def test_v1_counts_at_harvest_and_ignores_the_commit():
    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v1"}, clock=b.clock, log_table=False)
    reqs = [Req(100)]
    for _ in range(3):
        v2_cycle(p, b, reqs, [2])
    assert p.totals_now()["committed_tokens"] == 9 and p.uncut_cycles == 0


@pytest.mark.parametrize("steps", [1, 6, 8, 20])
def test_eager_draft_steps_never_crowd_out_phases(fake, steps):
    p, b, out = fake
    names = ["draft_prep", "draft", "tree", "verify_prep", "verify", "accept", "draft_extend_prep",
             "draft_extend", "draft_extend_post"]
    for _ in range(11):
        run_cycle(p, b, phases=[(n, 1.0) for n in names], steps=[0.1] * steps)
    bucket = out[0]["buckets"]["1"]
    assert list(bucket["phases"]) == names
    assert [s["mean"] for s in bucket["draft_steps_gpu_ms"]] == pytest.approx([0.1] * steps)
    assert out[0]["marks_lost"] == 0


def test_marks_past_a_cycles_room_are_counted(fake):
    p, b, out = fake
    p.begin("decode", 1)
    for i in range(profiler_mod.MAX_MARKS + 5):
        b.advance(0.01)
        p.mark(f"m{i}")
    p.end()
    assert p.marks_lost == 6  # the first mark is the cycle's begin


def test_gpu_period_leaves_out_what_the_host_waited_for(fake):
    p, b, out = fake
    for i in range(11):
        run_cycle(p, b, harvest=False)
        b.host += 0.030 if i == 5 else 0.0  # the scheduler waited 30 ms for a prefill's results
        p.harvest([2])
    bucket = out[0]["buckets"]["1"]
    assert bucket["cycle_wall_ms"]["max"] == pytest.approx(39.0)
    assert bucket["cycle_period_gpu_ms"]["max"] == pytest.approx(9.0)
    assert out[0]["tokens_per_s"] == pytest.approx(30 / 0.0896, rel=1e-4)


def test_garbage_collector_pauses_inside_a_cycle_are_timed(fake):
    import gc

    p, b, out = fake
    p.follow_gc()
    try:
        for i in range(11):
            p.begin("decode", 1)
            b.advance(1.0)
            if i == 4:
                p._on_gc("start", {})
                b.host += 0.050  # the collector held the host 50 ms
                p._on_gc("stop", {})
            p.mark("verify")
            p.end()
            p.harvest([1])
        assert p._gc_cb in gc.callbacks
    finally:
        p.close()
    assert p._gc_cb is None
    pauses = out[0]["buckets"]["1"]["host_pause_ms"]
    assert pauses["n"] == 1 and pauses["max"] == pytest.approx(50.0)


def test_a_cycle_where_the_device_waited_on_the_host_is_a_stall_reported_apart(fake):
    p, b, out = fake
    for i in range(11):
        p.begin("decode", 1)
        b.advance(0.02, 0.3)  # draft_inputs: host work, the GPU ahead
        if i == 6:
            b.advance(200.0, 200.0)  # a kernel compiled for a new shape: the GPU waits on the host
        p.mark("draft_inputs")
        b.advance(6.0, 0.2)  # verify: GPU work the host does not wait for
        p.mark("verify")
        p.end()
        p.harvest([2])
    bucket = out[0]["buckets"]["1"]
    st = bucket["stalled"]
    assert st["cycles"] == 1 and st["phases"]["draft_inputs"]["n"] == 1
    assert st["phases"]["draft_inputs"]["gpu_ms"] == pytest.approx(200.02)
    di = bucket["phases"]["draft_inputs"]["gpu_ms"]
    assert di["n"] == 9 and di["mean"] == pytest.approx(0.02) and di["max"] == pytest.approx(0.02)
    assert bucket["cycle_gpu_ms"]["mean"] == pytest.approx(6.02)
    # the stall's time is still decode time: tokens/s counts it
    assert out[0]["seconds"] == pytest.approx((10 * 6.02 + 200.0) / 1000.0, rel=1e-3)
    assert "stalled: 1 cycles" in format_summary(out[0])


def test_a_steadily_host_bound_phase_is_not_a_stall(fake):
    p, b, out = fake
    for _ in range(11):  # an eager draft at a large batch: launch-bound every cycle
        p.begin("decode", 24)
        b.advance(15.0, 15.0)
        p.mark("draft")
        b.advance(30.0, 1.0)
        p.mark("verify")
        p.end()
        p.harvest([2] * 24)
    bucket = out[0]["buckets"]["17-32"]
    assert bucket["stalled"]["cycles"] == 0 and bucket["phases"]["draft"]["gpu_ms"]["n"] == 10


@pytest.mark.parametrize("read_first", [True, False])
def test_a_cycle_after_every_request_finished_is_not_decode_time(read_first):
    """Under the overlap scheduler one more cycle runs as a batch drains: it gives clients
    nothing, and its time is left out of decode time, whether it is read before or after
    its commit says so."""
    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False)
    reqs = [Req(13), Req(13)]
    results = []
    for i in range(4):  # 3 cycles of 4 tokens fill 13, the 4th runs on finished requests
        if i == 3 and not read_first:
            b.hold = True  # the 4th cycle's events are still incomplete when its commit comes
        p.begin("decode", 2)
        b.advance(10.0)
        p.mark("verify")
        p.end()
        b.advance(1.0)
        results.append([3, 3])
    for correct in results:
        p.harvest(correct)
        p.commit_begin(reqs)
        for r, c in zip(reqs, correct):
            if not r.finished():
                r.take(c + 1)
        p.commit_end()
    assert p.totals_now()["committed_tokens"] == 24  # counted where committed
    b.hold = False
    b.release()
    p.catch_up()  # as /server_info does: what completed is read, in order
    t = p.totals_now()
    assert t["committed_tokens"] == 24 and t["drain_cycles"] == 1
    # three cycles of 10 ms and the two gaps between them; not the 4th cycle nor its gap
    assert t["decode_gpu_ms"] == pytest.approx(32.0)


def test_folding_on_the_helper_thread_gives_the_same_windows():
    """The server reads on its own thread and summarises windows on the outputs thread
    (AT_HAND_OVER); with a reader thread (READER_THREAD) or all inline (INLINE) the same windows
    come out, and each summary is made on the outputs thread, not the caller's."""
    import threading

    outs = {}
    for reading in (INLINE, READER_THREAD, AT_HAND_OVER):
        b = FakeBackend()
        out = []
        made_on = set()
        p = Profiler(b, interval=10, sink=lambda s: (out.append(s), made_on.add(threading.current_thread().name)),
                     config={"num_steps": 3}, clock=b.clock, log_table=False, reading=reading)
        before = {t.name for t in threading.enumerate()}
        for i in range(35):
            run_cycle(p, b, bs=1 + i % 3)
        assert p.flush()
        outs[reading] = out
        if reading != INLINE:
            assert made_on == {"specprof-outputs"}
            assert all(isinstance(w["window"], int) for w in out)
        else:
            assert made_on == {threading.current_thread().name}
        if reading == AT_HAND_OVER:  # no reader thread: the cycles were read here, at each hand-over
            assert not p.folder.reading_thread and p.totals_now()["decode_cycles"] == 35
    strip = lambda ws: [{k: v for k, v in w.items() if k != "time"} for w in ws]  # noqa: E731
    assert len(outs[READER_THREAD]) == 3
    assert strip(outs[READER_THREAD]) == strip(outs[INLINE]) == strip(outs[AT_HAND_OVER])


def test_a_stuck_output_never_blocks_the_hot_path_nor_grows_memory(monkeypatch):
    import threading

    from sglang.specprof import folder

    monkeypatch.setattr(folder, "BACKLOG", 4)
    import time

    gate = threading.Event()
    b = FakeBackend()
    p = Profiler(b, interval=5, sink=lambda s: gate.wait(), config={"num_steps": 3}, clock=b.clock,
                 log_table=False, reading=READER_THREAD)
    for _ in range(200):  # the sink blocks at the first window; the cycles keep coming
        run_cycle(p, b)
        time.sleep(0.0002)  # the wait for the GPU: the reader's turn
    p.catch_up(5.0)  # the reading goes on past a stuck output
    assert p.totals_now()["decode_cycles"] == 200 and p.dropped == 0
    assert p.folder.dropped_batches > 0 and p.folder._out.qsize() <= 4
    gate.set()
    assert p.flush()


def test_jsonl_rotates_at_its_cap_so_a_disk_never_fills(fake, tmp_path):
    p, b, out = fake
    path = tmp_path / "prof.jsonl"
    sink = JsonlSink(str(path), max_bytes=20_000)
    p.sinks.append(sink)
    for _ in range(101):
        run_cycle(p, b)
    assert sink.rotations >= 1
    assert path.stat().st_size <= 20_000 and (tmp_path / "prof.jsonl.1").stat().st_size <= 20_000
    older, _ = schema.read(str(tmp_path / "prof.jsonl.1"))
    newer, _ = schema.read(str(path))
    assert older[-1]["window"] + 1 == newer[0]["window"] and newer[-1]["window"] == 9


def test_a_fifo_as_output_is_refused_at_startup(tmp_path):
    import os

    from sglang.specprof import server_args as spa

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)

    class Args:
        speculative_profile = True
        speculative_algorithm = "EAGLE3"
        speculative_profile_interval = 100
        speculative_profile_output = str(fifo)

    with pytest.raises(spa.SpecProfileArgError, match="is not a regular file"):
        spa.validate(Args())  # returns at once: opening a FIFO for writing would block
    with pytest.raises(OSError, match="not a regular file"):
        JsonlSink(str(fifo))


# Python calls into the profiler's own code per v2 decode cycle of 8 requests on the
# scheduler's thread (the hooks and the commit; the reader thread reads the events), counted at the time of writing
# plus a margin: a change that makes the hot path do more fails here, on any machine.
HOT_PATH_CALLS = 20  # 18.1 at the time of writing, timed by phase or not (the gate's and end's writes inline)
# ... with the reading and folding there too (the server's AT_HAND_OVER), per phases_every
HOT_PATH_READING_CALLS = {1: 78, 4: 60}  # 71.7 and 54.8 at the time of writing (75.4 and 59.4 before a cycle's stall check was a loop)
# ... and the lines of the profiler's code they run, [reader thread][phases_every]: 293.5 and
# 226.0 with a reader thread, 864.7 and 579.2 reading there, at the time of writing (3 of them
# the stream check at each cycle's end; 267.4,
# 218.2, 844.9 and 577.7 when `begin` did the slot's bookkeeping that `end` does now for the
# next cycle: off 0.5.12's critical path, not less of it). Fewer lines are not always less
# time: the commit hooks reading the batch through map/attrgetter ran 56 fewer lines a cycle
# of 8 and took 2.9 us more (bench/hook_cost.py --pollute-kb 4096, paired), so not kept.
HOT_PATH_LINES = {True: {1: 300, 4: 232}, False: {1: 880, 4: 592}}


def profiler_tracer(here, on=lambda: True):
    """A `sys.settrace` function that counts the calls into files under `here` (while `on()`)
    and the lines run in them; returns it and the counts ({"calls", "lines"})."""
    got = {"calls": 0, "lines": 0}

    def in_frame(frame, event, arg):
        if event == "line":
            got["lines"] += 1
        return in_frame

    def count(frame, event, arg):
        if on() and event == "call" and any(h in frame.f_code.co_filename for h in here):
            got["calls"] += 1
            return in_frame
        return None

    return count, got


class CountingBackend(FakeBackend):
    """Counts the event calls made on the calling (scheduler's) thread and on the others."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def _count(self, name):
        import threading

        key = name if threading.current_thread() is threading.main_thread() else name + "@reader"
        self.ops[key] = self.ops.get(key, 0) + 1

    def record(self, ev):
        self._count("record")
        super().record(ev)

    def query(self, ev):
        self._count("query")
        return super().query(ev)

    def elapsed(self, a, b):
        self._count("elapsed")
        return super().elapsed(a, b)


@pytest.mark.parametrize("every, most, records, mode", [
    (1, HOT_PATH_CALLS, 12, READER_THREAD), (4, HOT_PATH_CALLS, 4.5, READER_THREAD),
    (1, HOT_PATH_READING_CALLS[1], 12, AT_HAND_OVER), (4, HOT_PATH_READING_CALLS[4], 4.5, AT_HAND_OVER)])
def test_the_hot_path_stays_small(every, most, records, mode):
    """The hooks alone (a reader thread reads), and the server's way: the hooks and the reading
    and folding on the scheduler's thread, at each hand-over."""
    import sys
    import time

    b = CountingBackend()
    p = Profiler(b, interval=100, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False,
                 reading=mode, phases_every=every)
    reqs = [Req(10**9) for _ in range(8)]
    names = ["draft_prep", "draft_inputs", "draft", "draft_outputs", "tree", "verify_prep", "verify", "accept",
             "draft_extend_prep", "draft_extend", "draft_extend_post"]

    def cycles(n):
        for _ in range(n):
            p.begin("decode", 8)
            for name in names:
                b.advance(0.5)
                p.mark(name)
            p.end()
            time.sleep(0.0002)  # the wait for the GPU, the GIL released: the reader's turn
            p.harvest([2] * 8)
            p.commit_begin(reqs)
            for r in reqs:
                r.take(3)
            p.commit_end()

    cycles(300)
    assert p.flush()
    count, got = profiler_tracer(("/sglang/specprof/", "/sglang_specprof/"))
    b.ops.clear()
    sys.settrace(count)
    try:
        cycles(200)
    finally:
        sys.settrace(None)
    assert p.flush()
    per, lines = got["calls"] / 200, got["lines"] / 200
    print(f"{per:.1f} profiler calls and {lines:.1f} lines a cycle on the scheduler's thread")
    assert lines <= HOT_PATH_LINES[mode == READER_THREAD][every], f"{lines:.1f} profiler lines a cycle"
    assert per <= most, f"{per:.1f} profiler calls a cycle on the scheduler's thread"
    # the scheduler's thread records the events (12 a cycle timed phase by phase, 2 one timed
    # whole); the reader reads them, every one (the server's way: the scheduler's thread)
    assert b.ops["record"] == 200 * records, b.ops
    at = "@reader" if mode == READER_THREAD else ""
    assert b.ops["elapsed" + at] >= 200 * (records - 1) and b.ops["query" + at] >= 200, b.ops
    if mode == READER_THREAD:
        assert "query" not in b.ops and "elapsed" not in b.ops, b.ops


# Python calls into the profiler, and lines of it run, in the hooks before the draft graph's
# replay (begin, the draft_prep mark, draft_replay_begin), where 0.5.12's GPU waits for the
# host: each of their microseconds is one of the cycle's (bench/host_sensitivity.py). At the
# time of writing: 3 calls and 46 lines a cycle timed by phase (every=1), 3 and 28.75 with one
# cycle in four timed by phase (a cycle timed whole: 3 calls, 23 lines). Before, 4 calls and
# 61 lines timed by phase, 4 and 48 timed whole, when `begin` took a slot from the pool and
# decided its detail itself and every replay was keyed before its launch; 7.0 and 5.5 calls
# before draft_replay_begin's record and graph key were written inline.
HEAD_CALLS = {1: 3.0, 4: 3.0}
HEAD_LINES = {1: 47, 4: 30}


@pytest.mark.parametrize("every", [1, 4])
def test_the_hooks_before_the_draft_replay_stay_few(every):
    import sys

    b = FakeBackend()
    p = Profiler(b, interval=100, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False,
                 reading=AT_HAND_OVER, phases_every=every)
    key = ("g", 8)
    evs = captured_graph(p, b, key, 3)
    counting = [False]
    count, got = profiler_tracer(("/sglang/specprof/",), lambda: counting[0])

    def cycles(n, counted):
        for _ in range(n):
            counting[0] = counted
            p.begin("decode", 8, 8000)
            b.advance(0.3)
            p.mark("draft_prep")
            b.advance(0.2)
            p.draft_replay_begin(*key)
            counting[0] = False
            replay(b, evs, [0.2, 0.2, 0.2])
            b.advance(0.6)
            p.draft_replay_end()
            p.draft_end()
            for name in ("tree", "verify_prep", "verify", "accept", "draft_extend_prep", "draft_extend",
                         "draft_extend_post"):
                b.advance(0.5)
                p.mark(name)
            p.end()
            b.advance(0.2)
            p.harvest([2] * 8)

    cycles(300, False)
    sys.settrace(count)
    try:
        cycles(400, True)
    finally:
        sys.settrace(None)
    per, lines = got["calls"] / 400, got["lines"] / 400
    assert per <= HEAD_CALLS[every], f"{per:.2f} profiler calls a cycle before the draft replay"
    assert lines <= HEAD_LINES[every], f"{lines:.2f} profiler lines a cycle before the draft replay"
    assert p.flush() and p.steps_lost == 0 and p.graphs.read_late == 0  # every replay read at its cycle's end
    assert p.totals_now()["decode_cycles"] == 700


@pytest.mark.parametrize("given, rank1", [
    ("prof.jsonl", "prof.rank1.jsonl"),
    ("./profile", "./profile.rank1"),
    ("run.v2/profile", "run.v2/profile.rank1"),
    ("/tmp/a.b/c.jsonl", "/tmp/a.b/c.rank1.jsonl"),
    (".hidden", ".hidden.rank1"),
])
def test_each_tp_rank_writes_beside_the_given_path(given, rank1):
    from sglang.specprof.jsonl import rank_path

    assert rank_path(given, 1) == rank1


def test_the_startup_check_leaves_no_empty_file_behind(tmp_path):
    from sglang.specprof import server_args as spa

    class Args:
        speculative_profile = True
        speculative_algorithm = "EAGLE3"
        speculative_profile_interval = 100
        speculative_profile_output = str(tmp_path / "prof.jsonl")

    spa.validate(Args())
    assert not (tmp_path / "prof.jsonl").exists()


class _Args:
    speculative_profile = True
    speculative_algorithm = "EAGLE3"
    speculative_profile_interval = 100
    speculative_profile_output = None


@pytest.mark.parametrize("fields, says", [
    ({"speculative_profile_output": ""}, "--speculative-profile-output needs a file path; an empty one writes nothing."),
    ({"speculative_profile_output": "", "speculative_profile": False},
     "--speculative-profile-output needs a file path; an empty one writes nothing."),
    ({"speculative_profile_interval": 10**26}, "--speculative-profile-interval must be 1 or more (at most 1000000 "
                                               "decode cycles a window), not 100000000000000000000000000."),
    ({"speculative_profile_interval": -5, "speculative_profile": False},
     "--speculative-profile-interval must be 1 or more (at most 1000000 decode cycles a window), not -5."),
    ({"speculative_profile_interval": 50, "speculative_profile": False},
     "--speculative-profile-interval only takes effect with --speculative-profile; add it."),
])
def test_an_option_that_would_do_nothing_is_refused_in_one_sentence(fields, says):
    from sglang.specprof import server_args as spa

    args = type("Args", (_Args,), fields)()
    with pytest.raises(spa.SpecProfileArgError) as e:
        spa.validate(args)
    assert str(e.value) == says


@pytest.mark.parametrize("declared, refused", [
    ([], False),
    ([("model", {"enable_multi_layer_eagle": True})], True),  # MiMoV2 / Step3p5 with EAGLE
    ([("model", {"enable_multi_layer_eagle": True}), ("user", {"enable_multi_layer_eagle": False})], False),
    ([("model", {"attention_backend": "fa3"})], False),
])
def test_multi_layer_eagle_that_sglang_turns_on_for_the_model_is_refused_too(declared, refused, monkeypatch):
    """From 0.5.15 SGLang declares multi-layer EAGLE for MiMoV2 and Step3p5 models while the
    arguments resolve, and sets the field only after the profiler's check: the check reads the
    declarations (the last one wins), so where SGLang would run the multi-layer v1 worker (not
    timed: `server_args.multi_layer_v1`) such a server is refused, not served unprofiled; where
    it runs the v2 worker it is taken."""
    from sglang.specprof import server_args as spa

    args = type("Args", (_Args,), {"speculative_algorithm": "EAGLE", "enable_multi_layer_eagle": False,
                                   "_resolved_overrides": declared})()
    monkeypatch.setattr(spa, "multi_layer_v1", lambda a: "with the overlap scheduler: drop --disable-overlap-schedule")
    monkeypatch.setattr(spa, "_installed", lambda: "0.5.12")
    if refused:
        with pytest.raises(spa.SpecProfileArgError) as e:
            spa.validate(args)
        assert str(e.value) == ("--speculative-profile times multi-layer EAGLE's v2 worker, which SGLang 0.5.12 runs "
                                "here only with the overlap scheduler: drop --disable-overlap-schedule; or profile "
                                "without the flag.")
    else:
        spa.validate(args)
    monkeypatch.setattr(spa, "multi_layer_v1", lambda a: None)
    spa.validate(args)


@pytest.mark.parametrize("culprit", ["fifo", "folder"])
def test_each_tp_rank_s_file_is_checked_at_startup(culprit, tmp_path):
    """tp > 1: each rank writes PATH.rankN; one of them a FIFO or a folder is refused before
    the server starts, as PATH itself would be (not the rank's profiler off at run time)."""
    from sglang.specprof import server_args as spa
    from sglang.specprof.jsonl import rank_path

    path = str(tmp_path / "prof.jsonl")
    bad = rank_path(path, 2)
    os.mkfifo(bad) if culprit == "fifo" else os.mkdir(bad)
    args = type("Args", (_Args,), {"speculative_profile_output": path, "tp_size": 4})()
    says = "is not a regular file" if culprit == "fifo" else "is a folder"
    with pytest.raises(spa.SpecProfileArgError, match=f"^--speculative-profile-output {path}: rank 2's file {bad} {says}; "
                                                      f"give a file path.$"):
        spa.validate(args)
    args.tp_size = 2  # ranks 0 and 1 only: fine, and no file left behind
    spa.validate(args)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(bad)]


def test_the_reader_waits_for_the_gate_or_an_idle_server(monkeypatch):
    """The reader takes the GIL only where the scheduler waits for the GPU (v1: between the
    verify launch and its result) or once nothing opened the gate for IDLE_S."""
    import time

    from sglang.specprof import folder

    monkeypatch.setattr(folder, "IDLE_S", 0.6)  # wide margins on a loaded machine

    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v1"}, clock=b.clock, log_table=False,
                 reading=READER_THREAD)
    for _ in range(8):  # no `verify` mark: the gate never opens
        run_cycle(p, b, phases=[("draft", 1.0), ("tree", 0.1)], steps=())
    p._hand_over()
    time.sleep(folder.IDLE_S / 4)
    assert p.totals_now()["decode_cycles"] == 0  # handed over, complete, and not read: the gate is shut
    deadline = time.time() + 5
    while p.totals_now()["decode_cycles"] < 8 and time.time() < deadline:
        time.sleep(0.005)
    assert p.totals_now()["decode_cycles"] == 8  # the server looked idle: read without a flush
    for _ in range(8):  # with a verify: the gate opens there and the reader reads at once
        run_cycle(p, b, phases=[("draft", 1.0), ("verify", 5.0), ("accept", 0.1)], steps=())
    p._hand_over()
    p.begin("decode", 1)
    p.mark("verify")  # the wait for the verify's result
    deadline = time.time() + folder.IDLE_S / 2
    while p.totals_now()["decode_cycles"] < 16 and time.time() < deadline:
        time.sleep(0.001)
    assert p.totals_now()["decode_cycles"] == 16


def test_the_gate_wakes_a_waiting_helper_and_costs_no_lock_otherwise():
    """Opening the gate sets its event only when a helper said it waits, and such a helper
    is woken by the next opening, whichever of the two comes first."""
    import threading
    import time

    from sglang.specprof.folder import Gate

    g = Gate()
    g.open()
    assert not g._ev.is_set()  # nobody waits: an attribute write, no lock taken
    for first in ("helper", "scheduler"):
        g.shut()
        woke = []
        t = threading.Thread(target=lambda: woke.append(g.wait(timeout=30)))
        if first == "scheduler":  # an opening and a shutting before the helper looks: it waits
            g.open()
            g.shut()
        t.start()
        deadline = time.time() + 10
        while not g.waiting and time.time() < deadline:
            time.sleep(0.001)
        assert g.waiting
        t0 = time.time()
        g.open()
        t.join(10)
        assert woke == [True] and time.time() - t0 < 5  # woken by the opening, not the 30 s timeout
        assert not g.waiting


def test_the_rank_exchange_folder_is_this_users_alone(tmp_path):
    from sglang.specprof.ranks import NotPrivate, exchange_folder

    assert str(os.getuid()) in os.path.basename(exchange_folder(30000))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as another user's /tmp folder would be: anyone may write rank0.json
    with pytest.raises(NotPrivate, match="not a folder of this user's alone"):
        RankExchange(str(shared), 0, 2)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(NotPrivate):
        RankExchange(str(tmp_path / "link"), 0, 2)
    mine = tmp_path / "mine"
    ex = RankExchange(str(mine), 1, 2)
    assert mine.stat().st_mode & 0o777 == 0o700
    ex.publish({"window": 0, "rank": 1, "buckets": {}})
    ex.close()  # at exit: its file, and the folder once empty
    assert not mine.exists()


# -- phases in one cycle of K (--speculative-profile-phases-every) ---------------------------


def _phase_sampled(every, cycles, interval=None, bs=lambda i: 1, **kw):
    """`cycles` + 1 cycles (the last closes the window) of batch size bs(i), phases in one of `every`."""
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=interval or cycles, sink=out.append, config={"num_steps": 3, "phases_every": every},
                 clock=b.clock, log_table=False, phases_every=every)
    for i in range(cycles + 1):
        run_cycle(p, b, bs=bs(i), **kw)
    return p, b, out


def test_every_cycle_is_timed_and_its_phases_one_in_k():
    full_p, full_b, (full,) = _phase_sampled(1, 40)
    p, b, (s,) = _phase_sampled(4, 40)
    fb, sb = full["buckets"]["1"], s["buckets"]["1"]
    # every cycle's GPU time and the decode time (tokens/s) are the same as with every phase timed
    assert sb["cycles"] == fb["cycles"] == 40
    assert sb["cycle_gpu_ms"]["n"] == 40 and sb["cycle_gpu_ms"]["mean"] == pytest.approx(8.6)
    assert s["seconds"] == pytest.approx(full["seconds"]) and s["tokens_per_s"] == pytest.approx(full["tokens_per_s"])
    assert sb["between_cycles_gpu_ms"]["n"] == fb["between_cycles_gpu_ms"]["n"]
    assert sb["cycle_wall_ms"]["mean"] == pytest.approx(fb["cycle_wall_ms"]["mean"])
    # the phases and draft steps come from cycles 0, 4, 8, ...: 10 of the 40, the same means
    assert {n: ph["gpu_ms"]["n"] for n, ph in sb["phases"].items()} == {n: 10 for n, _ in PHASES}
    assert {n: ph["gpu_ms"]["mean"] for n, ph in sb["phases"].items()} == pytest.approx(dict(PHASES))
    assert [st["n"] for st in sb["draft_steps_gpu_ms"]] == [10, 10, 10]
    assert sb["phase_cycle_gpu_ms"]["n"] == 10
    assert sum(ph["share"] for ph in sb["phases"].values()) == pytest.approx(1.0, abs=1e-3)
    assert s["samples"] and all(smp["phases"] for smp in s["samples"])  # the --trace cycles: timed ones only
    # two events a plain cycle instead of one per mark and step
    per_full, per = full_b.records / 41, b.records / 41
    assert per_full == 1 + len(PHASES) + 4 and per < 0.25 * per_full + 0.75 * 2 + 0.5
    table = format_summary(s)
    assert "phases timed in 10 of 40 cycles" in table


def test_each_batch_size_gets_its_timed_cycles():
    _, _, (s,) = _phase_sampled(4, 30, bs=lambda i: 1 if i % 3 else 8)  # bs 8 in one cycle of 3: 10 of them
    assert s["buckets"]["5-8"]["phases"]["verify"]["gpu_ms"]["n"] == 3  # its 1st, 5th and 9th
    assert s["buckets"]["1"]["phases"]["verify"]["gpu_ms"]["n"] == 5


def test_each_window_times_each_batch_size_by_phase():
    # one bs-2 cycle a window, never the 8th of its size
    _, _, out = _phase_sampled(8, 40, interval=10, bs=lambda i: 2 if i % 10 == 9 else 1)
    assert len(out) == 4
    for s in out:
        assert s["buckets"]["2"]["phases"]["verify"]["gpu_ms"]["n"] == 1
        assert s["buckets"]["1"]["phases"]["verify"]["gpu_ms"]["n"] == 2  # its 1st and 9th of the window


def test_a_stalled_cycle_timed_whole_is_taken_out():
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=20, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False,
                 phases_every=4)
    for i in range(21):
        if i == 6:  # a plain cycle where the device waited 200 ms on the host (a compile)
            run_cycle(p, b, phases=[(n, 200.0 if n == "verify" else ms) for n, ms in PHASES])
        else:
            run_cycle(p, b)
    (s,) = out
    bk = s["buckets"]["1"]
    assert bk["stalled"]["cycles"] == 1 and bk["stalled"]["gpu_ms"] == pytest.approx(8.6 - 6.0 + 200.0)
    assert bk["cycle_gpu_ms"]["n"] == 19 and bk["cycle_gpu_ms"]["max"] == pytest.approx(8.6)
    assert s["seconds"] > 0.2  # still decode time: counted in tokens/s


def test_a_kernel_sample_times_its_cycles_phase_by_phase(monkeypatch):
    from fakes import FakeTorch
    from sglang.specprof.kernel_sampler import KernelSampler

    b = FakeBackend()
    out = []
    p = Profiler(b, interval=5, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False,
                 phases_every=8)
    monkeypatch.setattr(hooks, "P", p)
    monkeypatch.setitem(hooks._state, "paused", None)
    p.kernels = KernelSampler(p, 1, torch_module=FakeTorch(b), swap=hooks.swap)
    seen = []
    for i in range(30):
        hooks.P.begin("decode", 1)  # the sampler's, in the profiler's place, while a sample is on
        s = p.cur
        seen.append((p.kernels.state, s.detail))
        for name, ms in PHASES:
            b.advance(ms)
            hooks.P.mark(name)
        hooks.P.end()
        b.advance(0.4)
        hooks.P.harvest([2])
    assert all(detail for state, detail in seen if state == "running")
    assert any(state == "running" for state, _ in seen)
    assert not all(detail for state, detail in seen if state == "idle")
    assert p.detail_all == (p.kernels.state != "idle")  # back to one in 8 between samples


def test_the_phase_sampling_option_is_checked():
    from sglang.specprof import server_args as spa

    class Args:
        speculative_profile = True
        speculative_algorithm = "EAGLE3"
        speculative_profile_interval = 100
        speculative_profile_output = None
        speculative_profile_phases_every = 0

    with pytest.raises(spa.SpecProfileArgError, match="phases-every must be 1 or more"):
        spa.validate(Args())
    Args.speculative_profile, Args.speculative_profile_phases_every = False, 2
    with pytest.raises(spa.SpecProfileArgError, match="phases-every only takes effect"):
        spa.validate(Args())
    Args.speculative_profile_phases_every = spa.PHASES_EVERY  # the default, unset: fine
    spa.validate(Args())


def test_adaptive_speculation_is_timed_where_the_series_says_so():
    """A release whose series passes each cycle's step count adds the policy field to its
    ServerArgs; elsewhere the profiler refuses --speculative-adaptive, and the policy option
    is refused without what it needs, each in one sentence."""
    from sglang.specprof import server_args as spa

    class Args:  # a release without the adaptive hooks (no speculative_adaptive_policy field)
        speculative_profile = True
        speculative_algorithm = "EAGLE3"
        speculative_profile_interval = 100
        speculative_profile_output = None
        speculative_adaptive = True

    with pytest.raises(spa.SpecProfileArgError, match="times --speculative-adaptive on SGLang 0.5.15 to 0.5.18 only"):
        spa.validate(Args())
    Args.speculative_adaptive = False
    spa.validate(Args())
    Args.speculative_profile, Args.speculative_adaptive = False, True  # adaptive alone: upstream's business
    spa.validate(Args())

    class Timed(Args):  # 0.5.16's series: the field is there
        speculative_profile = True
        speculative_adaptive = True
        speculative_adaptive_policy = None

    spa.validate(Timed())
    Timed.speculative_adaptive_policy = "cost"
    spa.validate(Timed())
    Timed.speculative_profile = False
    with pytest.raises(spa.SpecProfileArgError, match="takes its figures from the profile: add --speculative-profile"):
        spa.validate(Timed())
    Timed.speculative_profile, Timed.speculative_adaptive = True, False
    with pytest.raises(spa.SpecProfileArgError, match="only takes effect with --speculative-adaptive"):
        spa.validate(Timed())
    Timed.speculative_adaptive, Timed.speculative_adaptive_policy = True, "fast"
    with pytest.raises(spa.SpecProfileArgError, match="takes ema or cost, not fast"):
        spa.validate(Timed())


@pytest.mark.parametrize("name", ["SIGTERM", "INT", "SIGCHLD", "SIGSEGV", "SIG_IGN", "HUP", "9", "SIGNOPE"])
def test_a_pause_signal_other_than_usr1_or_usr2_is_refused(name, monkeypatch, caplog):
    """The scheduler's own handlers (SIGTERM, SIGINT, SIGCHLD) and fatal signals stay as they
    are; `SIG_IGN` is a handler, not a signal (it is 1: SIGHUP)."""
    import signal

    monkeypatch.setenv(hooks.PAUSE_SIGNAL_ENV, name)
    kept = [signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGSEGV, signal.SIGHUP, signal.SIGKILL]
    before = [signal.getsignal(s) for s in kept]
    with caplog.at_level(logging.WARNING, logger="sglang.specprof"):
        hooks._follow_pause_signal()
    assert [signal.getsignal(s) for s in kept] == before
    (rec,) = caplog.records
    assert rec.getMessage() == (f"speculative profile: {hooks.PAUSE_SIGNAL_ENV}='{name}' not followed: it takes "
                                f"SIGUSR1 or SIGUSR2 (the other signals are the server's own).")


def test_a_signal_pauses_the_profiler_and_the_next_resumes_it(monkeypatch):
    """SGLANG_SPECPROF_PAUSE_SIGNAL: the hooks go to the null profiler while paused (nothing
    counted), a cycle cut by the pause is dropped, and the counts after the resume are exact."""
    import signal

    b = FakeBackend()
    p = Profiler(b, interval=1000, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False)
    monkeypatch.setattr(hooks, "P", p)
    monkeypatch.setitem(hooks._state, "paused", None)
    monkeypatch.setenv(hooks.PAUSE_SIGNAL_ENV, "USR2")
    old = signal.getsignal(signal.SIGUSR2)
    try:
        hooks._follow_pause_signal()
        reqs = [Req(10**6) for _ in range(2)]

        def cycle(pause_inside=False):
            h = hooks.P
            h.begin("decode", 2)
            b.advance(1.0)
            h.mark("verify")
            if pause_inside:
                os.kill(os.getpid(), signal.SIGUSR2)
            h = hooks.P
            h.end()
            h.harvest([1, 2])
            hooks.P.commit_begin(reqs)
            for r, c in zip(reqs, [1, 2]):
                r.take(c + 1)
            hooks.P.commit_end()

        for _ in range(3):
            cycle()
        assert p.totals_now()["committed_tokens"] == 3 * 5
        cycle(pause_inside=True)  # paused between two of its hooks
        assert hooks.P is not p and not hooks.P.enabled
        for _ in range(4):
            cycle()
        assert p.totals_now()["committed_tokens"] == 3 * 5  # nothing while paused
        os.kill(os.getpid(), signal.SIGUSR2)
        assert hooks.P is p
        for _ in range(5):
            cycle()
        assert p.flush()
        t = p.totals_now()
        assert t["committed_tokens"] == 8 * 5 and p.uncut_cycles == 0
        assert t["decode_cycles"] == 3 + 5  # the cycle cut by the pause: dropped
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_a_window_makes_no_random_generator_until_a_reservoir_fills(monkeypatch):
    """Each window's buckets make dozens of series as its cycles are folded on the scheduler's
    thread; a series makes its reservoir's generator (4 us) only once it holds more samples
    than it keeps, and then samples as one made up front would have."""
    import random

    from sglang_specprof import series, window

    made = []

    class Counted(random.Random):
        def __init__(self, *a):
            made.append(a)
            super().__init__(*a)

    monkeypatch.setattr(series.random, "Random", Counted)
    b = FakeBackend()
    p = Profiler(b, interval=100, config={"num_steps": 3, "worker": "v2"}, clock=b.clock, log_table=False)
    for _ in range(250):
        run_cycle(p, b, bs=2)
    assert p.flush() and made == []

    s = window.Series(seed=7)
    xs = [((i * 7919) % 1000) / 10.0 for i in range(window.SAMPLES_PER_SERIES + 500)]
    for x in xs:
        s.add(x)
    assert made == []  # appended only: the reservoir is filled where it is read
    assert s.n == len(xs) and made == []
    s.settle()
    assert made == [(7,)]
    ref, rng = [], random.Random(7)  # the reservoir with its generator made up front
    for i, x in enumerate(xs, 1):
        if i <= window.SAMPLES_PER_SERIES:
            ref.append(x)
        else:
            j = rng.randrange(i)
            if j < window.SAMPLES_PER_SERIES:
                ref[j] = x
    assert s.samples == ref and s.n == len(xs) and s.max == max(xs)


class StreamsBackend(FakeBackend):
    """A fake GPU with streams: events go to the stream of the last refresh(); one recorded on
    a stream the work no longer runs on completes at once, with no time of the work's (0.0)."""

    def __init__(self):
        super().__init__()
        self.current = 1  # the stream the worker runs on
        self.on = None  # the stream the records go to
        self.refreshes = 0

    def stream_id(self):
        return self.current

    def refresh(self):
        self.refreshes += 1
        self.on = self.current
        return self.on

    def record(self, ev):
        super().record(ev)
        if self.on != self.current:
            ev.t = 0.0


def test_a_cycle_recorded_on_a_stream_the_worker_left_is_dropped_not_timed_wrong():
    """`begin` records on the stream the cycles before ran on and `end` checks it: the cycle
    after the worker moved to another stream is dropped (one, and only it), the next one starts
    on the new stream, and no cycle's time holds the other stream's."""
    b = StreamsBackend()
    out = []
    p = Profiler(b, interval=10, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False)
    for i in range(11):
        if i == 4:
            b.current = 2  # between two cycles the worker's stream changes
        run_cycle(p, b)
    (s,) = out
    bucket = s["buckets"]["1"]
    assert s["dropped_cycles"] == 1
    assert bucket["cycles"] == 9  # 10 lists settle 10 cycles: the dropped one among them, untimed
    whole = sum(ms for _, ms in PHASES)
    assert bucket["cycle_gpu_ms"]["mean"] == pytest.approx(whole) and bucket["cycle_gpu_ms"]["max"] == pytest.approx(whole)
    assert b.refreshes == 3  # the first cycle's, at the change, the next cycle's long way: not one a cycle


def test_an_idle_server_closes_its_open_window_after_a_while(fake):
    from sglang.specprof.profiler import IDLE_CLOSE_S

    ms = IDLE_CLOSE_S * 1000.0
    p, b, out = fake
    for _ in range(13):  # one window of 10, three cycles in the open one
        run_cycle(p, b)
    p.idle()  # the first idle call only notes where things stand
    b.advance(0.0, ms - 1.0)
    p.idle()  # just short of the threshold: not yet
    assert [w["window"] for w in out] == [0] and out[0]["closed_idle"] is False
    b.advance(0.0, 2.0)
    p.idle()
    assert [w["decode_cycles"] for w in out] == [10, 3] and out[1]["closed_idle"] is True
    assert out[1]["totals"]["decode_cycles"] == 13 and out[1]["totals"]["committed_tokens"] == 39
    assert out[1]["buckets"]["1"]["accept"]["committed_tokens"] == 9
    b.advance(0.0, 5000.0)
    p.idle()  # nothing open: nothing more
    assert len(out) == 2
    for _ in range(3):  # cycles after the pause start the next window, which idles again
        run_cycle(p, b)
    p.idle()
    b.advance(0.0, 0.6 * ms)
    run_cycle(p, b)  # a cycle in between: idle from the next call on, not from the first
    p.idle()
    b.advance(0.0, 0.6 * ms)
    p.idle()
    assert len(out) == 2
    b.advance(0.0, 0.6 * ms)
    p.idle()
    assert [w["decode_cycles"] for w in out] == [10, 3, 4] and out[2]["window"] == 2
    assert out[2]["totals"]["committed_tokens"] == 51


def test_with_sleep_on_idle_the_window_closes_at_a_call_clear_of_the_threshold():
    """--sleep-on-idle: upstream's housekeeping runs once a second, each TP rank's in step
    with the others' but each on its own clock, a few hundred microseconds apart. Every rank
    closes at the same call, whatever its offset."""
    closed_at = set()
    for skew_ms in (-0.4, 0.0, 0.3, 0.5):  # each a rank: its calls' times off by this much
        b = FakeBackend()
        out = []
        p = Profiler(b, interval=10, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False)
        for _ in range(3):
            run_cycle(p, b)
        calls = 0
        while not out and calls < 10:
            p.idle()
            calls += 1
            b.advance(0.0, 1000.0 + (skew_ms if calls == 1 else 0.0))  # the poll's 1 s timeout
        closed_at.add(calls)
    assert closed_at == {3}  # the third call, 2 s after the first, for every rank


def test_after_an_idle_close_each_window_holds_the_cycles_of_its_own_lists(fake):
    """v2 launches the next cycle before the last one's result: a cycle is read before the
    list that closes the window before it, and goes to the next window. After a window closed
    idle, with fewer cycles than the interval, the next one still ends `interval` lists on,
    not at a multiple of the interval (which put an eleventh cycle in it, and every window
    after it one cycle off its lists)."""
    p, b, out = fake
    run_overlapped(p, b, 13)
    p.idle()
    b.advance(0.0, 2000.0)
    p.idle()
    run_overlapped(p, b, 25)
    got = [(w["decode_cycles"], w["buckets"]["1"]["cycles"], w["buckets"]["1"]["accept"]["verified_requests"])
           for w in out]
    assert got == [(10, 10, 10), (3, 3, 3), (10, 10, 10), (10, 10, 10)]
    assert [w["closed_idle"] for w in out] == [False, True, False, False]


def test_after_a_pause_the_open_window_keeps_the_cycle_whose_list_was_lost(fake):
    """Paused with a cycle read and its acceptance list not yet given (v2: the next cycle
    launched first), that list is lost: the open window still closes `interval` lists on, so
    it holds that cycle too, and the windows after it hold their own cycles."""
    p, b, out = fake
    run_overlapped(p, b, 15, last=False)
    p.resume()  # the 15th cycle's list never comes
    run_overlapped(p, b, 26)
    got = [(w["buckets"]["1"]["cycles"], w["buckets"]["1"]["accept"]["verified_requests"]) for w in out]
    assert got == [(10, 10), (11, 10), (10, 10), (10, 10)]


def test_idle_leaves_a_cycle_in_flight_or_awaiting_its_commit_alone(fake):
    p, b, out = fake
    for _ in range(3):
        run_cycle(p, b)
    p.begin("decode", 1)  # a cycle that has not ended
    p.idle()
    b.advance(0.0, 3000.0)
    p.idle()
    assert out == []
    p.end()
    p.unsettled.append([2])  # v2: harvested, its commit still to come
    p.idle()
    b.advance(0.0, 3000.0)
    p.idle()
    assert out == []
    p.unsettled.clear()
    p.harvest([2])
    p.idle()
    b.advance(0.0, 3000.0)
    p.idle()
    assert [w["decode_cycles"] for w in out] == [4]
    NullProfiler().idle()  # the flag off: nothing
