"""FROZEN_KV_MTP (FrozenKVMTPWorkerV2, 0.5.14 on), profiled on the CPU with a fake worker shaped
as upstream's: its cycle wrapped on the instances from `hooks.idle` (frozen_kv.py), the verify's
marks and the acceptance from the series' hooks in the EAGLE v2 verify and
`on_verify_complete_cpu` it inherits."""
import ast
import types

import pytest
from packaging.version import Version

import test_plain
from fakes import FakeBackend
from conftest import pinned_wheel
from specprof_build import release
from test_algorithms import Batch, Req, _accept, _args, _close, _serve
from test_multilayer import MultiLayerEagleWorkerV2, assert_no_and_every_draft_accepted, prefill_phases

from sglang.specprof import frozen_kv, hooks
from sglang.specprof import server_args as spa
from sglang.specprof.profiler import Profiler
from sglang_specprof import report

class DraftGraph:
    """FrozenKVMTPCudaGraphRunner: the assistant's steps replayed, batch sizes up to `most`."""

    def __init__(self, b, most):
        self.b, self.bs, self.most = b, most, most

    def can_run_graph(self, forward_batch):
        return len(forward_batch.reqs) <= self.most

    def execute(self, forward_batch):
        self.b.advance(0.3)
        return "parents", "scores", "tokens"


class DraftWorker:
    """FrozenKVMTPDraftWorker: the draft input prepared, the assistant's steps (graph or eager),
    the tree; the draft extend picks the next seed (no forward)."""

    def __init__(self, b, graph_most):
        self.b = b
        self.cuda_graph_runner = DraftGraph(b, graph_most) if graph_most else None
        self.eager = 0

    def draft_forward(self, forward_batch):
        self.eager += 1
        self.b.advance(0.5)
        return "parents", "scores", "tokens"

    def draft(self, batch):
        self.b.advance(0.04)  # ForwardBatch.init_new, positions
        if self.cuda_graph_runner and self.cuda_graph_runner.can_run_graph(batch):
            self.cuda_graph_runner.execute(batch)
        else:
            self.draft_forward(batch)
        self.b.advance(0.02)  # build_tree_kernel_efficient, the verify input
        return "verify_input"

    def _draft_extend_for_decode(self, batch, batch_result):
        self.b.advance(0.01)

    def _draft_extend_for_prefill(self, batch, hidden_states, next_token_ids, mm_input_embeds=None):
        self.b.advance(0.01)
        return "seed"


class EAGLEWorkerV2:
    """What FROZEN_KV_MTP inherits, with the series' hooks: the verify (as multi-layer EAGLE's,
    run_eagle_verify) and the harvest."""

    verify = MultiLayerEagleWorkerV2.verify

    def on_verify_complete_cpu(self, correct, batch_size=0):
        hooks.P.harvest(correct)
        self.verified = list(correct)


class FrozenKVMTPWorkerV2(EAGLEWorkerV2):
    """Upstream's worker, its calls in upstream's order."""

    def __init__(self, b, accept, graph_most=16, steps=3):
        self.b, self.accept = b, accept
        self.speculative_num_steps = steps
        self._draft_worker = DraftWorker(b, graph_most)
        self.cycle = 0
        self.verified = None

    @property
    def draft_worker(self):
        return self._draft_worker

    def forward_batch_generation(self, batch, on_publish=None):
        if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            self.b.advance(6.0)  # the target's prefill, capturing the hidden states
            self.draft_worker._draft_extend_for_prefill(batch, "hidden", "ids")
            return None
        self.draft_worker.draft(batch)
        correct = self.verify(batch)
        self.draft_worker._draft_extend_for_decode(batch, correct)
        self.cycle += 1
        return correct


def _profiled(monkeypatch, graph_most=16):
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "FROZEN_KV_MTP", "num_steps": 3, "num_draft_tokens": 4, "topk": 1,
                         "worker": "v2"})
    monkeypatch.setattr(hooks, "P", p)  # the series' hooks in the inherited methods call the installed profiler
    worker = FrozenKVMTPWorkerV2(b, _accept, graph_most)
    assert frozen_kv.is_worker(worker)
    assert frozen_kv.time_cycles(worker, lambda: p)
    assert not frozen_kv.time_cycles(worker, lambda: p)  # once
    return p, b, worker, out


@pytest.mark.parametrize("graph_most", [16, 4, 0], ids=["graphs", "graphs-and-eager", "no-graph"])
def test_a_frozen_kv_cycle_is_timed_phase_by_phase_and_commits_what_the_clients_got(monkeypatch, graph_most):
    p, b, worker, out = _profiled(monkeypatch, graph_most)
    got = _serve(p, worker, True) + _serve(p, worker, True, rounds=2, bs=3)  # batches of 6, then of 3
    _close(p, b)
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got == p.tokens["committed_tokens"]
    assert p.uncut_cycles == 0 and p.marks_lost == 0
    decode = {k: bk for k, bk in s["buckets"].items() if bk["cycles"]}
    assert decode
    for bk in decode.values():
        ph = bk["phases"]
        assert list(ph) == ["draft", "tree", "verify_prep", "verify", "accept", "draft_extend"]
        assert ph["tree"]["gpu_ms"]["mean"] == pytest.approx(0.02)
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.2)
        assert ph["draft_extend"]["gpu_ms"]["mean"] == pytest.approx(0.01)
        assert bk["graph"]["replays"].get("verify") == bk["cycles"]
        # the assistant's steps: the graph's replays and the eager runs counted; the draft's time
        # is the preparation and the steps (a replay 0.3 ms, eager 0.5)
        replays = bk["graph"]["replays"].get("draft", 0)
        assert replays + bk["graph"]["eager"]["draft"] == bk["cycles"]
        if replays in (0, bk["cycles"]):
            assert ph["draft"]["gpu_ms"]["mean"] == pytest.approx(0.34 if replays else 0.54)
    replays = sum(bk["graph"]["replays"].get("draft", 0) for bk in decode.values())
    eager = sum(bk["graph"]["eager"]["draft"] for bk in decode.values())
    assert eager == worker.draft_worker.eager  # every eager run counted, and only those
    assert (replays > 0) == bool(graph_most) and (eager > 0) == (graph_most < 6)
    prefill = [bk for bk in s["buckets"].values() if bk.get("prefill_cycles")]
    assert prefill
    assert_no_and_every_draft_accepted(decode.values())
    assert worker.verified is not None  # upstream's own on_verify_complete_cpu still runs


