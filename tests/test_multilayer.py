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
from test_algorithms import Batch, Req, _accept, _args, _close, _serve, idle_installed

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
        return run_eagle_verify(self, batch)

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


def run_eagle_verify(worker, batch):
    """eagle_worker_common's (0.5.16 on), with the series' hooks."""
    worker.b.advance(0.1)
    hooks.P.mark("verify_prep")
    worker.b.advance(4.0 + 0.05 * len(batch.reqs))
    hooks.P.mark("verify")
    hooks.P.graph("verify", True, RUNNER)
    worker.b.advance(0.2)
    hooks.P.mark("accept")
    return [worker.accept(worker.cycle, i, r) for i, r in enumerate(batch.reqs)]


class Target:
    """The target worker: its verify forward over the draft tokens (a graph replayed)."""

    def __init__(self, b):
        self.b = b
        self.model_runner = types.SimpleNamespace(decode_cuda_graph_runner=RUNNER)

    def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False):
        self.b.advance(4.0 + 0.05 * len(forward_batch.reqs) if is_verify else 6.0)  # a verify, or a prefill
        return types.SimpleNamespace(can_run_cuda_graph=is_verify)


class OwnVerify(MultiLayerEagleWorkerV2):
    """0.5.8 to 0.5.15: the worker verifies with code of its own, no hook of the series inside:
    the verify input prepared on the plan stream, the target's verify forward, the sampling."""

    def __init__(self, b, accept):
        super().__init__(b, accept, tree_hooked=False)  # the tree built inline in the draft
        self.target_worker = Target(b)

    def forward_batch_generation(self, batch, on_publish=None):
        if batch.forward_mode.is_extend():  # the target's prefill, then the draft's extend
            self.target_worker.forward_batch_generation(batch)
            self.draft_worker._draft_extend_for_prefill(batch, "hidden", "ids")
            return None
        return super().forward_batch_generation(batch, on_publish)

    def verify(self, batch):
        self.b.advance(0.1)  # eagle_prepare_for_verify
        self.target_worker.forward_batch_generation(batch=None, forward_batch=batch, is_verify=True)
        self.b.advance(0.2)  # eagle_sample, the bonus tokens
        return [self.accept(self.cycle, i, r) for i, r in enumerate(batch.reqs)]


OwnVerify.__name__ = "MultiLayerEagleWorkerV2"  # upstream's class, of another release


# up to 0.5.11 no worker has `on_verify_complete_cpu`: the series harvests where the scheduler
# resolves a v2 batch's tokens (`_resolve_spec_overlap_token_ids`), for any worker
NO_CALLBACK = type("MultiLayerEagleWorkerV2", (OwnVerify,), {
    "on_verify_complete_cpu": property(lambda self: (_ for _ in ()).throw(AttributeError("on_verify_complete_cpu")))})


def _profiled(monkeypatch, tree_hooked, plan, shape=MultiLayerEagleWorkerV2):
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "EAGLE", "num_steps": 3, "num_draft_tokens": 4, "topk": 1, "worker": "v2",
                         "multi_layer": True})
    monkeypatch.setattr(hooks, "P", p)  # the series' hooks in the verify call the installed profiler
    worker = MultiLayerEagleWorkerV2(b, _accept, tree_hooked, plan) if shape is MultiLayerEagleWorkerV2 else shape(
        b, _accept)
    assert multilayer.is_worker(worker)
    assert multilayer._own_verify(worker) is (shape is not MultiLayerEagleWorkerV2)
    assert multilayer.time_cycles(worker, lambda: p, tree_hooked=tree_hooked)
    assert not multilayer.time_cycles(worker, lambda: p, tree_hooked=tree_hooked)  # once
    return p, b, worker, out


@pytest.mark.parametrize("tree_hooked, plan", [(True, False), (True, True), (False, True)],
                         ids=["0.5.16-to-0.5.19", "0.5.20", "0.5.21-on"])
