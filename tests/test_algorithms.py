"""STANDALONE and NGRAM, profiled on the CPU with fake workers shaped as upstream's.

STANDALONE's worker subclasses the EAGLE worker with a constructor of its own (which does
not call the EAGLE one): the series installs the profiler there, and every other hook is the
EAGLE worker's. NGRAM's cycle (no draft model: drafts matched on the host) is wrapped on the
worker instance from `hooks.idle` (ngram.py): v1-shaped up to 0.5.13.post1 (its verify
appends each request's tokens), v2-shaped from 0.5.14 (the scheduler commits them).
"""
import ast
import contextlib
import re
import types

import pytest

import test_plain
from fakes import FakeBackend

from sglang.specprof import hooks, ngram
from sglang.specprof.profiler import Profiler
from sglang_specprof import report
from sglang_specprof.table import format_summary
from conftest import pinned_wheel
from specprof_build import release


class Mode(test_plain.Mode):
    def is_target_verify(self):
        return self.kind == "verify"


class Req:
    """A request: its output (the prefill's token first), where it stops, whether finished."""

    def __init__(self, max_new, stop_at=None):
        self.rid = id(self)
        self.origin_input_ids = [1] * 16
        self.output_ids = [0]
        self.finished_len = None
        self.finished_reason = None
        self.is_retracted = False
        self.max_new, self.stop_at = max_new, stop_at

    def finished(self):
        return self.finished_reason is not None

    def take(self, n):
        """Append a verified run of n tokens, stopping at the request's stop (as upstream's loops do)."""
        for _ in range(n):
            self.output_ids.append(0)
            if len(self.output_ids) >= self.max_new:
                self.finished_reason, self.finished_len = "length", self.max_new
            elif self.stop_at is not None and len(self.output_ids) >= self.stop_at:
                self.finished_reason, self.finished_len = "stop", self.stop_at
            if self.finished():
                return


class Batch(test_plain.Batch):
    MODE = Mode  # with the verify an NGRAM cycle runs
    SEQ_LEN = 20


class Result:
    def __init__(self, graph):
        self.can_run_cuda_graph = graph


class Target:
    """The target worker: a verify forward of `bs * draft_tokens` tokens, or a prefill."""

    def __init__(self, b, ms=4.0):
        self.b, self.ms, self.calls = b, ms, 0
        self.model_runner = types.SimpleNamespace(decode_cuda_graph_runner=types.SimpleNamespace(bs=8))

    def forward_batch_generation(self, batch, is_verify=False):
        self.calls += 1
        self.b.advance(self.ms + (0.05 * len(batch.reqs) if is_verify else 2.0))
        return Result(is_verify)


class NgramWorker:
    """Upstream's NGRAMWorker, its methods in upstream's order. `accept(i, req)`: the correct
    drafts of request i this cycle. v1 (up to 0.5.13.post1): the verify appends each request's
    tokens and the cache update is `_update_ngram_cache` (0.5.8's name); v2: the scheduler
    commits them, after `on_verify_complete_cpu`."""

    def __init__(self, b, accept, v2):
        self.b, self.accept = b, accept
        self.target_worker = Target(b)
        self.model_runner = self.target_worker.model_runner
        self.cycle = 0
        self.updates = 0
        if v2:
            self.on_verify_complete_cpu = types.MethodType(NgramWorker._on_verify, self)
            self._update_ngram_corpus = self._update
        else:
            self._update_ngram_cache = self._update

    def _on_verify(self, correct, batch_size=0):
        self.verified = list(correct)

    def _prepare_draft_tokens(self, batch):
        self.b.advance(0.0, 0.3)  # the n-gram cache looked up on the host
        return None, None

    def _prepare_for_speculative_decoding(self, batch):
        if not batch.forward_mode.is_decode():
            return
        self._prepare_draft_tokens(batch)
        self.b.advance(0.1)  # the tree's indices and mask, copied and built
        batch.forward_mode = Mode("verify")

    def _update(self, batch):
        self.updates += 1
        self.b.advance(0.0, 0.2)

    def forward_batch_generation(self, batch):
        self._prepare_for_speculative_decoding(batch)
        correct = None
        if batch.forward_mode.is_target_verify():
            self.target_worker.forward_batch_generation(batch, is_verify=True)
            correct = [self.accept(self.cycle, i, r) for i, r in enumerate(batch.reqs)]
            self.b.advance(0.2)  # sampling and acceptance
            if not hasattr(self, "on_verify_complete_cpu"):  # v1: the verify appends, cut at a stop
                for r, c in zip(batch.reqs, correct):
                    r.take(c + 1)
            (self._update_ngram_corpus if hasattr(self, "_update_ngram_corpus") else self._update_ngram_cache)(batch)
            batch.forward_mode = Mode("decode")
            self.cycle += 1
        else:
            self.target_worker.forward_batch_generation(batch)
        return correct


