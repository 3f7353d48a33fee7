"""Kernel samples on the CPU: the sampler's life on a fake torch, attribution and classes, the outputs."""
import json

import pytest

from fakes import FakeBackend, FakeTorch
from sglang.specprof import hooks
from sglang.specprof.kernel_sampler import MAX_ENV, MAX_SAMPLES, KernelSampler, analyse_sample, max_samples_from_env
from sglang.specprof.profiler import RECORDER_HOOKS, Profiler
from sglang_specprof import kernels as K
from sglang_specprof.table import format_summary

# phase: [(kernel, ms)], as a v2 decode cycle launches them
CYCLE = [
    ("draft_prep", [("triton_poi_fused_copy_0", 0.05)]),
    ("draft_inputs", [("Memcpy HtoD (Pinned -> Device)", 0.01)]),
    ("draft", [("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 0.3), ("_fwd_kernel_stage1", 0.1),
               ("topk_kernel", 0.05)]),
    ("tree", [("build_tree_kernel_efficient", 0.04)]),
    ("verify", [("sm90_xmma_gemm_bf16bf16_bf16f32", 4.0), ("_fwd_grouped_kernel_stage1", 1.0),
                ("cross_device_reduce_1stage", 0.5), ("rms_norm_kernel", 0.2)]),
    ("accept", [("verify_tree_greedy", 0.1)]),
    ("draft_extend", [("nvjet_tst_64x8", 0.6), ("extend_attention_fwd", 0.2)]),
]
BETWEEN = [("vectorized_elementwise_kernel<4, FillFunctor>", 0.03)]


def cycle(p, ft, bs=2, idle_in=None, steps=None):
    """A decode cycle's hooks, each called on the installed profiler (hooks.P), as the series
    call them: `p`, or the kernel sampler in its place while a sample is armed, runs or ends."""
    hooks.P.begin("decode", bs, None, steps)
    for name, ks in CYCLE:
        for kname, ms in ks:
            ft.launch(kname, ms, via="cudaGraphLaunch" if name == "verify" else "cudaLaunchKernel")
        if name == idle_in:
            ft.b.advance(0.25)  # the device waits for the host before the phase's mark
        hooks.P.mark(name)
    hooks.P.end()
    hooks.P.harvest([1] * bs)
    for kname, ms in BETWEEN:
        ft.launch(kname, ms)


def installed(monkeypatch, p, ft, every=2, cycles=3):
    """`p` installed in the hooks, with a kernel sampler that hooks.swap puts in its place."""
    monkeypatch.setattr(hooks, "P", p)
    monkeypatch.setitem(hooks._state, "paused", None)
    monkeypatch.setitem(hooks._state, "warned", False)  # hooks.disable's, restored after the test
    p.kernels = KernelSampler(p, every=every, cycles=cycles, torch_module=ft, swap=hooks.swap)


@pytest.fixture
def rig(monkeypatch):
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=5, sink=out.append, config={"num_steps": 3, "worker": "v2"}, clock=b.clock,
                 log_table=False)
    ft = FakeTorch(b)
    installed(monkeypatch, p, ft)
    return p, b, ft, out