def test_a_multi_layer_cycle_is_timed_phase_by_phase_and_commits_what_the_clients_got(monkeypatch, tree_hooked, plan):
    p, b, worker, out = _profiled(monkeypatch, tree_hooked, plan)
    decode = served_exactly(p, b, worker, out)
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
    assert_no_and_every_draft_accepted(decode)
    assert worker.verified is not None  # upstream's own on_verify_complete_cpu still runs


@pytest.mark.parametrize("shape", [OwnVerify, NO_CALLBACK], ids=["0.5.12-to-0.5.15", "0.5.8-to-0.5.11"])
def test_a_worker_that_verifies_with_code_of_its_own_is_timed_alike(monkeypatch, shape):
    """Up to 0.5.15 the worker's `verify` is its own (no hook of the series inside) and the tree is
    built in the draft: the target's verify forward is wrapped (verify_prep closed as it starts,
    verify as it returns, its graph counted), the method's return closes accept. Up to 0.5.11 the
    scheduler's resolve (the series' hook there) hands the profiler the correct drafts."""
    p, b, worker, out = _profiled(monkeypatch, False, False, shape)
    assert hasattr(worker, "on_verify_complete_cpu") == (shape is not NO_CALLBACK)
    assert worker.target_worker.forward_batch_generation.specprof_multilayer
    decode = served_exactly(p, b, worker, out)
    for bk in decode:
        ph = bk["phases"]
        assert list(ph) == ["draft", "tree", "verify_prep", "verify", "accept", "draft_extend"]
        assert ph["verify_prep"]["gpu_ms"]["mean"] == pytest.approx(0.1)
        assert 4.0 < ph["verify"]["gpu_ms"]["mean"] <= 4.0 + 0.05 * 6
        assert ph["accept"]["gpu_ms"]["mean"] == pytest.approx(0.2)
        assert bk["graph"]["replays"].get("verify")
    assert_no_and_every_draft_accepted(decode)


def test_the_prefill_of_a_worker_of_its_own_verify_is_the_target_s_extend_then_the_draft_s(monkeypatch):
    """Up to 0.5.15 the prefill's target forward is the wrapped one, outside a verify: nothing marked
    there, the draft's extend over the prompt closes target_extend as it starts."""
    phases = prefill_phases(*_profiled(monkeypatch, False, False, OwnVerify))
    assert list(phases) == ["target_extend", "draft_extend"], phases
    assert phases["target_extend"]["mean"] == pytest.approx(6.0)
    assert phases["draft_extend"]["mean"] == pytest.approx(0.8)


def served_exactly(p, b, worker, out, v2=True, smaller=False) -> list:
    """Rounds of 6 requests (and, `smaller`, 2 more of 3) served and the profile closed: the
    tokens the profile committed are those the clients got, and no cycle went uncut or lost a
    mark. Returns the summary's decode buckets."""
    got = _serve(p, worker, v2) + (_serve(p, worker, v2, rounds=2, bs=3) if smaller else 0)
    _close(p, b)
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got == p.tokens["committed_tokens"]
    assert p.uncut_cycles == 0 and p.marks_lost == 0
    assert any(bk.get("prefill_cycles") for bk in s["buckets"].values())
    decode = [bk for bk in s["buckets"].values() if bk["cycles"]]
    assert decode
    return decode


def assert_no_and_every_draft_accepted(decode) -> None:
    """Across the decode buckets' histograms of correct drafts: requests with none and with 3."""
    hist = [0] * 4
    for bk in decode:
        for n, c in enumerate(bk["accept"]["drafts_histogram"]):
            hist[n] += c
    assert hist[0] and hist[3]


def prefill_phases(p, b, worker, out, v2=True) -> dict:
    """One round of 3 requests served and the profile closed: the prefill phases' figures."""
    _serve(p, worker, v2, rounds=1, bs=3)
    _close(p, b)
    return prefills_of(out)


def prefills_of(out) -> dict:
    """The prefill phases' figures of the windows `out`."""
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


