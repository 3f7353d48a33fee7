"""Multi-layer EAGLE (MultiLayerEagleWorkerV2, 0.5.16 on), profiled on the CPU with a fake worker
shaped as upstream's: its cycle wrapped on the instances from `hooks.idle` (multilayer.py), the
verify's marks from the series' hooks in `run_eagle_verify`, the tree's from
`build_eagle_verify_input` up to 0.5.20 and from the draft's return after."""
import ast
import re
import types

import pytest
from packaging.version import Version

import test_plain
from fakes import FakeBackend
from conftest import pinned_wheel
from specprof_build import release
from test_algorithms import Batch, Req, _accept, _args, _close, _serve

from sglang.specprof import hooks, multilayer
from sglang.specprof import server_args as spa
from sglang.specprof.profiler import Profiler
from sglang_specprof import report

RUNNER = types.SimpleNamespace(bs=8)  # the target's decode graph runner


class DraftWorker:
    """MultiLayerEagleDraftWorker: the draft reorders the last extend's top-k (no model), builds
    the tree (the series' `tree` hook inside up to 0.5.20), and the MTP layers run in the extend."""

    def __init__(self, b, tree_hooked, plan):
        self.b, self.tree_hooked = b, tree_hooked
        self.extends = 0
        if plan:  # 0.5.20 on: the draft extend's plan staged before the verify
            self._draft_extend_plan_for_decode = types.MethodType(DraftWorker._plan, self)

    def draft_forward(self, forward_batch):
        self.b.advance(0.05, 0.03)
        return "parents", "scores", "tokens"

    def draft(self, batch):
        self.b.advance(0.01)  # prepare_for_draft
        self.draft_forward(batch)
        self.b.advance(0.02)  # build_eagle_verify_input
        if self.tree_hooked:
            hooks.P.mark("tree")
        return "verify_input"

    def _plan(self, batch):
        self.b.advance(0.01)
        return "staged"

    def _draft_extend_for_decode(self, batch, batch_output, staged=None):
        self.extends += 1
        self.b.advance(1.5)  # every MTP layer once

    def _draft_extend_for_prefill(self, batch, hidden_states, next_token_ids):
        self.b.advance(0.8)
        return "next_draft_input"


class MultiLayerEagleWorkerV2:
    """Upstream's worker, its calls in upstream's order; `accept(cycle, i, req)`: request i's
    correct drafts this cycle (the scheduler commits them after `on_verify_complete_cpu`)."""

    def __init__(self, b, accept, tree_hooked=True, plan=False, steps=3):
        self.b, self.accept = b, accept
        self.speculative_num_steps = steps
        self._draft_worker = DraftWorker(b, tree_hooked, plan)
        self.cycle = 0
        self.verified = None

    @property
    def draft_worker(self):
        return self._draft_worker

    def on_verify_complete_cpu(self, correct, batch_size=0):  # BaseSpecWorker's: nothing
        self.verified = list(correct)

    def verify(self, batch):
        """run_eagle_verify, with the series' hooks."""
        self.b.advance(0.1)
        hooks.P.mark("verify_prep")
        self.b.advance(4.0 + 0.05 * len(batch.reqs))
        hooks.P.mark("verify")
        hooks.P.graph("verify", True, RUNNER)
        self.b.advance(0.2)
        hooks.P.mark("accept")
        return [self.accept(self.cycle, i, r) for i, r in enumerate(batch.reqs)]

    def forward_batch_generation(self, batch, on_publish=None):
        if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            self.b.advance(6.0)  # the target's prefill
            self.draft_worker._draft_extend_for_prefill(batch, "hidden", "ids")
            return None
        self.draft_worker.draft(batch)
        staged = None
        if hasattr(self.draft_worker, "_draft_extend_plan_for_decode"):
            staged = self.draft_worker._draft_extend_plan_for_decode(batch)
        correct = self.verify(batch)
        self.draft_worker._draft_extend_for_decode(batch, correct, staged=staged)
        self.cycle += 1
        return correct


def _profiled(monkeypatch, tree_hooked, plan):
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "EAGLE", "num_steps": 3, "num_draft_tokens": 4, "topk": 1, "worker": "v2",
                         "multi_layer": True})
    monkeypatch.setattr(hooks, "P", p)  # the series' hooks in the verify call the installed profiler
    worker = MultiLayerEagleWorkerV2(b, _accept, tree_hooked, plan)
    assert multilayer.is_worker(worker)
    assert multilayer.time_cycles(worker, lambda: p, tree_hooked=tree_hooked)
    assert not multilayer.time_cycles(worker, lambda: p, tree_hooked=tree_hooked)  # once
    return p, b, worker, out


@pytest.mark.parametrize("tree_hooked, plan", [(True, False), (True, True), (False, True)],
                         ids=["0.5.16-to-0.5.19", "0.5.20", "0.5.21-on"])