def test_classes_of_kernel_names():
    assert K.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert K.kernel_class("nvjet_tst_128x64_64x4_1x2_h_bz_TNT") == "gemm"
    assert K.kernel_class("_fwd_grouped_kernel_stage1") == "attention"
    assert K.kernel_class("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert K.kernel_class("cross_device_reduce_1stage<__nv_bfloat16, 2>") == "communication"
    assert K.kernel_class("verify_tree_greedy") == "sampling"
    assert K.kernel_class("Memcpy DtoH (Device -> Pinned)") == "copy"
    assert K.kernel_class("Memset (Device)") == "copy"
    assert K.kernel_class("rms_norm_kernel") == "other"


def test_a_sample_attributes_every_kernel_to_its_phase(rig):
    p, b, ft, out = rig
    for _ in range(30):
        cycle(p, ft)
    p.flush()
    with_k = [w for w in out if w.get("kernels")]
    assert len(with_k) >= 1
    k = with_k[0]["kernels"]
    assert "error" not in k, k
    assert k["window"] == 2 and k["cycles"] == 3 and k["bs"] == [2, 2, 2] and k["complete"]
    assert ft.starts == 1 + p.kernels.samples  # the warm-up start, then one per sample
    assert ft.synced == 1  # only the warm-up's stop synchronised; a sample's does not
    ph = k["phases"]
    assert list(ph) == [n for n, _ in CYCLE]
    # every event torch recorded: each kernel's launch and its run, the annotations, the context cycle
    assert k["records"] > 2 * sum(q["kernels"] for q in ph.values())
    v = ph["verify"]
    assert v["cycles"] == 3 and v["kernels"] == 12
    assert v["busy_ms"]["gemm"] == pytest.approx(12.0)
    assert v["busy_ms"]["attention"] == pytest.approx(3.0)
    assert v["busy_ms"]["communication"] == pytest.approx(1.5)
    assert v["busy_ms"]["other"] == pytest.approx(0.6)
    assert v["kernel_ms"] == pytest.approx(17.1)
    assert v["idle_ms"] == pytest.approx(0.0, abs=1e-6)
    # the fake device runs each kernel at its launch: kernel spans are the CUDA events' spans
    for name, q in ph.items():
        assert q["span_vs_events"] == pytest.approx(1.0, abs=1e-3), name
        assert q["events_agree"] is True, name
    per_cycle = sum(ms for _, ks in CYCLE for _, ms in ks)
    gap = sum(ms for _, ms in BETWEEN)
    assert k["coverage"] == pytest.approx(per_cycle / (per_cycle + gap), abs=1e-4)
    assert k["between_cycles"]["kernels"] == 3
    assert k["slowed"] == pytest.approx(1.0, abs=0.02)  # the fake host is no slower while sampled
    assert ph["verify"]["window_ms"] == pytest.approx(5.7, abs=1e-3)
    assert k["between_cycles"]["top"][0][0].startswith("vectorized_elementwise_kernel")
    # tracks for the trace: the first cycles' kernels one by one, positions from the cycle's start
    t = k["tracks"][0]
    assert [x[0] for x in t["phases"]] == [n for n, _ in CYCLE]
    assert len(t["kernels"]) == sum(len(ks) for _, ks in CYCLE)
    assert k["names"][t["kernels"][0][4]] == "triton_poi_fused_copy_0"
    json.dumps(k)  # JSON as it stands


def test_a_sample_under_adaptive_speculation_is_set_beside_its_step_counts_buckets(monkeypatch):
    """Under --speculative-adaptive the window's buckets are "2@3": the sampled cycles carry
    their step count, so the sample is compared with the cycles of the same step count."""
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=5, sink=out.append, config={"num_steps": 3, "worker": "v2", "adaptive": True},
                 clock=b.clock, log_table=False)
    ft = FakeTorch(b)
    installed(monkeypatch, p, ft)
    for _ in range(30):
        cycle(p, ft, steps=3)  # the kernel sampler's begin takes the step count too
    p.flush()
    k = next(w for w in out if w.get("kernels"))["kernels"]
    assert "error" not in k, k
    assert k["bs"] == [2, 2, 2] and k["steps"] == [3, 3, 3]
    assert k["slowed"] == pytest.approx(1.0, abs=0.02)
    assert k["phases"]["verify"]["window_ms"] == pytest.approx(5.7, abs=1e-3)
    assert set(out[0]["buckets"]) == {"2@3"}


HOOKS = [n for n in vars(hooks.NullProfiler) if not n.startswith("_") and callable(getattr(Profiler, n))]


