"""Prometheus gauges for each summary window (with --enable-metrics), next to SGLang's own."""

from __future__ import annotations


class MetricsSink:
    def __init__(self, labels: dict):
        from prometheus_client import Gauge

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        mode = {"multiprocess_mode": "mostrecent"}
        self.phase = Gauge("sglang:specprof_phase_gpu_ms", "Mean GPU time of a speculative cycle phase (ms).",
                           names + ["bucket", "phase"], **mode)
        self.phase_host = Gauge("sglang:specprof_phase_host_ms", "Mean host time of a speculative cycle phase (ms).",
                                names + ["bucket", "phase"], **mode)
        self.cycle = Gauge("sglang:specprof_cycle_wall_ms", "Mean wall time of a speculative decode cycle (ms).",
                           names + ["bucket"], **mode)
        self.accept = Gauge("sglang:specprof_accept_length", "Mean accepted length per verified request.",
                            names + ["bucket"], **mode)
        self.position = Gauge("sglang:specprof_position_accept_rate",
                              "P(draft token at this position accepted | all before it accepted).",
                              names + ["bucket", "position"], **mode)
        self.tokens = Gauge("sglang:specprof_tokens_per_s", "Committed tokens per second of decode time.",
                            names, **mode)

    def __call__(self, s: dict) -> None:
        lab = self.labels
        if s.get("tokens_per_s") is not None:
            self.tokens.labels(**lab).set(s["tokens_per_s"])
        for key, b in s.get("buckets", {}).items():
            for name, p in b["phases"].items():
                if p["gpu_ms"]["mean"] is not None:
                    self.phase.labels(**lab, bucket=key, phase=name).set(p["gpu_ms"]["mean"])
                if p["host_ms"]["mean"] is not None:
                    self.phase_host.labels(**lab, bucket=key, phase=name).set(p["host_ms"]["mean"])
            if b["cycle_wall_ms"]["mean"] is not None:
                self.cycle.labels(**lab, bucket=key).set(b["cycle_wall_ms"]["mean"])
            if b["accept"]["mean_length"] is not None:
                self.accept.labels(**lab, bucket=key).set(b["accept"]["mean_length"])
            for i, a in enumerate(b["accept"]["per_position"], 1):
                if a is not None:
                    self.position.labels(**lab, bucket=key, position=str(i)).set(a)
