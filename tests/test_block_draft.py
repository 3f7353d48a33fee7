"""The block drafters, DFLASH (DFlashWorkerV2, 0.5.14 on) and DSPARK (DSparkWorkerV2, 0.5.16 on),
profiled on the CPU with fake workers shaped as upstream's: each cycle wrapped on the instances
from `hooks.idle` (block_draft.py): the worker, its draft model runner, its target worker, and
DSPARK's verify executor and KV injector."""
import ast
import types

import pytest
from packaging.version import Version

from fakes import FakeBackend
from conftest import pinned_wheel
from specprof_build import release
from test_algorithms import Batch, Req, _accept, _args, _close, _serve, idle_installed
from test_multilayer import assert_no_and_every_draft_accepted, prefill_phases, prefills_of, served_exactly

from sglang.specprof import block_draft, hooks
from sglang.specprof.profiler import Profiler
from sglang_specprof import report

RUNNER = types.SimpleNamespace(bs=8)  # the target's decode graph runner
DECODE = ["draft_prep", "draft", "verify_prep", "verify", "accept", "draft_kv"]


class DraftModelRunner:
    """The draft's ModelRunner: one forward over the block, a graph up to `most` requests."""

    def __init__(self, b, most):
        self.b, self.most = b, most

    def forward(self, forward_batch):
        graph = len(forward_batch.reqs) <= self.most
        self.b.advance(0.4 if graph else 0.6)
        return types.SimpleNamespace(can_run_graph=graph, logits_output="logits")


class TargetWorker:
    def __init__(self, b):
        self.b = b
        self.model_runner = types.SimpleNamespace(decode_cuda_graph_runner=RUNNER)

    def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False, **kwargs):
        n = len((batch or forward_batch).reqs)
        self.b.advance((4.0 + 0.05 * n) if is_verify else 6.0)
        return types.SimpleNamespace(can_run_cuda_graph=is_verify, logits_output="logits")


class BlockWorker:
    """What both workers share: BaseSpecWorker's do-nothing on_verify_complete_cpu."""

    def __init__(self, b, accept, graph_most):
        self.b, self.accept = b, accept
        self.draft_model_runner = DraftModelRunner(b, graph_most)
        self._target = TargetWorker(b)
        self.cycle = 0
        self.verified = None

    @property
    def target_worker(self):
        return self._target

    def on_verify_complete_cpu(self, correct, batch_size=0):
        self.verified = list(correct)

    def _correct(self, batch):
        self.cycle += 1
        return [self.accept(self.cycle - 1, i, r) for i, r in enumerate(batch.reqs)]


class DFlashWorkerV2(BlockWorker):
    """Upstream's cycle, inline in forward_batch_generation."""

    def _append_target_hidden_to_draft_kv_by_loc(self, target_hidden=None, **kwargs):
        self.b.advance(0.15)

    def forward_batch_generation(self, batch, on_publish=None):
        if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            self.target_worker.forward_batch_generation(batch, capture_hidden_mode="full")
            self._append_target_hidden_to_draft_kv_by_loc(target_hidden="hidden")
            return None
        self.b.advance(0.05)  # the block's inputs
        self.draft_model_runner.forward(batch)
        self.b.advance(0.03)  # the block sampled, the verify's input prepared
        self.target_worker.forward_batch_generation(batch=None, forward_batch=batch, is_verify=True,
                                                    skip_attn_backend_init=True)
        self.b.advance(0.08)  # the accepted prefix and the bonus
        self._append_target_hidden_to_draft_kv_by_loc(target_hidden="hidden")
        return self._correct(batch)


class KvInjector:
    def __init__(self, b):
        self.b = b

    def inject_target_hidden(self, **kwargs):
        self.b.advance(0.15)


class VerifyExecutor:
    def __init__(self, worker):
        self.w = worker

    def run_non_compact(self, batch):
        self.w.b.advance(0.03)
        return self.w.target_worker.forward_batch_generation(batch=None, forward_batch=batch, is_verify=True)

    def accept_and_finalize(self, batch):
        self.w.b.advance(0.08)
        return "accept"

    def commit_hidden(self, batch):
        self.w.b.advance(0.01)
        self.w._kv_injector.inject_target_hidden(target_hidden="hidden")


class Proposer:
    def __init__(self, worker):
        self.w = worker

    def propose(self, batch):
        self.w.b.advance(0.05)
        return self.w.draft_model_runner.forward(batch)


