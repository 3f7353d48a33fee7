"""A stand-in for `python -m sglang.launch_server` that the benchmark harnesses can drive on a CPU.

It takes the flags the harnesses pass, serves /health, /generate and /server_info, and
decodes in cycles whose GPU cost follows a simple model (draft steps, a verify that grows
with the tokens it checks), sleeping that long in real time; a request's prefill runs as
a cycle of its own before it joins the batch, as in SGLang. With --speculative-profile the
cycles go through the real profiler on a fake GPU (tests/fakes.py) and the host's real
clock, and the profile JSONL is the real writer's, so `sglang-specprof report` reads it as
it reads a server's: its cycle periods hold the host's real time, as a server's do.

    SPECPROF_BENCH_LAUNCH=fake_sglang_server PYTHONPATH=tests python bench/advisor_check.py ...
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakes import FakeBackend  # noqa: E402  (puts overlay/ on the path)
from sglang.specprof.jsonl import JsonlSink  # noqa: E402
from sglang.specprof.null import NullProfiler  # noqa: E402
from sglang.specprof.profiler import Profiler  # noqa: E402

# GPU ms of a cycle's phases; `t` is the number of tokens the cycle verifies (bs * (steps + 1)).
STEP_MS = 0.45
COST = {"draft_prep": lambda t: 0.05, "tree": lambda t: 0.02, "verify": lambda t: 4.0 + 0.03 * t,
        "accept": lambda t: 0.06, "draft_extend": lambda t: 0.5 + 0.004 * t}
PREFILL_MS = 2.0  # a request's prefill (its 64 prompt tokens)


class Engine:
    def __init__(self, steps, acc, profiler, backend, seed, topk=1, draft_tokens=None):
        self.steps, self.acc, self.topk = steps, acc, topk
        self.draft_tokens = draft_tokens or steps + 1
        self.p, self.b = profiler, backend
        self.rng = random.Random(seed)
        self.lock = threading.Condition()
        self.active = []  # [needed, got, done_event, prefilled]

    def submit(self, n):
        job = [n, 0, threading.Event(), False]
        with self.lock:
            self.active.append(job)
            self.lock.notify()
        job[2].wait()
        return job[1]

    def accept_length(self):
        """SGLang's SIMULATE_ACC_LEN 'match-expected': the floor or the ceiling, at random."""
        a = max(1.0, min(self.steps + 1, self.acc))
        lo = int(a)
        return lo + (1 if self.rng.random() < a - lo and lo < self.steps + 1 else 0)

    def run(self):
        while True:
            with self.lock:
                while not self.active:
                    self.lock.wait()
                batch = list(self.active)
            new = [job for job in batch if not job[3]]
            if new:  # as in SGLang, a request's prefill runs before it joins the decode batch
                self.sleep_out(self.prefill(len(new)))
                for job in new:
                    job[3] = True
            bs, tokens = len(batch), len(batch) * self.draft_tokens
            ctx = sum(64 + job[1] for job in batch)
            length = self.accept_length()
            self.sleep_out(self.cycle(bs, tokens, ctx, length))
            with self.lock:
                for job in batch:
                    job[1] += length
                    if job[1] >= job[0]:
                        job[1] = job[0]
                        self.active.remove(job)
                        job[2].set()

    def sleep_out(self, ms):
        """As on 0.5.12, each cycle starts synchronised with the last one: the host's time up
        to the first launch is the cycle's, what it does after is hidden behind the GPU."""
        delay = self.launched + ms / 1000.0 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def prefill(self, bs):
        p, b = self.p, self.b
        p.begin("prefill", bs)
        self.launched = time.perf_counter()
        ms = PREFILL_MS * bs
        b.advance(ms)
        p.mark("target_extend")
        p.end()
        return ms

    def cycle(self, bs, tokens, ctx, length):
        p, b = self.p, self.b
        total = 0.0
        p.begin("decode", bs, ctx)
        for name in ("draft_prep", "draft", "tree", "verify", "accept", "draft_extend"):
            if name == "draft":
                self.launched = time.perf_counter()  # the draft's launch: the GPU has work from here
                step_ms = STEP_MS * (1 + 0.25 * (self.topk - 1))  # a wider tree drafts more tokens a step
                for i in range(self.steps):
                    p.draft_step(i)
                    b.advance(step_ms)
                    total += step_ms
                p.draft_step(self.steps)
            else:
                ms = COST[name](tokens)
                b.advance(ms)
                total += ms
            p.mark(name)
        p.end()
        b.advance(0.05)
        total += 0.05
        p.harvest([length - 1] * bs)
        return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-num-steps", type=int, default=3)
    ap.add_argument("--speculative-eagle-topk", type=int, default=1)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    ap.add_argument("--speculative-profile", action="store_true")
    ap.add_argument("--speculative-profile-output")
    ap.add_argument("--speculative-profile-interval", type=int, default=20)
    a, _ = ap.parse_known_args()
    steps = a.speculative_num_steps
    backend = FakeBackend()
    profiler = NullProfiler()  # the flag off: the hooks do nothing (bench/host_sensitivity.py makes them spin)
    if a.speculative_profile:
        sinks = [JsonlSink(a.speculative_profile_output)] if a.speculative_profile_output else []
        profiler = Profiler(backend, interval=a.speculative_profile_interval, sink=sinks,
                            log_table=False, config={"algorithm": "EAGLE3", "num_steps": steps,
                                                     "topk": a.speculative_eagle_topk,
                                                     "num_draft_tokens": a.speculative_num_draft_tokens or steps + 1})
    engine = Engine(steps, float(os.environ.get("SGLANG_SIMULATE_ACC_LEN", "1")), profiler, backend, a.port,
                    a.speculative_eagle_topk, a.speculative_num_draft_tokens)
    threading.Thread(target=engine.run, daemon=True).start()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send({})
            elif self.path == "/server_info":
                state = {}
                if a.speculative_profile:  # as the series' scheduler adds it (hooks.internal_state)
                    state["speculative_profile"] = {"enabled": True, "latest": profiler.latest(),
                                                    "totals": profiler.totals_now()}
                self._send({"internal_states": [state]})
            else:
                self.send_error(404)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = req["sampling_params"]["max_new_tokens"]
            got = engine.submit(n)
            self._send({"output_ids": [100] * got})

    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    print("Load weight end.", flush=True)
    print("Memory pool end.", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
