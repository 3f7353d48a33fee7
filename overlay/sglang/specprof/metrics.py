"""Prometheus gauges for each summary window (with --enable-metrics), next to SGLang's own.

`dashboards/grafana-specprof.json` draws them; its test checks that every query names a
gauge set here.
"""

from __future__ import annotations

from sglang_specprof.advisor import window_advice

# name: (help, labels beyond the sink's own)
GAUGES = {
    "sglang:specprof_phase_gpu_ms": ("Mean GPU time of a speculative cycle phase (ms).", ["bucket", "phase"]),
    "sglang:specprof_phase_host_ms": ("Mean host time of a speculative cycle phase (ms).", ["bucket", "phase"]),
    "sglang:specprof_phase_share": ("Share of a phase in the mean GPU time of the cycles timed by phase.",
                                    ["bucket", "phase"]),
    "sglang:specprof_cycle_gpu_ms": ("Mean GPU time of a speculative decode cycle (ms).", ["bucket"]),
    "sglang:specprof_cycle_wall_ms": ("Mean wall time of a speculative decode cycle (ms).", ["bucket"]),
    "sglang:specprof_accept_length": ("Mean accepted length per verified request.", ["bucket"]),
    "sglang:specprof_position_accept_rate": ("P(draft token at this position accepted | all before it accepted).",
                                             ["bucket", "position"]),
    "sglang:specprof_bucket_tokens_per_s": ("Committed tokens per second of the bucket's decode time.", ["bucket"]),
    "sglang:specprof_tokens_per_s": ("Committed tokens per second of decode time.", []),
    "sglang:specprof_window_seconds": ("GPU seconds of the last window by kind: decode, prefill, beside_prefill "
                                       "(the device waiting while the host admitted requests).", ["kind"]),
    "sglang:specprof_kv_used_share": ("Mean share of the KV pool the running requests held at the bucket's cycles' "
                                      "start.", ["bucket"]),
    "sglang:specprof_waiting_requests": ("Mean requests waiting for a running slot at the bucket's cycles' start "
                                         "(beyond --max-running-requests, or the KV pool's room).", ["bucket"]),
    "sglang:specprof_running_requests_cap": ("The running-request cap (--max-running-requests) the profile read.", []),
    "sglang:specprof_advisor_best_steps": ("The step count the advisor predicts fastest for the bucket.", ["bucket"]),
    "sglang:specprof_advisor_expected_gain": ("The advisor's predicted tokens/s gain of its pick over the running "
                                              "setting (0.05 = +5%).", ["bucket"]),
}


class MetricsSink:
    def __init__(self, labels: dict, registry=None, advice=None):
        from prometheus_client import REGISTRY, Gauge

        self.advice = window_advice if advice is None else advice  # summary -> {bucket: advisor's result}
        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        reg = REGISTRY if registry is None else registry
        self.g = {name: Gauge(name, doc, names + extra, multiprocess_mode="mostrecent", registry=reg)
                  for name, (doc, extra) in GAUGES.items()}
        self._shown: set = set()  # (gauge, its own label values) the last window set
        self._now: set = set()  # ... and those the window being published set

    def _set(self, name, value, **labels):
        if value is not None:
            self.g[name].labels(**self.labels, **labels).set(value)
            self._now.add((name, tuple(str(labels[k]) for k in GAUGES[name][1])))

    def __call__(self, s: dict) -> None:
        """Each gauge's series for this window; a series the last window set and this one has
        not (a bucket, a phase or a position that stopped appearing) is removed, not left at
        its last value."""
        self._now = set()
        self._publish(s)
        base = tuple(self.labels.values())
        for name, values in self._shown - self._now:
            self.g[name].remove(*base, *values)
        self._shown = self._now

    def _publish(self, s: dict) -> None:
        self._set("sglang:specprof_tokens_per_s", s.get("tokens_per_s"))
        for kind, key in (("decode", "seconds"), ("prefill", "prefill_seconds"),
                          ("beside_prefill", "beside_prefill_seconds")):
            self._set("sglang:specprof_window_seconds", s.get(key), kind=kind)
        cap = (s.get("config") or {}).get("max_running_requests")
        if isinstance(cap, int) and not isinstance(cap, bool):
            self._set("sglang:specprof_running_requests_cap", cap)
        advice = self.advice(s)
        for key, b in s.get("buckets", {}).items():
            if not b.get("cycles"):
                continue
            for name, p in b["phases"].items():
                self._set("sglang:specprof_phase_gpu_ms", p["gpu_ms"]["mean"], bucket=key, phase=name)
                self._set("sglang:specprof_phase_host_ms", p["host_ms"]["mean"], bucket=key, phase=name)
                self._set("sglang:specprof_phase_share", p.get("share"), bucket=key, phase=name)
            self._set("sglang:specprof_cycle_gpu_ms", b["cycle_gpu_ms"]["mean"], bucket=key)
            self._set("sglang:specprof_cycle_wall_ms", b["cycle_wall_ms"]["mean"], bucket=key)
            self._set("sglang:specprof_accept_length", b["accept"]["mean_length"], bucket=key)
            self._set("sglang:specprof_bucket_tokens_per_s", b.get("tokens_per_s"), bucket=key)
            self._set("sglang:specprof_kv_used_share", (b.get("kv_used_share") or {}).get("mean"), bucket=key)
            self._set("sglang:specprof_waiting_requests", (b.get("waiting_requests") or {}).get("mean"), bucket=key)
            for i, a in enumerate(b["accept"]["per_position"], 1):
                self._set("sglang:specprof_position_accept_rate", a, bucket=key, position=str(i))
            adv = advice.get(key)
            if adv is not None:
                self._set("sglang:specprof_advisor_best_steps", adv["best"], bucket=key)
                self._set("sglang:specprof_advisor_expected_gain", adv.get("expected_gain"), bucket=key)
