"""--speculative-profile on a server without speculation, and the scheduler's waiting queue.

The scheduler's idle housekeeping hands the Scheduler to `hooks.idle` before its first
request (scheduler-idle-window.patch in every series): on a server without speculation the
plain profile starts there, each decode forward one cycle of one phase, each request's token
settled at the scheduler's commit; on every profiled server the windows count the requests
waiting for a running slot from then on.
"""
import sys
import types
from pathlib import Path

import pytest

from fakes import FakeBackend

from sglang.specprof import hooks
from sglang.specprof.plain import PlainProfiler, time_forwards
from sglang.specprof.profiler import Profiler
from sglang_specprof import compare, report

ROOT = Path(__file__).resolve().parent.parent


class Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_decode(self):
        return self.kind == "decode"

    def is_extend(self):
        return self.kind == "extend"


class Req:
    def __init__(self, want):
        self.origin_input_ids = [0] * 32
        self.output_ids = [0]
        self.finished_len = None
        self.want = want  # tokens it finishes at


class Batch:
    """A batch as the worker's forward takes it: its requests, lengths and forward mode."""

    MODE = Mode
    SEQ_LEN = 1

    def __init__(self, reqs, kind="decode"):
        self.reqs = list(reqs)
        self.seq_lens = [self.SEQ_LEN] * len(self.reqs)
        self.seq_lens_cpu = None
        self.forward_mode = self.MODE(kind)


class Worker:
    """A model worker: its forward takes `ms` of device time (the fake clock)."""

    def __init__(self, backend, ms=lambda bs: 4.0 + 0.01 * bs):
        self.b, self.ms, self.calls = backend, ms, 0

    def forward_batch_generation(self, batch, **kwargs):
        self.calls += 1
        self.b.advance(self.ms(len(batch.seq_lens)))
        return ("result", len(batch.reqs))


class Scheduler:
    """What the plain profile reads of the Scheduler: its arguments, its model worker, its
    waiting queue (rebound by upstream, not only appended to), and the commit of a decode
    batch's tokens with the hooks every series has (process_batch_result_decode)."""

    def __init__(self, worker, args=None):
        self.model_worker = worker
        self.server_args = args
        self.tp_rank = 0
        self.waiting_queue = []

    def commit(self, p, batch):
        p.commit_begin(batch.reqs)
        for r in batch.reqs:
            if r.finished_len is None:
                r.output_ids.append(0)
                if len(r.output_ids) >= r.want:
                    r.finished_len = len(r.output_ids)
        p.commit_end()


def _serve(p, b, sched, rounds=30, bs=8, overlap=True):
    """Decode rounds of `bs` requests in the overlap scheduler's order (forward N+1 launched
    before the result of N is committed); each round's requests finish at 6-13 tokens, so
    finished requests ride along (skipped at the commit). Returns the tokens the clients got."""
    worker = sched.model_worker
    got = 0
    for r in range(rounds):
        reqs = [Req(6 + (i + r) % 8) for i in range(bs)]
        worker.forward_batch_generation(Batch(reqs, "extend"))  # the prefill: its token is not decode's
        pending = None
        while any(q.finished_len is None for q in reqs):
            sched.waiting_queue = [object()] * (3 * r)  # upstream rebinds the list
            batch = Batch(reqs)
            worker.forward_batch_generation(batch)
            if overlap and pending is not None:
                sched.commit(p, pending)
            if not overlap:
                sched.commit(p, batch)
            pending = batch
        if overlap and pending is not None:
            sched.commit(p, pending)
        got += sum(len(q.output_ids) - 1 for q in reqs)
    return got


def _close(p, b):
    """The server idles: the open window closes with what it has (Profiler.idle)."""
    p.idle()
    b.advance(0.0, 2000.0)
    p.idle()
    assert p.flush()


def _plain(interval=40):
    b = FakeBackend()
    out = []
    p = PlainProfiler(b, interval=interval, sink=out.append, clock=b.clock, log_table=False,
                      config={"algorithm": None, "num_steps": None, "worker": "plain"})
    sched = Scheduler(Worker(b))
    assert time_forwards(sched.model_worker, lambda: p)
    assert not time_forwards(sched.model_worker, lambda: p)  # once
    p.scheduler = sched
    return p, b, sched, out