def test_a_v1_multi_layer_worker_seen_at_startup_is_served_unprofiled_with_one_warning(monkeypatch, caplog):
    """Where SGLang chooses a topk above 1 for the model after the startup check (0.5.11, 0.5.12),
    its v1 worker runs, which nothing times: one warning, not a profile that stays empty."""
    test_plain._fake_cuda(monkeypatch)
    v1 = type("MultiLayerEagleWorker", (), {"forward_batch_generation": lambda self, batch: None})()
    args = _args("EAGLE")
    args.enable_multi_layer_eagle = True
    sched = types.SimpleNamespace(server_args=args, model_worker=v1, tp_rank=0, waiting_queue=[])
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        hooks.idle(sched)
        hooks.idle(types.SimpleNamespace(server_args=args, model_worker=v1, tp_rank=0, waiting_queue=[]))
    assert isinstance(hooks.P, hooks.NullProfiler)
    said = [r.getMessage() for r in caplog.records if "multi-layer EAGLE's v1 worker" in r.getMessage()]
    assert len(said) == 1 and "the server keeps serving" in said[0], said


def test_idle_installs_the_profile_on_a_multi_layer_server_and_wraps_its_cycle_once(monkeypatch):
    worker = MultiLayerEagleWorkerV2(FakeBackend(), _accept)
    args = _args("EAGLE")
    args.enable_multi_layer_eagle = True  # as the server's arguments have it once resolved
    with idle_installed(monkeypatch, worker, args) as (p, sched):
        assert type(p) is Profiler and p.scheduler is sched
        assert p.config["algorithm"] == "EAGLE" and p.config["worker"] == "v2" and p.config["num_steps"] == 3
        assert p.config["multi_layer"] is True
        fwd = worker.forward_batch_generation
        assert fwd.specprof_multilayer and worker.draft_worker._draft_extend_for_decode.specprof_multilayer
        hooks.idle(sched)
        assert hooks.P is p and worker.forward_batch_generation is fwd


@pytest.mark.parametrize("version, env, overlap_off, topk, says", [
    ("0.5.8", None, False, None, "only with SGLANG_ENABLE_SPEC_V2=1 (SGLang sets it for MiMoV2 and Step3p5 models): set it"),
    ("0.5.10.post1", "1", False, None, None),
    ("0.5.10", "true", True, None, None),  # spec v2 on: upstream turns the overlap scheduler back on
    ("0.5.11", None, False, None, None),
    ("0.5.12", "0", False, None, "only with SGLANG_ENABLE_SPEC_V2 on: unset it"),
    ("0.5.12.post1", None, True, None, "only with the overlap scheduler: drop --disable-overlap-schedule"),
    ("0.5.11", None, False, 4, "only at topk 1: set --speculative-eagle-topk 1"),
    ("0.5.13", "0", True, 4, None),  # from 0.5.13 the v2 worker whatever the settings
    ("0.5.16", None, True, None, None),
    ("0.5.23", None, False, None, None),
])
def test_multi_layer_eagle_is_refused_where_sglang_would_run_its_v1_worker(monkeypatch, version, env, overlap_off,
                                                                           topk, says):
    """Upstream runs the v1 `MultiLayerEagleWorker` (no hook, not wrapped) where the overlap
    scheduler is off: the check refuses the flag there, saying how to get the v2 worker."""
    if env is None:
        monkeypatch.delenv("SGLANG_ENABLE_SPEC_V2", raising=False)
    else:
        monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", env)
    args = types.SimpleNamespace(disable_overlap_schedule=overlap_off, speculative_eagle_topk=topk)
    got = spa.multi_layer_v1(args, version)
    assert (got is None) if says is None else ("only " + got == says), got


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


def _calls(fn, attr):
    """The calls to `.attr(...)` inside function `fn` (an ast.FunctionDef)."""
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]


