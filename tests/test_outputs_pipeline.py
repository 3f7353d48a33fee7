"""The output pipeline (pipeline.py): a closed window's summary is enriched by named steps in
the order the pipeline declares, then every sink is handed a read-only copy of it."""

import copy
import json
import logging
import pickle

import pytest

from fakes import FakeBackend
from sglang.specprof.profiler import Profiler
from sglang.specprof.ranks import RankExchange
from test_profiler import run_cycle


def _cycles(p, b, n):
    for _ in range(n):
        run_cycle(p, b)


def _closed_window() -> dict:
    """A closed window's summary as the folder hands it to the pipeline (plain, not enriched)."""
    b = FakeBackend()
    out = []
    p = Profiler(b, interval=10, sink=out.append, config={"num_steps": 3}, clock=b.clock, log_table=False)
    _cycles(p, b, 11)
    return json.loads(json.dumps(out[0]))


def test_a_sink_cannot_change_what_it_is_handed(caplog):
    b = FakeBackend()
    refused, seen = [], []

    def meddler(s):
        for change in (lambda: s.__setitem__("window", 7), lambda: s.pop("buckets"), lambda: s.update(x=1),
                       lambda: s.setdefault("ranks", {}), lambda: s["buckets"]["1"].__setitem__("cycles", 0),
                       lambda: s["config"].clear(), lambda: s["buckets"]["1"]["accept"]["per_position"].append(1.0),
                       lambda: s["buckets"]["1"]["accept"]["per_position"].sort()):
            with pytest.raises(TypeError, match="read-only"):
                change()
            refused.append(1)
        s["tokens_per_s"] = 0.0  # not caught: this sink is switched off, the next one goes on

    p = Profiler(b, interval=10, sink=[meddler, seen.append], config={"num_steps": 3}, clock=b.clock,
                 log_table=False)
    with caplog.at_level(logging.WARNING, logger="sglang.specprof"):
        _cycles(p, b, 21)
    assert len(refused) == 8 and len(seen) == 2 and p.sinks == [seen.append]
    assert "meddler" not in caplog.text  # a function: its type is named
    assert caplog.text.count("function failed (TypeError: a closed window's summary is read-only") == 1
    latest = p.latest()
    assert type(latest) is dict and latest == seen[-1] and latest["window"] == 1 and latest["tokens_per_s"] > 0
    # what a sink writes out is the summary itself, byte for byte; a copy of it is its own to change
    assert json.dumps(seen[-1], separators=(",", ":")) == json.dumps(latest, separators=(",", ":"))
    for mine in (copy.deepcopy(seen[-1]), pickle.loads(pickle.dumps(seen[-1])), copy.copy(seen[-1])):
        assert type(mine) is dict and mine == latest
        mine["window"] = 9
    deep = copy.deepcopy(seen[-1])
    deep["buckets"]["1"]["accept"]["per_position"].append(1.0)
    assert type(deep["buckets"]["1"]) is dict and seen[-1] == latest


def test_the_enrichment_runs_in_the_order_the_pipeline_declares(tmp_path):
    b = FakeBackend()
    seen = []
    ex = RankExchange(str(tmp_path / "ranks"), 0, 2)
    p = Profiler(b, interval=10, sink=seen.append, config={"num_steps": 3}, clock=b.clock, log_table=False,
                 exchange=ex, rank=0)
    assert p.outputs.order == ["kernels", "ranks"]
    ran = []
    for step in p.outputs.steps:
        def recorded(summary, sample, step=step, name=step.name):
            ran.append((name, [k for k in ("kernels", "ranks") if k in summary]))
            return step(summary, sample)
        recorded.name = step.name
        p.outputs.steps[p.outputs.steps.index(step)] = recorded
    summary = _closed_window()
    p.outputs.publish(summary, {"window": 0, "seqs": []})  # a sample that cannot be read: an error line
    # each step sees what the steps before it added, and nothing after
    assert ran == [("kernels", []), ("ranks", ["kernels"])]
    (view,) = seen
    assert list(view)[-2:] == p.outputs.order  # added in that order, at the end
    assert view["kernels"]["window"] == 0 and "error" in view["kernels"]
    assert view["ranks"] is None  # rank 1 has published nothing yet
    assert p.latest() is summary and view == summary
    assert json.load(open(tmp_path / "ranks" / "rank0.json"))["window"] == 0  # this rank's window went out
    ex.close()


def test_a_failing_step_is_switched_off_and_the_sinks_still_run(tmp_path, caplog):
    class Gone:
        folder = str(tmp_path / "gone")

        def publish(self, summary):
            raise FileNotFoundError(2, "No such file or directory")

    b = FakeBackend()
    seen = []
    p = Profiler(b, interval=10, sink=seen.append, config={"num_steps": 3}, clock=b.clock, log_table=False,
                 exchange=Gone(), rank=0)
    with caplog.at_level(logging.WARNING, logger="sglang.specprof"):
        _cycles(p, b, 21)
    assert p.outputs.order == ["kernels"] and len(seen) == 2 and all("ranks" not in s for s in seen)
    assert caplog.text.count("the rank exchange in") == 1 and "and is switched off" in caplog.text
