#!/usr/bin/env python3
"""GPU time one CUDA event record adds to a stream, where the GPU is the bottleneck.

The host queues far ahead of the GPU (a sleep kernel first), so what is measured is the
GPU's own time: work without events, the same work with a timing event recorded between
every two pieces of it (eager kernels, CUDA graph replays), and a graph captured with event
nodes inside it against the same graph without. Prints µs per event (median of --reps
interleaved runs) as one JSON line.

    python bench/event_gpu_cost.py [--reps 7] [--cycles 200]
"""
import argparse
import json
import statistics

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cycles", type=int, default=200, help="cycles queued per run")
    ap.add_argument("--pieces", type=int, default=12, help="pieces of work a cycle (an event after each)")
    ap.add_argument("--kernels", type=int, default=8, help="matmuls a piece")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/event_gpu_cost.py needs an NVIDIA GPU: torch sees none here")
    dev = torch.device("cuda")
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, 4096, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream()

    def piece():
        for _ in range(a.kernels):
            torch.matmul(x, w, out=out)

    n_steps = 4
    with torch.cuda.stream(s):
        piece()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            piece()
        step_events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(n_steps + 1)]
        g_ev = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_ev, stream=s):
            per = max(1, a.kernels // n_steps)
            for i in range(n_steps):
                step_events[i].record()
                for _ in range(per):
                    torch.matmul(x, w, out=out)
            step_events[n_steps].record()
        g_plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_plain, stream=s):
            for _ in range(per * n_steps):
                torch.matmul(x, w, out=out)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(a.pieces)]
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(kind):
        with torch.cuda.stream(s):
            # about half a second: the host queues ahead of the GPU (and stays ahead when
            # the launch queue fills, blocking in step with it)
            torch.cuda._sleep(int(1e9))
            t0.record(s)
            for _ in range(a.cycles):
                for i in range(a.pieces):
                    if kind.startswith("eager"):
                        piece()
                    elif kind.startswith("graph_nodes"):
                        g_ev.replay()
                    elif kind.startswith("graph_plain"):
                        g_plain.replay()
                    else:
                        g.replay()
                    if kind.endswith("+events"):
                        events[i].record(s)
            t1.record(s)
        t1.synchronize()
        return t0.elapsed_time(t1) * 1000.0 / a.cycles  # µs a cycle

    kinds = ["eager", "eager+events", "graph", "graph+events", "graph_plain", "graph_nodes"]
    for k in kinds:  # warm
        run(k)
    res = {k: [] for k in kinds}
    for r in range(a.reps):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for k in order:
            res[k].append(run(k))
    med = {k: round(statistics.median(v), 2) for k, v in res.items()}
    out_ = {
        "us_per_cycle": med,
        "eager_us_per_event": round((med["eager+events"] - med["eager"]) / a.pieces, 3),
        "graph_replay_us_per_event": round((med["graph+events"] - med["graph"]) / a.pieces, 3),
        "graph_node_us_per_event": round((med["graph_nodes"] - med["graph_plain"]) / ((n_steps + 1) * a.pieces), 3),
        "pieces": a.pieces, "kernels_per_piece": a.kernels, "cycles": a.cycles, "reps": a.reps,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }
    print(json.dumps(out_))


if __name__ == "__main__":
    main()