class DSparkWorkerV2(BlockWorker):
    """Upstream's cycle, its work in component objects held on the worker; `folded`: 0.5.23's
    sampling-accept graph with the commit folded in (neither accept_and_finalize nor commit_hidden)."""

    def __init__(self, b, accept, graph_most, folded=False):
        super().__init__(b, accept, graph_most)
        self._kv_injector = KvInjector(b)
        self._proposer = Proposer(self)
        self._verify_executor = VerifyExecutor(self)
        self.folded = folded

    def forward_batch_generation(self, batch, on_publish=None):
        if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            self.target_worker.forward_batch_generation(batch, capture_hidden_mode="full")
            self._kv_injector.inject_target_hidden(target_hidden="hidden")
            return None
        self._proposer.propose(batch)
        self._verify_executor.run_non_compact(batch)
        if self.folded:
            self.b.advance(0.25)  # the sampling-accept graph: acceptance and the draft KV
        else:
            self._verify_executor.accept_and_finalize(batch)
            self._verify_executor.commit_hidden(batch)
        return self._correct(batch)


class DFlashWorker(BlockWorker):
    """0.5.11 to 0.5.13: the v1 worker (no overlap scheduler), its verify appending each
    request's tokens (cut at its stop), the committed tokens appended to the draft's KV before
    the next block's draft and after the verify; no on_verify_complete_cpu (`__getattr__` to the
    target worker, which has none)."""

    on_verify_complete_cpu = property(lambda self: (_ for _ in ()).throw(AttributeError("on_verify_complete_cpu")))

    def _append_target_hidden_to_draft_kv(self, batch, draft_input):
        self.b.advance(0.15)

    def forward_batch_generation(self, batch, **kwargs):
        if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            self.target_worker.forward_batch_generation(batch)
            self._append_target_hidden_to_draft_kv(batch, "draft_input")
            return None
        self.b.advance(0.02)  # _prepare_for_speculative_decoding: what the last verify committed, then
        self._append_target_hidden_to_draft_kv(batch, "draft_input")
        self.b.advance(0.03)  # the block's ids, embeddings, positions
        self.draft_model_runner.forward(batch)
        self.b.advance(0.03)  # the block sampled, prepare_for_verify
        self.target_worker.forward_batch_generation(batch, is_verify=True)
        self.b.advance(0.08)  # verify_input.verify: the accepted prefix appended to each request
        correct = self._correct(batch)
        for r, c in zip(batch.reqs, correct):
            r.take(c + 1)
        self._append_target_hidden_to_draft_kv(batch, "draft_input")
        return correct


WORKERS = {"DFLASH": DFlashWorkerV2, "DSPARK": DSparkWorkerV2}


def _profiled(monkeypatch, algorithm, graph_most=16, shape=None):
    b = FakeBackend()
    out = []
    worker = (shape or WORKERS[algorithm])(b, _accept, graph_most)
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": algorithm, "num_steps": 1, "num_draft_tokens": 8, "topk": 1,
                         "worker": block_draft.worker_kind(worker)})
    monkeypatch.setattr(hooks, "P", p)
    assert block_draft.is_worker(worker)
    assert block_draft.time_cycles(worker, lambda: p)
    assert not block_draft.time_cycles(worker, lambda: p)  # once
    return p, b, worker, out


@pytest.mark.parametrize("algorithm", WORKERS)
@pytest.mark.parametrize("graph_most", [16, 4], ids=["graphs", "graphs-and-eager"])
def test_a_block_cycle_is_timed_phase_by_phase_and_commits_what_the_clients_got(monkeypatch, algorithm, graph_most):
    p, b, worker, out = _profiled(monkeypatch, algorithm, graph_most)
    decode = served_exactly(p, b, worker, out, smaller=True)  # batches of 6, then of 3
    for bk in decode:
        ph = bk["phases"]
        assert list(ph) == DECODE
        assert ph["draft_prep"]["gpu_ms"]["mean"] == pytest.approx(0.05)
        assert ph["verify_prep"]["gpu_ms"]["mean"] == pytest.approx(0.03)
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.08)
        assert ph["draft_kv"]["gpu_ms"]["mean"] == pytest.approx(0.15 if algorithm == "DFLASH" else 0.16)
        assert bk["graph"]["replays"].get("verify") == bk["cycles"]
        replays = bk["graph"]["replays"].get("draft", 0)
        assert replays + bk["graph"]["eager"]["draft"] == bk["cycles"]
        if replays in (0, bk["cycles"]):
            assert ph["draft"]["gpu_ms"]["mean"] == pytest.approx(0.4 if replays else 0.6)
    eager = sum(bk["graph"]["eager"]["draft"] for bk in decode)
    assert (eager > 0) == (graph_most < 6)
    assert_no_and_every_draft_accepted(decode)
    assert worker.verified is not None  # upstream's own on_verify_complete_cpu still runs