def test_a_sample_swaps_the_sampler_in_for_the_profiler_and_patches_nothing(rig):
    """Between samples the hooks call the profiler itself (the plain hot path); from a
    sample's arming to its stop they call the sampler, and the profiler is never patched:
    its attributes hold no hook but its recorder's, and each of its hooks is its class's or
    its recorder's (the bound methods the profiler hands out, profiler.RECORDER_HOOKS)."""
    p, b, ft, out = rig
    assert {"begin", "mark", "end", "draft_end", "draft_replay_begin", "harvest", "commit_end"} <= set(HOOKS)
    rec = p.recorder

    def untouched():
        assert set(HOOKS) & set(vars(p)) == set(HOOKS) & set(RECORDER_HOOKS), set(HOOKS) & set(vars(p))
        for n in HOOKS:
            owner = rec if n in RECORDER_HOOKS else p
            assert getattr(p, n).__self__ is owner and getattr(p, n).__func__ is getattr(type(owner), n), n

    seen = set()
    for i in range(40):
        hooks.P.begin("decode", 2)
        st = p.kernels.state
        seen.add(st)
        assert hooks.P is (p if st == "idle" else p.kernels), (i, st)
        untouched()
        for name, ks in CYCLE:
            for kname, ms in ks:
                ft.launch(kname, ms)
            hooks.P.mark(name)
        hooks.P.end()
        untouched()
        hooks.P.harvest([1, 1])
        st = p.kernels.state
        seen.add(st)
        assert hooks.P is (p if st == "idle" else p.kernels), (i, st)
        untouched()
    assert seen == {"idle", "armed", "running", "ending"}
    p.flush()
    assert p.kernels.samples >= 3
    assert all("error" not in w["kernels"] for w in out if w.get("kernels"))


def test_the_sampler_calls_only_the_profilers_public_methods():
    """kernel_sampler.py writes none of the profiler's attributes and calls none of its
    private methods: what it needs the profiler offers (every_phase, add_kernel_sample)."""
    import ast
    import inspect

    from sglang.specprof import kernel_sampler

    tree = ast.parse(inspect.getsource(kernel_sampler))

    def is_profiler(node):  # `self.profiler`, or a local `p` (what the sampler calls it)
        return (isinstance(node, ast.Name) and node.id == "p" or isinstance(node, ast.Attribute)
                and node.attr == "profiler" and isinstance(node.value, ast.Name) and node.value.id == "self")

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ("setattr", "delattr") or (
                isinstance(node, ast.Attribute) and node.attr == "__dict__"):
            bad.append(ast.unparse(node))
        if isinstance(node, ast.Attribute) and is_profiler(node.value) and (
                node.attr.startswith("_") or not isinstance(node.ctx, ast.Load) or node.attr == "items"):
            bad.append(ast.unparse(node))
    assert not bad, bad


def test_idle_at_a_phases_end_goes_to_the_next_phase_in_the_kernel_view(rig):
    """The device waits on the host after verify's last kernel: the CUDA event at verify's
    mark holds the wait, the kernels' ends do not (it shows in accept's span, as idle)."""
    p, b, ft, out = rig
    for _ in range(20):
        cycle(p, ft, idle_in="verify")
    p.flush()
    k = next(w["kernels"] for w in out if w.get("kernels"))
    v, a = k["phases"]["verify"], k["phases"]["accept"]
    assert v["span_ms"] == pytest.approx(3 * 5.7, abs=1e-3)
    assert v["event_ms"] == pytest.approx(3 * 5.95, abs=1e-3)
    assert a["idle_ms"] == pytest.approx(3 * 0.25, abs=1e-3)
    # accept's event span (its kernel only) lies between its kernels' spans: it agrees ...
    assert a["own_span_ms"] == pytest.approx(3 * 0.1, abs=1e-3) and a["events_agree"] is True
    # ... and verify's holds the wait past its last kernel: 4% over its span, it does not
    assert v["events_agree"] is False
    assert a["span_ms"] + v["span_ms"] == pytest.approx(a["event_ms"] + v["event_ms"], abs=1e-3)