def _accept(cycle, i, req):
    return (cycle + i) % 4  # 0..3 correct drafts of 11


def _serve(p, worker, v2, rounds=6, bs=6):
    """Rounds of `bs` requests, prefilled then decoded to their ends; v2 in the overlap
    scheduler's order (the next forward launched before this one's result is committed).
    Returns the tokens the clients got (the first token of each is the prefill's)."""
    got = 0
    for r in range(rounds):
        reqs = [Req(8 + (i + r) % 9, stop_at=10 if i == 2 else None) for i in range(bs)]
        worker.forward_batch_generation(Batch(reqs, "extend"))
        pending = None
        while any(not q.finished() for q in reqs):
            live = [q for q in reqs if not q.finished()] if not v2 else reqs
            batch = Batch(live)
            correct = worker.forward_batch_generation(batch)
            if v2:
                if pending is not None:
                    _commit(p, worker, *pending)
                pending = (batch, correct)
            else:  # v1: the commit hooks run, and count nothing (the verify appended)
                p.commit_begin(batch.reqs)
                p.commit_end()
        if pending is not None:
            _commit(p, worker, *pending)
        got += sum((q.finished_len or len(q.output_ids)) - 1 for q in reqs)
    return got


def _commit(p, worker, batch, correct):
    """The scheduler's result processing (v2): the accepted lengths to the worker (up to 0.5.11,
    where no worker takes them, to the series' hook in the scheduler's resolve), then the commit."""
    if hasattr(worker, "on_verify_complete_cpu"):
        worker.on_verify_complete_cpu(correct, batch_size=len(batch.reqs))
    else:
        p.harvest(correct)
    p.commit_begin(batch.reqs)
    for r, c in zip(batch.reqs, correct):
        if not (r.finished() or r.is_retracted):
            r.take(c + 1)
    p.commit_end()


def _profiled(v2):
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "NGRAM", "num_steps": None, "num_draft_tokens": 12, "topk": 8,
                         "worker": "v2" if v2 else "v1"})
    worker = NgramWorker(b, _accept, v2)
    assert ngram.worker_kind(worker) == ("v2" if v2 else "v1")
    assert ngram.time_cycles(worker, lambda: p)
    assert not ngram.time_cycles(worker, lambda: p)  # once
    return p, b, worker, out


def _close(p, b):
    p.idle()
    b.advance(0.0, 2000.0)
    p.idle()
    assert p.flush()


