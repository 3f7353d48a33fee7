"""The Prometheus gauges, and the Grafana dashboard that draws them."""
import json
import re
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import advisor, report
from sglang_specprof.fit import LOCAL_MIN_CYCLES

prometheus_client = pytest.importorskip("prometheus_client")
from sglang.specprof.metrics import GAUGES, MetricsSink  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "grafana-specprof.json"
PROFILE = ROOT / "tests" / "data" / "exact" / "0.5.16-g" / "profile-s3k1.jsonl.xz"


def _exported(window):
    reg = prometheus_client.CollectorRegistry()
    MetricsSink({"tp_rank": 0}, registry=reg)(window)
    samples = {}
    for fam in reg.collect():
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _window(tmp_path):
    import lzma

    p = tmp_path / "p.jsonl"
    p.write_bytes(lzma.decompress(PROFILE.read_bytes()))
    windows, _ = report.load(str(p))
    return next(w for w in windows if w.get("prefill_seconds") and len(w["buckets"]) >= 2)


def test_each_window_sets_every_gauge_with_its_figures(tmp_path):
    w = _window(tmp_path)
    got = _exported(w)
    # a profile written before the KV pool's use and the running-request cap were recorded
    # (tests/test_adaptive.py sets those two from a window that has them)
    assert set(got) == set(GAUGES) - ADDED_AFTER_RECORDING
    (tok,) = got["sglang:specprof_tokens_per_s"]
    assert tok == ({"tp_rank": "0"}, pytest.approx(w["tokens_per_s"]))
    kinds = {lab["kind"]: v for lab, v in got["sglang:specprof_window_seconds"]}
    assert kinds == {"decode": pytest.approx(w["seconds"]), "prefill": pytest.approx(w["prefill_seconds"]),
                     "beside_prefill": pytest.approx(w["beside_prefill_seconds"])}
    shares = {(lab["bucket"], lab["phase"]): v for lab, v in got["sglang:specprof_phase_share"]}
    advised = {lab["bucket"] for lab, _ in got["sglang:specprof_advisor_best_steps"]}
    for key, b in w["buckets"].items():
        if not b["cycles"]:
            continue
        for name, p in b["phases"].items():
            assert shares[(key, name)] == pytest.approx(p["share"])
        if b["cycles"] < LOCAL_MIN_CYCLES:  # a few cycles predict their noise: no advice, no gauge
            assert key not in advised
            continue
        best = advisor.predict(advisor.inputs_from_bucket(b, w["config"]["num_steps"]))["best"]
        assert ({"tp_rank": "0", "bucket": key}, best) in got["sglang:specprof_advisor_best_steps"]
    assert any(b["cycles"] < LOCAL_MIN_CYCLES for b in w["buckets"].values() if b["cycles"])
    assert any(b["cycles"] >= LOCAL_MIN_CYCLES for b in w["buckets"].values())


def test_a_series_a_window_no_longer_has_is_removed(tmp_path):
    """A bucket (or a phase, a position) that stopped appearing has no series left at its
    last value: the next window removes it."""
    w = _window(tmp_path)
    reg = prometheus_client.CollectorRegistry()
    sink = MetricsSink({"tp_rank": 0}, registry=reg)
    sink(w)

    def buckets():
        return {s.labels["bucket"] for fam in reg.collect() for s in fam.samples if "bucket" in s.labels}

    keys = [k for k, b in w["buckets"].items() if b["cycles"]]
    assert buckets() == set(keys) and len(keys) >= 2
    kept = keys[0]
    later = json.loads(json.dumps(w))
    later["buckets"] = {kept: later["buckets"][kept]}
    dropped = next(iter(later["buckets"][kept]["phases"]))
    del later["buckets"][kept]["phases"][dropped]
    later["tokens_per_s"] = None
    sink(later)
    assert buckets() == {kept}
    phases = {s.labels["phase"] for fam in reg.collect() for s in fam.samples if "phase" in s.labels}
    assert dropped not in phases and phases
    assert not [s for fam in reg.collect() for s in fam.samples if s.name == "sglang:specprof_tokens_per_s"]
    sink(w)  # back again
    assert buckets() == set(keys)


def _names(expr):
    return set(re.findall(r"sglang:specprof_\w+", expr))