def test_no_sample_while_another_torch_profiler_runs(rig):
    p, b, ft, out = rig
    ft.other_on = True
    for _ in range(16):
        cycle(p, ft)
    p.flush()
    assert p.kernels.samples == 0 and p.kernels.skipped == 1
    assert out[-1]["kernel_samples"] == {"taken": 0, "skipped": 1, "max": MAX_SAMPLES}
    assert not any(w.get("kernels") for w in out)
    assert hooks.P is p and p.begin.__self__ is p.recorder  # the recorder's own, not patched


def test_a_sample_that_cannot_be_read_is_one_line_and_profiling_goes_on(rig):
    p, b, ft, out = rig

    class Broken:
        def events(self):
            raise RuntimeError("kineto gave nothing back")

    real_stop = ft.profiler.profile.stop

    def stop(self):
        real_stop(self)
        self.profiler.kineto_results = Broken()

    ft.profiler.profile.stop = stop
    try:
        for _ in range(21):  # v2 counts a cycle at its commit, or when the next one's list comes
            cycle(p, ft)
        p.flush()
    finally:
        ft.profiler.profile.stop = real_stop
    k = next(w["kernels"] for w in out if w.get("kernels"))
    assert k["error"].startswith("RuntimeError: kineto gave nothing back")
    assert not p.broken and len(out) == 4
    assert "could not be read" in format_summary(out[-1] if out[-1].get("kernels") else
                                                 next(w for w in out if w.get("kernels")))


@pytest.mark.parametrize("readable", [True, False])
def test_a_sample_s_events_are_freed_once_read_not_by_the_cyclic_collector(readable):
    """The profile object sits in a reference cycle (as torch's does); its recorded events
    are freed as soon as the sample is read, or fails to be, with the cyclic collector off."""
    import gc
    import weakref

    ft = FakeTorch(FakeBackend())
    prof = ft.profiler.profile()
    prof.start()
    prof.stop()
    if not readable:
        prof.profiler.kineto_results.events = None  # not callable: the read fails
    results, whole = weakref.ref(prof.profiler.kineto_results), weakref.ref(prof)
    smp = {"prof": prof, "window": 3}
    del prof
    gc.disable()
    try:
        if readable:
            assert analyse_sample(smp)["window"] == 3
        else:
            with pytest.raises(TypeError):
                analyse_sample(smp)
        assert results() is None and whole() is None and "prof" not in smp
    finally:
        gc.enable()


def test_the_log_table_shows_the_breakdown(rig):
    p, b, ft, out = rig
    for _ in range(20):
        cycle(p, ft)
    p.flush()
    w = next(w for w in out if w.get("kernels"))
    text = format_summary(w)
    assert "kernels (3 sampled decode cycles): coverage" in text
    rows = text.splitlines()
    at = next(i for i, x in enumerate(rows) if "kernels (3 sampled" in x)
    line = next(x for x in rows[at:] if x.strip().startswith("verify "))
    # verify per cycle: span 5.7 ms, 4 kernels, gemm 4.0 / 5.7 = 70.2%
    assert "5.700" in line and "70.2%" in line and " yes " in line