@pytest.mark.parametrize("version", release.available())
def test_each_release_s_multi_layer_worker_is_what_the_wrappers_take(version):
    """Read from each pinned wheel: every release's v2 worker has the methods multilayer.py wraps;
    it verifies through run_eagle_verify (the series' verify hooks) from 0.5.16 and before with
    code of its own around the target's verify forward (wrapped); the correct drafts reach
    `on_verify_complete_cpu` from 0.5.12 and, before, the series' harvest in the scheduler; the v1
    worker exists up to 0.5.12 and SGLANG_ENABLE_SPEC_V2 is on by default from 0.5.11
    (`server_args.multi_layer_v1`); the series marks the tree in build_eagle_verify_input from
    0.5.16 to 0.5.20 (where `_tree_hooked` finds it), the wrapper after the draft elsewhere."""
    import zipfile

    v = Version(version)
    with zipfile.ZipFile(pinned_wheel(version)) as z:
        names = set(z.namelist())
        path = "sglang/srt/speculative/multi_layer_eagle_worker_v2.py"
        if path not in names:
            pytest.skip("no multi-layer EAGLE in this release")
        classes = {c.name: c for c in ast.parse(z.read(path)).body if isinstance(c, ast.ClassDef)}
        spec_info = z.read("sglang/srt/speculative/spec_info.py").decode()
        base = z.read("sglang/srt/speculative/base_spec_worker.py").decode() if (
            "sglang/srt/speculative/base_spec_worker.py" in names) else ""
        environ = z.read("sglang/srt/environ.py").decode() if "sglang/srt/environ.py" in names else ""
    own = {name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)} for name, c in classes.items()}
    worker = classes["MultiLayerEagleWorkerV2"]
    verify = next(f for f in worker.body if isinstance(f, ast.FunctionDef) and f.name == "verify")
    through_common = any(isinstance(n, ast.Name) and n.id == "run_eagle_verify" for n in ast.walk(verify))
    assert through_common == (v >= Version("0.5.16")), version
    if not through_common:  # its own: the target's verify forward inside, the one wrapped
        fwd = _calls(verify, "forward_batch_generation")
        assert len(fwd) == 1 and ast.unparse(fwd[0].func) == "self.target_worker.forward_batch_generation"
        assert any(k.arg == "is_verify" and ast.unparse(k.value) == "True" for k in fwd[0].keywords), version
    assert {"draft", "draft_forward", "_draft_extend_for_decode", "_draft_extend_for_prefill"} <= own[
        "MultiLayerEagleDraftWorker"]
    assert ("_draft_extend_plan_for_decode" in own["MultiLayerEagleDraftWorker"]) == (v >= Version("0.5.20"))
    assert "forward_batch_generation" in own["MultiLayerEagleWorkerV2"]
    assert "on_verify_complete_cpu" not in own["MultiLayerEagleWorkerV2"]  # BaseSpecWorker's, where there is one
    patch = (release.load(version).directory / "eagle-v2-profile-hooks.patch").read_text()
    callback = "def on_verify_complete_cpu" in base
    assert callback == (v >= Version("0.5.12")), version
    if not callback:  # the series harvests where the scheduler resolves a v2 batch's tokens
        assert re.search(r"^\+\s*specprof\.P\.harvest\(result\.", patch, re.M), version
    v1 = re.search(r"multi_layer_eagle_worker import \(?\s*MultiLayerEagleWorker\b", spec_info) is not None
    assert v1 == (v < Version(".".join(map(str, spa.MULTI_LAYER_V2_ONLY)))), version
    if v1:
        on = re.search(r"SGLANG_ENABLE_SPEC_V2 = EnvBool\((True|False)\)", environ).group(1) == "True"
        assert on == (v >= Version(".".join(map(str, spa.SPEC_V2_DEFAULT)))), version
    if v >= Version("0.5.16"):
        common = patch.split("diff --git a/sglang/srt/speculative/eagle_worker_common.py ")[1].split("diff --git")[0]
        tree_in_build = re.search(r'^@@ [^\n]*def build_eagle_verify_input\([^\n]*\n(?:[ +][^\n]*\n)*?\+\s*'
                                  r'specprof\.P\.mark\("tree"\)', common, re.M) is not None
        assert tree_in_build == (v <= Version("0.5.20")), version


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
