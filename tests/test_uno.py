"""UNO (UnoWorkerV2, 0.5.20 on), profiled on the CPU with a fake worker shaped as upstream's: the
target drafts for itself under a LoRA adapter (`_run_draft_block`, which runs `_run_target_block`)
and verifies in a second target block; its cycle wrapped on the instance from `hooks.idle` (uno.py)."""
import ast
import types

import pytest
from packaging.version import Version

from fakes import FakeBackend
from conftest import pinned_wheel
from specprof_build import release
from test_algorithms import Batch, Req, _accept, _args, _close, _serve, idle_installed
from test_multilayer import assert_no_and_every_draft_accepted, prefill_phases

from sglang.specprof import hooks, uno
from sglang.specprof.profiler import Profiler
from sglang_specprof import report

RUNNER = types.SimpleNamespace(bs=8)


class UnoWorkerV2:
    """Upstream's worker, its calls in upstream's order (linear, or a tree with `tree_mode`)."""

    def __init__(self, b, accept, tree_mode=False):
        self.b, self.accept, self.tree_mode = b, accept, tree_mode
        self.target_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(decode_cuda_graph_runner=RUNNER))
        self.cycle = 0
        self.verified = None
        self.blocks = 0

    def on_verify_complete_cpu(self, correct, batch_size=0):  # BaseSpecWorker's: nothing
        self.verified = list(correct)

    def _run_target_block(self, forward_batch, *, need_top1=True):
        self.blocks += 1
        self.b.advance(3.0)
        return types.SimpleNamespace(can_run_cuda_graph=True), "top1"

    def _run_draft_block(self, forward_batch, *, need_top1=True):
        self.b.advance(0.02)  # the adapter's routing
        return self._run_target_block(forward_batch, need_top1=need_top1)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if batch.forward_mode.is_extend():
            self.b.advance(6.0)  # the target's prefill
            return None
        self.b.advance(0.05)  # the draft input
        self._run_draft_block(batch)
        if self.tree_mode:
            self.b.advance(0.02)  # build_eagle_verify_input, with the series' tree hook
            hooks.P.mark("tree")
            self.b.advance(0.1)  # run_eagle_verify, with the series' hooks
            hooks.P.mark("verify_prep")
            self.b.advance(4.0)
            hooks.P.mark("verify")
            self.b.advance(0.2)
            hooks.P.mark("accept")
            self.b.advance(0.04)  # pack_uno_tree_result
        else:
            self.b.advance(0.03)  # the candidates and the verify's batch
            self._run_target_block(batch)
            self.b.advance(0.07)  # _accept_and_pack, the next draft input
        self.cycle += 1
        return [self.accept(self.cycle - 1, i, r) for i, r in enumerate(batch.reqs)]


def _profiled(monkeypatch, tree_mode=False):
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=1000, sink=out.append, clock=b.clock, log_table=False,
                 config={"algorithm": "UNO", "num_steps": 1, "num_draft_tokens": 4, "topk": 1, "worker": "v2"})
    monkeypatch.setattr(hooks, "P", p)
    worker = UnoWorkerV2(b, _accept, tree_mode)
    assert uno.is_worker(worker)
    assert uno.time_cycles(worker, lambda: p)
    assert not uno.time_cycles(worker, lambda: p)  # once
    return p, b, worker, out


@pytest.mark.parametrize("tree_mode, phases", [
    (False, {"draft_prep": 0.05, "draft": 3.02, "verify_prep": 0.03, "verify": 3.0, "accept": 0.07}),
    (True, {"draft_prep": 0.05, "draft": 3.02, "tree": 0.02, "verify_prep": 0.1, "verify": 4.0, "accept": 0.2,
            "pack": 0.04}),
], ids=["linear", "tree"])
def test_a_uno_cycle_is_timed_phase_by_phase_and_commits_what_the_clients_got(monkeypatch, tree_mode, phases):
    p, b, worker, out = _profiled(monkeypatch, tree_mode)
    got = _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == got == p.tokens["committed_tokens"]
    assert p.uncut_cycles == 0 and p.marks_lost == 0
    decode = [bk for bk in s["buckets"].values() if bk["cycles"]]
    for bk in decode:
        assert list(bk["phases"]) == list(phases)
        for name, ms in phases.items():  # the draft block's own target block stays in the draft
            assert bk["phases"][name]["gpu_ms"]["mean"] == pytest.approx(ms), name
        assert bk["graph"]["replays"].get("draft") == bk["cycles"]
        if not tree_mode:  # the tree's verify graph is the series' hook's to count
            assert bk["graph"]["replays"].get("verify") == bk["cycles"]
    assert_no_and_every_draft_accepted(decode)
    assert worker.verified is not None