def test_a_chrome_trace_reads_like_the_servers_events():
    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "specprof/7/begin/decode/1", "ts": 100.0, "dur": 0.1},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 101.0, "dur": 3, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "gemm_a", "ts": 110.0, "dur": 20.0, "args": {"correlation": 1}},
        {"cat": "user_annotation", "name": "specprof/7/verify", "ts": 105.0, "dur": 0.1},
        {"cat": "user_annotation", "name": "specprof/8/begin/decode/1", "ts": 200.0, "dur": 0.1},
        {"cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 201.0, "dur": 3, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "triton_attn_fwd", "ts": 210.0, "dur": 5.0, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 202.0, "dur": 3, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "nvjet_x", "ts": 215.0, "dur": 10.0, "args": {"correlation": 3}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 226.0, "dur": 1.0, "args": {"correlation": 4}},
        {"cat": "user_annotation", "name": "specprof/8/verify", "ts": 203.0, "dur": 0.1},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 204.0, "dur": 3, "args": {"correlation": 4}},
        {"cat": "user_annotation", "name": "specprof/8/accept", "ts": 205.0, "dur": 0.1},
    ]}
    k = K.analyse(K.from_chrome(trace), {8: [["verify", 0.0151], ["accept", 0.0011]]})
    assert k["cycles"] == 1  # cycle 7 is the stretch's context
    v = k["phases"]["verify"]
    assert v["kernels"] == 2 and v["busy_ms"]["attention"] == pytest.approx(0.005)
    assert v["busy_ms"]["gemm"] == pytest.approx(0.010)
    assert v["span_ms"] == pytest.approx(0.225 - 0.130)  # from the end of cycle 7's gemm
    assert k["phases"]["accept"]["busy_ms"]["copy"] == pytest.approx(0.001)
    assert k["coverage"] == 1.0


def test_merge_sums_samples():
    a = {"cycles": 2, "coverage": 0.9, "phases": {"verify": {"cycles": 2, "kernels": 4, "kernel_ms": 9.0,
         "busy_ms": {"gemm": 9.0}, "span_ms": 10.0, "idle_ms": 1.0, "event_ms": 10.0}},
         "between_cycles": {"kernel_ms": 1.0, "busy_ms": {"copy": 1.0}}, "unmatched_kernels": 1}
    m = K.merge([a, a, {"window": 3, "error": "x"}])
    assert m["samples"] == 2 and m["cycles"] == 4
    assert m["phases"]["verify"]["kernel_ms"] == 18.0 and m["phases"]["verify"]["span_vs_events"] == 1.0
    assert m["coverage"] == pytest.approx(18 / 20)
    assert m["unmatched_kernels"] == 2


def test_report_table_plot_and_trace_carry_the_samples(rig, tmp_path):
    from sglang_specprof import report
    from sglang_specprof.trace import trace

    p, b, ft, out = rig
    for _ in range(45):
        cycle(p, ft)
    p.flush()
    s = report.summarize(out)
    k = s["kernels"]
    assert k["samples"] == sum(1 for w in out if w.get("kernels"))
    assert k["samples"] >= 2
    assert k["phases"]["verify"]["busy_ms"]["gemm"] == pytest.approx(12.0 * k["samples"])
    text = report.render(s, {})
    assert "kernel samples merged" in text and "coverage" in text
    tr = trace(out)
    kern = [e for e in tr["traceEvents"] if e.get("tid") == 4 and e.get("ph") == "X"]
    assert len(kern) == k["samples"] * 2 * sum(len(ks) for _, ks in CYCLE)
    assert {e["args"]["class"] for e in kern} >= {"gemm", "attention", "communication", "sampling", "copy"}
    pytest.importorskip("matplotlib")
    from sglang_specprof.plot import plot

    drawn = plot(s, str(tmp_path / "p.png"))
    per_cycle_gemm = drawn["kernels"]["gemm"][[n for n, _ in CYCLE].index("verify")]
    assert per_cycle_gemm == pytest.approx(4.0)


def test_a_pause_during_a_sample_and_an_internal_error_leave_the_right_profiler(rig):
    """Paused while a sample is on, the null profiler takes the hooks and the resume gives
    them back to the sampler, which gives them to the profiler when the sample ends; an
    internal error during a sample stops it and leaves the null profiler."""
    p, b, ft, out = rig
    k = p.kernels
    while k.state != "running":
        cycle(p, ft)
    hooks._pause_toggle()
    assert not hooks.P.enabled and hooks._state["paused"] is k
    cycle(p, ft)  # not seen
    hooks._pause_toggle()
    assert hooks.P is k and hooks._state["paused"] is None
    for _ in range(8):
        cycle(p, ft)
    assert k.state == "idle" and hooks.P is p and k.samples == 1
    p.on_error = hooks.disable
    while k.state != "running":
        cycle(p, ft)
    hooks.P.begin("decode", 2)
    p._fail(RuntimeError("a test's"))
    assert isinstance(hooks.P, hooks.NullProfiler) and k.state == "idle" and ft.active is None


