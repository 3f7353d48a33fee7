"""FROZEN_KV_MTP (FrozenKVMTPWorkerV2, 0.5.14 on), profiled on the CPU with a fake worker shaped
as upstream's: its cycle wrapped on the instances from `hooks.idle` (frozen_kv.py), the verify's
marks and the acceptance from the series' hooks in the EAGLE v2 verify and
`on_verify_complete_cpu` it inherits."""
import ast
import re
import types

import pytest
from packaging.version import Version

from fakes import FakeBackend
from conftest import pinned_wheel
from specprof_build import release
from test_algorithms import Batch, Req, _accept, _args, _close, _serve, idle_installed
from test_multilayer import (MultiLayerEagleWorkerV2, assert_no_and_every_draft_accepted, prefill_phases,
                             prefills_of, served_exactly)

from sglang.specprof import frozen_kv, hooks
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

    REPLAY = "execute"  # the graph runner's method that replays the assistant's steps (v1: `replay`)

    def draft(self, batch):
        self.b.advance(0.04)  # ForwardBatch.init_new, positions
        if self.cuda_graph_runner and self.cuda_graph_runner.can_run_graph(batch):
            getattr(self.cuda_graph_runner, self.REPLAY)(batch)
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


class Target:
    """The target worker (v1): its verify forward, or a prefill."""

    def __init__(self, b):
        self.b = b
        self.model_runner = types.SimpleNamespace(decode_cuda_graph_runner=types.SimpleNamespace(bs=8))

    def forward_batch_generation(self, model_worker_batch, is_verify=False):
        self.b.advance(4.0 + 0.05 * len(model_worker_batch.reqs) if is_verify else 6.0)
        return types.SimpleNamespace(can_run_cuda_graph=is_verify)


class FrozenKVMTPWorker:
    """0.5.12 and 0.5.13: the v1 worker (no overlap scheduler), drafting itself (its graph runner
    `replay`s the assistant's steps), verifying with its own `verify`, whose EagleVerifyInput.verify
    appends each request's tokens (with the series' accept mark inside in 0.5.12: `hooked`)."""

    def __init__(self, b, accept, graph_most=16, hooked=False, steps=3):
        self.b, self.accept, self.hooked = b, accept, hooked
        self.speculative_num_steps = steps
        runner = DraftGraph(b, graph_most) if graph_most else None
        if runner is not None:
            runner.replay, runner.execute = runner.execute, None  # FrozenKVMTPCudaGraphRunner's, v1
        self.cuda_graph_runner = runner
        self.target_worker = Target(b)
        self.cycle = 0
        self.eager = 0

    draft_forward = DraftWorker.draft_forward
    draft = DraftWorker.draft
    REPLAY = "replay"

    def verify(self, batch):
        self.b.advance(0.1)  # prepare_for_verify, the model worker batch
        self.target_worker.forward_batch_generation(batch, is_verify=True)
        self.b.advance(0.2)  # EagleVerifyInput.verify: the accepted path
        if self.hooked:
            hooks.P.mark("accept")
        correct = [self.accept(self.cycle, i, r) for i, r in enumerate(batch.reqs)]
        for r, c in zip(batch.reqs, correct):
            r.take(c + 1)
        self.b.advance(0.03)  # the rejected drafts' KV freed, the hidden states picked
        return correct

    def forward_target_extend(self, batch):
        return self.target_worker.forward_batch_generation(batch)

    def forward_draft_extend(self, batch, hidden_states, next_token_ids, seq_lens_cpu, mm_input_embeds=None):
        self.b.advance(0.01)

    def forward_draft_extend_after_decode(self, batch):
        self.b.advance(0.01)

    def forward_batch_generation(self, batch):
        if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            self.forward_target_extend(batch)
            self.forward_draft_extend(batch, "hidden", "ids", None)
            return None
        batch.spec_info = self.draft(batch)
        correct = self.verify(batch)
        self.forward_draft_extend_after_decode(batch)
        self.cycle += 1
        return correct