@pytest.mark.parametrize("graph_most", [16, 4], ids=["graphs", "graphs-and-eager"])
def test_dflash_s_v1_worker_is_timed_alike_and_commits_what_the_clients_got(monkeypatch, graph_most):
    """0.5.11 to 0.5.13: the v1 worker, no overlap scheduler. The same phases as v2's; the append
    of what the last verify committed, before the block's draft, stays inside draft_prep; the
    correct drafts are what each request's output grew by (cut at its stop), less the bonus."""
    p, b, worker, out = _profiled(monkeypatch, "DFLASH", graph_most, shape=DFlashWorker)
    assert block_draft.worker_kind(worker) == "v1" and p.config["worker"] == "v1"
    decode = served_exactly(p, b, worker, out, v2=False, smaller=True)
    for bk in decode:
        ph = bk["phases"]
        assert list(ph) == DECODE
        assert ph["draft_prep"]["gpu_ms"]["mean"] == pytest.approx(0.2)
        assert ph["verify_prep"]["gpu_ms"]["mean"] == pytest.approx(0.03)
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.08)
        assert ph["draft_kv"]["gpu_ms"]["mean"] == pytest.approx(0.15)
        assert bk["graph"]["replays"].get("verify") == bk["cycles"]
        assert bk["graph"]["replays"].get("draft", 0) + bk["graph"]["eager"]["draft"] == bk["cycles"]
    assert_no_and_every_draft_accepted(decode)
    prefill = prefills_of(out)
    assert list(prefill) == ["target_extend", "draft_kv"], prefill
    assert prefill["target_extend"]["mean"] == pytest.approx(6.0) and prefill["draft_kv"]["mean"] == pytest.approx(0.15)


def test_idle_installs_a_v1_profile_on_a_v1_dflash_server(monkeypatch):
    worker = DFlashWorker(FakeBackend(), _accept, 16)
    with idle_installed(monkeypatch, worker, _args("DFLASH")) as (p, _):
        assert type(p) is Profiler and p.config["worker"] == "v1" and not p.settle_on_commit
        assert worker.forward_batch_generation.specprof_block and worker._append_target_hidden_to_draft_kv.specprof_block


@pytest.mark.parametrize("algorithm", WORKERS)
def test_the_prefill_is_the_target_s_extend_then_the_draft_s_kv(monkeypatch, algorithm):
    phases = prefill_phases(*_profiled(monkeypatch, algorithm))
    assert list(phases) == ["target_extend", "draft_kv"], phases
    assert phases["target_extend"]["mean"] == pytest.approx(6.0)
    assert phases["draft_kv"]["mean"] == pytest.approx(0.15)


@pytest.mark.parametrize("algorithm", WORKERS)
def test_calls_outside_a_cycle_are_not_marked_and_a_paused_profile_leaves_the_worker_running(monkeypatch, algorithm):
    p, b, worker, out = _profiled(monkeypatch, algorithm)
    before = p.seq
    worker.draft_model_runner.forward(Batch([Req(5)]))  # another caller: no cycle
    worker.target_worker.forward_batch_generation(Batch([Req(5)]))
    assert p.cur is None and p.seq == before
    null = hooks.NullProfiler()
    monkeypatch.setattr(hooks, "P", null)
    w2 = WORKERS[algorithm](FakeBackend(), _accept, 16)
    block_draft.time_cycles(w2, lambda: null)
    assert w2.forward_batch_generation(Batch([Req(5), Req(5)])) == [0, 1]


@pytest.mark.parametrize("algorithm", WORKERS)
def test_idle_installs_the_profile_and_wraps_the_cycle_once_and_the_report_says_what_the_advisor_cannot(
        monkeypatch, algorithm):
    worker = WORKERS[algorithm](FakeBackend(), _accept, 16)
    with idle_installed(monkeypatch, worker, _args(algorithm, steps=1)) as (p, sched):
        assert type(p) is Profiler and p.scheduler is sched
        assert p.config["algorithm"] == algorithm and p.config["worker"] == "v2"
        fwd = worker.forward_batch_generation
        assert fwd.specprof_block and worker.draft_model_runner.forward.specprof_block
        hooks.idle(sched)
        assert hooks.P is p and worker.forward_batch_generation is fwd
    p, b, worker, out = _profiled(monkeypatch, algorithm)
    _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    text = report.render(s, report.advise(s))
    assert report.advise(s) == {} and "--speculative-num-steps" not in text
    assert text.count(f"does not apply to {algorithm}") == 1
    assert f"--speculative-{algorithm.lower()}-block-size" in text


def _classes(z, path):
    return {c.name: c for c in ast.parse(z.read(path)).body if isinstance(c, ast.ClassDef)}


def _methods(c):
    return {f.name for f in c.body if isinstance(f, ast.FunctionDef)}