def test_windows_and_kernel_samples_leave_no_cyclic_garbage(rig):
    """Python's cyclic collector can leave a serving scheduler's garbage for long: what the
    profiler drops each window and each kernel sample goes by reference counting alone (a
    sample's torch profile object is in a reference cycle, so it is taken apart once read)."""
    import gc

    p, b, ft, out = rig
    for _ in range(30):  # the first windows and sample: what is made once
        cycle(p, ft)
    p.flush()
    gc.collect()
    gc.disable()
    try:
        before = sum(1 for w in out if w.get("kernels"))
        for _ in range(120):
            cycle(p, ft)
        p.flush()
        samples = sum(1 for w in out if w.get("kernels")) - before
        left = gc.collect()
    finally:
        gc.enable()
    assert samples >= 4
    assert left == 0


def test_a_process_takes_at_most_its_limit_of_samples_and_says_so_once(rig, caplog):
    """torch's profiler keeps host memory for every sample, for good: past the limit no sample
    is armed (the hooks stay the profiler's own), one warning says why, the windows say how many."""
    p, b, ft, out = rig
    p.kernels.max_samples = 2
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        for _ in range(80):  # 16 windows of 5 cycles: a sample due every 2
            cycle(p, ft)
        p.flush()
    assert p.kernels.samples == 2 and sum(1 for w in out if w.get("kernels")) == 2
    assert ft.starts == 1 + 2  # the warm-up, then the two samples: no torch profiler after the limit
    assert hooks.P is p and p.kernels.state == "idle"
    assert out[-1]["kernel_samples"] == {"taken": 2, "skipped": 0, "max": 2}
    said = [r.getMessage() for r in caplog.records if MAX_ENV in r.getMessage()]
    assert len(said) == 1 and "2 kernel samples taken" in said[0], said


def test_no_limit_when_told_none(rig):
    p, b, ft, out = rig
    p.kernels.max_samples = 0
    for _ in range(80):
        cycle(p, ft)
    p.flush()
    assert p.kernels.samples >= 5


@pytest.mark.parametrize("raw,want,warns", [("", MAX_SAMPLES, False), ("0", 0, False), ("7", 7, False),
                                            (" 12 ", 12, False), ("-1", MAX_SAMPLES, True), ("1.5", MAX_SAMPLES, True),
                                            ("nan", MAX_SAMPLES, True), ("lots", MAX_SAMPLES, True)])
def test_the_limit_read_from_the_environment(monkeypatch, caplog, raw, want, warns):
    monkeypatch.setenv(MAX_ENV, raw)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        assert max_samples_from_env() == want
    assert any(MAX_ENV in r.getMessage() for r in caplog.records) == warns


def test_install_says_the_limit_and_the_profile_records_it(monkeypatch, caplog):
    import sys
    import types

    class Backend(FakeBackend):
        kind = "fake"

    monkeypatch.setitem(sys.modules, "sglang.specprof.cuda_backend", types.SimpleNamespace(CudaBackend=Backend))
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(FakeBackend()))
    monkeypatch.setattr(hooks, "P", hooks.P)
    monkeypatch.setenv(MAX_ENV, "30")
    args = types.SimpleNamespace(speculative_profile=True, speculative_algorithm="EAGLE3", speculative_num_steps=3,
                                 speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                                 speculative_profile_interval=100, speculative_profile_output=None, tp_size=1,
                                 speculative_profile_kernels=4)
    with caplog.at_level("INFO", logger="sglang.specprof"):
        hooks.install(args, 0, "v2")
    try:
        assert hooks.P.kernels.max_samples == 30 and hooks.P.config["kernels_max"] == 30
        assert any("every 4 windows, at most 30 (CUPTI" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        hooks.P.close()