@pytest.mark.parametrize("v2", [False, True], ids=["v1-0.5.8-to-0.5.13", "v2-0.5.14-on"])
def test_an_ngram_cycle_is_timed_phase_by_phase_and_commits_what_the_clients_got(v2):
    p, b, worker, out = _profiled(v2)
    got = _serve(p, worker, v2)
    _close(p, b)
    s = report.summarize(out)
    decode = [bk for bk in s["buckets"].values() if bk["cycles"]]
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got == p.tokens["committed_tokens"]
    assert p.uncut_cycles == 0 and p.marks_lost == 0
    for bk in decode:
        assert list(bk["phases"]) == list(ngram.PHASES)
        ph = bk["phases"]
        # the match and the cache update are host work: no GPU time of their own, host time
        assert ph["ngram_match"]["gpu_ms"]["mean"] == 0.0 and ph["ngram_match"]["host_ms"]["mean"] == pytest.approx(0.3)
        assert ph["ngram_update"]["host_ms"]["mean"] == pytest.approx(0.2)
        assert ph["verify_prep"]["gpu_ms"]["mean"] == pytest.approx(0.1)
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.2)
        assert bk["graph"]["replays"].get("verify")  # the target's decode graph replayed for the verify
        assert not bk["draft_steps_gpu_ms"]
    assert s["buckets"] and any(bk.get("prefill_cycles") for bk in s["buckets"].values())
    # per position, from the verify's correct drafts: 0..3 in turn, never past 3
    hist = [0] * 4
    for bk in decode:
        for n, c in enumerate(bk["accept"]["drafts_histogram"]):
            hist[n] += c
    assert hist[0] and hist[3] and all(x == 0 for x in decode[0]["accept"]["per_position"][3:] if x is not None)
    pos = decode[0]["accept"]["per_position"]
    assert pos[0] is not None and 0.0 < pos[0] < 1.0


def test_the_ngram_report_says_the_step_count_advisor_does_not_apply():
    p, b, worker, out = _profiled(True)
    _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    text = report.render(s, report.advise(s))
    assert "advisor: the step-count advisor does not apply to NGRAM" in text
    assert "--speculative-num-steps" not in text and report.advise(s) == {}
    assert text.count("does not apply to NGRAM") == 1  # once, not a line a bucket
    # the live log's table too
    assert "does not apply to NGRAM" in format_summary(out[-1])


def test_a_standalone_profile_gets_the_eagle_advice():
    """STANDALONE's cycles are the EAGLE worker's (a draft model of its own): its model applies."""
    from test_profiler import run_cycle

    b = FakeBackend()
    out = []
    p = Profiler(b, interval=40, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "STANDALONE", "num_steps": 3, "topk": 1, "num_draft_tokens": 4, "worker": "v2"})
    reqs = [Req(10_000) for _ in range(4)]
    for _ in range(40):
        run_cycle(p, b, bs=4, harvest=False)
        _commit(p, types.SimpleNamespace(on_verify_complete_cpu=lambda c, batch_size: p.harvest(c)),
                Batch(reqs), [2, 1, 3, 0])
    assert p.flush() and p.uncut_cycles == 0
    text = format_summary(out[-1])
    assert "advisor: --speculative-num-steps" in text and "does not apply" not in text


def test_the_verify_forward_outside_an_ngram_cycle_is_not_marked():
    p, b, worker, out = _profiled(True)
    before = p.seq
    worker.target_worker.forward_batch_generation(Batch([Req(5)]), is_verify=True)  # another caller
    assert p.cur is None and p.seq == before


# -- installed from the scheduler's idle housekeeping, as on a server ------------------------

def _args(algorithm, steps=3):
    return types.SimpleNamespace(speculative_profile=True, speculative_algorithm=algorithm,
                                 speculative_num_steps=steps, speculative_eagle_topk=8,
                                 speculative_num_draft_tokens=12, speculative_profile_interval=100,
                                 speculative_profile_output=None, tp_size=1, max_running_requests=48)


@contextlib.contextmanager
def idle_installed(monkeypatch, worker, args):
    """A scheduler of `worker` with server arguments `args` runs its idle housekeeping once, as
    before its first request: the profiler it installed and the scheduler (closed after)."""
    test_plain._fake_cuda(monkeypatch)
    sched = types.SimpleNamespace(server_args=args, model_worker=worker, tp_rank=0, waiting_queue=[])
    hooks.idle(sched)
    try:
        yield hooks.P, sched
    finally:
        hooks.P.close()