def test_the_prefill_is_the_target_s_extend_then_the_seed(monkeypatch):
    phases = prefill_phases(*_profiled(monkeypatch))
    assert list(phases) == ["target_extend", "draft_extend"], phases
    assert phases["target_extend"]["mean"] == pytest.approx(6.0)
    assert phases["draft_extend"]["mean"] == pytest.approx(0.01)


def test_marks_outside_a_cycle_are_not_taken_and_a_paused_profile_leaves_the_worker_running(monkeypatch):
    p, b, worker, out = _profiled(monkeypatch)
    before = p.seq
    worker.draft_worker.draft(Batch([Req(5)]))  # another caller: no cycle
    assert p.cur is None and p.seq == before
    null = hooks.NullProfiler()
    monkeypatch.setattr(hooks, "P", null)
    w2 = FrozenKVMTPWorkerV2(FakeBackend(), _accept)
    frozen_kv.time_cycles(w2, lambda: null)
    assert w2.forward_batch_generation(Batch([Req(5), Req(5)])) == [0, 1]


def test_idle_installs_the_profile_on_a_frozen_kv_server_and_wraps_its_cycle_once(monkeypatch):
    test_plain._fake_cuda(monkeypatch)
    worker = FrozenKVMTPWorkerV2(FakeBackend(), _accept)
    sched = types.SimpleNamespace(server_args=_args("FROZEN_KV_MTP"), model_worker=worker, tp_rank=0,
                                  waiting_queue=[])
    hooks.idle(sched)
    try:
        p = hooks.P
        assert type(p) is Profiler and p.scheduler is sched
        assert p.config["algorithm"] == "FROZEN_KV_MTP" and p.config["worker"] == "v2" and p.config["num_steps"] == 3
        fwd = worker.forward_batch_generation
        assert fwd.specprof_frozen_kv and worker.draft_worker.cuda_graph_runner.execute.specprof_frozen_kv
        hooks.idle(sched)
        assert hooks.P is p and worker.forward_batch_generation is fwd
    finally:
        hooks.P.close()


def test_the_report_says_the_step_count_advisor_does_not_apply(monkeypatch):
    """The assistant's steps run inside one graph of the worker's own runner: the profile times them
    whole (draft), so the advisor, which weighs each step's cost, advises nothing and says why."""
    p, b, worker, out = _profiled(monkeypatch)
    _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    text = report.render(s, report.advise(s))
    assert report.advise(s) == {} and "--speculative-num-steps" not in text
    assert text.count("does not apply to FROZEN_KV_MTP") == 1
    assert "[FROZEN_KV_MTP v2 steps=3 topk=1 draft_tokens=4]" in text


@pytest.mark.parametrize("version, timed", [("0.5.13.post1", False), ("0.5.14", True), ("0.5.23", True),
                                            ("0.5.12", False), ("", False)])
def test_frozen_kv_is_timed_from_0_5_14(version, timed):
    assert spa.frozen_kv_timed(version) is timed


@pytest.mark.parametrize("version", release.available())
def test_each_release_s_frozen_kv_worker_is_what_the_wrappers_take(version):
    """Read from each pinned wheel: the releases the startup check takes are those whose
    FROZEN_KV_MTP worker is an EAGLEWorkerV2 (its verify and on_verify_complete_cpu EAGLE v2's,
    which carry the series' hooks) and has the methods frozen_kv.py wraps."""
    import zipfile

    with zipfile.ZipFile(pinned_wheel(version)) as z:
        names = set(z.namelist())
        path = "sglang/srt/speculative/frozen_kv_mtp_worker_v2.py"
        if path not in names:
            assert Version(version) < Version("0.5.12")
            return
        classes = {c.name: c for c in ast.parse(z.read(path)).body if isinstance(c, ast.ClassDef)}
        runner = "sglang/srt/speculative/frozen_kv_mtp_cuda_graph_runner.py"
        runner_methods = {f.name for c in ast.parse(z.read(runner)).body if isinstance(c, ast.ClassDef)
                          for f in c.body if isinstance(f, ast.FunctionDef)}
    worker = classes["FrozenKVMTPWorkerV2"]
    v2 = any(isinstance(base, ast.Name) and base.id == "EAGLEWorkerV2" for base in worker.bases)
    assert spa.frozen_kv_timed(version) == v2, version
    if not v2:
        return
    own = {name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)} for name, c in classes.items()}
    assert {"draft", "draft_forward", "_draft_extend_for_decode", "_draft_extend_for_prefill"} <= own[
        "FrozenKVMTPDraftWorker"]
    assert "forward_batch_generation" in own["FrozenKVMTPWorkerV2"]
    assert not {"verify", "on_verify_complete_cpu"} & own["FrozenKVMTPWorkerV2"]  # EAGLE v2's, with the hooks
    assert "execute" in runner_methods
    patch = (release.load(version).directory / "eagle-v2-profile-hooks.patch").read_text()
    assert 'specprof.P.mark("verify_prep")' in patch and "specprof.P.harvest(num_correct_drafts_per_req)" in patch