def _profiled(monkeypatch, graph_most=16, v1=None):
    b = FakeBackend()
    out = []
    worker = FrozenKVMTPWorkerV2(b, _accept, graph_most) if v1 is None else FrozenKVMTPWorker(
        b, _accept, graph_most, hooked=v1 == "0.5.12")
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "FROZEN_KV_MTP", "num_steps": 3, "num_draft_tokens": 4, "topk": 1,
                         "worker": frozen_kv.worker_kind(worker)})
    monkeypatch.setattr(hooks, "P", p)  # the series' hooks in the inherited methods call the installed profiler
    assert frozen_kv.is_worker(worker)
    assert frozen_kv.time_cycles(worker, lambda: p, **({} if v1 is None else {"accept_hooked": v1 == "0.5.12"}))
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


@pytest.mark.parametrize("v1", ["0.5.12", "0.5.13"])
@pytest.mark.parametrize("graph_most", [16, 4, 0], ids=["graphs", "graphs-and-eager", "no-graph"])
def test_the_v1_worker_is_timed_alike_and_commits_what_the_clients_got(monkeypatch, graph_most, v1):
    """0.5.12 and 0.5.13: the v1 worker, no overlap scheduler. The same phases as v2's; in 0.5.12
    the series' v1 hook inside EagleVerifyInput.verify closes accept and the verify's return
    free_kv, in 0.5.13 (no v1 series) the return closes accept; the correct drafts are what each
    request's output grew by, less the bonus."""
    p, b, worker, out = _profiled(monkeypatch, graph_most, v1=v1)
    assert p.config["worker"] == "v1"
    decode = served_exactly(p, b, worker, out, v2=False, smaller=True)
    tail = ["accept", "free_kv"] if v1 == "0.5.12" else ["accept"]
    for bk in decode:
        ph = bk["phases"]
        assert list(ph) == ["draft", "tree", "verify_prep", "verify"] + tail + ["draft_extend"]
        assert ph["verify_prep"]["gpu_ms"]["mean"] == pytest.approx(0.1)
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.2 if v1 == "0.5.12" else 0.23)
        assert ph["draft_extend"]["gpu_ms"]["mean"] == pytest.approx(0.01)
        assert bk["graph"]["replays"].get("verify") == bk["cycles"]
        assert bk["graph"]["replays"].get("draft", 0) + bk["graph"]["eager"]["draft"] == bk["cycles"]
    assert sum(bk["graph"]["eager"]["draft"] for bk in decode) == worker.eager
    assert_no_and_every_draft_accepted(decode)
    prefill = prefills_of(out)
    assert list(prefill) == ["target_extend", "draft_extend"], prefill


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
    worker = FrozenKVMTPWorkerV2(FakeBackend(), _accept)
    with idle_installed(monkeypatch, worker, _args("FROZEN_KV_MTP")) as (p, sched):
        assert type(p) is Profiler and p.scheduler is sched
        assert p.config["algorithm"] == "FROZEN_KV_MTP" and p.config["worker"] == "v2" and p.config["num_steps"] == 3
        fwd = worker.forward_batch_generation
        assert fwd.specprof_frozen_kv and worker.draft_worker.cuda_graph_runner.execute.specprof_frozen_kv
        hooks.idle(sched)
        assert hooks.P is p and worker.forward_batch_generation is fwd


def test_idle_installs_a_v1_profile_on_a_v1_frozen_kv_server(monkeypatch):
    """0.5.12 and 0.5.13: the v1 worker's profile is a v1 profile (acceptance settled at the cycle's
    end, the reader on its thread), its graph runner's `replay` wrapped."""
    worker = FrozenKVMTPWorker(FakeBackend(), _accept)
    with idle_installed(monkeypatch, worker, _args("FROZEN_KV_MTP")) as (p, _):
        assert type(p) is Profiler and p.config["worker"] == "v1" and not p.settle_on_commit
        assert worker.forward_batch_generation.specprof_frozen_kv and worker.cuda_graph_runner.replay.specprof_frozen_kv


@pytest.mark.parametrize("body, hooked", [("specprof.P.mark('accept')", True), ("return 'accept'", False),
                                           ("specprof.P.mark('verify')", False)])
def test_the_series_v1_accept_hook_is_told_by_its_code(monkeypatch, body, hooked):
    """`_accept_hooked` reads EagleVerifyInput.verify: the v1 series' accept mark inside (0.5.12), or not."""
    import sys

    ns = {}
    exec(compile(f"def verify(self):\n    {body}\n", "eagle_info.py", "exec"), ns)
    mod = types.ModuleType("sglang.srt.speculative.eagle_info")
    mod.EagleVerifyInput = type("EagleVerifyInput", (), {"verify": ns["verify"]})
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.eagle_info", mod)
    assert frozen_kv._accept_hooked() is hooked


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