@pytest.mark.parametrize("v2", [False, True])
def test_idle_installs_the_ngram_profile_and_wraps_its_cycle_once(monkeypatch, v2):
    worker = NgramWorker(FakeBackend(), _accept, v2)
    with idle_installed(monkeypatch, worker, _args("NGRAM")) as (p, sched):
        assert type(p) is Profiler and p.scheduler is sched
        assert p.config["algorithm"] == "NGRAM" and p.config["num_steps"] is None  # no draft steps
        assert p.config["worker"] == ("v2" if v2 else "v1")
        fwd = worker.forward_batch_generation
        assert fwd.specprof_ngram and worker.target_worker.forward_batch_generation.specprof_ngram
        hooks.idle(sched)
        assert hooks.P is p and worker.forward_batch_generation is fwd


def test_the_standalone_constructor_installs_the_eagle_profile_with_its_rank_from_the_runtime(monkeypatch):
    """0.5.22 on: StandaloneWorkerV2's constructor has no rank in scope; `install(args, None)`
    asks SGLang's runtime context, and without one (here) takes rank 0."""
    test_plain._fake_cuda(monkeypatch)
    hooks.install(_args("STANDALONE"), None, "v2")
    try:
        p = hooks.P
        assert type(p) is Profiler and p.rank == 0
        assert p.config["algorithm"] == "STANDALONE" and p.config["num_steps"] == 3
    finally:
        hooks.P.close()


# -- the series: STANDALONE's constructor installs, and every other hook is inherited ----------

# what the STANDALONE workers would have to define for a hook of the EAGLE worker's not to run
HOOKED = {"forward_batch_generation", "draft", "draft_forward", "verify", "_draft_extend_for_decode",
          "forward_draft_extend_after_decode", "on_verify_complete_cpu", "forward_target_extend"}


@pytest.mark.parametrize("version", release.available())
def test_each_series_installs_the_profiler_in_the_standalone_constructors(version):
    rel = release.load(version)
    texts = {p.name: p.read_text() for p in rel.patches}
    for patch, path, cls in (("eagle-v2-profile-hooks.patch", "standalone_worker_v2.py", "StandaloneWorkerV2"),
                             ("eagle-v1-profile-hooks.patch", "standalone_worker.py", "StandaloneWorker")):
        if patch not in texts:
            continue  # 0.5.13 on: no v1 worker
        diff = texts[patch].split(f"diff --git a/sglang/srt/speculative/{path} ")
        assert len(diff) == 2, (version, path)
        added = [ln[1:].strip() for ln in diff[1].splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        worker = "v2" if "v2" in patch else "v1"
        assert added[0] == "from sglang.specprof import hooks as specprof"
        assert re.fullmatch(r'specprof\.install\(server_args, (tp_rank|ps\.tp_rank|get_parallel\(\)\.tp_rank|None), '
                            rf'"{worker}"\)', added[1]), added
        assert len(added) == 2  # the one hook it needs; the others are the EAGLE worker's


@pytest.mark.parametrize("version", release.available())
def test_the_standalone_workers_define_none_of_the_hooked_methods(version):
    """Up to its constructor, each STANDALONE worker is the EAGLE worker: it defines none of
    the methods that carry the EAGLE hooks, so they fire for STANDALONE's cycles too."""
    import zipfile

    with zipfile.ZipFile(pinned_wheel(version)) as z:
        names = [n for n in z.namelist() if re.fullmatch(r"sglang/srt/speculative/standalone_worker(_v2)?\.py", n)]
        assert names
        for n in names:
            tree = ast.parse(z.read(n))
            for cls in (c for c in tree.body if isinstance(c, ast.ClassDef)):
                own = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                assert not own & HOOKED, (version, n, cls.name, own & HOOKED)
                assert [b.id for b in cls.bases if isinstance(b, ast.Name)][0] in (
                    "EAGLEWorker", "EAGLEWorkerV2", "EagleDraftWorker")
