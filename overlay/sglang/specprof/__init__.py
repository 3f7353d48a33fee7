"""sglang-specprof: phase-by-phase timing of EAGLE / EAGLE3 speculative decoding.

This package runs in the server (hooks, the profiler, CUDA events, outputs); the analysis
it shares with the offline tools is the top-level package sglang_specprof.
"""