@pytest.mark.parametrize("version", release.available())
def test_each_release_s_frozen_kv_worker_is_what_the_wrappers_take(version):
    """Read from each pinned wheel: up to 0.5.13 SGLang creates the v1 worker (the v2 class a
    placeholder that raises), with the methods frozen_kv.py wraps there and the series' v1 accept
    hook inside EagleVerifyInput.verify in 0.5.12 only (`_accept_hooked`); from 0.5.14 the worker
    is an EAGLEWorkerV2 (its verify and on_verify_complete_cpu EAGLE v2's, which carry the series'
    hooks) and has the methods frozen_kv.py wraps."""
    import zipfile

    v = Version(version)
    with zipfile.ZipFile(pinned_wheel(version)) as z:
        names = set(z.namelist())
        path = "sglang/srt/speculative/frozen_kv_mtp_worker_v2.py"
        if path not in names:
            assert v < Version("0.5.12")
            return
        classes = {c.name: c for c in ast.parse(z.read(path)).body if isinstance(c, ast.ClassDef)}
        runner = "sglang/srt/speculative/frozen_kv_mtp_cuda_graph_runner.py"
        runner_methods = {f.name for c in ast.parse(z.read(runner)).body if isinstance(c, ast.ClassDef)
                          for f in c.body if isinstance(f, ast.FunctionDef)}
        v1_path = "sglang/srt/speculative/frozen_kv_mtp_worker.py"
        v1_classes = {c.name: c for c in ast.parse(z.read(v1_path)).body if isinstance(c, ast.ClassDef)} if (
            v1_path in names) else {}
        spec_info = z.read("sglang/srt/speculative/spec_info.py").decode()
    worker = classes["FrozenKVMTPWorkerV2"]
    v2 = any(isinstance(base, ast.Name) and base.id == "EAGLEWorkerV2" for base in worker.bases)
    assert v2 == (v >= Version("0.5.14")), version
    if not v2:  # the v1 worker is the one created
        assert re.search(r"frozen_kv_mtp_worker import \(?\s*FrozenKVMTPWorker\b", spec_info), version
        own = {f.name for f in v1_classes["FrozenKVMTPWorker"].body if isinstance(f, ast.FunctionDef)}
        assert {"forward_batch_generation", "draft", "draft_forward", "verify", "forward_target_extend",
                "forward_draft_extend", "forward_draft_extend_after_decode"} <= own, version
        assert "replay" in runner_methods and "on_verify_complete_cpu" not in own
        verify = next(f for f in v1_classes["FrozenKVMTPWorker"].body
                      if isinstance(f, ast.FunctionDef) and f.name == "verify")
        fwd = [n for n in ast.walk(verify) if isinstance(n, ast.Call) and ast.unparse(n.func) ==
               "self.target_worker.forward_batch_generation"]
        assert len(fwd) == 1 and any(k.arg == "is_verify" for k in fwd[0].keywords), version
        v1_patch = release.load(version).directory / "eagle-v1-profile-hooks.patch"
        hooked = v1_patch.exists() and re.search(r"^\+\s*specprof\.P\.mark\(\"accept\"\)", v1_patch.read_text(), re.M)
        assert bool(hooked) == (v < Version("0.5.13")), version
        return
    own = {name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)} for name, c in classes.items()}
    assert {"draft", "draft_forward", "_draft_extend_for_decode", "_draft_extend_for_prefill"} <= own[
        "FrozenKVMTPDraftWorker"]
    assert "forward_batch_generation" in own["FrozenKVMTPWorkerV2"]
    assert not {"verify", "on_verify_complete_cpu"} & own["FrozenKVMTPWorkerV2"]  # EAGLE v2's, with the hooks
    assert "execute" in runner_methods
    patch = (release.load(version).directory / "eagle-v2-profile-hooks.patch").read_text()
    assert 'specprof.P.mark("verify_prep")' in patch and "specprof.P.harvest(num_correct_drafts_per_req)" in patch
