"""Reading a kernel-level trace: the torch profiler's events as plain tuples, and each kernel's class.

The sampler in the server (`sglang.specprof.kernel_sampler`) runs the torch profiler (CUPTI
through kineto) for a few decode cycles and puts a zero-length annotation
`specprof/<cycle>/<mark>` at every phase mark. Each kernel (and copy, memset) comes back
with the correlation of the host call that launched it (`cudaLaunchKernel`,
`cudaGraphLaunch` for every kernel of a replayed graph, `cuLaunchKernel` for triton).
No torch here: the server hands the events over as tuples (`from_kineto`), a Chrome trace
exported by the torch profiler reads the same way (`from_chrome`). `kernels.analyse`
attributes them to the phases.
"""

from __future__ import annotations

import functools
import re

PREFIX = "specprof/"

# first match wins, in this order
_RULES = (
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|cross_device|custom_ar|"
                                 r"one_?shot|two_?shot|multimem|all_?to_?all|broadcast")),
    ("attention", re.compile(r"attn|attention|flash|fmha|_mha|mla|paged|_fwd_\w*kernel|decode_kernel|"
                             r"extend_kernel|sdpa|merge_state")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|matmul|_mm_|splitk|sm90_|sm80_|"
                        r"ampere_|hopper_|scaled_mm|deep_gemm|_gemm")),
    ("sampling", re.compile(r"top_?k|top_?p|sampl|softmax|argmax|multinomial|tree|accept|verify|cumsum|"
                            r"radix|sort|gumbel|select")),
    ("copy", re.compile(r"memcpy|memset|copy|catarray|fill")),
)


@functools.lru_cache(maxsize=4096)  # a sample holds thousands of kernels and a few dozen names
def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, rx in _RULES:
        if rx.search(low):
            return cls
    return "other"


def from_kineto(events, pause=None) -> dict:
    """The torch profiler's kineto events (`prof.profiler.kineto_results.events()`), as
    plain tuples: annotations, host launches by correlation, device kernels."""
    ann, launches, kernels = [], {}, []
    for i, e in enumerate(events):
        if pause is not None and i % 128 == 127:
            pause()
        name = e.name()
        on_gpu = str(e.device_type()).endswith("CUDA")
        if name.startswith(PREFIX):
            if not on_gpu:
                ann.append((e.start_ns(), name))
            continue
        if on_gpu:
            if not e.is_user_annotation():
                start = e.start_ns()
                kernels.append((start, start + e.duration_ns(), e.correlation_id(), name))
        elif name.startswith("cu"):
            launches[e.correlation_id()] = e.start_ns()
    return {"annotations": ann, "launches": launches, "kernels": kernels}


def from_chrome(trace: dict) -> dict:
    """A Chrome trace exported by the torch profiler (`export_chrome_trace`), as tuples."""
    ann, launches, kernels = [], {}, []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat")
        name = e.get("name", "")
        if cat == "user_annotation" and name.startswith(PREFIX):
            ann.append((round(e["ts"] * 1000), name))
        elif cat in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launches[c] = round(e["ts"] * 1000)
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            c = (e.get("args") or {}).get("correlation")
            start = round(e["ts"] * 1000)
            kernels.append((start, start + round(e.get("dur", 0) * 1000), c, name))
    return {"annotations": ann, "launches": launches, "kernels": kernels}


def parse_marks(annotations):
    """Annotations sorted by host time -> [(ts, seq, mark)], and each cycle's kind and bs."""
    marks, cycles = [], {}
    for ts, name in sorted(annotations):
        parts = name[len(PREFIX):].split("/")
        try:
            seq = int(parts[0])
        except (ValueError, IndexError):
            continue
        mark = parts[1] if len(parts) > 1 else ""
        if mark == "begin":
            kind = parts[2] if len(parts) > 2 else "decode"
            bs = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
            steps = int(parts[4]) if len(parts) > 4 and parts[4].isdigit() else None  # adaptive only
            cycles[seq] = {"kind": kind, "bs": bs, "steps": steps, "marks": [(ts, "begin")]}
        elif seq in cycles:
            cycles[seq]["marks"].append((ts, mark))
        else:
            continue
        marks.append((ts, seq, mark, len(cycles[seq]["marks"]) - 1))
    return marks, cycles


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total