@pytest.mark.parametrize("overlap", [True, False])
def test_a_plain_server_s_forwards_are_cycles_and_its_commits_what_the_clients_got(overlap):
    p, b, sched, out = _plain()
    got = _serve(p, b, sched, overlap=overlap)
    _close(p, b)
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got == p.tokens["committed_tokens"]
    assert p.uncut_cycles == 0
    (key,) = [k for k, bk in s["buckets"].items() if bk["cycles"]]
    bk = s["buckets"][key]
    assert list(bk["phases"]) == ["target_decode"]
    assert bk["phases"]["target_decode"]["gpu_ms"]["mean"] == pytest.approx(4.08)
    assert bk["accept"]["mean_length"] == 1.0 and bk["accept"]["skipped_requests"] > 0
    assert bk["prefill_cycles"] > 0
    # 1 token a request a forward: 8 requests, fewer as they finish, in 4.08 ms each
    assert 0.5 * 8 / 4.08e-3 < bk["tokens_per_s"] <= 8 / 4.08e-3 + 1


def test_the_waiting_queue_is_counted_where_the_scheduler_rebinds_it():
    p, b, sched, out = _plain(interval=1000)
    _serve(p, b, sched, rounds=5)
    _close(p, b)
    sched.waiting_queue = None  # gone: not read, never raises
    w = report.summarize(out)["buckets"]
    (bk,) = [x for x in w.values() if x["cycles"]]
    wq = bk["waiting_requests"]
    assert wq["max"] == 12 and 0 < wq["mean"] < 12 and wq["n"] == bk["cycles"]


def _window_at_cap(waiting, kv=0.25, cap=48):
    bk = {"cycles": 100, "accept": {"verified_requests": 100 * cap, "skipped_requests": 0},
          "kv_used_share": {"mean": kv, "max": kv + 0.02, "n": 100}}
    if waiting is not None:
        bk["waiting_requests"] = {"mean": waiting, "max": waiting + 4 if waiting else 0, "n": 100}
    return {"config": {"max_running_requests": cap}, "buckets": {"33-64": bk}}


def test_the_cap_line_names_the_waiting_requests_and_advises_a_cap_that_runs_them():
    (line,) = report.cap_lines(_window_at_cap(76))
    assert "48.0 requests a cycle against the running-request cap of 48, 76 waiting for a slot (at most 80)" in line
    # the running ones and the most that waited at once: 48 + 80, not 48 + the mean 76 (with
    # 128 requests at once on the H100, 0.5.16: the mean's 102 gained 11%, 128 34%)
    assert "--max-running-requests 128 would run them" in line
    # the pool holds fewer than all: the advice stops where the pool would be 80% full
    (line,) = report.cap_lines(_window_at_cap(200))
    assert "--max-running-requests 142 would run more, the pool filled to about 80%" in line
    # at the cap with nothing waiting: the cap held nothing back
    assert report.cap_lines(_window_at_cap(0)) == []
    # a profile from before the waiting count: judged by the batch alone, as before
    (old,) = report.cap_lines(_window_at_cap(None))
    assert "waiting for a slot" not in old and "--max-running-requests 142 would run more" in old


def _fake_cuda(monkeypatch):
    class Backend(FakeBackend):
        kind = "fake"

    monkeypatch.setitem(sys.modules, "sglang.specprof.cuda_backend", types.SimpleNamespace(CudaBackend=Backend))
    monkeypatch.setattr(hooks, "P", hooks.P)
    monkeypatch.setitem(hooks._state, "scheduler", None)
    monkeypatch.setitem(hooks._state, "warned", False)


def _args(algorithm=None, profile=True):
    return types.SimpleNamespace(speculative_profile=profile, speculative_algorithm=algorithm,
                                 speculative_num_steps=None, speculative_eagle_topk=None,
                                 speculative_num_draft_tokens=None, speculative_profile_interval=100,
                                 speculative_profile_output=None, tp_size=1, max_running_requests=128)


def test_idle_starts_the_plain_profile_on_a_server_without_speculation_once(monkeypatch):
    _fake_cuda(monkeypatch)
    sched = Scheduler(Worker(FakeBackend()), _args())
    hooks.idle(sched)
    try:
        p = hooks.P
        assert isinstance(p, PlainProfiler) and p.scheduler is sched and p.config["worker"] == "plain"
        fwd = sched.model_worker.forward_batch_generation
        assert fwd.specprof_plain
        hooks.idle(sched)  # every idle call after: the same profiler, wrapped once
        assert hooks.P is p and sched.model_worker.forward_batch_generation is fwd
        # a forward of an unknown kind passes through untimed
        before = p.seq
        assert fwd(Batch([Req(5)], "idle"))[0] == "result" and p.seq == before
    finally:
        hooks.P.close()