def test_every_dashboard_query_names_a_gauge_the_server_exports(tmp_path):
    """Every panel's query and every template variable reads a gauge the sink sets, with
    labels that gauge has; every gauge is drawn somewhere."""
    dash = json.loads(DASHBOARD.read_text())
    w = _window(tmp_path)
    # the fields a profile records since the recorded one was written (KV pool, cap)
    w["config"]["max_running_requests"] = 48
    for bk in w["buckets"].values():
        bk["kv_used_share"] = dict.fromkeys(("mean", "p50", "p90", "p99", "max"), 0.3) | {"n": 1}
        bk["waiting_requests"] = dict.fromkeys(("mean", "p50", "p90", "p99", "max"), 80) | {"n": 1}
    got = _exported(w)
    labels = {name: {"tp_rank", *extra} for name, (_, extra) in GAUGES.items()}
    used = set()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(dash["panels"]) >= 8
    for expr in exprs:
        names = _names(expr)
        assert names, expr
        for name in names:
            assert name in got, (name, expr)
            for lab in re.findall(r"(\w+)\s*=~?", expr.split("{", 1)[1]) if "{" in expr else []:
                assert lab in labels[name], (lab, name)
            inner = re.search(r"label_values\([^,]+,\s*(\w+)\)", expr)
            if inner:
                assert inner.group(1) in labels[name]
        used |= names
    for p in dash["panels"]:
        for t in p["targets"]:
            (name,) = _names(t["expr"])
            for lab in re.findall(r"\{\{(\w+)\}\}", t["legendFormat"]):
                assert lab in labels[name], (lab, name)
    assert used == set(GAUGES)


# gauges added after tests/data/metrics/0.5.16 was recorded on the GPU machine: not yet read
# from a real server's /metrics
ADDED_AFTER_RECORDING = {"sglang:specprof_kv_used_share", "sglang:specprof_running_requests_cap",
                         "sglang:specprof_waiting_requests"}


def test_the_dashboard_reads_what_a_real_server_exported():
    """/metrics of a 0.5.16 server with --enable-metrics (tests/gpu/metrics_check.py on the
    GPU machine, tests/data/metrics/): every gauge is there, from SGLang's multiprocess
    collector, and every dashboard query names gauges it holds; the tokens/s gauge is the
    last window's."""
    rec = ROOT / "tests" / "data" / "metrics" / "0.5.16"
    text = (rec / "metrics.txt").read_text()
    names = {re.match(r"[\w:]+", ln).group(0) for ln in text.splitlines() if ln.startswith("sglang:specprof_")}
    assert names == set(GAUGES) - ADDED_AFTER_RECORDING
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            assert _names(t["expr"]) <= names | ADDED_AFTER_RECORDING, t["expr"]
    check = json.loads((rec / "check.json").read_text())
    assert check["tokens_per_s_gauge"] == [check["tokens_per_s_latest_window"]]


def test_the_log_table_and_the_gauges_share_one_advisor_run(tmp_path, monkeypatch, caplog):
    """One window published to both the log table and the gauges runs the advisor once per
    bucket (hooks.install hands both the same `Advice`)."""
    import logging

    from sglang.specprof.profiler import Profiler
    from sglang.specprof.sinks import Advice

    w = _window(tmp_path)
    for b in w["buckets"].values():  # each bucket with the cycles the live advice asks for
        if b["cycles"]:
            b["cycles"] = max(b["cycles"], LOCAL_MIN_CYCLES)
    judged = sum(1 for b in w["buckets"].values() if advisor.inputs_from_bucket(b, w["config"]["num_steps"]))
    assert judged >= 2
    calls = []
    real = advisor.predict
    monkeypatch.setattr(advisor, "predict", lambda inp, *a, **k: calls.append(1) or real(inp, *a, **k))
    shared = Advice()
    gauges = MetricsSink({"tp_rank": 0}, registry=prometheus_client.CollectorRegistry(), advice=shared)
    p = Profiler(FakeBackend(), sink=[gauges], config=w["config"], advice=shared)
    with caplog.at_level(logging.INFO, logger="sglang.specprof"):
        p.outputs.publish(w)
    assert "advisor:" in caplog.text  # the table showed the advice
    assert len(calls) == judged