def test_a_multi_layer_cycle_is_timed_phase_by_phase_and_commits_what_the_clients_got(monkeypatch, tree_hooked, plan):
    p, b, worker, out = _profiled(monkeypatch, tree_hooked, plan)
    got = _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got == p.tokens["committed_tokens"]
    assert p.uncut_cycles == 0 and p.marks_lost == 0
    decode = [bk for bk in s["buckets"].values() if bk["cycles"]]
    want = ["draft", "tree"] + (["draft_extend_plan"] if plan else []) + ["verify_prep", "verify", "accept",
                                                                          "draft_extend"]
    for bk in decode:
        ph = bk["phases"]
        assert list(ph) == want
        assert ph["draft"]["gpu_ms"]["mean"] == pytest.approx(0.06)  # prepared, then the top-k reordered
        assert ph["tree"]["gpu_ms"]["mean"] == pytest.approx(0.02)
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.2)
        assert ph["draft_extend"]["gpu_ms"]["mean"] == pytest.approx(1.5)  # the MTP layers
        assert bk["graph"]["replays"].get("verify")
    prefill = [bk for bk in s["buckets"].values() if bk.get("prefill_cycles")]
    assert prefill
    assert_no_and_every_draft_accepted(decode)
    assert worker.verified is not None  # upstream's own on_verify_complete_cpu still runs


def assert_no_and_every_draft_accepted(decode) -> None:
    """Across the decode buckets' histograms of correct drafts: requests with none and with 3."""
    hist = [0] * 4
    for bk in decode:
        for n, c in enumerate(bk["accept"]["drafts_histogram"]):
            hist[n] += c
    assert hist[0] and hist[3]


def prefill_phases(p, b, worker, out) -> dict:
    """One round of 3 requests served and the profile closed: the prefill phases' figures."""
    _serve(p, worker, True, rounds=1, bs=3)
    _close(p, b)
    phases = {}
    for w in out:
        for bk in (w.get("buckets") or {}).values():
            phases.update(bk.get("prefill_phases_gpu_ms") or {})
    return phases


def test_the_prefill_is_the_target_s_extend_then_the_draft_s(monkeypatch):
    phases = prefill_phases(*_profiled(monkeypatch, True, False))
    assert list(phases) == ["target_extend", "draft_extend"], phases
    assert phases["target_extend"]["mean"] == pytest.approx(6.0)
    assert phases["draft_extend"]["mean"] == pytest.approx(0.8)


def test_marks_outside_a_cycle_are_not_taken_and_a_paused_profile_leaves_the_worker_running(monkeypatch):
    p, b, worker, out = _profiled(monkeypatch, True, False)
    before = p.seq
    worker.draft_worker._draft_extend_for_decode(Batch([Req(5)]), None)  # another caller: no cycle
    assert p.cur is None and p.seq == before
    null = hooks.NullProfiler()
    monkeypatch.setattr(hooks, "P", null)
    w2 = MultiLayerEagleWorkerV2(FakeBackend(), _accept)
    multilayer.time_cycles(w2, lambda: null, tree_hooked=True)
    assert w2.forward_batch_generation(Batch([Req(5), Req(5)])) == [0, 1]


def test_idle_installs_the_profile_on_a_multi_layer_server_and_wraps_its_cycle_once(monkeypatch):
    test_plain._fake_cuda(monkeypatch)
    worker = MultiLayerEagleWorkerV2(FakeBackend(), _accept)
    args = _args("EAGLE")
    args.enable_multi_layer_eagle = True  # as the server's arguments have it once resolved
    sched = types.SimpleNamespace(server_args=args, model_worker=worker, tp_rank=0, waiting_queue=[])
    hooks.idle(sched)
    try:
        p = hooks.P
        assert type(p) is Profiler and p.scheduler is sched
        assert p.config["algorithm"] == "EAGLE" and p.config["worker"] == "v2" and p.config["num_steps"] == 3
        assert p.config["multi_layer"] is True
        fwd = worker.forward_batch_generation
        assert fwd.specprof_multilayer and worker.draft_worker._draft_extend_for_decode.specprof_multilayer
        hooks.idle(sched)
        assert hooks.P is p and worker.forward_batch_generation is fwd
    finally:
        hooks.P.close()


@pytest.mark.parametrize("version, timed", [("0.5.15.post1", False), ("0.5.16", True), ("0.5.16+specprof.3", True),
                                            ("0.5.23", True), ("0.5.8", False), ("0.0.0.dev0", False), ("", False)])
def test_multi_layer_is_timed_from_0_5_16(version, timed):
    assert spa.multi_layer_timed(version) is timed