@pytest.mark.parametrize("args", [_args(profile=False), _args("EAGLE3")])
def test_idle_starts_nothing_without_the_flag_or_beside_the_eagle_worker_s_profiler(monkeypatch, args):
    _fake_cuda(monkeypatch)
    sched = Scheduler(Worker(FakeBackend()), args)
    eagle = None
    if args.speculative_algorithm:  # the EAGLE worker's constructor installed its profiler
        hooks.install(args, 0, "v2")
        eagle = hooks.P
    try:
        hooks.idle(sched)
        assert hooks.P is eagle if eagle is not None else not hooks.P.enabled
        assert not hasattr(sched.model_worker.forward_batch_generation, "specprof_plain")
        if eagle is not None:
            assert type(eagle) is Profiler and eagle.scheduler is sched  # its queue read from now on
    finally:
        if eagle is not None:
            eagle.close()


def test_compare_puts_the_zero_step_tax_beside_a_plain_server():
    """A bucket at 0 steps of a speculative server against a plain one: the tax, by part."""
    def window(worker, phases, tps):
        b = {"cycles": 100, "phases": {n: {"gpu_ms": {"mean": v, "n": 100}} for n, v in phases.items()},
             "cycle_wall_ms": {"mean": sum(phases.values()), "n": 100},
             "accept": {"mean_length": 1.0, "verified_requests": 800, "committed_tokens": 800},
             "tokens_per_s": tps}
        key = "5-8@0" if worker == "v2" else "5-8"
        return {"config": {"worker": worker, "num_steps": 3 if worker == "v2" else None, "adaptive": worker == "v2"},
                "buckets": {key: b}}

    spec = [window("v2", {"draft_extend_prep": 0.05, "draft_extend": 0.45, "verify_prep": 0.1, "verify": 4.3,
                          "accept": 0.1}, 1600.0)] * 3
    plain = [window("plain", {"target_decode": 4.4}, 1818.0)] * 3
    res = compare.compare(spec, plain)
    tax = res["zero_step_tax"]["5-8@0"]
    assert tax["plain_gpu_ms"] == 4.4 and tax["step0_gpu_ms"] == pytest.approx(5.0)
    assert tax["tax"] == pytest.approx(5.0 / 4.4 - 1, abs=1e-4)
    assert tax["parts_gpu_ms"] == {"draft extend": 0.5, "verify": 4.4, "the rest": 0.1}
    assert tax["verify_over_plain"] == 0.0 and tax["tokens_per_s_ratio"] == pytest.approx(1600 / 1818, abs=1e-4)
    text = compare.format_compare(res, "a", "b")
    assert "bs 5-8@0: 5.000 against 4.400 (+13.6%): draft extend 0.500, verify 4.400, the rest 0.100" in text
    # two speculative profiles: no tax
    assert "zero_step_tax" not in compare.compare(spec, spec)


def test_recorded_zero_step_tax_is_the_draft_extend():
    """The closed loop's profiles on the GPU (0.5.16, 8B-shaped pair, 2026-12-05): the speculative
    server run at 0 steps against a profiled server without speculation, each bucket the two share.
    The verify at 0 steps runs the plain decode forward (within 3%), so the tax is the draft extend
    the step-0 cycle keeps running: above 10% of a plain forward at every batch size, and no
    more than 0.1 ms a cycle besides it."""
    from sglang_specprof import schema

    data = ROOT / "tests" / "data" / "zero-step" / "0.5.16-h100"
    spec, _ = schema.read(str(data / "profile-spec.jsonl.xz"))
    plain, _ = schema.read(str(data / "profile-plain.jsonl.xz"))
    res = compare.compare(spec, plain)
    taxes = res["zero_step_tax"]
    assert {"1@0", "17-32@0", "65-128@0"} <= set(taxes)
    for key, tax in taxes.items():
        parts = tax["parts_gpu_ms"]
        assert abs(tax["verify_over_plain"]) <= 0.03, key
        assert tax["tax"] > 0.10, key
        assert parts["the rest"] < 0.1, key
        extend = parts["draft extend"]
        assert extend / (tax["step0_gpu_ms"] - tax["plain_gpu_ms"]) > 0.8, key
        assert extend / tax["plain_gpu_ms"] > 0.10, key