@pytest.mark.parametrize("version", release.available())
def test_each_release_s_block_drafters_are_what_the_wrappers_take(version):
    """Read from each pinned wheel: DFLASH's v1 worker from 0.5.11 to 0.5.13 and its v2 worker
    from 0.5.14, DSPARK's from 0.5.16; each has the methods and components block_draft.py wraps,
    its draft model runner and target verify called as the wrappers expect; the v2 workers have
    no on_verify_complete_cpu of their own (BaseSpecWorker's: wrapped), the v1 worker none at all,
    and its verify appends each request's tokens (what `wrapping.worker_cycle` counts)."""
    import zipfile

    spec = "sglang/srt/speculative/"
    v = Version(version)
    with zipfile.ZipFile(pinned_wheel(version)) as z:
        names = set(z.namelist())
        v1 = spec + "dflash_worker.py"
        assert (v1 in names) == (Version("0.5.11") <= v < Version("0.5.14")), version
        if v1 in names:
            worker = _classes(z, v1)["DFlashWorker"]
            fwd = next(f for f in worker.body if isinstance(f, ast.FunctionDef) and f.name == "forward_batch_generation")
            calls = [ast.unparse(n.func) for n in ast.walk(fwd) if isinstance(n, ast.Call)]
            # the cycle: the block drafted in _prepare_for_speculative_decoding, the target's verify,
            # the acceptance, then the committed tokens appended to the draft's KV (and in a prefill)
            assert calls.count("self._append_target_hidden_to_draft_kv") == 2, version
            assert "self._prepare_for_speculative_decoding" in calls and "verify_input.verify" in calls
            source = z.read(v1).decode()
            assert "is_verify=True" in source and "self.draft_model_runner.forward(" in source
            assert "on_verify_complete_cpu" not in source and "BaseSpecWorker" not in source
            prep = next(f for f in worker.body if isinstance(f, ast.FunctionDef)
                        and f.name == "_prepare_for_speculative_decoding")
            prep_calls = [ast.unparse(n.func) for n in ast.walk(prep) if isinstance(n, ast.Call)]
            assert "self._append_target_hidden_to_draft_kv" in prep_calls and "self.draft_model_runner.forward" in prep_calls
            assert "req.output_ids.append(" in z.read(spec + "dflash_info.py").decode()
        dflash = spec + "dflash_worker_v2.py"
        assert (dflash in names) == (v >= Version("0.5.14")), version
        if dflash in names:
            worker = _classes(z, dflash)["DFlashWorkerV2"]
            assert {"forward_batch_generation", "_append_target_hidden_to_draft_kv_by_loc"} <= _methods(worker)
            assert "on_verify_complete_cpu" not in _methods(worker)
            source = z.read(dflash).decode()
            assert "self.draft_model_runner.forward(" in source and "is_verify=True" in source
            assert "self.draft_model_runner = " in source
        dspark = spec + "dspark_components/dspark_worker_v2.py"
        assert (dspark in names) == (Version(version) >= Version("0.5.16")), version
        if dspark in names:
            worker = _classes(z, dspark)["DSparkWorkerV2"]
            assert "forward_batch_generation" in _methods(worker) and "on_verify_complete_cpu" not in _methods(worker)
            source = z.read(dspark).decode()
            for attr in ("self.draft_model_runner = ", "self._verify_executor = ", "self._kv_injector = ",
                         "self._verify_executor.accept_and_finalize(", "self._verify_executor.commit_hidden("):
                assert attr in source, (version, attr)
            executor = _classes(z, spec + "dspark_components/dspark_verify.py")["TargetVerifyExecutor"]
            assert {"accept_and_finalize", "commit_hidden", "run_non_compact", "run_compact"} <= _methods(executor)
            injector = _classes(z, spec + "dspark_components/dspark_kv_inject.py")["TargetHiddenKvInjector"]
            assert "inject_target_hidden" in _methods(injector)
            draft = z.read(spec + "dspark_components/dspark_draft.py").decode()
            assert "self.draft_model_runner.forward(" in draft


def test_a_dspark_cycle_whose_acceptance_and_kv_a_graph_holds_is_closed_by_accept(monkeypatch):
    """0.5.23 can fold the acceptance and the draft KV into a graph of their own: no wrapped call
    marks them, and without a closing mark their time would fall between the cycles."""
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "DSPARK", "num_steps": 1, "num_draft_tokens": 8, "topk": 1, "worker": "v2"})
    monkeypatch.setattr(hooks, "P", p)
    worker = DSparkWorkerV2(b, _accept, 16, folded=True)
    block_draft.time_cycles(worker, lambda: p)
    got = _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got
    for bk in (bk for bk in s["buckets"].values() if bk["cycles"]):
        assert list(bk["phases"]) == ["draft_prep", "draft", "verify_prep", "verify", "accept"]
        assert bk["phases"]["accept"]["gpu_ms"]["mean"] == pytest.approx(0.25)