def test_a_decode_batch_with_an_extend_in_it_is_timed_as_the_prefill_upstream_runs(monkeypatch):
    """Under data parallel attention a decode batch can hold an extend (`is_extend_in_batch`):
    upstream runs its prefill path, and the cycle is timed as one, its marks in place."""
    p, b, worker, out = _profiled(monkeypatch, True, False)
    _serve(p, worker, True, rounds=1, bs=3)
    mixed = Batch([Req(8) for _ in range(3)])
    mixed.is_extend_in_batch = True
    before = p.tokens["committed_tokens"]
    worker.forward_batch_generation(mixed)
    _serve(p, worker, True, rounds=1, bs=3)
    _close(p, b)
    assert p.uncut_cycles == 0 and p.marks_lost == 0 and p.tokens["committed_tokens"] > before
    s = report.summarize(out)
    assert sum(bk.get("prefill_cycles") or 0 for bk in s["buckets"].values()) == 3


@pytest.mark.parametrize("version", release.available())
def test_each_release_s_multi_layer_worker_is_what_the_wrappers_take(version):
    """Read from each pinned wheel: the releases the startup check takes are those whose
    multi-layer worker verifies through run_eagle_verify (the series' verify hooks) and has the
    methods multilayer.py wraps; the series marks the tree in build_eagle_verify_input up to
    0.5.20 (where `_tree_hooked` finds it), the wrapper after the draft from 0.5.21."""
    import zipfile

    with zipfile.ZipFile(pinned_wheel(version)) as z:
        names = set(z.namelist())
        path = "sglang/srt/speculative/multi_layer_eagle_worker_v2.py"
        if path not in names:
            assert not spa.multi_layer_timed(version)
            return
        classes = {c.name: c for c in ast.parse(z.read(path)).body if isinstance(c, ast.ClassDef)}
    own = {name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)} for name, c in classes.items()}
    verify = next(f for f in classes["MultiLayerEagleWorkerV2"].body
                  if isinstance(f, ast.FunctionDef) and f.name == "verify")
    through_common = any(isinstance(n, ast.Name) and n.id == "run_eagle_verify" for n in ast.walk(verify))
    assert spa.multi_layer_timed(version) == through_common, version
    if not through_common:
        return
    assert {"draft", "draft_forward", "_draft_extend_for_decode", "_draft_extend_for_prefill"} <= own[
        "MultiLayerEagleDraftWorker"]
    assert ("_draft_extend_plan_for_decode" in own["MultiLayerEagleDraftWorker"]) == (
        Version(version) >= Version("0.5.20"))
    assert "forward_batch_generation" in own["MultiLayerEagleWorkerV2"]
    assert "on_verify_complete_cpu" not in own["MultiLayerEagleWorkerV2"]  # BaseSpecWorker's: wrapped
    patch = (release.load(version).directory / "eagle-v2-profile-hooks.patch").read_text()
    common = patch.split("diff --git a/sglang/srt/speculative/eagle_worker_common.py ")[1].split("diff --git")[0]
    tree_in_build = re.search(r'^@@ [^\n]*def build_eagle_verify_input\([^\n]*\n(?:[ +][^\n]*\n)*?\+\s*specprof\.P\.'
                              r'mark\("tree"\)', common, re.M) is not None
    assert tree_in_build == (Version(version) <= Version("0.5.20")), version


def test_the_report_and_the_log_say_the_step_count_advisor_does_not_apply(monkeypatch):
    """Each step of multi-layer EAGLE is an MTP layer run in the draft extend, not a draft step:
    the advisor's model would read the steps as free. The report says so once, and advises nothing."""
    from sglang_specprof.table import format_summary

    p, b, worker, out = _profiled(monkeypatch, True, False)
    _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    text = report.render(s, report.advise(s))
    assert report.advise(s) == {} and "--speculative-num-steps" not in text
    assert text.count("does not apply to multi-layer EAGLE") == 1
    assert "does not apply to multi-layer EAGLE" in format_summary(out[-1])


def test_a_multi_layer_worker_of_another_shape_is_served_unprofiled_with_one_warning(monkeypatch, caplog):
    """A release whose worker lacks a method the wrappers take: the profiler steps aside with one
    warning (not a profile that stays empty), and the worker serves as it would without it."""
    test_plain._fake_cuda(monkeypatch)
    worker = MultiLayerEagleWorkerV2(FakeBackend(), _accept)
    del DraftWorker._draft_extend_for_prefill  # restored below
    try:
        args = _args("EAGLE")
        args.enable_multi_layer_eagle = True
        sched = types.SimpleNamespace(server_args=args, model_worker=worker, tp_rank=0, waiting_queue=[])
        with caplog.at_level("WARNING", logger="sglang.specprof"):
            hooks.idle(sched)
    finally:
        DraftWorker._draft_extend_for_prefill = _PREFILL
    assert isinstance(hooks.P, hooks.NullProfiler)  # the profiler installed, then closed by `disable`
    said = [r.getMessage() for r in caplog.records if "disabled" in r.getMessage()]
    assert len(said) == 1 and "could not be wrapped: AttributeError" in said[0], said
    assert worker.forward_batch_generation(Batch([Req(5), Req(5)])) == [0, 1]


_PREFILL = DraftWorker._draft_extend_for_prefill