def test_the_prefill_is_the_target_s_forward(monkeypatch):
    phases = prefill_phases(*_profiled(monkeypatch))
    assert list(phases) == ["target_extend"] and phases["target_extend"]["mean"] == pytest.approx(6.0)


def test_blocks_outside_a_cycle_are_not_marked_and_a_paused_profile_leaves_the_worker_running(monkeypatch):
    p, b, worker, out = _profiled(monkeypatch)
    before = p.seq
    worker._run_draft_block(Batch([Req(5)]))
    worker._run_target_block(Batch([Req(5)]))
    assert p.cur is None and p.seq == before
    null = hooks.NullProfiler()
    monkeypatch.setattr(hooks, "P", null)
    w2 = UnoWorkerV2(FakeBackend(), _accept)
    uno.time_cycles(w2, lambda: null)
    assert w2.forward_batch_generation(Batch([Req(5), Req(5)])) == [0, 1]


def test_idle_installs_the_profile_and_the_report_says_the_advisor_does_not_apply(monkeypatch):
    worker = UnoWorkerV2(FakeBackend(), _accept)
    with idle_installed(monkeypatch, worker, _args("UNO", steps=1)) as (p, _):
        assert type(p) is Profiler and p.config["algorithm"] == "UNO"
        assert worker.forward_batch_generation.specprof_uno and worker._run_target_block.specprof_uno
    p, b, worker, out = _profiled(monkeypatch)
    _serve(p, worker, True)
    _close(p, b)
    s = report.summarize(out)
    text = report.render(s, report.advise(s))
    assert report.advise(s) == {} and text.count("does not apply to UNO") == 1


@pytest.mark.parametrize("version", release.available())
def test_each_release_s_uno_worker_is_what_the_wrappers_take(version):
    """Read from each pinned wheel: UNO's worker from 0.5.20, its draft block running a target
    block of its own, the decode running a draft block and then a target block, no
    on_verify_complete_cpu of its own (BaseSpecWorker's: wrapped)."""
    import zipfile

    path = "sglang/srt/speculative/uno_worker_v2.py"
    with zipfile.ZipFile(pinned_wheel(version)) as z:
        if path not in z.namelist():
            assert Version(version) < Version("0.5.20")
            return
        tree = ast.parse(z.read(path))
    assert Version(version) >= Version("0.5.20")
    worker = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "UnoWorkerV2")
    methods = {f.name: f for f in worker.body if isinstance(f, ast.FunctionDef)}
    assert {"forward_batch_generation", "_run_draft_block", "_run_target_block", "_forward_decode"} <= set(methods)
    assert "on_verify_complete_cpu" not in methods

    def calls(f):
        return {n.func.attr for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"}

    assert "_run_target_block" in calls(methods["_run_draft_block"])
    assert {"_run_draft_block", "_run_target_block"} <= calls(methods["_forward_decode"])
    assert "tree_mode" in ast.unparse(methods["_run_draft_block"])


def test_two_tokens_beside_the_drafts_are_committed_and_nothing_counts_as_cut(monkeypatch):
    """UNO commits its accepted proposals and two tokens more a request (the correction and the
    bonus; the scheduler hands `accept - 2` to on_verify_complete_cpu): the committed tokens are
    what the requests took, and none counts as cut at a stop (it read -1 a request before)."""
    p, b, worker, out = _profiled(monkeypatch)
    reqs = [Req(100), Req(100), Req(100)]
    worker.forward_batch_generation(Batch(reqs, "extend"))
    taken = 0
    for _ in range(4):
        batch = Batch(reqs)
        correct = worker.forward_batch_generation(batch)
        worker.on_verify_complete_cpu(correct, batch_size=len(reqs))
        p.commit_begin(batch.reqs)
        for r, c in zip(reqs, correct):
            r.take(c + 2)
            taken += c + 2
        p.commit_end()
    _close(p, b)
    assert p.tokens["committed_tokens"] == taken and p.tokens["cut_tokens"] == 0
    s = report.summarize(out)
    assert sum(bk["accept"]["committed_tokens"] for bk in s["buckets"].values()) == taken
